"""FlashInferAttention's host logic on CPU: the paged-KV metadata it plans with and the
wrapper it picks, checked by running a torch reference of flashinfer's paged wrappers
(same plan/run conventions: kv_indptr / kv_indices / kv_last_page_len, causal aligned to the
bottom right) against TorchAttention. flashinfer itself is not imported."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from engine.layers.attention import TorchAttention
from engine.layers.flashinfer_attention import (
    FlashInferAttention,
    _Staging,
    causal_bits,
    packed_tree_mask,
    pad_metadata,
    paged_kv_metadata,
    set_decode_kernel,
    xqa_supported,
)
from engine.layers.forward import ForwardBatch
from engine.layers.kv_pool import KVPool
from engine.run.cuda_graph import decode_table


class RefWrapper:
    """Torch stand-in for flashinfer's BatchPrefill/BatchDecode paged wrappers (NHD)."""

    def __init__(self, workspace, layout="NHD", use_cuda_graph=False, use_tensor_cores=False,  # noqa: ANN001
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,  # noqa: ANN001
                 paged_kv_last_page_len_buffer=None, backend="auto") -> None:  # noqa: ANN001
        assert layout == "NHD"
        self.graph = use_cuda_graph
        self.bufs = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        self.plans = 0

    def plan(self, *args, causal=False, q_data_type=None, kv_data_type=None,  # noqa: ANN001
             max_token_per_sequence=None, packed_custom_mask=None) -> None:  # noqa: ANN001
        if len(args) == 8:  # prefill: qo_indptr first
            qo, args = args[0], args[1:]
            # what flashinfer computes itself when it is not given
            assert max_token_per_sequence == int((qo[1:] - qo[:-1]).max())
        else:
            qo = None
        indptr, indices, last, hq, hkv, d, ps = args
        if self.graph:  # copy into the fixed buffers, as flashinfer does
            self.bufs[0].copy_(indptr)
            self.bufs[1][: len(indices)].copy_(indices)
            self.bufs[2].copy_(last)
            indptr, indices, last = self.bufs[0], self.bufs[1], self.bufs[2]
        b = len(last)
        self.qo = qo if qo is not None else torch.arange(b + 1, dtype=torch.int32)
        self.meta = (indptr.clone(), indices.clone(), last.clone(), ps)
        self.causal = causal or qo is None
        self.plans += 1
        self._custom_mask_buf = packed_custom_mask
        if packed_custom_mask is not None:  # flashinfer's plan: offsets in bits (q_len * kv_len summed)
            kv_lens = (indptr[1:] - indptr[:-1] - 1) * ps + last
            self._mask_indptr_buf = torch.cat([torch.zeros(1, dtype=torch.int64),
                                               torch.cumsum((qo[1:] - qo[:-1]) * kv_lens, 0)])

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        k_cache, v_cache = kv
        indptr, indices, last, ps = self.meta
        out = torch.empty_like(q)
        for i in range(len(last)):
            pages = indices[indptr[i] : indptr[i + 1]].long()
            kv_len = (len(pages) - 1) * ps + int(last[i])
            k = k_cache[pages].flatten(0, 1)[:kv_len].transpose(0, 1)
            v = v_cache[pages].flatten(0, 1)[:kv_len].transpose(0, 1)
            r0, r1 = int(self.qo[i]), int(self.qo[i + 1])
            qi = q[r0:r1].transpose(0, 1)
            mask = torch.arange(kv_len)[None, :] <= (kv_len - (r1 - r0) + torch.arange(r1 - r0))[:, None]
            if self._custom_mask_buf is not None:  # as flashinfer's attention/variants.cuh reads it
                base = int(self._mask_indptr_buf[i])
                offs = torch.arange((r1 - r0) * kv_len)
                byte = self._custom_mask_buf[base + offs // 8].to(torch.int64)
                mask = ((byte >> (offs % 8)) & 1).bool().view(r1 - r0, kv_len)
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, enable_gqa=True)
            out[r0:r1] = o.transpose(0, 1)
        return out


class NoStaging(_Staging):
    """The staging without pinned buffers or CUDA events (its `plan` is the real one)."""

    def __init__(self) -> None:
        pass

    def take(self) -> torch.Tensor:
        return torch.empty(0)

    def release(self) -> None:
        pass


def make_backend(pool: KVPool, hq: int, max_batch: int = 8) -> FlashInferAttention:
    be = object.__new__(FlashInferAttention)  # skip the CUDA-only constructor
    be.device = torch.device("cpu")
    be._fi = SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=RefWrapper)
    be.workspace = torch.empty(0)
    be._staging = NoStaging()
    be._prefill, be._decode = RefWrapper(None), RefWrapper(None, use_tensor_cores=True)
    be._active, be._bound, be._graph, be._table_args, be._table_kernel = None, False, {}, None, "fa2"
    be.bind(num_q_heads=hq, kv_pool=pool, max_batch=max_batch, max_pages_per_req=16)
    return be


