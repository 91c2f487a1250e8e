"""Fused MoE on CUDA in triton: the routed experts of engine/layers/moe.py's `Experts` without a
host sync, so a decode step that holds MoE layers can be captured in a CUDA graph.

Routing is one launch (`route`: `route_kernel`, expert groups included); then, for one token,
two GEMV launches where the tuning file has `moe_gemv` (engine/layers/moe_gemv.py, `config`),
else four launches a layer (`fused_experts`):

1. `align_kernel`, one program per (global) expert: the T*k (token, slot) pairs routed to this
   rank's experts grouped by expert into segments padded to BLOCK_M rows (`sorted_ids`: pair
   index, or `numel` on a padding row; `block_expert`: the local expert of each BLOCK_M block;
   `num_padded`: the rows in use). Within an expert the pairs keep their flat order (a stable
   sort, as the torch path's argsort). Each program also adds its expert's pairs to the layer's
   `token_counts`. A CUDA graph's padding rows (`pad`) are left out: not counted, and not
   computed (their experts' weights are not read for them; combine gives them zeros).
   Everything lives in buffers of a size fixed by the shapes: at most numel + min(numel,
   local experts) * (BLOCK_M - 1) rows.
2. `gemm_kernel` over w13: each program one BLOCK_M block of one expert and BLOCK_N / 2 columns
   of the intermediate dim (BLOCK_N weight rows, as over w2); it accumulates the gate and the up
   tile side by side and stores
   silu(gate) * up ([numel, I] in the activation dtype).
3. `gemm_kernel` over w2: times the pair's routing weight (float32 accumulator), [numel, H].
4. `combine_kernel`: a token's k rows summed in float32 in slot order (pairs routed to another
   rank's experts add nothing), stored in x's dtype.

Programs of blocks past `num_padded` return at once (the grid is sized for the worst case).
fp8 stacks (engine/layers/moe_quant.py) are read as e4m3 and widened in registers (weight-only:
the activations are not rounded): `fp8_row` scales each output column of the tile once at the
end, `fp8_block` each k-step's product by its 128 x 128 block's scale (BLOCK_K divides 128).
Block sizes: `KernelTuning.moe_gemm` (engine/layers/tuning.py), by the mean rows an expert with
tokens gets.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.layers import batch_invariant
from engine.layers.triton_kernels import pdl_start
from engine.layers.triton_ops import interpreted, pdl_launch
from engine.layers.tuning import kernel_tuning

QUANTS = {None: 0, "fp8_row": 1, "fp8_block": 2}
# triton's interpreter multiplies bfloat16 tiles as raw bits: there (the CPU tests) dot in float32
DOT_F32 = interpreted()
CHUNK_SMALL = 128  # the align kernel reads pairs in chunks of this many (decode), else 1024


@triton.jit
def _keep_groups(choice, bins, GROUPED: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr, EG: tl.constexpr,
                 TOPK_GROUP: tl.constexpr):
    """`choice` with every expert outside the TOPK_GROUP best of G groups (EG experts each) at -inf;
    a group scored by the sum of its two best choices (GROUPED 1: noaux_tc) or its best (2)."""
    grp = bins // EG
    gslots = tl.arange(0, G_P2)
    gs = tl.full((G_P2,), float("-inf"), tl.float32)
    for g in tl.static_range(G):
        mine = tl.where(grp == g, choice, float("-inf"))
        m1 = tl.max(mine, 0)
        score = m1
        if GROUPED == 1:  # the second best: the best left once one copy of the first is taken out
            first = tl.min(tl.where(mine == m1, bins, bins.shape[0]), 0)
            score = m1 + tl.max(tl.where(bins == first, float("-inf"), mine), 0)
        gs = tl.where(gslots == g, score, gs)
    keep = tl.zeros_like(choice) != 0
    for _ in tl.static_range(TOPK_GROUP):  # the best group left, the lowest index among equals
        best = tl.min(tl.where(gs == tl.max(gs, 0), gslots, G_P2), 0)
        keep = keep | (grp == best)
        gs = tl.where(gslots == best, float("-inf"), gs)
    return tl.where(keep, choice, float("-inf"))


@triton.jit
def route_kernel(logits, bias, weights, ids, E, scale, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                 NORM: tl.constexpr, TOP_K: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr,
                 GROUPED: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr, EG: tl.constexpr,
                 TOPK_GROUP: tl.constexpr, PDL: tl.constexpr):
    """Token t's routing from its router logits (float32 or bf16, taken to float32), as
    moe.route computes it: scores (softmax or 1 / (1 + exp(-x))), with GROUPED only the
    experts of the TOPK_GROUP best groups (`_keep_groups`), the top_k of scores (+ bias), best
    first, their scores as weights (over their sum + 1e-20 with NORM) times `scale`."""
    pdl_start(PDL)  # the logits are the previous launch's
    t = tl.program_id(0).to(tl.int64)
    bins = tl.arange(0, E_P2)
    em = bins < E
    x = tl.load(logits + t * E + bins, mask=em, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = tl.where(em, 1.0 / (1.0 + tl.exp(-x)), 0.0)
    else:
        p = tl.exp(x - tl.max(x, 0))
        scores = p / tl.sum(p, 0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias + bins, mask=em, other=0.0)
    choice = tl.where(em, choice, float("-inf"))
    if GROUPED != 0:
        choice = _keep_groups(choice, bins, GROUPED, G, G_P2, EG, TOPK_GROUP)
    slots = tl.arange(0, K_P2)
    w = tl.zeros((K_P2,), tl.float32)
    picked = tl.zeros((K_P2,), tl.int64)
    for j in tl.static_range(TOP_K):  # the best left, the lowest index among equals
        best = tl.min(tl.where(choice == tl.max(choice, 0), bins, E_P2), 0)
        w = tl.where(slots == j, tl.sum(tl.where(bins == best, scores, 0.0), 0), w)
        picked = tl.where(slots == j, best.to(tl.int64), picked)
        choice = tl.where(bins == best, float("-inf"), choice)
    if NORM:
        w = w / (tl.sum(w, 0) + 1e-20)
    km = slots < TOP_K
    tl.store(weights + t * TOP_K + slots, w * scale, mask=km)
    tl.store(ids + t * TOP_K + slots, picked, mask=km)


@triton.jit
def _pairs(ids, keys, offs, numel, below, TOP_K: tl.constexpr, HAS_KEYS: tl.constexpr):
    """(mask, expert ids as int32) of the pairs at `offs`: those past `numel`, and with HAS_KEYS
    those of padding rows (a CUDA graph's: key below `below`), masked, their ids 0."""
    m = offs < numel
    if HAS_KEYS:
        m = m & (tl.load(keys + offs // TOP_K, mask=m, other=0) >= below)
    return m, tl.load(ids + offs, mask=m, other=0).to(tl.int32)


# keys: a view (a CUDA graph's out_slots) whose alignment must not pick another compiled variant
@triton.jit(do_not_specialize=["keys", "numel", "first", "below"])
def align_kernel(ids, sorted_ids, block_expert, num_padded, counts, keys, numel, first, below,
                 TOP_K: tl.constexpr, LOCAL: tl.constexpr, E_P2: tl.constexpr, BM: tl.constexpr,
                 CHUNK: tl.constexpr, HAS_KEYS: tl.constexpr):
    """Program e: expert e's pairs into its padded segment (module docstring, step 1)."""
    e = tl.program_id(0)
    bins = tl.arange(0, E_P2)
    hist = tl.zeros((E_P2,), tl.int32)
    counted = 0
    for c0 in range(0, numel, CHUNK):
        m, v = _pairs(ids, keys, c0 + tl.arange(0, CHUNK), numel, below, TOP_K, HAS_KEYS)  # padding rows left out
        # the masked pairs land in bin 0: taken off again (histogram's mask is not in every triton)
        hist += tl.histogram(v, E_P2) - tl.where(bins == 0, CHUNK - tl.sum(m.to(tl.int32), 0), 0)
        counted += tl.sum((m & (v == e)).to(tl.int32), 0)
    tl.store(counts + e, tl.load(counts + e) + counted)
    local = (bins >= first) & (bins < first + LOCAL)
    padded = tl.where(local, (hist + BM - 1) // BM * BM, 0)
    if e == 0:
        tl.store(num_padded, tl.sum(padded, 0))
    le = e - first
    if (le >= 0) & (le < LOCAL):
        start = tl.sum(tl.where(bins < e, padded, 0), 0)
        size = tl.sum(tl.where(bins == e, padded, 0), 0)
        n = tl.sum(tl.where(bins == e, hist, 0), 0)
        seen = 0
        for c0 in range(0, numel, CHUNK):
            offs = c0 + tl.arange(0, CHUNK)
            m, v = _pairs(ids, keys, offs, numel, below, TOP_K, HAS_KEYS)
            hit = (m & (v == e)).to(tl.int32)
            rank = seen + tl.cumsum(hit, 0) - 1
            tl.store(sorted_ids + start + rank, offs, mask=hit != 0)
            seen += tl.sum(hit, 0)
        for p0 in range(n, size, CHUNK):  # the segment's padding rows
            p = p0 + tl.arange(0, CHUNK)
            tl.store(sorted_ids + start + p, numel, mask=p < size)
        for b0 in range(0, size // BM, CHUNK):
            b = b0 + tl.arange(0, CHUNK)
            tl.store(block_expert + start // BM + b, le, mask=b < size // BM)


@triton.jit
def _tile(pid, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Grouped tile order: GROUP_M row blocks share each weight tile while it is in L2."""
    per_group = GROUP_M * tiles_n
    first = (pid // per_group) * GROUP_M
    size = tl.minimum(tiles_m - first, GROUP_M)
    return first + (pid % per_group) % size, (pid % per_group) // size


@triton.jit
def _scaled(part, ws, rows, k0, nm, QUANT: tl.constexpr, stride_wsn):
    """A k-step's product with fp8_block's scale of (rows // 128, k0 // 128) applied."""
    if QUANT == 2:
        part = part * tl.load(ws + (rows // 128) * stride_wsn + k0 // 128, mask=nm, other=0.0)[None, :]
    return part


@triton.jit
def _dot(a, b, F32: tl.constexpr):
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    if a.dtype == tl.float32:  # a float32 model (--dtype float32): full precision, not TF32
        return tl.dot(a, b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b.to(a.dtype))


@triton.jit(do_not_specialize=["numel"])
def gemm_kernel(a, w, ws, c, sorted_ids, block_expert, num_padded, weights, N, K, numel,
                stride_am, stride_we, stride_wn, stride_wse, stride_wsn, stride_cm,
                A_DIV: tl.constexpr, SILU: tl.constexpr, MUL_WEIGHT: tl.constexpr, QUANT: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                DOT_F32: tl.constexpr):
    """c[pair, n] for the pairs of one BM block of one expert (module docstring, steps 2-3).
    A row of a is pair // A_DIV (x for w13: A_DIV = top_k; the intermediate for w2: 1).
    SILU: w holds gate rows [0, N) and up rows [N, 2N); c = silu(gate) * up."""
    tiles_n = tl.cdiv(N, BN)
    pm, pn = _tile(tl.program_id(0), tl.num_programs(0) // tiles_n, tiles_n, GROUP_M)
    if pm * BM >= tl.load(num_padded):
        return
    pair = tl.load(sorted_ids + pm * BM + tl.arange(0, BM))
    rmask = pair < numel
    arow = tl.where(rmask, pair // A_DIV, 0).to(tl.int64)
    expert = tl.load(block_expert + pm).to(tl.int64)
    rn = pn * BN + tl.arange(0, BN)
    nm = rn < N
    wb = w + expert * stride_we
    sb = ws + expert * stride_wse
    acc = tl.zeros((BM, BN), tl.float32)
    acc_up = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        km = rk < K
        at = tl.load(a + arow[:, None] * stride_am + rk[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
        wt = tl.load(wb + rn[None, :] * stride_wn + rk[:, None], mask=nm[None, :] & km[:, None], other=0.0)
        acc += _scaled(_dot(at, wt, DOT_F32), sb, rn, k0, nm, QUANT, stride_wsn)
        if SILU:
            ut = tl.load(wb + (N + rn)[None, :] * stride_wn + rk[:, None], mask=nm[None, :] & km[:, None], other=0.0)
            acc_up += _scaled(_dot(at, ut, DOT_F32), sb, N + rn, k0, nm, QUANT, stride_wsn)
    if QUANT == 1:
        acc = acc * tl.load(sb + rn, mask=nm, other=0.0)[None, :]
        if SILU:
            acc_up = acc_up * tl.load(sb + N + rn, mask=nm, other=0.0)[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(weights + pair, mask=rmask, other=0.0)[:, None]
    crow = tl.where(rmask, pair, 0).to(tl.int64)
    tl.store(c + crow[:, None] * stride_cm + rn[None, :], acc.to(c.dtype.element_ty),
             mask=rmask[:, None] & nm[None, :])


@triton.jit(do_not_specialize=["keys", "first", "below"])
def combine_kernel(y, ids, out, H, first, keys, below, TOP_K: tl.constexpr, LOCAL: tl.constexpr,
                   ALL_LOCAL: tl.constexpr, HAS_KEYS: tl.constexpr, BH: tl.constexpr):
    """out[t] = sum over slots j, in order, of y[t * TOP_K + j] (float32); rows of pairs routed to
    another rank's experts, or of a padding row (HAS_KEYS: keys[t] < below), were never written
    and count as zeros."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    acc = tl.zeros((BH,), tl.float32)
    live = H
    if HAS_KEYS:
        live = tl.where(tl.load(keys + t) >= below, H, 0)
    for j in tl.static_range(TOP_K):
        width = live
        if not ALL_LOCAL:
            le = tl.load(ids + t * TOP_K + j) - first
            width = tl.where((le >= 0) & (le < LOCAL), live, 0)
        acc += tl.load(y + (t * TOP_K + j) * H + cols, mask=cols < width, other=0.0).to(tl.float32)
    tl.store(out + t * H + cols, acc.to(out.dtype.element_ty), mask=cols < H)


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# deterministic inference's one config for every batch: a row's tile shape (16 rows, tl.dot's
# least M), K steps and warps, so its bits, do not depend on how many pairs the batch routes. The
# route, align and combine kernels are per token / slot-ordered already. Checked on an H200 (bf16
# and fp8-block stacks, 1 to 512 rows: tests/gpu/test_moe_gpu.py::test_det_config_rows_keep_their_bits).
DET_CONFIG = GemmConfig(16, 64, 64, 1, 4, 3)


class Stack(NamedTuple):
    """One expert stack as the GEMM reads it: weights [E_local, N, K] and the scales or None."""

    w: torch.Tensor
    scale: torch.Tensor | None
    quant: str | None


def _gemm(a: torch.Tensor, s: Stack, c: torch.Tensor, n: int, align: tuple, weights: torch.Tensor | None,
          a_div: int, silu: bool, cfg: GemmConfig) -> None:
    sorted_ids, block_expert, num_padded, blocks, numel = align
    w, scale, q = s.w, s.scale, QUANTS[s.quant]
    bk = min(cfg.block_k, 128) if q == 2 else cfg.block_k  # one block scale per k-step
    sc = scale if scale is not None else w  # an unused pointer when plain
    bn = max(16, cfg.block_n // 2) if silu else cfg.block_n  # block_n: the weight rows a program reads
    grid = (blocks * triton.cdiv(n, bn),)
    gemm_kernel[grid](
        a, w, sc, c, sorted_ids, block_expert, num_padded, weights if weights is not None else sc,
        n, w.shape[2], numel, a.stride(0), w.stride(0), w.stride(1),
        sc.stride(0) if scale is not None else 0, sc.stride(1) if q == 2 else 0, c.stride(0),
        A_DIV=a_div, SILU=silu, MUL_WEIGHT=weights is not None, QUANT=q,
        BM=cfg.block_m, BN=bn, BK=bk, GROUP_M=cfg.group_m, DOT_F32=DOT_F32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def moe_pdl(device: torch.device, tokens: int) -> dict:
    """PDL (triton_ops.pdl_launch) for one token's routing and expert GEMVs, where the GPU's tuning
    launches triton kernels with it (`triton_pdl`). Served on an H200, Qwen3-30B-A3B batch 1: 2.83
    against 2.93 ms a step without (docs/PERF.md, twenty-first session). Not for more tokens: the
    fused path's launches with PDL lost (3.44 against 3.13 ms at d27660d)."""
    return pdl_launch(device, tokens == 1 and device.type == "cuda" and kernel_tuning(device).triton_pdl)


def route(logits: torch.Tensor, spec, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """moe.route in one launch: (float32 weights [T, k], int64 ids [T, k]) from logits [T, E].
    One warp a token: its reductions over E are warp shuffles, no shared memory (H200, a launch
    in a CUDA graph, bench/results/moe-launch-probe-h200-029a204.json: Qwen3-30B-A3B 2.3 us
    against 4.2 with 4 warps, DeepSeek-V3's grouped routing 3.9 against 7.2, at 1-32 tokens; the probe
    is in git at 96cf1db, scripts/moe_launch_probe.py). One token launches with PDL (`moe_pdl`),
    as the expert GEMVs that follow it (moe_gemv.py)."""
    from engine.layers.moe import is_grouped

    t, e = logits.shape
    k, g = spec.top_k, spec.n_group
    grouped = (1 if spec.topk_method == "noaux_tc" else 2) if is_grouped(spec) else 0
    weights = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    if t:
        route_kernel[(t,)](logits.contiguous(), bias if bias is not None else logits, weights, ids, e,
                           float(spec.routed_scaling_factor), SIGMOID=spec.scoring_func == "sigmoid",
                           HAS_BIAS=bias is not None, NORM=spec.norm_topk_prob, TOP_K=k,
                           K_P2=triton.next_power_of_2(k), E_P2=triton.next_power_of_2(e), GROUPED=grouped,
                           G=g, G_P2=triton.next_power_of_2(g), EG=e // g, TOPK_GROUP=spec.topk_group,
                           num_warps=1, **moe_pdl(logits.device, t))
    return weights, ids


def align(ids: torch.Tensor, counts: torch.Tensor, first: int, local: int, block_m: int,
          pad: tuple[torch.Tensor, int] | None = None) -> tuple:
    """(sorted_ids, block_expert, num_padded, blocks, numel) for the flat pairs of `ids` [T, k]
    (module docstring, step 1); adds the counted pairs to `counts` [E] (int64). Four warps: even
    with one or two at 1-8 tokens (2.4 us), 2.3x faster than one at 32 (the probe above)."""
    t, k = ids.shape
    numel = t * k
    blocks = triton.cdiv(numel + min(numel, local) * (block_m - 1), block_m)
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    num_padded = torch.empty(1, dtype=torch.int32, device=ids.device)
    e = counts.numel()
    keys, below = pad if pad is not None else (ids, 0)
    align_kernel[(e,)](
        ids, sorted_ids, block_expert, num_padded, counts, keys, numel, first, below,
        TOP_K=k, LOCAL=local, E_P2=triton.next_power_of_2(e), BM=block_m,
        CHUNK=CHUNK_SMALL if numel <= CHUNK_SMALL else 1024, HAS_KEYS=pad is not None, num_warps=4,
    )
    return sorted_ids, block_expert, num_padded, blocks, numel


def fused_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: Stack, w2: Stack,
                  counts: torch.Tensor, first: int, cfg: GemmConfig,
                  pad: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """This rank's partial sum [T, H] of sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for its
    experts first .. first + E_local - 1 (w13 [E_local, 2 I, H], w2 [E_local, H, I]); adds the
    routed pairs to `counts` [E]. `pad`'s rows (key < bound) are left out: zeros, not counted."""
    t, k = ids.shape
    h, inter, local = x.shape[1], w2.w.shape[2], w13.w.shape[0]
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    ids, weights, x = ids.contiguous(), weights.contiguous(), x.contiguous()
    al = align(ids, counts, first, local, cfg.block_m, pad)
    mid = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)
    _gemm(x, w13, mid, inter, al, None, k, True, cfg)
    y = torch.empty(t * k, h, dtype=x.dtype, device=x.device)
    _gemm(mid, w2, y, h, al, weights, 1, False, cfg)
    bh = min(1024, triton.next_power_of_2(h))
    keys, below = pad if pad is not None else (ids, 0)
    combine_kernel[(t, triton.cdiv(h, bh))](y, ids, out, h, first, keys, below, TOP_K=k, LOCAL=local,
                                           ALL_LOCAL=local == counts.numel(), HAS_KEYS=pad is not None, BH=bh,
                                           num_warps=4)
    return out


def config_for(device: torch.device, numel: int, local: int) -> GemmConfig:
    """The GEMM blocks for `numel` pairs over `local` experts: by the mean rows of an expert with
    tokens (at most min(numel, local) experts have any), from the GPU's tuning file; DET_CONFIG
    for every batch under deterministic inference."""
    if batch_invariant.enabled():
        return DET_CONFIG
    return GemmConfig(*kernel_tuning(device).moe_config(-(-numel // max(1, min(numel, local)))))


_WARMED: set[tuple] = set()


def warm(x: torch.Tensor, w13: Stack, w2: Stack, top_k: int, experts: int, pad: bool) -> None:
    """Compile every kernel variant a forward of these shapes can take (each tuning rule's blocks,
    both align chunk sizes, the one-token GEMVs) once per process, on a throwaway batch: the first eager forward
    (the runner's warm-up) pays it, not a served step. Nothing under a CUDA graph capture."""
    det = batch_invariant.enabled()
    key = (x.device, x.dtype, w13.quant, tuple(w13.w.shape), tuple(w2.w.shape), top_k, experts, pad, det)
    if key in _WARMED or x.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return
    _WARMED.add(key)
    local = w13.w.shape[0]
    counts = torch.zeros(experts, dtype=torch.int64, device=x.device)
    configs = [DET_CONFIG] if det else [GemmConfig(*r.config) for r in kernel_tuning(x.device).moe_gemm]
    for cfg in configs:
        for t in (1, -(-(CHUNK_SMALL + 1) // top_k)):  # both align chunk sizes
            ids = (torch.arange(t * top_k, device=x.device) % local).view(t, top_k)
            xs = torch.zeros(t, x.shape[1], dtype=x.dtype, device=x.device)
            weights = torch.ones(t, top_k, dtype=torch.float32, device=x.device)
            keys = (torch.zeros(t, dtype=torch.int64, device=x.device), 0) if pad else None
            fused_experts(xs, weights, ids, w13, w2, counts, 0, cfg, keys)
    from engine.layers import moe_gemv  # it builds on this module

    xs = torch.zeros(1, x.shape[1], dtype=x.dtype, device=x.device)
    gemv = moe_gemv.config(xs, w13)
    if gemv is not None:  # one token's path
        ids = (torch.arange(top_k, device=x.device) % local).view(1, top_k)
        weights = torch.ones(1, top_k, dtype=torch.float32, device=x.device)
        moe_gemv.one_token_experts(xs, weights, ids, w13, w2, counts, 0, gemv)
