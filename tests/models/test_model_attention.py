"""ForwardBatch construction, KVPool, and the torch attention backend vs dense attention."""

from __future__ import annotations

import math

import pytest
import torch

from engine.layers.attention import TorchAttention, create_backend
from engine.layers.forward import ForwardBatch
from engine.layers.kv_pool import KVPool


def test_build_layout() -> None:
    # request 0: decode at position 5 (pages 3,7); request 1: 3-token chunk at 2..4, not sampled;
    # request 2: fresh 2-token prefill on page 9
    b = ForwardBatch.from_requests(
        [([11], 5, [3, 7]), ([21, 22, 23], 2, [4, 8, 6]), ([31, 32], 0, [9])],
        page_size=4, device="cpu", sample_mask=[True, False, True],
    )
    assert b.input_ids.tolist() == [11, 21, 22, 23, 31, 32]
    assert b.positions.tolist() == [5, 2, 3, 4, 0, 1]
    assert b.out_slots.tolist() == [7 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3, 8 * 4 + 0, 9 * 4 + 0, 9 * 4 + 1]
    assert b.seq_lens.tolist() == [6, 5, 2] and b.seq_lens_cpu == [6, 5, 2]
    assert b.extend_lens.tolist() == [1, 3, 2] and b.extend_lens_cpu == [1, 3, 2]
    assert b.start_pos_cpu == [5, 2, 0]
    # only the pages covering seq_lens, padded with page 0 (request 1's spare page 6 is cut)
    assert b.page_table.tolist() == [[3, 7], [4, 8], [9, 0]]
    assert b.page_table.dtype == torch.int32 and b.seq_lens.dtype == torch.int32
    assert b.logit_indices.tolist() == [0, 5]
    assert not b.is_decode and b.num_tokens == 6 and b.batch_size == 3
    assert ForwardBatch.from_requests([([1], 3, [2]), ([2], 0, [5])], 4, "cpu").is_decode


def test_build_accepts_device_tensor_ids() -> None:
    ids = torch.tensor([5, 6, 7])
    b = ForwardBatch.build(ids, [0, 4], [2, 1], [[1], [2, 3]], [1, 1], 4, "cpu")
    assert b.input_ids.tolist() == [5, 6, 7] and b.out_slots.tolist() == [4, 5, 12]


