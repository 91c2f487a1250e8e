"""Triton kernels behind engine/run/triton_ops.py (imported only where triton is; see there).

Module-level so kernels can call each other (triton resolves callees through globals).
"""

import triton
import triton.language as tl

try:  # grid-dependency control for programmatic dependent launch (SM90+, recent triton)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # kernels are then compiled with PDL=False only
    gdc_wait = gdc_launch_dependents = None


@triton.jit
def qk_norm_rope_store_kernel(
    qkv, qkv_stride, q_out, positions, slots, cos_sin, cs_stride,
    q_w, k_w, eps, k_cache, v_cache,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
    HQ_P2: tl.constexpr, HKV_P2: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # everything here reads the previous kernel's output
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0)
    half: tl.constexpr = D // 2
    act = q_out.dtype.element_ty
    pos = tl.load(positions + t)
    slot = tl.load(slots + t)
    d = tl.arange(0, half)
    cos = tl.load(cos_sin + pos * cs_stride + d)[None, :]
    sin = tl.load(cos_sin + pos * cs_stride + half + d)[None, :]
    row = qkv + t * qkv_stride

    # q heads: norm, rotate, store contiguous
    hq = tl.arange(0, HQ_P2)[:, None]
    mq = hq < HQ
    q1 = tl.load(row + hq * D + d[None, :], mask=mq, other=0.0).to(tl.float32)
    q2 = tl.load(row + hq * D + half + d[None, :], mask=mq, other=0.0).to(tl.float32)
    if NORM:
        r = tl.rsqrt((tl.sum(q1 * q1, 1) + tl.sum(q2 * q2, 1)) / D + eps)[:, None]
        q1 = (q1 * r * tl.load(q_w + d).to(tl.float32)[None, :]).to(act).to(tl.float32)
        q2 = (q2 * r * tl.load(q_w + half + d).to(tl.float32)[None, :]).to(act).to(tl.float32)
    qo = q_out + t * (HQ * D) + hq * D + d[None, :]
    tl.store(qo, (q1 * cos - q2 * sin).to(act), mask=mq)
    tl.store(qo + half, (q2 * cos + q1 * sin).to(act), mask=mq)

    # k heads: norm, rotate, store into the pool slot
    hk = tl.arange(0, HKV_P2)[:, None]
    mk = hk < HKV
    kb = row + HQ * D + hk * D + d[None, :]
    k1 = tl.load(kb, mask=mk, other=0.0).to(tl.float32)
    k2 = tl.load(kb + half, mask=mk, other=0.0).to(tl.float32)
    if NORM:
        r = tl.rsqrt((tl.sum(k1 * k1, 1) + tl.sum(k2 * k2, 1)) / D + eps)[:, None]
        k1 = (k1 * r * tl.load(k_w + d).to(tl.float32)[None, :]).to(act).to(tl.float32)
        k2 = (k2 * r * tl.load(k_w + half + d).to(tl.float32)[None, :]).to(act).to(tl.float32)
    cache_t = k_cache.dtype.element_ty
    ko = k_cache + slot * (HKV * D) + hk * D + d[None, :]
    tl.store(ko, (k1 * cos - k2 * sin).to(act).to(cache_t), mask=mk)
    tl.store(ko + half, (k2 * cos + k1 * sin).to(act).to(cache_t), mask=mk)

    # v heads: copy into the pool slot
    vb = row + (HQ + HKV) * D + hk * D + d[None, :]
    vo = v_cache + slot * (HKV * D) + hk * D + d[None, :]
    tl.store(vo, tl.load(vb, mask=mk, other=0.0).to(cache_t), mask=mk)
    tl.store(vo + half, tl.load(vb + half, mask=mk, other=0.0).to(cache_t), mask=mk)


@triton.jit
def x_chunk(x, cols, K: tl.constexpr, SILU_MUL: tl.constexpr):
    if SILU_MUL:  # x = [gate | up] of width 2K: the input is silu(gate) * up, rounded like the kernel's
        g = tl.load(x + cols).to(tl.float32)
        return (g / (1.0 + tl.exp(-g)) * tl.load(x + K + cols).to(tl.float32)).to(x.dtype.element_ty)
    return tl.load(x + cols)

@triton.jit
def gemv_kernel(x, w, y, N, stride_w, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SILU_MUL: tl.constexpr, PDL: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    wrow = w + rows[:, None] * stride_w
    cols = tl.arange(0, BLOCK_K)
    # the first weight tile does not depend on the previous kernel: load it before waiting
    wt = tl.load(wrow + cols[None, :], mask=rmask[:, None], other=0.0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    acc = wt.to(tl.float32) * x_chunk(x, cols, K, SILU_MUL).to(tl.float32)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        wt = tl.load(wrow + cols[None, :], mask=rmask[:, None], other=0.0)
        acc += wt.to(tl.float32) * x_chunk(x, cols, K, SILU_MUL).to(tl.float32)[None, :]
    tl.store(y + rows, tl.sum(acc, 1).to(y.dtype.element_ty), mask=rmask)


@triton.jit
def s_chunk(x, r, r_out, cols, pid, HAS_RES: tl.constexpr):
    """x + r over `cols` in float32; program 0 also writes it (the new residual)."""
    s = tl.load(x + cols).to(tl.float32)
    if HAS_RES:
        s = s + tl.load(r + cols).to(tl.float32)
        if pid == 0:
            tl.store(r_out + cols, s.to(x.dtype.element_ty))
    return s

@triton.jit
def add_norm_gemv_kernel(x, r, r_out, nw, eps, w, y, N, stride_w, K: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr):
    # one pass: y = rrms * W (s * nw) with s = x + r, so the sum of squares of s (every
    # program re-reads the 1 x K vector from L2) is applied after the dot products
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    wrow = w + rows[:, None] * stride_w
    cols = tl.arange(0, BLOCK_K)
    wt = tl.load(wrow + cols[None, :], mask=rmask[:, None], other=0.0)  # independent: before the wait
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    s = s_chunk(x, r, r_out, cols, pid, HAS_RES)
    ss = s * s
    acc = wt.to(tl.float32) * (s * tl.load(nw + cols).to(tl.float32))[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        wt = tl.load(wrow + cols[None, :], mask=rmask[:, None], other=0.0)
        s = s_chunk(x, r, r_out, cols, pid, HAS_RES)
        ss += s * s
        acc += wt.to(tl.float32) * (s * tl.load(nw + cols).to(tl.float32))[None, :]
    rrms = tl.rsqrt(tl.sum(ss, 0) / K + eps)
    tl.store(y + rows, (tl.sum(acc, 1) * rrms).to(y.dtype.element_ty), mask=rmask)