def plan_padded(fi: FlashInferAttention, bs: int, batch: ForwardBatch) -> None:
    """What CudaGraphRunner.run_decode hands the backend before replaying the graph of size bs for
    this decode batch: the dense table and lengths, or FA2's padded metadata (indices on the device)."""
    if fi.uses_table(bs):
        b = batch.batch_size
        seq = torch.ones(bs, dtype=torch.int32)
        seq[:b] = batch.seq_lens
        table = torch.zeros(bs, batch.page_table.shape[1], dtype=torch.int32)
        table[:b] = batch.page_table
        fi.set_graph_table(bs, seq, table)
        return
    meta = paged_kv_metadata(batch.seq_lens_cpu, batch.page_table_cpu, batch.page_size)
    indptr, indices, last = pad_metadata(*meta, bs - batch.batch_size)
    fi.plan_graph_arrays(bs, indptr, last, indices)


def run_step(reqs, pools, backends, hq, hkv, d, ps, gen):  # noqa: ANN001, ANN201
    batch = ForwardBatch.from_requests(reqs, ps, "cpu")
    t = batch.num_tokens
    q = torch.randn(t, hq, d, generator=gen)
    k = torch.randn(t, hkv, d, generator=gen)
    v = torch.randn(t, hkv, d, generator=gen)
    outs = []
    for be, pool in zip(backends, pools, strict=True):
        be.prepare(batch)
        outs.append(be.forward(q, k, v, 0, batch, pool))
    return batch, outs


def _torch_and_flashinfer(seed: int) -> tuple[list[KVPool], FlashInferAttention, list, torch.Generator, list[int]]:
    """Pools (4/2 heads of 16, pages of 4) for the torch backend and the reference-run flashinfer
    one, a generator and the free pages shuffled."""
    pools = [KVPool(1, 64, 4, 2, 16, torch.float32, "cpu") for _ in range(2)]
    fi = make_backend(pools[1], 4)
    free = list(range(1, 64))
    random.Random(seed).shuffle(free)
    return pools, fi, [TorchAttention("cpu"), fi], torch.Generator().manual_seed(seed), free


def test_prefill_mixed_decode_and_cached_prefix_match_torch() -> None:
    hq, hkv, d, ps = 4, 2, 16, 4
    pools, fi, backends, gen, free = _torch_and_flashinfer(0)
    pa, pb, pc = free[:4], free[4:10], free[10:13]
    steps = [
        [([1] * 9, 0, pa), ([2] * 13, 0, pb)],  # prefill
        [([3], 9, pa), ([4] * 7, 13, pb), ([5] * 6, 0, pc)],  # decode + chunk on prefix + prefill
        [([6], 10, pa), ([7], 20, pb), ([8], 6, pc)],  # pure decode
        [([9] * 3, 8, pa[:2] + free[20:21])],  # a new request on A's first 2 cached pages
    ]
    for reqs in steps:
        batch, (ref, got) = run_step(reqs, pools, backends, hq, hkv, d, ps, gen)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        assert fi._active is (fi._decode if batch.is_decode else fi._prefill)


def test_draft_trees_take_the_custom_mask_as_torch_does() -> None:
    """A step with draft trees beside a causal chunk and a decode: the prefill wrapper planned
    with packed_tree_mask (its bytes read as flashinfer's kernel reads them) attends as the
    torch backend does with the same trees; the next step is causal again."""
    hq, hkv, d, ps = 4, 2, 16, 4
    pools, fi, backends, gen, free = _torch_and_flashinfer(1)
    pa, pb, pc = free[:5], free[5:10], free[10:14]
    run_step([([1] * 9, 0, pa), ([2] * 7, 0, pb), ([3] * 5, 0, pc)], pools, backends, hq, hkv, d, ps, gen)
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                        dtype=torch.bool)  # two branches under the first node
    for be in backends:
        be.set_tree_masks({0: tree, 2: tree[:3, :3]})
    batch, (ref, got) = run_step([([4] * 5, 9, pa), ([5], 7, pb), ([6] * 3, 5, pc)], pools, backends,
                                 hq, hkv, d, ps, gen)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert fi._active is fi._prefill and fi._prefill._custom_mask_buf is not None and fi.step_trees
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    assert not torch.equal(tree, causal)  # the trees change the answer: rows 2-4 skip a sibling
    _, (ref, got) = run_step([([7] * 2, 14, pa)], pools, backends, hq, hkv, d, ps, gen)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert fi._prefill._custom_mask_buf is None and not fi.step_trees


