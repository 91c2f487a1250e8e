"""Context parallelism's kernels on the GPU (engine/layers/cp_attention.py): two simulated cp ranks,
each with its own pool holding only its pages (round robin, global ids local * 2 + owner), attend
their share by FlashAttention with its LSE; the partials merged by LSE equal full attention at a
128k-token context: a whole 128k prefill, a 4096-token chunk after a cached 124k prefix, and a
decode at 128k (whose LSE is also checked against the scores computed directly)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers.cp_attention import ContextParallelAttention, merge_partials
from engine.layers.forward import ForwardBatch
from engine.layers.kv_pool import KVPool
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


def test_cp2_batched_decode_rows_by_flashinfer() -> None:
    """A decode step of requests at contexts of 1 (no key on rank 1), 17, 1000 and 5000 tokens: each
    rank attends its one-token rows in one flashinfer paged decode over its local pages (its LSE,
    base 2, turned to natural log); the merged rows equal attention over every key, and the merged
    LSE is each row's log-sum-exp."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(5)
    contexts = [1, 17, 1000, 5000]
    pools = [KVPool(1, 4096, PAGE, HKV, D, dtype, dev) for _ in range(CP)]
    next_local = [1] * CP  # page 0 is padding
    reqs, keys = [], []
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
        reqs.append(([0], n - 1, table))
        keys.append((k, v))
    batch = ForwardBatch.from_requests(reqs, PAGE, dev)
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
    got, lse = merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    for i, (k, v) in enumerate(keys):
        kr, vr = (x.float().transpose(0, 1).repeat_interleave(HQ // HKV, 0) for x in (k, v))
        scores = torch.einsum("hd,hld->hl", q[i].float(), kr) * D**-0.5
        want = torch.einsum("hl,hld->hd", scores.softmax(-1), vr)
        err = (got[i] - want).norm() / want.norm()
        assert err < 1e-2, f"request {i} (context {contexts[i]}): relative error {err:.2e}"
        torch.testing.assert_close(lse[i], torch.logsumexp(scores, -1), atol=2e-2, rtol=1e-3)
