"""Triton kernels of the quantized projections (engine/layers/quant_ops.py launches them)."""

from __future__ import annotations

import triton
import triton.language as tl

from engine.layers.triton_kernels import x_chunk

FP8_MAX = tl.constexpr(448.0)  # globals a kernel reads must be constexpr


@triton.jit
def per_token_quant_kernel(x, xq, xs, K, stride_x, BLOCK: tl.constexpr):
    """Row r of x -> e4m3 row r of xq and its scale xs[r] = amax / 448 (two passes over the row)."""
    r = tl.program_id(0)
    row = x + r * stride_x
    amax = tl.zeros((BLOCK,), tl.float32)
    for k0 in range(0, K, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(tl.load(row + cols, mask=cols < K, other=0.0).to(tl.float32)))
    s = tl.maximum(tl.max(amax, 0), 1e-12) / FP8_MAX
    for k0 in range(0, K, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        v = tl.load(row + cols, mask=cols < K, other=0.0).to(tl.float32) / s
        tl.store(xq + r * K + cols, tl.clamp(v, -FP8_MAX, FP8_MAX).to(xq.dtype.element_ty), mask=cols < K)
    tl.store(xs + r, s)


@triton.jit
def add_rms_norm_quant_kernel(x, r, nw, xq, xs, eps, K, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    """Row i: s = x + r (rounded to x's dtype; stored into r, in place), y = RMSNorm(s) * nw as
    the unfused path rounds it (after the rsqrt, then after the weight), then y per token to e4m3:
    xq[i] = y / xs[i], xs[i] = amax(y) / 448. One program a row, the row in registers."""
    i = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    cm = cols < K
    act = x.dtype.element_ty
    v = tl.load(x + i * K + cols, mask=cm, other=0.0).to(tl.float32)
    if HAS_RES:
        v = (v + tl.load(r + i * K + cols, mask=cm, other=0.0).to(tl.float32)).to(act)
        tl.store(r + i * K + cols, v, mask=cm)
        v = v.to(tl.float32)
    h = (v * tl.rsqrt(tl.sum(v * v, 0) / K + eps)).to(act).to(tl.float32)
    y = (h * tl.load(nw + cols, mask=cm, other=0.0).to(tl.float32)).to(act).to(tl.float32)
    sc = tl.maximum(tl.max(tl.abs(y), 0), 1e-12) / FP8_MAX
    tl.store(xq + i * K + cols, tl.clamp(y / sc, -FP8_MAX, FP8_MAX).to(xq.dtype.element_ty), mask=cm)
    tl.store(xs + i, sc)


@triton.jit
def silu_mul_quant_kernel(h, xq, xs, K, BLOCK: tl.constexpr):
    """Row i of h = [gate | up] (2K wide): y = silu(gate) * up rounded to h's dtype, then per
    token to e4m3 as per_token_quant_kernel (two passes, the second recomputing y)."""
    i = tl.program_id(0).to(tl.int64)
    row = h + i * 2 * K
    amax = tl.zeros((BLOCK,), tl.float32)
    for k0 in range(0, K, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(x_chunk(row, cols, cols < K, K, True).to(tl.float32)))
    sc = tl.maximum(tl.max(amax, 0), 1e-12) / FP8_MAX
    for k0 in range(0, K, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        y = x_chunk(row, cols, cols < K, K, True).to(tl.float32)
        tl.store(xq + i * K + cols, tl.clamp(y / sc, -FP8_MAX, FP8_MAX).to(xq.dtype.element_ty), mask=cols < K)
    tl.store(xs + i, sc)


@triton.jit
def group_quant_kernel(x, xq, xs, M, K, stride_x, stride_sm, stride_sg, ROWS: tl.constexpr, GROUP: tl.constexpr):
    """Rows [ROWS * pid0, +ROWS) of group g (GROUP columns) -> e4m3, each row's scale at
    xs[r * stride_sm + g * stride_sg] (row-major [M, G] or the GEMMs' column-major layout)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    ok = (rows[:, None] < M) & (cols[None, :] < K)
    v = tl.load(x + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(v), 1), 1e-12) / FP8_MAX
    q = tl.clamp(v / s[:, None], -FP8_MAX, FP8_MAX).to(xq.dtype.element_ty)
    tl.store(xq + rows[:, None] * K + cols[None, :], q, mask=ok)
    tl.store(xs + rows * stride_sm + g * stride_sg, s, mask=rows < M)


@triton.jit
def _tile(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped tile order (GROUP_M row tiles share each weight tile while it is in L2)."""
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    per_group = GROUP_M * tiles_n
    first = (pid // per_group) * GROUP_M
    size = tl.minimum(tiles_m - first, GROUP_M)
    return first + (pid % per_group) % size, (pid % per_group) // size


@triton.jit
def fp8_block_gemm_kernel(a, b, c, a_s, b_s, M, N, K, G, stride_am, stride_bn, stride_bsn,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """c = a @ b^T with a e4m3 [M, K] scaled per (row, 128 columns) by a_s [M, G] and b e4m3
    [N, K] scaled per 128 x 128 block by b_s [N/128, G]: each k-block's product is scaled, then
    summed in float32 (BK = 128, one scale pair per k-block)."""
    pm, pn = _tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    mm, nm = rm < M, rn < N
    acc = tl.zeros((BM, BN), tl.float32)
    for kb in range(0, G):
        km = kb * BK + rk < K
        at = tl.load(a + rm[:, None] * stride_am + (kb * BK + rk)[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        bt = tl.load(b + rn[None, :] * stride_bn + (kb * BK + rk)[:, None], mask=nm[None, :] & km[:, None], other=0.0)
        sa = tl.load(a_s + rm * G + kb, mask=mm, other=0.0)
        sb = tl.load(b_s + (rn // 128) * stride_bsn + kb, mask=nm, other=0.0)
        acc += tl.dot(at, bt) * sa[:, None] * sb[None, :]
    tl.store(c + rm[:, None] * N + rn[None, :], acc.to(c.dtype.element_ty), mask=mm[:, None] & nm[None, :])


@triton.jit
def fp8_row_gemm_kernel(a, b, c, a_s, b_s, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        GROUP_M: tl.constexpr):
    """c = (a * a_s) @ (b * b_s)^T: a e4m3 [M, K] with a scale per row, b e4m3 [N, K] with a
    scale per row, K a multiple of BK; the scales applied once, after the sum."""
    pm, pn = _tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    ap = a + rm[:, None].to(tl.int64) * K + rk[None, :]
    bp = b + rn[None, :].to(tl.int64) * K + rk[:, None]
    acc = tl.zeros((BM, BN), tl.float32)
    for _ in range(0, K, BK):
        acc = tl.dot(tl.load(ap, mask=rm[:, None] < M, other=0.0), tl.load(bp, mask=rn[None, :] < N, other=0.0), acc)
        ap += BK
        bp += BK
    acc = acc * tl.load(a_s + rm, mask=rm < M, other=0.0)[:, None] * tl.load(b_s + rn, mask=rn < N, other=0.0)[None, :]
    tl.store(c + rm[:, None] * N + rn[None, :], acc.to(c.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _e2m1(code):
    """e2m1 4-bit codes -> float32 values: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0."""
    mag = code & 7
    e = (mag >> 1).to(tl.float32)
    m = (mag & 1).to(tl.float32)
    val = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * tl.exp2(e - 1.0))
    return tl.where((code & 8) != 0, -val, val)


@triton.jit
def nvfp4_gemm_kernel(a, w, ws, ws2, c, M, N, K, stride_am, stride_wn, stride_wsn,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """c = a @ W^T, W dequantized tile by tile in registers: w uint8 [N, K/2] (two e2m1 codes a
    byte, the even column low), ws e4m3 [N, K/16], ws2 float32 [N]. Weight-only: a stays bf16."""
    pm, pn = _tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    mm, nm = rm < M, rn < N
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        at = tl.load(a + rm[:, None] * stride_am + rk[None, :], mask=mm[:, None] & (rk < K)[None, :], other=0.0)
        rb = k0 // 2 + tl.arange(0, BK // 2)
        p = tl.load(w + rn[None, :] * stride_wn + rb[:, None], mask=nm[None, :] & (rb < K // 2)[:, None], other=0)
        pair = tl.join(_e2m1(p & 0xF), _e2m1(p >> 4))  # [BK/2, BN, 2]: column 2i low, 2i + 1 high
        wt = tl.reshape(tl.permute(pair, (0, 2, 1)), (BK, BN))
        rg = k0 // 16 + tl.arange(0, BK // 16)
        s = tl.load(ws + rn[None, :] * stride_wsn + rg[:, None], mask=nm[None, :] & (rg < K // 16)[:, None],
                    other=0.0).to(tl.float32)
        s = tl.reshape(tl.broadcast_to(s[:, None, :], (BK // 16, 16, BN)), (BK, BN))
        acc += tl.dot(at, (wt * s).to(at.dtype))
    acc = acc * tl.load(ws2 + rn, mask=nm, other=0.0)[None, :]
    tl.store(c + rm[:, None] * N + rn[None, :], acc.to(c.dtype.element_ty), mask=mm[:, None] & nm[None, :])


@triton.jit
def fp8_weight_only_gemm_kernel(a, w, ws, c, M, N, K, stride_am, stride_wn, stride_wsn,
                                BLOCK_SCALES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                                BK: tl.constexpr, GROUP_M: tl.constexpr):
    """c = a @ (w * scales)^T for few rows of a (bf16): the e4m3 weight tile is widened to bf16
    in registers (half the weight bytes of a bf16 GEMM, no activation rounding). Scales: one per
    output row (applied once at the end), or BLOCK_SCALES [N/128, K/128] (BK = 128: one per
    k-step and 128 rows)."""
    pm, pn = _tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    mm, nm = rm < M, rn < N
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        km = rk < K
        at = tl.load(a + rm[:, None] * stride_am + rk[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        wt = tl.load(w + rn[None, :] * stride_wn + rk[:, None], mask=nm[None, :] & km[:, None], other=0.0)
        part = tl.dot(at, wt.to(at.dtype))
        if BLOCK_SCALES:
            part = part * tl.load(ws + (rn // 128) * stride_wsn + k0 // 128, mask=nm, other=0.0)[None, :]
        acc += part
    if not BLOCK_SCALES:
        acc = acc * tl.load(ws + rn, mask=nm, other=0.0)[None, :]
    tl.store(c + rm[:, None] * N + rn[None, :], acc.to(c.dtype.element_ty), mask=mm[:, None] & nm[None, :])