@pytest.mark.parametrize(
    ("args", "msg"),
    [
        (([1, 2, 3], [0], [3], [[1]], [1], 2), "cannot hold 3 tokens"),
        (([1], [0], [1], [[0]], [1], 4), "padding page"),
        (([1, 2], [0], [1], [[1]], [1], 4), "input_ids has shape"),
        (([1], [0, 0], [1], [[1]], [1], 4), "differ in length"),
        (([], [0], [0], [[1]], [1], 4), "extend_len 0"),
        (([], [], [], [], [], 4), "empty forward batch"),
    ],
)
def test_build_rejects_bad_input(args: tuple, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        ForwardBatch.build(*args, device="cpu")


def test_kv_pool_store_and_sizing() -> None:
    pool = KVPool(num_layers=2, num_pages=4, page_size=2, num_kv_heads=3, head_dim=8, dtype=torch.float32,
                  device="cpu")
    assert pool.k[0].shape == (8, 3, 8) and pool.num_slots == 8
    k, v = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    pool.store(1, torch.tensor([5, 2]), k, v)
    assert torch.equal(pool.k[1][5], k[0]) and torch.equal(pool.v[1][2], v[1])
    assert not pool.k[0].any()  # other layers untouched
    kp, _ = pool.page_view(1)
    assert torch.equal(kp[2, 1], k[0])  # slot 5 = page 2, offset 1
    per_page = KVPool.bytes_per_page(2, 2, 3, 8, torch.bfloat16)
    assert per_page == 2 * 2 * 2 * 3 * 8 * 2
    assert KVPool.pages_for_bytes(10 * per_page + 1, 2, 2, 3, 8, torch.bfloat16) == 10
    assert pool.nbytes() == 4 * KVPool.bytes_per_page(2, 2, 3, 8, torch.float32)
    with pytest.raises(ValueError, match="page 0 is padding"):
        KVPool(1, 1, 2, 1, 8, torch.float32, "cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_kv_pool_page_bytes_are_every_layers_pages(dtype: torch.dtype) -> None:
    """page_bytes(): the raw bytes of all layers, [layer, page, bytes], the same memory as the
    per-layer buffers (the host tier copies a page range of every layer through it)."""
    pool = KVPool(num_layers=3, num_pages=4, page_size=2, num_kv_heads=2, head_dim=8, dtype=dtype, device="cpu")
    kb, vb = pool.page_bytes()
    assert kb.shape == vb.shape == (3, 4, 2 * 2 * 8 * dtype.itemsize) and kb.dtype == torch.uint8
    pool.store(1, torch.tensor([5]), torch.ones(1, 2, 8), torch.full((1, 2, 8), 2.0))  # slot 5 = page 2
    assert kb[1, 2].any() and vb[1, 2].any()
    assert kb.count_nonzero() == kb[1, 2].count_nonzero() and vb.count_nonzero() == vb[1, 2].count_nonzero()
    kb[2, 3] = 7  # and writes through them land in the per-layer buffers the attention reads
    assert pool.k[2].view(torch.uint8)[6:8].eq(7).all() and not pool.k[1].view(torch.uint8)[6:8].any()


def _dense_reference(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, start: int) -> torch.Tensor:
    """Plain causal GQA attention for one request: q [n, Hq, D] at positions start.., keys [L, Hkv, D]."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1)
    v = vals.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    q_pos = torch.arange(start, start + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(keys.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_attention_matches_dense(dtype: torch.dtype) -> None:
    """Decodes, a prefill over a cached prefix and a fresh prefill, mixed in one step, GQA 6:2
    (in bf16 the decodes take the two-GEMM path, the prefills SDPA)."""
    torch.manual_seed(0)
    hq, hkv, d, ps = 6, 2, 16, 4
    pool = KVPool(1, 32, ps, hkv, d, dtype, "cpu")
    # (start, new, pages): the prefix KV of start tokens is written into the pool beforehand
    reqs = [(9, 1, [5, 2, 11]), (6, 5, [7, 3, 1]), (0, 7, [4, 9]), (2, 1, [8])]
    full_k, full_v = [], []
    for start, new, pages in reqs:
        k, v = torch.randn(start + new, hkv, d), torch.randn(start + new, hkv, d)
        full_k.append(k)
        full_v.append(v)
        slots = torch.tensor([pages[p // ps] * ps + p % ps for p in range(start)], dtype=torch.int64)
        pool.store(0, slots, k[:start], v[:start])
    full_k = [k.to(dtype).float() for k in full_k]  # what the pool holds
    full_v = [v.to(dtype).float() for v in full_v]
    batch = ForwardBatch.from_requests([([0] * n, s, p) for s, n, p in reqs], ps, "cpu")
    q = torch.randn(batch.num_tokens, hq, d).to(dtype)
    k_new = torch.cat([k[s:] for k, (s, _, _) in zip(full_k, reqs, strict=True)])
    v_new = torch.cat([v[s:] for v, (s, _, _) in zip(full_v, reqs, strict=True)])
    backend = TorchAttention("cpu")
    backend.prepare(batch)
    out = backend.forward(q, k_new.to(dtype), v_new.to(dtype), 0, batch, pool)
    assert out.shape == q.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    row = 0
    for (start, new, _), k, v in zip(reqs, full_k, full_v, strict=True):
        want = _dense_reference(q[row : row + new].float(), k, v, start)
        torch.testing.assert_close(out[row : row + new].float(), want, atol=tol, rtol=tol)
        row += new


def test_create_backend() -> None:
    assert isinstance(create_backend("torch", "cpu"), TorchAttention)
    assert isinstance(create_backend("auto", torch.device("cpu")), TorchAttention)
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_backend("bogus", "cpu")
    with pytest.raises(RuntimeError, match="not available"):
        create_backend("flashinfer", "cpu")
