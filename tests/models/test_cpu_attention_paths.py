"""The CPU-only fast paths of the torch attention backend and the KV pool: page gathers by
index_select, decode-only steps (no scatter into a separate output), half-precision decode as
one grouped flash SDPA call, and joint q/k RoPE, each against a plain reference."""

from __future__ import annotations

import math

import pytest
import torch

from engine.layers import ops
from engine.layers.attention import TorchAttention
from engine.layers.forward import ForwardBatch
from engine.layers.kv_pool import KVPool

pytestmark = pytest.mark.usefixtures("vendor_kernels")  # these test the default kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_gather_pages_matches_slot_indexing(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    ps, hkv, d = 4, 3, 8
    pool = KVPool(2, 16, ps, hkv, d, dtype, "cpu")
    slots = torch.arange(pool.num_slots)
    pool.store(1, slots, torch.randn(pool.num_slots, hkv, d), torch.randn(pool.num_slots, hkv, d))
    pages = torch.tensor([[3, 7, 0], [12, 1, 5]])
    k, v = pool.gather_pages(1, pages, torch.float32)
    assert k.shape == (2, 3 * ps, hkv, d) and k.dtype == torch.float32
    token_slots = (pages[:, :, None] * ps + torch.arange(ps)).flatten(1)  # [2, 3 * ps]
    assert torch.equal(k, pool.k[1][token_slots].float())
    assert torch.equal(v, pool.v[1][token_slots].float())


