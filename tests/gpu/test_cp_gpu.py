"""Context parallelism's kernels on the GPU (engine/layers/cp_attention.py): two simulated cp ranks,
each with its own pool holding only its pages (round robin, global ids local * 2 + owner), attend
their share by FlashAttention with its LSE; the partials merged by LSE equal full attention at a
128k-token context: a whole 128k prefill, a 4096-token chunk after a cached 124k prefix, and a
decode at 128k (whose LSE is also checked against the scores computed directly)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers.cp_attention import ContextParallelAttention
from engine.layers.forward import ForwardBatch
from engine.layers.kv_pool import KVPool
from engine.layers.lse_attention import merge_partials
from engine.layers.parallel import TPGroup

L, HQ, HKV, D, PAGE, CP = 131072, 32, 8, 128, 16, 2


def _global(i: int) -> int:
    """The global id of request page i: local id i // CP + 1 (page 0 is padding) in rank i % CP's pool."""
    return (i // CP + 1) * CP + i % CP


@pytest.mark.parametrize("new", [L, 4096, 1])
def test_cp2_flash_partials_merged_equal_full_attention_at_128k(new: int) -> None:
    dev, dtype = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(new)
    k, v = (torch.randn(L, HKV, D, device=dev, generator=g, dtype=dtype) for _ in range(2))
    q = (4 * torch.randn(new, HQ, D, device=dev, generator=g)).to(dtype)  # peaked: a few keys dominate
    start = L - new
    table = [_global(i) for i in range(L // PAGE)]
    pools = [KVPool(1, L // PAGE // CP + 2, PAGE, HKV, D, dtype, dev) for _ in range(CP)]
    pos = torch.arange(start, device=dev)
    for r, pool in enumerate(pools):  # the cached prefix, each page in its owner's pool only
        mine = pos[(pos // PAGE) % CP == r]
        pool.store(0, (mine // PAGE // CP + 1) * PAGE + mine % PAGE, k[mine], v[mine])
    batch = ForwardBatch.from_requests([([0] * new, start, table)], PAGE, dev)
    parts = []
    for r, pool in enumerate(pools):
        be = ContextParallelAttention(TPGroup(r, CP))
        be.prepare(batch)
        be.store_rows(0, pool, k[start:], v[start:])
        parts.append(be.partial(q, k[start:], v[start:], 0, pool))
    got, lse = merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    # each rank's pool holds its own pages: together every token once
    assert sum(int(p.k_all[0].abs().sum((-1, -2)).ne(0).sum()) for p in pools) == L
    kr, vr = (x.transpose(0, 1).repeat_interleave(HQ // HKV, 0)[None] for x in (k, v))
    mask = torch.ones(new, L, dtype=torch.bool, device=dev).tril(start)  # row i sees keys 0 .. start + i
    want = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kr, vr, attn_mask=mask if new < L else None,
                                          is_causal=new == L)[0].transpose(0, 1).float()
    err = (got - want).norm() / want.norm()
    assert err < 1e-2, f"relative error {err:.2e}"
    if new < L:  # the cached prefix counts: attention over the new keys alone is far off
        alone = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kr[:, :, start:], vr[:, :, start:],
                                               is_causal=True)[0].transpose(0, 1).float()
        assert (alone - want).norm() / want.norm() > 10 * err
    if new == 1:  # the merged LSE is the log-sum-exp of the row's scores over all 128k keys
        scores = torch.einsum("hd,hld->hl", q[0].float(), kr[0].float()) * D**-0.5
        torch.testing.assert_close(lse[0], torch.logsumexp(scores, -1), atol=2e-2, rtol=1e-3)


def _decode_setup(contexts: list[int], pools: list[KVPool], next_local: list[int], g: torch.Generator):
    """Requests at these contexts (keys 0..n-2 cached in their owners' pools, key n-1 new): their
    global page tables, their keys and values."""
    dev, dtype = pools[0].device, pools[0].dtype
    tables, keys = [], []
    for n in contexts:
        table = []
        for i in range(-(-n // PAGE)):
            owner = i % CP
            table.append(next_local[owner] * CP + owner)
            next_local[owner] += 1
        k, v = (torch.randn(n, HKV, D, device=dev, generator=g, dtype=dtype) for _ in range(2))
        pos = torch.arange(n - 1, device=dev)
        for r, pool in enumerate(pools):  # the cached prefix, each page in its owner's pool only
            mine = pos[(pos // PAGE) % CP == r]
            if mine.numel():
                glob = torch.tensor(table, device=dev)[mine // PAGE]
                pool.store(0, glob // CP * PAGE + mine % PAGE, k[mine], v[mine])
        tables.append(table)
        keys.append((k, v))
    return tables, keys


def test_cp2_batched_decode_rows_by_flashinfer() -> None:
    """A decode step of requests at contexts of 1 (no key on rank 1), 17, 1000 and 5000 tokens: each
    rank attends its one-token rows in one flashinfer paged decode over its local pages (its LSE,
    base 2, turned to natural log); the merged rows equal attention over every key, and the merged
    LSE is each row's log-sum-exp."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(5)
    contexts = [1, 17, 1000, 5000]
    pools = [KVPool(1, 4096, PAGE, HKV, D, dtype, dev) for _ in range(CP)]
    tables, keys = _decode_setup(contexts, pools, [1] * CP, g)
    batch = ForwardBatch.from_requests([([0], n - 1, t) for n, t in zip(contexts, tables, strict=True)], PAGE, dev)
    q = (4 * torch.randn(len(contexts), HQ, D, device=dev, generator=g)).to(dtype)
    k_new = torch.stack([k[-1] for k, _ in keys])
    v_new = torch.stack([v[-1] for _, v in keys])
    parts = []
    for r, pool in enumerate(pools):
        be = ContextParallelAttention(TPGroup(r, CP))
        be.prepare(batch)
        assert be.plan.decode is not None and be.plan.decode.reqs == ([0, 1, 2, 3] if r == 0 else [1, 2, 3])
        be.store_rows(0, pool, k_new, v_new)
        parts.append(be.partial(q, k_new, v_new, 0, pool))
    _assert_attends_every_key(keys, q, *merge_partials(torch.stack([p[0] for p in parts]),
                                                       torch.stack([p[1] for p in parts])))


def _assert_attends_every_key(keys: list[tuple[torch.Tensor, torch.Tensor]], q: torch.Tensor, got: torch.Tensor,
                              lse: torch.Tensor) -> None:
    """Row i of the merged output and LSE is request i's attention over all its keys."""
    for i, (k, v) in enumerate(keys):
        kr, vr = (x.float().transpose(0, 1).repeat_interleave(HQ // HKV, 0) for x in (k, v))
        scores = torch.einsum("hd,hld->hl", q[i].float(), kr) * D**-0.5
        want = torch.einsum("hl,hld->hd", scores.softmax(-1), vr)
        err = (got[i] - want).norm() / want.norm()
        assert err < 1e-2, f"request {i} (context {k.shape[0]}): relative error {err:.2e}"
        torch.testing.assert_close(lse[i], torch.logsumexp(scores, -1), atol=2e-2, rtol=1e-3)


def test_cp2_decode_partials_in_a_cuda_graph_replanned_each_step() -> None:
    """Each simulated rank captures its decode partial (`graph_partial`: the owner test and local
    slots on the device, flashinfer's fixed-size decode over its own pages) once at batch 8, then
    replays it for two different steps, re-planned from the steps' lists (`plan_graph_lists`): the
    merged rows equal attention over every key (the new key stored only by its page's owner,
    requests with no page on rank 1 and the padding rows weighed 0)."""
    dev, dtype, bs = torch.device("cuda"), torch.bfloat16, 8
    g = torch.Generator(device=dev).manual_seed(7)
    pools = [KVPool(1, 4096, PAGE, HKV, D, dtype, dev) for _ in range(CP)]
    next_local = [1] * CP
    backends = [ContextParallelAttention(TPGroup(r, CP)) for r in range(CP)]
    q_s = torch.zeros(bs, HQ, D, device=dev, dtype=dtype)
    k_s, v_s = (torch.zeros(bs, HKV, D, device=dev, dtype=dtype) for _ in range(2))
    pos_s, slot_s = (torch.zeros(bs, dtype=torch.int64, device=dev) for _ in range(2))
    pad = torch.zeros(bs, 1, dtype=torch.int32)
    batch = ForwardBatch(input_ids=pos_s, positions=pos_s, out_slots=slot_s, page_table=pad.to(dev),
                         seq_lens=torch.ones(bs, dtype=torch.int32, device=dev),
                         extend_lens=torch.ones(bs, dtype=torch.int32, device=dev),
                         logit_indices=torch.arange(bs, device=dev), seq_lens_cpu=[1] * bs, extend_lens_cpu=[1] * bs,
                         page_size=PAGE, is_decode=True, page_table_cpu=pad)
    graphs, outs = [], []
    for be, pool in zip(backends, pools, strict=True):
        be.bind(num_q_heads=HQ, kv_pool=pool, max_batch=bs, max_pages_per_req=400)
        assert be.supports_cuda_graph
        be.graph_wrapper(bs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                be.graph_partial(q_s, k_s, v_s, 0, batch, pool)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outs.append(be.graph_partial(q_s, k_s, v_s, 0, batch, pool))
        graphs.append(graph)
    # owners of the new keys' pages: 0, 1, 0, 1 and 0, 1, 0
    for contexts in ([1, 17, 1000, 4990], [5, 300, 2000]):
        tables, keys = _decode_setup(contexts, pools, next_local, g)
        b = len(contexts)
        starts = [n - 1 for n in contexts]
        q = (4 * torch.randn(b, HQ, D, device=dev, generator=g)).to(dtype)
        q_s.zero_(), k_s.zero_(), v_s.zero_(), pos_s.zero_(), slot_s.zero_()
        q_s[:b] = q
        k_s[:b] = torch.stack([k[-1] for k, _ in keys])
        v_s[:b] = torch.stack([v[-1] for _, v in keys])
        pos_s[:b] = torch.tensor(starts, device=dev)
        slot_s[:b] = torch.tensor([t[s // PAGE] * PAGE + s % PAGE for t, s in zip(tables, starts, strict=True)],
                                  device=dev)
        for be, graph in zip(backends, graphs, strict=True):
            be.plan_graph_lists(bs, starts, tables)
            graph.replay()
        assert torch.isneginf(outs[1][1][b:]).all()  # padding rows (position 0: page 0 is rank 0's)
        if contexts[0] == 1:  # request 0's one key is rank 0's: rank 1's row weighs 0
            assert torch.isneginf(outs[1][1][0]).all()
        _assert_attends_every_key(keys, q, *merge_partials(torch.stack([o[0] for o in outs]),
                                                           torch.stack([o[1] for o in outs])))