def test_packed_tree_mask_starts_each_request_on_a_byte() -> None:
    trees = {1: torch.tensor([[1, 0], [0, 1]], dtype=torch.bool)}
    packed, offsets = packed_tree_mask([3, 2], [5, 7], trees)
    assert offsets.tolist() == [0, 2, 4]  # 15 bits -> 2 bytes, 14 bits -> 2 bytes
    bits = torch.from_numpy(__import__("numpy").unpackbits(packed.numpy(), bitorder="little")).bool()
    assert bits[:15].view(3, 5).tolist() == (torch.arange(5)[None] <= torch.arange(2, 5)[:, None]).tolist()
    want = torch.ones(2, 7, dtype=torch.bool)
    want[:, 5:] = trees[1]
    assert bits[16:30].view(2, 7).tolist() == want.tolist()


def test_causal_bits_are_the_packed_causal_mask() -> None:
    """causal_bits (runs of whole bytes, edge bytes ORed in) equals packing the [n, kv] bools, at
    KV lengths on and off byte boundaries, below 8 (rows sharing bytes) and one row."""
    import numpy as np

    for n in [*range(1, 20), 31, 32, 33, 64, 100]:
        for kv in {n, n + 1, n + 7, n + 8, n + 9, n + 15, n + 16, n + 100, 3 * n + 5}:
            m = torch.arange(kv)[None, :] <= torch.arange(kv - n, kv)[:, None]
            want = np.packbits(m.numpy().reshape(-1), bitorder="little")
            assert np.array_equal(causal_bits(n, kv), want), (n, kv)


def test_graph_plan_pads_rows_onto_the_padding_page() -> None:
    hq, hkv, d, ps = 4, 2, 16, 4
    pools = [KVPool(1, 32, ps, hkv, d, torch.float32, "cpu") for _ in range(2)]
    fi = make_backend(pools[1], hq)
    gen = torch.Generator().manual_seed(1)
    # fill some KV first (prefill through both backends)
    run_step([([1] * 6, 0, [3, 5]), ([2] * 3, 0, [7])], pools, [TorchAttention("cpu"), fi], hq, hkv, d, ps, gen)
    fi.graph_wrapper(4)  # capture-time dummy plan
    batch = ForwardBatch.from_requests([([3], 6, [3, 5]), ([4], 3, [7])], ps, "cpu")
    q = torch.randn(4, hq, d, generator=gen)  # 2 real rows + 2 padding rows
    k, v = torch.randn(4, hkv, d, generator=gen), torch.randn(4, hkv, d, generator=gen)
    ref_be = TorchAttention("cpu")
    ref_be.prepare(batch)
    ref = ref_be.forward(q[:2], k[:2], v[:2], 0, batch, pools[0])
    plan_padded(fi, 4, batch)
    w = fi._graph[4]
    assert fi._active is w and w.plans == 2
    indptr, indices, last, _ = w.meta
    assert indptr.tolist() == [0, 2, 3, 4, 5] and last.tolist() == [3, 4, 1, 1]
    assert indices[:5].tolist() == [3, 5, 7, 0, 0]
    pools[1].store(0, batch.out_slots, k[:2], v[:2])
    got = w.run(q, pools[1].page_view(0))
    torch.testing.assert_close(got[:2], ref, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got).all()