def _reference(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """One query token [Hq, D] over keys/vals [L, Hkv, D], float64."""
    group = q.shape[0] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = vals.double().repeat_interleave(group, dim=1)
    probs = (torch.einsum("hd,khd->hk", q.double(), k) / math.sqrt(q.shape[-1])).softmax(-1)
    return torch.einsum("hk,khd->hd", probs, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("hq", "hkv"), [(9, 3), (4, 4), (8, 1)])
def test_decode_only_step_matches_reference(dtype: torch.dtype, hq: int, hkv: int) -> None:
    """A step of decodes only, ragged lengths (pages padded, masked): the output is the
    attention itself, no scatter; half precision takes the grouped SDPA call."""
    torch.manual_seed(1)
    d, ps = 16, 4
    pool = KVPool(1, 40, ps, hkv, d, dtype, "cpu")
    starts = [9, 2, 14, 5]
    page_lists = [[5, 2, 11], [8], [20, 21, 22, 23], [30, 31]]
    full_k, full_v = [], []
    for start, pages in zip(starts, page_lists, strict=True):
        k, v = torch.randn(start + 1, hkv, d), torch.randn(start + 1, hkv, d)
        slots = torch.tensor([pages[p // ps] * ps + p % ps for p in range(start)], dtype=torch.int64)
        pool.store(0, slots, k[:start], v[:start])
        full_k.append(k.to(dtype))
        full_v.append(v.to(dtype))
    batch = ForwardBatch.from_requests([([0], s, p) for s, p in zip(starts, page_lists, strict=True)], ps, "cpu")
    q = torch.randn(len(starts), hq, d).to(dtype)
    backend = TorchAttention("cpu")
    backend.prepare(batch)
    k_new = torch.stack([k[-1] for k in full_k])
    v_new = torch.stack([v[-1] for v in full_v])
    out = backend.forward(q, k_new, v_new, 0, batch, pool)
    assert out.shape == q.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i in range(len(starts)):
        torch.testing.assert_close(out[i].double(), _reference(q[i], full_k[i], full_v[i]), atol=tol, rtol=tol)


def test_decode_rows_scatter_when_mixed_with_a_prefill() -> None:
    """A prefill before the decode row: the decode's output lands on its own row."""
    torch.manual_seed(2)
    hq, hkv, d, ps = 6, 2, 8, 4
    pool = KVPool(1, 16, ps, hkv, d, torch.bfloat16, "cpu")
    k0, v0 = torch.randn(6, hkv, d), torch.randn(6, hkv, d)
    pool.store(0, torch.tensor([12, 13, 14, 15, 20]), k0[:5], v0[:5])
    batch = ForwardBatch.from_requests([([1, 2, 3], 0, [2]), ([7], 5, [3, 5])], ps, "cpu")
    q = torch.randn(4, hq, d).to(torch.bfloat16)
    kn, vn = torch.randn(4, hkv, d), torch.randn(4, hkv, d)
    kn[3], vn[3] = k0[5], v0[5]
    backend = TorchAttention("cpu")
    backend.prepare(batch)
    out = backend.forward(q, kn.bfloat16(), vn.bfloat16(), 0, batch, pool)
    want = _reference(q[3], k0.bfloat16(), v0.bfloat16())
    torch.testing.assert_close(out[3].double(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_joint_qk_matches_separate_rotation(dtype: torch.dtype) -> None:
    """Rotary.apply_qkv (CPU: q and k in one pass, in place by the C kernel in bf16, the sign folded
    into sin and one addcmul in fp16) against apply_rope on q and k apart, and against float32:
    within one rounding."""
    torch.manual_seed(3)
    t, hq, hkv, d = 5, 6, 2, 16
    qkv = torch.randn(t, (hq + 2 * hkv) * d).to(dtype)
    rotary = ops.Rotary(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), d, 64)
    state = rotary.prepare(torch.arange(t) + 7, dtype)
    q = qkv[:, : hq * d].reshape(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].reshape(t, hkv, d)
    qj, kj = rotary.apply_qkv(qkv.clone(), hq, hkv, state)
    assert qj.shape == q.shape and kj.shape == k.shape and qj.dtype == dtype
    cos32, sin32 = ops.rope_cos_sin(torch.arange(t) + 7, rotary.inv_freq, torch.float32)
    for got, x in ((qj, q), (kj, k)):
        want = ops.apply_rope(x, state.cos, state.sin)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
        exact = ops.apply_rope(x.float(), cos32, sin32)
        torch.testing.assert_close(got.float(), exact, atol=3e-2, rtol=1e-2)
    assert rotary.apply_qkv(qkv.clone(), hq, hkv, state)[0].equal(qj)  # the signed sin is reused


def _dense_causal(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, start: int) -> torch.Tensor:
    """q [n, Hq, D] at positions start.. over keys/vals [start + n, Hkv, D], float64."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = vals.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(q.shape[-1])
    q_pos = torch.arange(start, start + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(keys.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_prefills_of_one_length_share_a_call(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three fresh 5-token prefills in a row (one call), a decode, a fresh prefill of another
    length and a chunk over a cached prefix: each against dense attention, and bitwise equal to
    one SDPA call per request."""
    torch.manual_seed(4)
    hq, hkv, d, ps = 6, 2, 16, 4
    reqs = [(0, 5, [1, 2]), (0, 5, [3, 4]), (0, 5, [5, 6]), (6, 1, [7, 8]), (0, 3, [9]), (4, 3, [10, 11])]
    pool = KVPool(1, 16, ps, hkv, d, dtype, "cpu")
    full_k, full_v = [], []
    for start, new, pages in reqs:
        k, v = torch.randn(start + new, hkv, d), torch.randn(start + new, hkv, d)
        slots = torch.tensor([pages[p // ps] * ps + p % ps for p in range(start)], dtype=torch.int64)
        pool.store(0, slots, k[:start], v[:start])
        full_k.append(k.to(dtype))
        full_v.append(v.to(dtype))
    batch = ForwardBatch.from_requests([([0] * n, s, p) for s, n, p in reqs], ps, "cpu")
    q = torch.randn(batch.num_tokens, hq, d).to(dtype)
    k_new = torch.cat([k[s:] for k, (s, _, _) in zip(full_k, reqs, strict=True)])
    v_new = torch.cat([v[s:] for v, (s, _, _) in zip(full_v, reqs, strict=True)])
    backend = TorchAttention("cpu")
    backend.prepare(batch)
    assert [e.count for e in backend._extends] == [3, 1, 1]
    out = backend.forward(q, k_new, v_new, 0, batch, pool)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    row = 0
    for (start, new, _), k, v in zip(reqs, full_k, full_v, strict=True):
        want = _dense_causal(q[row : row + new], k, v, start)
        torch.testing.assert_close(out[row : row + new].double(), want, atol=tol, rtol=tol)
        row += new
    monkeypatch.setattr(TorchAttention, "_fresh_runs", staticmethod(lambda batch, reqs: reqs))
    apart = TorchAttention("cpu")
    apart.prepare(batch)
    assert [e.count for e in apart._extends] == [1, 1, 1, 1, 1]
    assert torch.equal(apart.attend(q, 0, batch, pool), out)
