"""Deterministic inference's GEMM on CUDA: x W^T (+ b) in one launch whose every output row
has the same bits whatever the number of rows (engine/layers/batch_invariant.py).

cuBLAS picks its kernel (tile, split-K) by the matrix shape, so the mode used to cut every
GEMM into calls of exactly 64 rows. A prefill then read the weights once per 64 tokens: on an
H200, Qwen3-0.6B's 64 x 256-token prefill took 168 ms of kernels in 7,168 launches a
projection kind, against ~15 ms unchunked (scripts/profile_decode.py ... det).

This kernel is batch-invariant by construction: an output element is the sum over K in tiles
of BLOCK_K taken in order, each tile one tl.dot (the tensor cores' k16 steps), never split
across programs; rows do not mix, masked rows load zeros, and the row count M is a plain
runtime argument (not specialized). The tile's BLOCK_M / BLOCK_N only say which elements a
program computes, not how one element is summed, so they may follow M: small tiles for decode
(enough programs to stream the weight at M <= 64), large ones for prefill. BLOCK_K, the warp
count per 64 rows and the dot's input precision stay fixed: those decide the instruction that
sums an element. tests/gpu/test_invariant_gemm_gpu.py checks the bits across M on the H200.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.layers.triton_ops import interpreted

BLOCK_K = 64
DECODE_MAX_ROWS = 64  # up to this many rows: one row tile, narrow column tiles


@triton.jit(do_not_specialize=["M"])
def invariant_gemm_kernel(x, w, bias, out, M, N, K, sx, sw, so,
                          HAS_BIAS: tl.constexpr, F32: tl.constexpr, EVEN_K: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """out[M, N] = x[M, K] @ w[N, K]^T (+ bias) for one (BM, BN) tile; tiles in groups of
    GROUP_M row tiles per column tile, so that a weight tile is read by neighbours from L2."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    size_m = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    xp = x + rm[:, None].to(tl.int64) * sx + rk[None, :]
    wp = w + rn[None, :].to(tl.int64) * sw + rk[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
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
        xp += BK
        wp += BK
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    op = out + rm[:, None].to(tl.int64) * so + rn[None, :]
    tl.store(op, acc.to(out.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))



def tiles(m: int, n: int) -> tuple[int, int, int, int, int]:
    """(BM, BN, GROUP_M, warps, stages) for m rows of an n-column weight. Decode (m <= 64): one
    row tile of 64 and column tiles narrow enough for ~132+ programs (an H200's SMs) to stream
    the weight; prefill: 64 x 256 tiles (one warp group per 64 rows, as in decode)."""
    if m <= DECODE_MAX_ROWS:
        bn = 64 if n >= 16384 else 32 if n >= 4096 else 16
        return 64, bn, 1, 4, 4
    return 64, 256, 8, 4, 3



def gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
         tile: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T (+ bias [N]) in x's dtype, each row's bits independent of M
    (`tile`: `tiles`' answer forced, for the GPU test's candidates)."""
    m, k = x.shape
    n = w.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    bm, bn, group, warps, stages = tile or tiles(m, n)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    f32 = x.dtype == torch.float32 or interpreted()
    xs, ws = (x.float(), w.float()) if interpreted() and x.dtype != torch.float32 else (x, w)
    res = out.float() if xs is not x else out
    invariant_gemm_kernel[grid](
        xs, ws, bias if bias is not None else xs, res, m, n, k, xs.stride(0), ws.stride(0), res.stride(0),
        HAS_BIAS=bias is not None, F32=f32, EVEN_K=k % BLOCK_K == 0, BM=bm, BN=bn, BK=BLOCK_K, GROUP_M=group,
        num_warps=warps, num_stages=stages,
    )
    if res is not out:
        out.copy_(res)
    return out