def ref_xqa(fp8_gmma, sm_count, num_kv_heads, window, q_scale, out, rcp_out_scale, q, sinks,  # noqa: ANN001
            k_cache, v_cache, k_sf, v_sf, table, max_seq_len, seq_lens, batch, kv_scale,  # noqa: ANN001
            semaphores, scratch, pdl, q_seq_len, mask) -> None:  # noqa: ANN001
    """Torch stand-in for flashinfer's compiled xqa op (NHD, q/out [B, 1, Hq, D], seq_lens [B, 1])."""
    assert table.dtype == torch.int32 and seq_lens.shape == (q.shape[0], 1) and table.is_contiguous()
    assert semaphores.numel() > 0 and scratch.numel() > 0 and batch == q.shape[0] and q_seq_len == 1
    page_size = k_cache.shape[1]
    assert max_seq_len == table.shape[1] * page_size and window == 0 and q_scale == kv_scale == 1.0
    for i in range(q.shape[0]):
        n = int(seq_lens[i, 0])
        pages = table[i, : -(-n // page_size)].long()
        k = k_cache[pages].flatten(0, 1)[:n].transpose(0, 1)
        v = v_cache[pages].flatten(0, 1)[:n].transpose(0, 1)
        out[i, 0] = F.scaled_dot_product_attention(q[i, 0][:, None], k, v, enable_gqa=True)[:, 0]


def xqa_backend(pool: KVPool, hq: int) -> FlashInferAttention:
    be = make_backend(pool, hq)
    be._xqa_ok, be.decode_mode = True, "xqa"
    be._init_xqa(ref_xqa)
    return be


def test_xqa_decode_eager_and_graph_match_torch() -> None:
    hq, hkv, d, ps = 4, 2, 16, 4
    pools = [KVPool(1, 32, ps, hkv, d, torch.float32, "cpu") for _ in range(2)]
    fi = xqa_backend(pools[1], hq)
    gen = torch.Generator().manual_seed(2)
    run_step([([1] * 6, 0, [3, 5]), ([2] * 3, 0, [7])], pools, [TorchAttention("cpu"), fi], hq, hkv, d, ps, gen)
    assert fi._table_args is None  # prefill plans the FA2 prefill wrapper
    # eager decode: XQA over the batch's own page table
    batch, (ref, got) = run_step([([3], 6, [3, 5]), ([4], 3, [7])], pools, [TorchAttention("cpu"), fi],
                                 hq, hkv, d, ps, gen)
    assert fi._table_kernel == "xqa" and fi._table_args[0] is batch.page_table
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # graph decode of padded size 4: capture-time padding, then this step's table
    assert fi.graph_wrapper(4) is None and fi._g_seq[:4].tolist() == [1, 1, 1, 1]
    starts, tables = [7, 4], [[3, 5], [7, 9]]
    batch = ForwardBatch.from_requests([([5], 7, tables[0]), ([6], 4, tables[1])], ps, "cpu")
    q = torch.randn(4, hq, d, generator=gen)
    k, v = torch.randn(4, hkv, d, generator=gen), torch.randn(4, hkv, d, generator=gen)
    ref_be = TorchAttention("cpu")
    ref_be.prepare(batch)
    ref = ref_be.forward(q[:2], k[:2], v[:2], 0, batch, pools[0])
    pools[1].store(0, batch.out_slots, k[:2], v[:2])
    out_slots, seq, table = decode_table(starts, tables, ps)
    assert out_slots.tolist() == batch.out_slots.tolist()
    pad_seq = torch.tensor([*seq.tolist(), 1, 1], dtype=torch.int32)
    pad_table = torch.zeros(4, table.shape[1], dtype=torch.int32)
    pad_table[:2] = torch.from_numpy(table)
    fi.set_graph_table(4, pad_seq, pad_table)
    got = fi.attend(q, 0, batch, pools[1])
    torch.testing.assert_close(got[:2], ref, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got).all()
    # a smaller batch (1 of 4 rows) after it: the rows it leaves become padding again
    fi._g_table.fill_(-1)  # stale columns must not matter past each row's pages
    fi.set_graph_table(4, pad_seq[:1], pad_table[:1])
    assert fi._g_seq[:4].tolist() == [8, 1, 1, 1] and fi._g_table[1:4, 0].tolist() == [0, 0, 0]


def test_decode_table_matches_forward_batch() -> None:
    rng = random.Random(5)
    ps = 4
    starts = [rng.randrange(0, 40) for _ in range(6)]
    tables = [rng.sample(range(1, 500), s // ps + 1 + rng.randrange(0, 3)) for s in starts]
    batch = ForwardBatch.build([1] * 6, starts, [1] * 6, tables, [1] * 6, ps, "cpu")
    out_slots, seq, table = decode_table(starts, tables, ps)
    assert out_slots.tolist() == batch.out_slots.tolist()
    assert seq.tolist() == batch.seq_lens_cpu
    assert table.tolist() == batch.page_table_cpu.tolist()


def test_xqa_support() -> None:
    bf, f8 = torch.bfloat16, torch.float8_e4m3fn
    assert xqa_supported((9, 0), bf, bf, 128, 16) and xqa_supported((9, 0), bf, f8, 128, 16)
    assert not xqa_supported((8, 0), bf, bf, 128, 16)  # Ampere: FA2 only
    assert not xqa_supported((9, 0), bf, bf, 128, 8)  # page size XQA does not build
    assert not xqa_supported((9, 0), torch.float32, torch.float32, 128, 16)
    assert not xqa_supported((9, 0), bf, bf, 72, 16)


def test_decode_kernel_flag_reaches_only_flashinfer() -> None:
    import pytest

    pool = KVPool(1, 8, 4, 2, 16, torch.float32, "cpu")
    fi = make_backend(pool, 4)
    set_decode_kernel(fi, "triton")
    assert fi.decode_mode == "triton"
    assert fi.decode_kernel(1) == "fa2"  # forced but unsupported here (CPU): FA2
    set_decode_kernel(TorchAttention("cpu"), "auto")  # the default is fine for any backend
    with pytest.raises(ValueError, match="needs the flashinfer attention backend"):
        set_decode_kernel(TorchAttention("cpu"), "fa2")
    with pytest.raises(ValueError, match="--decode-kernel"):
        set_decode_kernel(fi, "fast")
