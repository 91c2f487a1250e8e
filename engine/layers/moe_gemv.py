"""The routed experts of one token as two GEMV launches (CUDA, triton; batch-1 decode).

At one token the fused MoE path (engine/layers/moe_kernels.py) pays four launches a layer
(align, w13, w2, combine) and runs its GEMMs on 16-row tensor-core tiles of which one row is
real: on an H200, Qwen3-30B-A3B's experts read at ~2.6-3.1 TB/s and the align and combine
launches cost 0.22 ms a step (docs/PERF.md). One token needs no alignment: each of its k
(slot, expert) pairs is a matrix-vector product, so

1. `experts13_kernel`, programs (slot j, BLOCK_N columns of the intermediate dim): the gate and
   up rows of expert ids[j] times x, summed in float32, stored as silu(gate) * up in x's dtype
   (mid [k, I]); the program of the first columns adds the pair to `counts` (every pair, this
   rank's experts or not, as `align_kernel` counts them);
2. `experts2_kernel`, programs of BLOCK_N output columns: every slot's w2 rows of expert ids[j]
   loaded at once (one [k, BLOCK_N, BLOCK_K] tile: a loop over the slots would wait for each
   expert's rows in turn) times mid[j], times the routing weight, rounded to x's dtype (as the
   fused path stores a pair's row), added in float32 in slot order (the combine), stored in x's dtype.

Pairs routed to another rank's experts (expert parallelism) load nothing and add nothing. There
is no padding row to leave out: a forward's one row is real (a graph of one row serves batch 1).
The products are the fused path's (bf16 x bf16 is exact in float32); only the order of the float32
sums differs, so the results agree to rounding (tests/run/test_moe_gemv.py; tests/gpu/test_moe_gpu.py at real shapes).
Plain and fp8_row stacks (a per-row scale applied once per output); fp8_block stays on the fused
path. Deterministic inference keeps the fused path's one config (its bits do not depend on the
batch); this path is for one token only, so it would break that invariance. Blocks: the tuning
file's `moe_gemv`, the fastest of scripts/kernel_sweep.py's grid. Served on an H200, Qwen3-30B-A3B
batch 1: 2.93 ms a step against 3.12 with the fused kernels (docs/PERF.md, fourteenth session);
2.83 with the routing and both launches under PDL (twenty-first session; moe_kernels.moe_pdl).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.layers import batch_invariant
from engine.layers.moe_kernels import QUANTS, Stack, moe_pdl
from engine.layers.triton_kernels import pdl_start
from engine.layers.tuning import kernel_tuning


@triton.jit
def _slot(ids, j, first, LOCAL: tl.constexpr):
    """(local expert of slot j, 1 if it is this rank's else 0): an int, not a bool, so that masks
    stay vectors (triton's interpreter rejects a broadcast scalar bool as a mask)."""
    e = tl.load(ids + j) - first
    return e, tl.where((e >= 0) & (e < LOCAL), 1, 0)


@triton.jit
def _row_dot(wb, v, rn, nm, k0, kk, stride_wn, BK: tl.constexpr):
    """sum over K tile k0 (columns below kk) of w[rn, k] * v[k] (float32), rows rn of the expert at wb."""
    rk = k0 + tl.arange(0, BK)
    wt = tl.load(wb + rn[:, None] * stride_wn + rk[None, :], mask=nm[:, None] & (rk < kk)[None, :], other=0.0)
    return tl.sum(wt.to(tl.float32) * v[None, :], 1)


@triton.jit
def experts13_kernel(x, w, ws, ids, counts, mid, first, N, K, stride_we, stride_wn, stride_wse,
                     LOCAL: tl.constexpr, QUANT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     PDL: tl.constexpr):
    """mid[j, n] = silu(gate_n . x) * (up_n . x) of slot j's expert, for BN columns n (module docstring, 1)."""
    pdl_start(PDL)  # every load waits for the ids (the routing, the previous launch)
    j = tl.program_id(0)
    pn = tl.program_id(1)
    e, live = _slot(ids, j, first, LOCAL)
    if pn == 0:
        tl.atomic_add(counts + first + e, 1)
    if live > 0:
        rn = pn * BN + tl.arange(0, BN)
        nm = rn < N
        wb = w + e.to(tl.int64) * stride_we
        g = tl.zeros((BN,), tl.float32)
        u = tl.zeros((BN,), tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            xv = tl.load(x + rk, mask=rk < K, other=0.0).to(tl.float32)
            g += _row_dot(wb, xv, rn, nm, k0, K, stride_wn, BK)
            u += _row_dot(wb, xv, N + rn, nm, k0, K, stride_wn, BK)
        if QUANT == 1:
            sb = ws + e.to(tl.int64) * stride_wse
            g = g * tl.load(sb + rn, mask=nm, other=0.0)
            u = u * tl.load(sb + N + rn, mask=nm, other=0.0)
        h = g / (1.0 + tl.exp(-g)) * u
        tl.store(mid + j * N + rn, h.to(mid.dtype.element_ty), mask=nm)


@triton.jit
def experts2_kernel(mid, w, ws, ids, weights, out, first, N, K, stride_we, stride_wn, stride_wse,
                    TOP_K: tl.constexpr, K_P2: tl.constexpr, LOCAL: tl.constexpr, QUANT: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    """out[n] = sum over slots j in order of round(weights[j] * (w2_n . mid[j])) for BN columns n
    (module docstring, 2). Every slot's tile is one [K_P2, BN, BK] load, so the k experts' rows are
    in flight at once (a loop over slots waits for each in turn); a slot of another rank's expert
    loads nothing and adds zero. With PDL the ids and the first K tile of w2 load before the wait:
    the routing (two launches back) is done once experts13_kernel has passed its own wait, which
    every one of its programs has before this launch starts; only `mid` is the previous launch's."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    nm = rn < N
    j = tl.arange(0, K_P2)
    e = tl.load(ids + j, mask=j < TOP_K, other=0) - first
    live = (j < TOP_K) & (e >= 0) & (e < LOCAL)
    wb = w + tl.where(live, e, 0).to(tl.int64)[:, None, None] * stride_we + rn[None, :, None] * stride_wn
    wm = live[:, None, None] & nm[None, :, None]
    rk = tl.arange(0, BK)
    km = rk < K
    wt = tl.load(wb + rk[None, None, :], mask=wm & km[None, None, :], other=0.0)
    pdl_start(PDL)
    hv = tl.load(mid + j[:, None] * K + rk[None, :], mask=live[:, None] & km[None, :], other=0.0)
    part = tl.sum(wt.to(tl.float32) * hv.to(tl.float32)[:, None, :], 2)
    for k0 in range(BK, K, BK):
        rk = k0 + tl.arange(0, BK)
        km = rk < K
        wt = tl.load(wb + rk[None, None, :], mask=wm & km[None, None, :], other=0.0)
        hv = tl.load(mid + j[:, None] * K + rk[None, :], mask=live[:, None] & km[None, :], other=0.0)
        part += tl.sum(wt.to(tl.float32) * hv.to(tl.float32)[:, None, :], 2)
    if QUANT == 1:
        sc = ws + tl.where(live, e, 0).to(tl.int64)[:, None] * stride_wse + rn[None, :]
        part = part * tl.load(sc, mask=live[:, None] & nm[None, :], other=0.0)
    wj = tl.load(weights + j, mask=live, other=0.0)
    y = (part * wj[:, None]).to(out.dtype.element_ty).to(tl.float32)  # a pair's row, rounded as stored
    acc = tl.zeros((BN,), tl.float32)
    for s in tl.static_range(TOP_K):  # slot order, as combine_kernel (a masked sum adds exact zeros)
        acc += tl.sum(tl.where((j == s)[:, None], y, 0.0), 0)
    tl.store(out + rn, acc.to(out.dtype.element_ty), mask=nm)


class GemvConfig(NamedTuple):
    """Programs' columns and K tile over w13 and over w2, and warps (the tuning file's `moe_gemv`)."""

    block_n13: int
    block_k13: int
    block_n2: int
    block_k2: int
    num_warps: int


def config(x: torch.Tensor, w13: Stack) -> GemvConfig | None:
    """The tuning file's blocks where this path takes the forward (one token, a plain or fp8_row
    stack, a GPU whose file has `moe_gemv`), else None; never under deterministic inference
    (the fused path's one config serves every batch there)."""
    if x.shape[0] != 1 or w13.quant not in (None, "fp8_row") or batch_invariant.enabled():
        return None
    blocks = kernel_tuning(x.device).moe_gemv
    return None if blocks is None else GemvConfig(*blocks)


def one_token_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: Stack, w2: Stack,
                      counts: torch.Tensor, first: int, cfg: GemvConfig) -> torch.Tensor:
    """moe_kernels.fused_experts for one token (x [1, H], weights [1, k] float32, ids [1, k]):
    this rank's partial sum [1, H]; adds the pairs to `counts` [E]. No padding rows: a forward's
    one row is real (a CUDA graph of one row replays only for batch 1)."""
    k, h, inter, local = ids.shape[1], x.shape[1], w2.w.shape[2], w13.w.shape[0]
    q = QUANTS[w13.quant]
    x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
    mid = torch.empty(k, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(1, h, dtype=x.dtype, device=x.device)
    s13 = w13.scale if w13.scale is not None else w13.w
    s2 = w2.scale if w2.scale is not None else w2.w
    pdl = moe_pdl(x.device, 1)
    experts13_kernel[(k, triton.cdiv(inter, cfg.block_n13))](
        x, w13.w, s13, ids, counts, mid, first, inter, h, w13.w.stride(0), w13.w.stride(1),
        s13.stride(0), LOCAL=local, QUANT=q, BN=cfg.block_n13, BK=cfg.block_k13,
        num_warps=cfg.num_warps, **pdl,
    )
    experts2_kernel[(triton.cdiv(h, cfg.block_n2),)](
        mid, w2.w, s2, ids, weights, out, first, h, inter, w2.w.stride(0), w2.w.stride(1),
        s2.stride(0), TOP_K=k, K_P2=triton.next_power_of_2(k), LOCAL=local, QUANT=q, BN=cfg.block_n2,
        BK=cfg.block_k2, num_warps=cfg.num_warps, **pdl,
    )
    return out
