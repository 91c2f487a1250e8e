"""An MoE layer's front at decode in one launch (CUDA, triton): the router's GEMV, the routing
and the experts' alignment of engine/layers/moe_kernels.py, for the few rows the router's
triton GEMV takes (decode batches of at most `gemv_max_rows` tokens, not under deterministic
inference: the conditions of `Router.logits`' GEMV).

At batch 1 each of the three was a launch of its own (Qwen3-30B-A3B on an H200: 2-3 us each, a
MoE layer's fixed cost beside 24 us of expert weights; docs/PERF.md). Here the GEMV's programs
store the logits, and the last of them to finish (an atomic counter, as the triton decode
attention's merge) routes every row (`route_row`, the code of `route_kernel`: the same weights
and ids, bit for bit) and aligns the pairs in registers: one program, since a decode batch has
at most a few dozen (token, slot) pairs. Its outputs are `align`'s (the same segments, padding
rows and counts), so `fused_experts` goes on from there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.layers import moe_kernels as mk
from engine.layers import triton_ops
from engine.layers.triton_kernels import gemv_kernel


@triton.jit
def _align_all(v, m, offs, numel, counts, E, first, sorted_ids, block_expert, num_padded,
               LOCAL: tl.constexpr, E_P2: tl.constexpr, BM: tl.constexpr, ROWS_P2: tl.constexpr,
               BLOCKS_P2: tl.constexpr):
    """align_kernel's outputs from the pairs' experts v (int32 [P]) where m, in one program:
    each local expert's pairs in flat order in a segment padded to BM rows (the rest `numel`),
    the local expert of every BM block, the rows in use; every expert's pairs added to counts."""
    bins = tl.arange(0, E_P2)
    onehot = (v[:, None] == bins[None, :]) & m[:, None]  # [P, E_P2]
    hist = tl.sum(onehot.to(tl.int32), 0)
    em = bins < E
    tl.store(counts + bins, tl.load(counts + bins, mask=em, other=0) + hist, mask=em)
    local = (bins >= first) & (bins < first + LOCAL)
    padded = tl.where(local, (hist + BM - 1) // BM * BM, 0)
    start = tl.cumsum(padded, 0) - padded
    total = tl.sum(padded, 0)
    tl.store(num_padded, total)
    rows = tl.arange(0, ROWS_P2)
    tl.store(sorted_ids + rows, numel, mask=rows < total)  # padding first, the pairs over it below
    b0 = tl.arange(0, BLOCKS_P2) * BM
    inside = (b0[:, None] >= start[None, :]) & (b0[:, None] < (start + padded)[None, :])
    tl.store(block_expert + b0 // BM, tl.sum(tl.where(inside, bins[None, :] - first, 0), 1), mask=b0 < total)
    tl.debug_barrier()  # the padding stores of every thread land before the pairs' stores
    # a pair's rank among its expert's: the live pairs before it with the same expert
    rank = tl.sum(((v[None, :] == v[:, None]) & m[None, :] & (offs[None, :] < offs[:, None])).to(tl.int32), 1)
    dest = tl.sum(tl.where(onehot, start[None, :], 0), 1) + rank
    tl.store(sorted_ids + dest, offs, mask=m & (v >= first) & (v < first + LOCAL))


@triton.jit
def router_front_kernel(x, w, logits, E, stride_w, stride_x, bias, weights, ids, scale, counter, keys, below,
                        counts, first, sorted_ids, block_expert, num_padded,
                        K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, M: tl.constexpr,
                        PDL: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                        TOP_K: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr, GROUPED: tl.constexpr,
                        G: tl.constexpr, G_P2: tl.constexpr, EG: tl.constexpr, TOPK_GROUP: tl.constexpr,
                        HAS_KEYS: tl.constexpr, LOCAL: tl.constexpr, BM: tl.constexpr, P_P2: tl.constexpr,
                        ROWS_P2: tl.constexpr, BLOCKS_P2: tl.constexpr):
    """Router logits [M, E] (the GEMV's programs), then in the last program to finish: every
    row's routing (weights, ids) and the alignment (module docstring)."""
    gemv_kernel(x, w, w, logits, E, stride_w, stride_x, K, BLOCK_N, BLOCK_K, M, False, False, PDL)
    tl.debug_barrier()
    if tl.atomic_add(counter, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        offs = tl.arange(0, P_P2)
        slots = tl.arange(0, K_P2)
        km = slots < TOP_K
        v = tl.zeros((P_P2,), tl.int32)
        for t in tl.static_range(M):
            wt, picked = mk.route_row(logits, bias, t, E, scale, SIGMOID, HAS_BIAS, NORM, TOP_K, K_P2, E_P2,
                                      GROUPED, G, G_P2, EG, TOPK_GROUP, ".cg")
            tl.store(weights + t * TOP_K + slots, wt, mask=km)
            tl.store(ids + t * TOP_K + slots, picked, mask=km)
            hit = (offs[:, None] == (t * TOP_K + slots)[None, :]) & km[None, :]
            v += tl.sum(tl.where(hit, picked[None, :].to(tl.int32), 0), 1)
        numel = M * TOP_K
        m = offs < numel
        if HAS_KEYS:  # a CUDA graph's padding rows: not counted, not computed
            m = m & (tl.load(keys + offs // TOP_K, mask=m, other=0) >= below)
        _align_all(v, m, offs, numel, counts, E, first, sorted_ids, block_expert, num_padded,
                   LOCAL, E_P2, BM, ROWS_P2, BLOCKS_P2)
        tl.store(counter, 0)  # ready for the next launch


def front(x: torch.Tensor, weight: torch.Tensor, gemv: tuple, spec, bias: torch.Tensor | None,  # noqa: ANN001
          counter: torch.Tensor, counts: torch.Tensor, first: int, local: int, block_m: int,
          pad: tuple[torch.Tensor, int] | None) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """(weights, ids, align's tuple) for x [M, H] (M <= the GEMV's rows) with the router weight
    [E, H] (its GEMV config `gemv`); counter: a zeroed int32 the kernel leaves at zero."""
    from engine.layers.moe import is_grouped
    from engine.layers.tuning import kernel_tuning

    m, k = x.shape[0], spec.top_k
    e, hidden = weight.shape
    numel = m * k
    blocks = triton.cdiv(numel + min(numel, local) * (block_m - 1), block_m)
    dev = x.device
    logits = torch.empty(m, e, dtype=x.dtype, device=dev)
    weights = torch.empty(m, k, dtype=torch.float32, device=dev)
    ids = torch.empty(m, k, dtype=torch.int64, device=dev)
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    keys, below = pad if pad is not None else (ids, 0)
    bn, bk, warps, stages = gemv
    grouped = (1 if spec.topk_method == "noaux_tc" else 2) if is_grouped(spec) else 0
    g = spec.n_group
    pdl = triton_ops.pdl_launch(dev, kernel_tuning(dev).triton_pdl)  # as the projections' GEMVs
    router_front_kernel[(triton.cdiv(e, bn),)](
        x, weight, logits, e, weight.stride(0), x.stride(0), bias if bias is not None else logits, weights, ids,
        float(spec.routed_scaling_factor), counter, keys, below, counts, first, sorted_ids, block_expert, num_padded,
        K=hidden, BLOCK_N=bn, BLOCK_K=bk, M=m, SIGMOID=spec.scoring_func == "sigmoid",
        HAS_BIAS=bias is not None, NORM=spec.norm_topk_prob, TOP_K=k, K_P2=triton.next_power_of_2(k),
        E_P2=triton.next_power_of_2(e), GROUPED=grouped, G=g, G_P2=triton.next_power_of_2(g), EG=e // g,
        TOPK_GROUP=spec.topk_group, HAS_KEYS=pad is not None, LOCAL=local, BM=block_m,
        P_P2=triton.next_power_of_2(numel), ROWS_P2=triton.next_power_of_2(blocks * block_m),
        BLOCKS_P2=triton.next_power_of_2(blocks), num_warps=warps, num_stages=stages, **pdl,
    )
    return weights, ids, (sorted_ids, block_expert, num_padded, blocks, numel)
