"""Deterministic inference's GEMM on CUDA: x W^T (+ b) in one launch whose every output row
has the same bits whatever the number of rows (engine/layers/batch_invariant.py).

cuBLAS picks its kernel (tile, split-K) by the matrix shape, so the mode used to cut every
GEMM into calls of exactly 64 rows. A prefill then read the weights once per 64 tokens: on an
H200, Qwen3-0.6B's 64 x 256-token prefill took 168 ms of kernels in 7,168 launches a
projection kind, against ~15 ms unchunked (scripts/profile_decode.py ... det).

This kernel is batch-invariant by construction: an output element is the sum over K in tiles
of BLOCK_K taken in order, each tile one tl.dot (the tensor cores' k16 steps), in a fixed
number of K slices (`split`: from the weight's shape only), each slice summed from zero and the
slices added in order, whether the slices are programs (a split grid) or one program's loop;
rows do not mix, masked rows load zeros, and the row count M is a plain runtime argument (not
specialized). The tile's BLOCK_M / BLOCK_N only say which elements a program computes, not how
one element is summed, so they may follow M: narrow tiles on a split grid for decode (enough
programs to stream the weight at M <= 64) and for mid-sized batches, large ones for prefill.
The warp count per 64 rows and the dot's input precision stay fixed: those decide the
instruction that sums an element. BLOCK_K stays 64: wider K tiles are the same k16 steps chained
in the same order (on the H200 128 and 256 kept the bits) but measured slower (docs/PERF.md,
eighteenth session). tests/gpu/test_invariant_gemm_gpu.py checks the bits across
M on the H200.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from engine.layers import invariant_gemv
from engine.layers.triton_kernels import pdl_start
from engine.layers.triton_ops import interpreted, pdl_launch
from engine.layers.tuning import kernel_tuning

BLOCK_K = 64
GEMV_ROWS = 16  # up to this many rows: the swapped-operand GEMV (invariant_gemv_kernel; 1-8 rows: invariant_gemv.cu)
GEMV_LONG_SLICE = 48  # K tiles a slice from which the GEMV pipelines 6 stages deep (gemv_stages)
GEMV_WIDE_GRID = (640, 1024)  # GEMV programs (~5-8 an H200 SM) over which it pipelines 3 stages deep
DECODE_MAX_ROWS = 64  # up to this many rows: one row tile, narrow column tiles
DECODE_PROGRAMS = 512  # a decode GEMM's programs (column tiles x K slices), ~4 an H200 SM
FULL_TILES = 128  # 128 x 256 tiles from this many (about one an H200 SM) fill the GPU
MID_TILES = 32  # below this many 64 x 128 tiles with no one-wave tile (`one_wave`): the split grid
# one-wave tiles (`one_wave`): BM x BN, programs between about half and all of an H200's 132 SMs,
# each pipelined as deep as this much shared memory allows (up to WAVE_STAGES)
WAVE_TILES = ((64, 32), (64, 64), (64, 128), (64, 256), (128, 256))
WAVE_PROGRAMS = (64, 132)
WAVE_SMEM = 200 << 10
WAVE_STAGES = 6
WORKSPACE_FLOATS = 8 << 20  # split-grid partials of one GEMM (32 MiB a device, allocated on first use)


@triton.jit
def _grouped(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program pid: GROUP_M row tiles per column tile in turn."""
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    size_m = min(grid_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def _k_step(xp, wp, rm, rn, rk, k, M, N, K, acc, F32: tl.constexpr, EVEN_K: tl.constexpr, BK: tl.constexpr):
    """acc + the product of K tile k's x tile (at xp) and w tile (at wp), rows past M, columns
    past N and K past its end read as zeros."""
    if EVEN_K:
        a = tl.load(xp, mask=rm[:, None] < M, other=0.0)
        b = tl.load(wp, mask=rn[None, :] < N, other=0.0)
    else:
        kk = k * BK + rk
        a = tl.load(xp, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(wp, mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
    if F32:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _slice(x, w, rm, rn, rk, M, N, K, sx, sw, k0, k1,
           F32: tl.constexpr, EVEN_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """x[rm, k] @ w[rn, k]^T over K tiles k0 .. k1 - 1, in order, from a zero accumulator."""
    rkk = k0 * BK + rk
    xp = x + rm[:, None].to(tl.int64) * sx + rkk[None, :]
    wp = w + rn[None, :].to(tl.int64) * sw + rkk[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(k0, k1):
        acc = _k_step(xp, wp, rm, rn, rk, k, M, N, K, acc, F32, EVEN_K, BK)
        xp += BK
        wp += BK
    return acc


@triton.jit
def _sliced(x, w, rm, rn, rk, M, N, K, sx, sw, kt, per, SPLIT: tl.constexpr,
            F32: tl.constexpr, EVEN_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """The SPLIT slices of `per` K tiles, each summed from zero (as `_slice`) and added in order,
    in one loop over K: one software pipeline, not a drain and refill per slice (a slice's end
    resets its accumulator, the pattern triton's persistent matmul pipelines). The bits are the
    separate slices': the same dots in the same order, the same float32 adds; a slice past the
    end (there are none unless per * (SPLIT - 1) >= kt) adds its zeros as an empty `_slice` does."""
    xp = x + rm[:, None].to(tl.int64) * sx + rk[None, :]
    wp = w + rn[None, :].to(tl.int64) * sw + rk[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    part = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, kt):
        part = _k_step(xp, wp, rm, rn, rk, k, M, N, K, part, F32, EVEN_K, BK)
        if ((k + 1) % per == 0) | (k == kt - 1):
            acc = acc + part
            part = tl.zeros((BM, BN), dtype=tl.float32)
        xp += BK
        wp += BK
    for _ in range(tl.cdiv(kt, per), SPLIT):
        acc = acc + part  # an empty slice's zeros (part is zero here)
    return acc


@triton.jit
def _slices_added(part, ws, counters, pid, s, mask, R: tl.constexpr, C: tl.constexpr, SPLIT: tl.constexpr):
    """A split grid's epilogue: slice s of tile pid stores its [R, C] partial to `ws`; the last
    of the tile's SPLIT programs to finish gets (True, the partials added in slice order) and
    zeroes the tile's counter for the next launch; the others get (False, zeros)."""
    tile = (pid * SPLIT) * R * C + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    tl.store(ws + tile + s * R * C, part, mask=mask)
    tl.debug_barrier()
    done = tl.atomic_add(counters + pid, 1, sem="acq_rel")
    acc = tl.zeros((R, C), dtype=tl.float32)
    if done == SPLIT - 1:
        for j in range(SPLIT):
            acc = acc + tl.load(ws + tile + j * R * C, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(counters + pid, 0)
    return done == SPLIT - 1, acc


@triton.jit(do_not_specialize=["M"])
def invariant_gemm_kernel(x, w, bias, out, ws, counters, M, N, K, sx, sw, so, scale, res, sr,
                          HAS_BIAS: tl.constexpr, FOLD: tl.constexpr, F32: tl.constexpr, EVEN_K: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                          SPLIT: tl.constexpr, SPLIT_GRID: tl.constexpr, PDL: tl.constexpr):
    """out[M, N] = x[M, K] @ w[N, K]^T (+ bias) for one (BM, BN) tile; tiles in groups of
    GROUP_M row tiles per column tile, so that a weight tile is read by neighbours from L2.
    K is summed in SPLIT slices of whole K tiles, each from zero, added in slice order: with
    SPLIT_GRID (decode, mid rows) each slice is a program (axis 1) that stores its partial to `ws` and
    the last of a tile's programs to finish adds them; else one program adds them as it goes.
    The two give the same bits: the same slices, the same float32 adds in the same order."""
    pdl_start(PDL)  # x, the workspace and the counters: the previous launches' (PDL: the tuning's)
    pid = tl.program_id(0)
    pid_m, pid_n = _grouped(pid, M, N, BM, BN, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    kt = tl.cdiv(K, BK)
    per = tl.cdiv(kt, SPLIT)
    rows = rm[:, None] < M
    if SPLIT_GRID:
        s = tl.program_id(1)
        part = _slice(x, w, rm, rn, rk, M, N, K, sx, sw, s * per, min((s + 1) * per, kt), F32, EVEN_K, BM, BN, BK)
        last, acc = _slices_added(part, ws, counters, pid, s, rows, BM, BN, SPLIT)
        if last:
            _store(acc, bias, out, rm, rn, M, N, so, scale, res, sr, HAS_BIAS, FOLD)
    elif SPLIT == 1:
        _store(_slice(x, w, rm, rn, rk, M, N, K, sx, sw, 0, kt, F32, EVEN_K, BM, BN, BK), bias, out, rm, rn, M, N, so,
               scale, res, sr, HAS_BIAS, FOLD)
    else:
        _store(_sliced(x, w, rm, rn, rk, M, N, K, sx, sw, kt, per, SPLIT, F32, EVEN_K, BM, BN, BK), bias, out,
               rm, rn, M, N, so, scale, res, sr, HAS_BIAS, FOLD)


@triton.jit(do_not_specialize=["M"])
def invariant_gemm_tma_kernel(x_desc, w_desc, bias, out, M, N, K, so, scale, res, sr, HAS_BIAS: tl.constexpr,
                              FOLD: tl.constexpr, BM: tl.constexpr,
                              BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, SPLIT: tl.constexpr,
                              PDL: tl.constexpr):
    """invariant_gemm_kernel's one-program tiles (GROUP_M > 1) with the x and w tiles loaded by
    the tensor memory accelerator (host descriptors; out-of-bounds rows and K columns read as
    zeros, as the masked loads): the same K slices, dots and adds, so the same bits. (On a split
    grid TMA loads measured no faster than the pointer loads: docs/PERF.md, sixteenth session.)"""
    pdl_start(PDL)
    pid = tl.program_id(0)
    pid_m, pid_n = _grouped(pid, M, N, BM, BN, GROUP_M)
    kt = tl.cdiv(K, BK)
    per = tl.cdiv(kt, SPLIT)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    part = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, kt):
        a = x_desc.load([pid_m * BM, k * BK])
        b = w_desc.load([pid_n * BN, k * BK])
        part = tl.dot(a, b.T, part)
        if ((k + 1) % per == 0) | (k == kt - 1):
            acc = acc + part
            part = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(tl.cdiv(kt, per), SPLIT):
        acc = acc + part  # an empty slice's zeros
    _store(acc, bias, out, pid_m * BM + tl.arange(0, BM), pid_n * BN + tl.arange(0, BN), M, N, so, scale, res, sr,
           HAS_BIAS, FOLD)


@triton.jit(do_not_specialize=["M"])
def invariant_gemv_kernel(x, w, bias, out, ws, counters, M, N, K, sx, sw, so, scale, res, sr,
                          HAS_BIAS: tl.constexpr, FOLD: tl.constexpr, F32: tl.constexpr, EVEN_K: tl.constexpr,
                          BN: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr):
    """invariant_gemm_kernel's split grid for M <= BR rows with the operands swapped: a program
    computes out^T's [BN, BR] tile = w[BN, K slice] @ x[BR, K slice]^T, the weight as the dot's
    64-row side (the warp group's operand) and the few rows of x as its narrow side, instead of
    a 64-row x tile of which one row is real. Each element is the same products over the same
    k16 steps, K tiles, slices and slice adds as invariant_gemm_kernel's (the H200 test checks
    the bits in bf16 at every projection shape it times)."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    s = tl.program_id(1)
    rn = pid * BN + tl.arange(0, BN)
    rm = tl.arange(0, BR)
    rk = tl.arange(0, BK)
    kt = tl.cdiv(K, BK)
    per = tl.cdiv(kt, SPLIT)
    # _slice with the operands' roles swapped: w's rows are the dot's first (64-row) side
    acc = _slice(w, x, rn, rm, rk, N, M, K, sw, sx, s * per, min((s + 1) * per, kt), F32, EVEN_K, BN, BR, BK)
    rows = rm[None, :] < M
    last, acc = _slices_added(acc, ws, counters, pid, s, rows, BN, BR, SPLIT)
    if last:  # _store's epilogue, transposed
        mask = rows & (rn[:, None] < N)
        if FOLD == 1:
            acc = acc * tl.load(scale + rm, mask=rm < M, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[:, None]
        if FOLD == 2:
            r = tl.load(res + rm[None, :].to(tl.int64) * sr + rn[:, None], mask=mask, other=0.0)
            acc = acc.to(out.dtype.element_ty).to(tl.float32) + r.to(tl.float32)
        op = out + rm[None, :].to(tl.int64) * so + rn[:, None]
        tl.store(op, acc.to(out.dtype.element_ty), mask=mask)


def _gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, bn: int, stages: int,
          slices: int, f32: bool, fold: _Fold) -> None:
    """invariant_gemv_kernel over out [M <= GEMV_ROWS, N]: the column tiles x the K slices, one
    warp group per 64 weight rows (bn), as the grid kernel has per 64 rows of x. (Its TMA twin
    measured no faster on the H200: docs/PERF.md, sixteenth session.)"""
    m, k = x.shape
    n = w.shape[0]
    ws, counters = _workspace(x.device)
    grid_n = triton.cdiv(n, bn)
    if grid_n * slices * bn * GEMV_ROWS > ws.numel() or grid_n > counters.numel():
        raise ValueError(f"invariant GEMV [{m}, {k}] x [{n}, {k}]^T: {slices} slices need more than the workspace")
    invariant_gemv_kernel[(grid_n, slices)](
        x, w, bias if bias is not None else x, out, ws, counters, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        *fold.args(x), HAS_BIAS=bias is not None, FOLD=fold.kind, F32=f32, EVEN_K=k % BLOCK_K == 0, BN=bn,
        BR=GEMV_ROWS, BK=BLOCK_K, SPLIT=slices, **_pdl(x.device), num_warps=4 * (bn // 64), num_stages=stages,
    )


@triton.jit
def _store(acc, bias, out, rm, rn, M, N, so, scale, res, sr, HAS_BIAS: tl.constexpr, FOLD: tl.constexpr):
    """out[rm, rn] = acc (+ bias) rounded once; FOLD 1: acc times its row's `scale` first (the folded
    norm, no bias), 2: bf16(acc) + `res` (row stride sr), rounded again: the epilogues of the CUDA
    GEMV (invariant_gemv.cu), so every row count has its bits."""
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if FOLD == 1:
        acc = acc * tl.load(scale + rm, mask=rm < M, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if FOLD == 2:
        r = tl.load(res + rm[:, None].to(tl.int64) * sr + rn[None, :], mask=mask, other=0.0)
        acc = acc.to(out.dtype.element_ty).to(tl.float32) + r.to(tl.float32)
    op = out + rm[:, None].to(tl.int64) * so + rn[None, :]
    tl.store(op, acc.to(out.dtype.element_ty), mask=mask)


@functools.cache  # per weight shape, asked on every GEMM call
def split(n: int, k: int) -> int:
    """K slices (a power of two) of an [n, k] weight, the same at every row count: enough that
    a decode GEMM has ~DECODE_PROGRAMS programs, each slice at least 4 K tiles."""
    cols = -(-n // decode_bn(n))
    s = 1
    while cols * s < DECODE_PROGRAMS and -(-k // BLOCK_K) // (2 * s) >= 4:
        s *= 2
    return s


def decode_bn(n: int) -> int:
    """Columns a decode program of the slice rule (`split`) counts with; the 17-64-row tile is
    twice as wide (the H200's timing at 16 rows, docs/PERF.md fifteenth session)."""
    return 64 if n >= 16384 else 32 if n >= 4096 else 16


def gemv_stages(n: int, k: int, slices: int) -> int:
    """Pipeline stages of the swapped GEMV (they decide no sums): 6 where a slice is long (at least
    GEMV_LONG_SLICE K tiles: Llama's down and LM head, ~1 us faster), 3 where the grid's programs
    are in GEMV_WIDE_GRID (3 stages' shared memory keeps ~7 of them an H200 SM resident,
    one wave: Llama's gate_up, 896 programs, 59.5-59.8 us against 63.2-63.6 at 4 on three
    machines), else 4 (docs/PERF.md, sixteenth session)."""
    if triton.cdiv(k, BLOCK_K) >= GEMV_LONG_SLICE * slices:
        return 6
    low, high = GEMV_WIDE_GRID
    return 3 if low < triton.cdiv(n, 64) * slices <= high else 4


@functools.lru_cache(maxsize=4096)  # asked on every GEMM call (an eager prefill: every projection)
def tiles(m: int, n: int, k: int) -> tuple[int, int, int, int, int, int]:
    """(BM, BN, GROUP_M, warps, stages, K slices) for m rows of an [n, k] weight; GROUP_M 1 marks a
    split grid (K slices as programs), GROUP_M > 1 one program a tile (TMA loads, see `gemm`).
    Decode (m <= 64): one row tile of 64, narrow column tiles, so that ~512 programs stream the
    weight. Above, by the tiles there are (one warp group per 64 rows in all): 128 x 256 where
    they about fill the GPU (FULL_TILES: the LM head from 65 rows); 64 x 128 on a split grid
    where the K tiles are at least three times those tiles (a long K); else the one-wave tile
    (`one_wave`); else 64 x 128 on a split grid below MID_TILES of them, one program a 64 x 64
    or 64 x 128 tile above. Up to GEMV_ROWS rows (BM =
    GEMV_ROWS marks it): the swapped-operand GEMV, 64 weight rows a program, its K slices as
    programs (1.2-2x the 64-row decode tile at 1 and 16 rows on an H200, the same bits:
    docs/PERF.md, fifteenth session). From the H200's timing of every candidate (docs/PERF.md,
    ninth session): at 4096 rows 128 x 256 with TMA loads 702-758 TFLOPS on Llama-3.1-8B's
    projections (cuBLAS 777-804; the 128 x 128 pointer tiles before, 417-448); at 128-512 rows
    64 x 128 TMA tiles 1.1-1.9x the split grid (Qwen's qkv at 128 rows 8.8 against 13.6 us)
    except with few tiles over a long K."""
    s = split(n, k)
    if m <= GEMV_ROWS:
        return GEMV_ROWS, 64, 1, 4, gemv_stages(n, k, s), s
    if m <= DECODE_MAX_ROWS:  # twice the slice rule's columns: 1.05-1.5x at 16 rows (fifteenth session)
        return 64, 2 * decode_bn(n), 1, 4, 4, s
    if triton.cdiv(m, 128) * triton.cdiv(n, 256) >= FULL_TILES:
        return 128, 256, 8, 8, 3, s
    if s == 1:
        return 64, 256, 8, 4, 3, s
    mid_tiles = triton.cdiv(m, 64) * triton.cdiv(n, 128)
    split_fits = mid_tiles * s * 64 * 128 <= WORKSPACE_FLOATS
    # a K of at least three K tiles a 64 x 128 tile: its slices as programs (Llama's down at 96 rows,
    # 64 tiles over 224 K tiles: 49.8 us against 54.2 in one wave; Qwen3-0.6B's down, 16 over 48:
    # 11.6 against 12.4; at 192 rows, 2.3 and 2 K tiles a tile, the wave wins: 60.6 against 81.4, 12.5
    # against 15.5)
    if 3 * mid_tiles <= triton.cdiv(k, BLOCK_K) and split_fits:
        return 64, 128, 1, 4, 4, s
    wave = one_wave(m, n)
    if wave is not None:
        bm, bn, stages = wave
        return bm, bn, 8, 4 * bm // 64, stages, s
    if mid_tiles < MID_TILES and split_fits:
        return 64, 128, 1, 4, 4, s
    return 64, 64 if mid_tiles < FULL_TILES else 128, 8, 4, 4, s


def one_wave(m: int, n: int) -> tuple[int, int, int] | None:
    """(BM, BN, stages) of the WAVE_TILES tile whose programs fill one wave of about half to all of
    the SMs (WAVE_PROGRAMS), one program an SM, with the fewest bytes a program reads ((1/BN +
    1/BM) of the operands' rows: the x and w tiles it loads a K tile), its pipeline as deep as
    WAVE_SMEM allows; None if no tile's programs fall in that range. A mid-sized batch's GEMM is
    bound by each SM's loads in flight, not by the HBM: one program a tile walks all of K, so
    deeper stages are its speed (scripts/det_gemm_sweep.py on an H200, docs/PERF.md twentieth
    session: Qwen3-0.6B's o at 256 rows 11.3 -> 9.2 us, Llama-3.1-8B's o 25.5 -> 20.3, its
    gate_up at 96 rows 89.6 -> 67.7; stages and tiles decide no sums)."""
    low, high = WAVE_PROGRAMS
    best = None
    for bm, bn in WAVE_TILES:
        programs = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        reads = (bm + bn) / (bm * bn * programs)
        if low <= programs <= high and (best is None or reads < best[0]):
            best = (reads, bm, bn)
    if best is None:
        return None
    _, bm, bn = best
    return bm, bn, min(WAVE_STAGES, WAVE_SMEM // ((bm + bn) * BLOCK_K * 2))


def regime_rows(rows: list[int], n: int, k: int) -> list[int]:
    """The first of `rows` in each tile choice of an [n, k] weight: one triton compile each
    (M is not specialized), so warming these warms every row count in `rows`."""
    first: dict[tuple, int] = {}
    for m in rows:
        first.setdefault(tiles(m, n, k), m)
    return sorted(first.values())


@dataclass(frozen=True)
class _Fold:
    """A GEMM's epilogue beyond the bias (FOLD of the kernels' `_store`): 0 none, 1 the folded
    norm (`eps`; `scale` its float32 row scales where a triton kernel applies them), 2 the residual
    add (`residual`)."""

    kind: int = 0
    eps: float | None = None
    scale: torch.Tensor | None = None
    residual: torch.Tensor | None = None

    @staticmethod
    def of(x: torch.Tensor, eps: float | None, residual: torch.Tensor | None, bias: torch.Tensor | None) -> _Fold:
        """The epilogue asked for, checked: one of the two, the norm bias-free on CUDA bf16 (the
        scales come from the CUDA kernel) unless interpreted (the reference's scales, in tests)."""
        if eps is not None and residual is not None:
            raise ValueError("invariant GEMM: a folded norm and a residual add in one GEMM")
        if eps is not None and (bias is not None or not (interpreted() or (x.is_cuda and x.dtype == torch.bfloat16))):
            raise ValueError("invariant GEMM: a folded norm takes bf16 on CUDA, without a bias")
        if residual is not None and (residual.shape != (x.shape[0], residual.shape[1]) or residual.stride(1) != 1):
            raise ValueError(f"invariant GEMM: residual {tuple(residual.shape)} for {x.shape[0]} rows")
        return _Fold(1 if eps is not None else 2 if residual is not None else 0, eps, None, residual)

    def as_float(self) -> _Fold:
        """The interpreter's float32 operands: the residual too."""
        return self if self.residual is None else replace(self, residual=self.residual.float())

    def scaled(self, x: torch.Tensor, slices: int) -> _Fold:
        """For a triton kernel: the norm's row scales computed in the order of the CUDA GEMV of this
        weight's `slices` K slices (the CUDA kernel's, or in the interpreter the reference's)."""
        if self.kind != 1:
            return self
        if interpreted():
            return replace(self, scale=invariant_gemv.row_scale_reference(x, self.eps, slices))
        scale = invariant_gemv.row_scale(x, self.eps, slices, _pdl(x.device)["PDL"])
        if scale is None:
            raise RuntimeError("invariant GEMM: the folded norm needs the CUDA GEMV's library (nvcc)")
        return replace(self, scale=scale)

    def args(self, x: torch.Tensor) -> tuple:
        """(scale, res, sr) of the kernels: x stands in for a pointer not read."""
        res = self.residual
        return (self.scale if self.scale is not None else x, res if res is not None else x,
                res.stride(0) if res is not None else 0)


def gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
         tile: tuple[int, int, int, int, int, int] | None = None, tma: bool | None = None,
         norm_eps: float | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T (+ bias [N]) in x's dtype, each row's bits independent of M.
    `norm_eps` (bf16 on CUDA, no bias): the RMSNorm of x folded in, its weight already in w: each
    row's sums times rsqrt(mean(x_row^2) + norm_eps) before the rounding, its squares summed in the
    CUDA GEMV's order for this weight's K slices (invariant_gemv.row_scale: one order for every row
    count). `residual` [M, N]: bf16(x w^T) + residual, rounded again (the
    residual stream's add after o_proj / down).
    One-program tiles of 16-bit operands load through the tensor memory accelerator
    (invariant_gemm_tma_kernel: 1.1-1.7x the pointer loads at 4096 rows on an H200, the same
    bits) where the operands' layout allows it; float32, triton's interpreter and a misaligned
    view take the pointer loads. `tile`: `tiles`' answer forced; `tma`: the loads forced (the
    GPU test's candidates)."""
    m, k = x.shape
    n = w.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    bm, bn, group, warps, stages, slices = tile or tiles(m, n, k)
    if bm == GEMV_ROWS and m > GEMV_ROWS:
        raise ValueError(f"invariant GEMV: {m} rows, at most {GEMV_ROWS}")
    if bm == GEMV_ROWS and x.dtype == torch.float32 and x.is_cuda:
        bm, bn = 64, 2 * decode_bn(n)  # (CUDA float32's bits through the GEMV are untested: the decode tile)
    f32 = x.dtype == torch.float32 or interpreted()
    fold = _Fold.of(x, norm_eps, residual, bias)
    if f32 and bm != GEMV_ROWS:  # float32 tiles are twice the bytes: (stages - 1) buffers within WAVE_SMEM
        stages = min(stages, 1 + WAVE_SMEM // ((bm + bn) * BLOCK_K * 4))
    xs, ws_ = (x.float(), w.float()) if interpreted() and x.dtype != torch.float32 else (x, w)
    res = out.float() if xs is not x else out
    if interpreted():
        fold = fold.as_float()
    if bm == GEMV_ROWS:
        if not (_cuda_gemv_takes(xs, ws_, bias) and _cuda_gemv(xs, ws_, bias, res, slices, fold=fold)):
            _gemv(xs, ws_, bias, res, bn, stages, slices, f32, fold.scaled(xs, slices))
    else:
        _gemm(xs, ws_, bias, res, (bm, bn, group, warps, stages, slices), tma, f32, fold.scaled(xs, slices))
    if res is not out:
        out.copy_(res)
    return out


def gemm_act(x: torch.Tensor, w: torch.Tensor, norm_eps: float | None = None) -> torch.Tensor | None:
    """silu(x gate^T) * (x up^T) [M, N / 2] for w = [gate | up] in one launch: the CUDA GEMV's
    epilogue applies flashinfer's act_and_mul to the bf16-rounded products, so the bits are
    `gemm` then ops.silu_and_mul's (tests/gpu/test_invariant_gemm_gpu.py), `norm_eps` as `gemm`'s;
    None where that kernel does not take the product (the caller runs the two)."""
    m, k = x.shape
    n = w.shape[0]
    if not (1 <= m <= invariant_gemv.MAX_ROWS and _cuda_gemv_takes(x, w, None)):
        return None
    slices = split(n, k)
    if not invariant_gemv.act_takes(x, w, slices):
        return None
    out = torch.empty(m, n // 2, dtype=x.dtype, device=x.device)
    fold = _Fold.of(x, norm_eps, None, None)
    return out if _cuda_gemv(x, w, None, out, slices, act=True, fold=fold) else None


def _cuda_gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, slices: int,
               act: bool = False, fold: _Fold | None = None) -> bool:
    """invariant_gemv.gemv at its ring depth for the slices, with the GEMMs' PDL choice."""
    return invariant_gemv.gemv(x, w, bias, out, slices, invariant_gemv.stages_for(slices, x.shape[1]),
                               _pdl(x.device)["PDL"], act=act, norm_eps=fold.eps if fold else None,
                               residual=fold.residual if fold else None)


def _gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
          tile: tuple[int, int, int, int, int, int], tma: bool | None, f32: bool, fold: _Fold) -> None:
    """invariant_gemm_kernel (or its TMA twin) over out [M, N] at `tile`."""
    (m, k), n = x.shape, w.shape[0]
    bm, bn, group, warps, stages, slices = tile
    grid_mn = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split_grid = slices > 1 and group == 1
    ws, counters = _workspace(x.device)
    if split_grid and (grid_mn * slices * bm * bn > ws.numel() or grid_mn > counters.numel()):
        raise ValueError(f"invariant GEMM [{m}, {k}] x [{n}, {k}]^T: {slices} slices need more than the workspace")
    if split_grid and tma:
        raise ValueError("invariant GEMM: a split grid takes pointer loads")
    if tma is None:
        tma = not split_grid and not f32 and _tma_layout(x) and _tma_layout(w)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        invariant_gemm_tma_kernel[(grid_mn,)](
            TensorDescriptor.from_tensor(x, [bm, BLOCK_K]), TensorDescriptor.from_tensor(w, [bn, BLOCK_K]),
            bias if bias is not None else x, out, m, n, k, out.stride(0), *fold.args(x), HAS_BIAS=bias is not None,
            FOLD=fold.kind, BM=bm, BN=bn, BK=BLOCK_K, GROUP_M=group, SPLIT=slices, **_pdl(x.device), num_warps=warps,
            num_stages=stages,
        )
        return
    invariant_gemm_kernel[(grid_mn, slices if split_grid else 1)](
        x, w, bias if bias is not None else x, out, ws, counters, m, n, k, x.stride(0), w.stride(0),
        out.stride(0), *fold.args(x), HAS_BIAS=bias is not None, FOLD=fold.kind, F32=f32, EVEN_K=k % BLOCK_K == 0,
        BM=bm, BN=bn, BK=BLOCK_K, GROUP_M=group, SPLIT=slices, SPLIT_GRID=split_grid, **_pdl(x.device),
        num_warps=warps, num_stages=stages,
    )


def _cuda_gemv_takes(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the GEMV runs as CUDA C++ (invariant_gemv.cu: the GPU's tuning turns it on where it
    measured faster with the same bits) rather than invariant_gemv_kernel."""
    return (x.is_cuda and not interpreted() and kernel_tuning(x.device).invariant_gemv_cuda
            and invariant_gemv.takes(x, w) and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous())))


def _pdl(device: torch.device) -> dict:
    """PDL (triton_ops.pdl_launch) where the GPU's tuning turns it on (`invariant_gemm_pdl`)."""
    return pdl_launch(device, device.type == "cuda" and kernel_tuning(device).invariant_gemm_pdl)


def _tma_layout(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor takes t: 16-byte aligned base and row stride, unit column stride."""
    return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


_WORKSPACES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 partials, int32 tile counters, zero between launches) of this device, made on
    the first GEMM (warm-up, before any CUDA graph is captured). One stream runs the GEMMs, one
    after another, so they share it."""
    if device not in _WORKSPACES:
        _WORKSPACES[device] = (torch.empty(WORKSPACE_FLOATS, dtype=torch.float32, device=device),
                               torch.zeros(1 << 16, dtype=torch.int32, device=device))
    return _WORKSPACES[device]
