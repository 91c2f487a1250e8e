"""Triton kernels behind engine/layers/triton_ops.py (imported only where triton is; see there).

Module-level so kernels can call each other (triton resolves callees through globals).
"""

import triton
import triton.language as tl

try:  # grid-dependency control for programmatic dependent launch (SM90+, recent triton)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # kernels are then compiled with PDL=False only
    gdc_wait = gdc_launch_dependents = None


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """With PDL: wait until the previous launch is done (what follows reads its output), then let
    the next launch start (it waits the same way before its first read)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def qk_norm_rope_store_kernel(
    qkv, qkv_stride, q_out, positions, slots, cos_sin, cs_stride,
    q_w, k_w, eps, k_cache, v_cache,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
    HQ_P2: tl.constexpr, HKV_P2: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr,
):
    pdl_start(PDL)  # everything here reads the previous kernel's output
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
def x_chunk(x, cols, cm, K: tl.constexpr, SILU_MUL: tl.constexpr):
    if SILU_MUL:  # x = [gate | up] of width 2K: the input is silu(gate) * up, rounded like the kernel's
        g = tl.load(x + cols, mask=cm, other=0.0).to(tl.float32)
        return (g / (1.0 + tl.exp(-g)) * tl.load(x + K + cols, mask=cm, other=0.0).to(tl.float32)).to(
            x.dtype.element_ty)
    return tl.load(x + cols, mask=cm, other=0.0)

@triton.jit
def gemv_store(v, y, rows, rmask, ss_in, p_in, eps, r, nw, ss_out, pid, K: tl.constexpr,
               NORM_IN: tl.constexpr, P_IN: tl.constexpr, NORM_OUT: tl.constexpr):
    """Store one row's outputs v [BLOCK_N] (float32, row-scaled); pointers are at that row.
    NORM_IN: x was u = s * norm weight, so v is scaled by rsqrt(mean(s^2) + eps), the sum of s^2
    being the p_in partial sums at ss_in. NORM_OUT: s = v (rounded) + r is the new residual (in
    r, in place), u = s * nw is stored instead of v, and this program's sum of s^2 at ss_out."""
    if NORM_IN:
        pi = tl.arange(0, P_IN)
        v = v * tl.rsqrt(tl.sum(tl.load(ss_in + pi, mask=pi < p_in, other=0.0), 0) / K + eps)
    if NORM_OUT:
        act = y.dtype.element_ty
        s = (v.to(act).to(tl.float32) + tl.load(r + rows, mask=rmask, other=0.0).to(tl.float32)).to(act)
        tl.store(r + rows, s, mask=rmask)
        sf = tl.where(rmask, s.to(tl.float32), 0.0)
        tl.store(ss_out + pid, tl.sum(sf * sf, 0))
        v = sf * tl.load(nw + rows, mask=rmask, other=0.0).to(tl.float32)
    tl.store(y + rows, v.to(y.dtype.element_ty), mask=rmask)


@triton.jit
def gemv_kernel(x, w, ws, y, N, stride_w, stride_x, ss_in, p_in, eps, r, nw, ss_out,
                K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, M: tl.constexpr,
                SILU_MUL: tl.constexpr, HAS_SCALE: tl.constexpr, PDL: tl.constexpr,
                NORM_IN: tl.constexpr, P_IN: tl.constexpr, NORM_OUT: tl.constexpr):
    # BLOCK_K >= K: the whole row slice is one (column-masked) tile, every weight load issued
    # before the wait, and each of the M rows of x meets it; otherwise (M == 1) K % BLOCK_K == 0
    # and the first tile loads before the wait. HAS_SCALE: w is fp8 and row n's sum is
    # multiplied by ws[n] (a weight-only FP8 GEMV: the activation is not quantized).
    # NORM_IN / NORM_OUT: an RMSNorm split across two GEMVs (gemv_store; triton_ops.PreNormed)
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    wrow = w + rows[:, None] * stride_w
    cols = tl.arange(0, BLOCK_K)
    cm = cols < K
    # the first weight tile does not depend on the previous kernel: load it before waiting
    wt = tl.load(wrow + cols[None, :], mask=rmask[:, None] & cm[None, :], other=0.0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if HAS_SCALE:
        scale = tl.load(ws + rows, mask=rmask, other=0.0)
    else:
        scale = 1.0
    p_out = tl.num_programs(0)
    if BLOCK_K >= K:
        wf = wt.to(tl.float32)
        for m in tl.static_range(M):
            xm = x_chunk(x + m * stride_x, cols, cm, K, SILU_MUL).to(tl.float32)
            gemv_store(tl.sum(wf * xm[None, :], 1) * scale, y + m * N, rows, rmask, ss_in + m * p_in, p_in, eps,
                       r + m * N, nw, ss_out + m * p_out, pid, K, NORM_IN, P_IN, NORM_OUT)
    else:
        acc = wt.to(tl.float32) * x_chunk(x, cols, cm, K, SILU_MUL).to(tl.float32)[None, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            wt = tl.load(wrow + cols[None, :], mask=rmask[:, None], other=0.0)
            acc += wt.to(tl.float32) * x_chunk(x, cols, cols < K, K, SILU_MUL).to(tl.float32)[None, :]
        gemv_store(tl.sum(acc, 1) * scale, y, rows, rmask, ss_in, p_in, eps, r, nw, ss_out, pid, K,
                   NORM_IN, P_IN, NORM_OUT)


@triton.jit
def s_chunk(x, r, r_out, cols, cm, pid, HAS_RES: tl.constexpr):
    """x + r over `cols` in float32; program 0 also writes it (the new residual)."""
    s = tl.load(x + cols, mask=cm, other=0.0).to(tl.float32)
    if HAS_RES:
        s = s + tl.load(r + cols, mask=cm, other=0.0).to(tl.float32)
        if pid == 0:
            tl.store(r_out + cols, s.to(x.dtype.element_ty), mask=cm)
    return s

@triton.jit
def add_norm_gemv_kernel(x, r, r_out, nw, eps, w, y, h, N, stride_w, K: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, M: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr,
                         H_OUT: tl.constexpr):
    # one pass: y = rrms * W (s * nw) with s = x + r, so the sum of squares of s (every
    # program re-reads the M x K input from L2) is applied after the dot products; H_OUT (one
    # tile): program 0 also stores the normalized rows h = s * rrms * nw in x's dtype
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    wrow = w + rows[:, None] * stride_w
    cols = tl.arange(0, BLOCK_K)
    cm = cols < K
    wt = tl.load(wrow + cols[None, :], mask=rmask[:, None] & cm[None, :], other=0.0)  # before the wait
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if BLOCK_K >= K:  # one tile: each of the M rows meets it
        wf = wt.to(tl.float32)
        nwf = tl.load(nw + cols, mask=cm, other=0.0).to(tl.float32)
        for m in tl.static_range(M):
            s = s_chunk(x + m * K, r + m * K, r_out + m * K, cols, cm, pid, HAS_RES)
            rrms = tl.rsqrt(tl.sum(s * s, 0) / K + eps)
            ym = tl.sum(wf * (s * nwf)[None, :], 1) * rrms
            tl.store(y + m * N + rows, ym.to(y.dtype.element_ty), mask=rmask)
            if H_OUT:
                if pid == 0:
                    tl.store(h + m * K + cols, (s * rrms * nwf).to(x.dtype.element_ty), mask=cm)
    else:
        s = s_chunk(x, r, r_out, cols, cm, pid, HAS_RES)
        ss = s * s
        acc = wt.to(tl.float32) * (s * tl.load(nw + cols, mask=cm, other=0.0).to(tl.float32))[None, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            cm = cols < K
            wt = tl.load(wrow + cols[None, :], mask=rmask[:, None], other=0.0)
            s = s_chunk(x, r, r_out, cols, cm, pid, HAS_RES)
            ss += s * s
            acc += wt.to(tl.float32) * (s * tl.load(nw + cols, mask=cm, other=0.0).to(tl.float32))[None, :]
        rrms = tl.rsqrt(tl.sum(ss, 0) / K + eps)
        tl.store(y + rows, (tl.sum(acc, 1) * rrms).to(y.dtype.element_ty), mask=rmask)


@triton.jit
def _kv_tile(k_cache, v_cache, trow, t, end, kv_off, HKV: tl.constexpr, D: tl.constexpr, PS: tl.constexpr):
    """K and V [BLOCK_N, D] of token positions t (masked past `end`), through the page table row."""
    tm = t < end
    slots = tl.load(trow + t // PS, mask=tm, other=0).to(tl.int64) * PS + t % PS
    kt = tl.load(k_cache + slots[:, None] * (HKV * D) + kv_off, mask=tm[:, None], other=0.0)
    vt = tl.load(v_cache + slots[:, None] * (HKV * D) + kv_off, mask=tm[:, None], other=0.0)
    return kt, vt, tm


@triton.jit
def _attend_tile(q, kt, vt, tm, m_i, l_i, acc, scale, act, dot_t):
    """One online-softmax step (base 2) of q [BLOCK_H, D] over a K/V tile."""
    qk = tl.dot(q.to(dot_t), tl.trans(kt.to(act).to(dot_t))) * scale
    qk = tl.where(tm[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(act).to(dot_t), vt.to(act).to(dot_t))
    return m_new, l_i, acc


@triton.jit
def decode_attention_kernel(
    qkv, qkv_stride, positions, cos_sin, cs_stride, q_w, k_w, eps,
    k_cache, v_cache, table, table_stride, part_o, part_lse, counters, out, sm_scale,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PS: tl.constexpr, NSPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, G_P2: tl.constexpr, SPLIT_P2: tl.constexpr,
    PROLOGUE: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr, F32_DOT: tl.constexpr,
    PARTS: tl.constexpr,
):
    """Split-KV decode attention of one (request, KV head, split), see triton_ops.decode_attention."""
    b = tl.program_id(0)
    vh = tl.program_id(1)  # a part of a KV head's query group (PARTS of them)
    kvh = vh // PARTS
    s = tl.program_id(2)
    G: tl.constexpr = HQ // HKV // PARTS  # query rows of this program
    VH: tl.constexpr = HKV * PARTS
    half: tl.constexpr = D // 2
    act = out.dtype.element_ty
    dot_t = tl.float32 if F32_DOT else act  # the same bf16 values; triton's interpreter needs fp32 dots
    cache_t = k_cache.dtype.element_ty
    pos = tl.load(positions + b)  # the new token's position: the request holds pos + 1 tokens
    # splits of whole BLOCK_N tiles over the pos + 1 tokens; the new token's split owns it and
    # splits past the end have nothing to do (the merge counts only the n_act active ones)
    chunk = tl.cdiv(tl.cdiv(pos + 1, NSPLIT), BLOCK_N) * BLOCK_N
    n_act = tl.cdiv(pos + 1, chunk)
    start = s * chunk
    if start > pos:
        return
    owner = (pos // chunk) == s
    end = tl.minimum(start + chunk, pos + 1)
    if PROLOGUE:  # the new token's K/V come from registers, the pool is read below pos only
        end = tl.minimum(end, pos)
    h = tl.arange(0, BLOCK_H)
    hm = h < G
    d = tl.arange(0, D)
    n = tl.arange(0, BLOCK_N)
    trow = table + b * table_stride
    kv_off = kvh * D + d[None, :]
    # the cached K/V do not depend on the previous kernel: the first tile loads before the wait
    kt, vt, tm = _kv_tile(k_cache, v_cache, trow, start + n, end, kv_off, HKV, D, PS)
    if PDL:  # q (and the new K/V) are the previous kernel's output
        gdc_wait()
        gdc_launch_dependents()
    row = qkv + b * qkv_stride
    if PROLOGUE:
        # neox RoPE on full-width loads: rot(x)[d] = x[d] cos - x[d + D/2] sin (first half),
        # x[d] cos + x[d - D/2] sin (second half); rounding as in qk_norm_rope_store
        dsw = (d + half) % D
        sign = tl.where(d < half, -1.0, 1.0)
        cos = tl.load(cos_sin + pos * cs_stride + d % half)
        sin = tl.load(cos_sin + pos * cs_stride + half + d % half)
        qh = (vh * G + h)[:, None] * D
        x = tl.load(row + qh + d[None, :], mask=hm[:, None], other=0.0).to(tl.float32)
        xs = tl.load(row + qh + dsw[None, :], mask=hm[:, None], other=0.0).to(tl.float32)
        kb = row + HQ * D + kvh * D
        k = tl.load(kb + d).to(tl.float32)
        ks = tl.load(kb + dsw).to(tl.float32)
        if NORM:
            r = tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]
            x = (x * r * tl.load(q_w + d).to(tl.float32)[None, :]).to(act).to(tl.float32)
            xs = (xs * r * tl.load(q_w + dsw).to(tl.float32)[None, :]).to(act).to(tl.float32)
            rk = tl.rsqrt(tl.sum(k * k, 0) / D + eps)
            k = (k * rk * tl.load(k_w + d).to(tl.float32)).to(act).to(tl.float32)
            ks = (ks * rk * tl.load(k_w + dsw).to(tl.float32)).to(act).to(tl.float32)
        q = (x * cos[None, :] + sign[None, :] * xs * sin[None, :]).to(act)
        k_new = (k * cos + sign * ks * sin).to(act).to(cache_t)
        v_new = tl.load(row + (HQ + HKV) * D + kvh * D + d).to(cache_t)
        slot = tl.load(trow + pos // PS).to(tl.int64) * PS + pos % PS
        # only the owner split stores the new K/V (a [D] mask: triton's interpreter rejects a
        # broadcast scalar bool as a mask)
        own = tl.full([D], 0, tl.int32) + s * PARTS + vh % PARTS == (pos // chunk) * PARTS  # part 0 of the owner
        tl.store(k_cache + slot * (HKV * D) + kvh * D + d, k_new, mask=own)
        tl.store(v_cache + slot * (HKV * D) + kvh * D + d, v_new, mask=own)
    else:
        q = tl.load(row + (vh * G + h)[:, None] * D + d[None, :], mask=hm[:, None], other=0.0)
    scale = sm_scale * 1.4426950408889634  # softmax in base 2
    m_i = tl.full([BLOCK_H], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    m_i, l_i, acc = _attend_tile(q, kt, vt, tm, m_i, l_i, acc, scale, act, dot_t)
    for t0 in range(start + BLOCK_N, end, BLOCK_N):
        kt, vt, tm = _kv_tile(k_cache, v_cache, trow, t0 + n, end, kv_off, HKV, D, PS)
        m_i, l_i, acc = _attend_tile(q, kt, vt, tm, m_i, l_i, acc, scale, act, dot_t)
    if PROLOGUE:  # the new token, in the owner split only
        kf = k_new.to(act).to(tl.float32)
        s_new = tl.sum(q.to(tl.float32) * kf[None, :], 1) * scale
        s_new = tl.where(owner, s_new, float("-inf"))
        m_new = tl.maximum(m_i, s_new)
        p_new = tl.exp2(s_new - m_new)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + p_new
        acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(act).to(tl.float32)[None, :]
        m_i = m_new
    # this split's normalized partial output and log2-sum-exp ([split, G, D] rows of the workspace)
    part = (b * VH + vh) * NSPLIT
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
    o_part = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(part_o + ((part + s) * G + h[:, None]) * D + d[None, :], o_part, mask=hm[:, None])
    tl.store(part_lse + (part + s) * G + h, lse, mask=hm)
    # the last active split of this (request, head) to finish merges them all (no merge kernel)
    tl.debug_barrier()
    done = tl.atomic_add(counters + b * VH + vh, 1, sem="acq_rel")
    if done == n_act - 1:
        si = tl.arange(0, SPLIT_P2)[:, None]
        hg = tl.arange(0, G_P2)[None, :]
        live = (si < n_act) & (hg < G)
        lse_all = tl.load(part_lse + (part + si) * G + hg, mask=live, other=float("-inf"), cache_modifier=".cg")
        m_all = tl.max(lse_all, 0)
        w = tl.exp2(lse_all - m_all[None, :])  # [SPLIT_P2, G_P2]; dead entries weigh 0
        w = w / tl.sum(w, 0)[None, :]
        po = tl.load(part_o + ((part + si) * G + hg)[:, :, None] * D + d[None, None, :], mask=live[:, :, None],
                     other=0.0, cache_modifier=".cg")
        o = tl.sum(w[:, :, None] * po, 0)  # [G_P2, D]
        hg1 = tl.arange(0, G_P2)
        tl.store(out + (b * HQ + vh * G + hg1[:, None]) * D + d[None, :], o.to(act), mask=(hg1 < G)[:, None])
        tl.store(counters + b * VH + vh, 0)  # ready for the next launch


@triton.jit(do_not_specialize=["logits_stride", "words", "vocab_size"])
def mask_by_slot_kernel(logits, logits_stride, bitmask, words, pairs, vocab_size, BLOCK: tl.constexpr):
    """Grammar mask: logits row `pairs[2i]` gets -inf wherever bit t of bitmask row
    `pairs[2i + 1]` (the request's slot) is 0; program (i, block) covers BLOCK tokens."""
    i = tl.program_id(0)
    blk = tl.program_id(1)
    row = tl.load(pairs + 2 * i).to(tl.int64)
    slot = tl.load(pairs + 2 * i + 1).to(tl.int64)
    w = blk * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
    packed = tl.load(bitmask + slot * words + w, mask=w < words, other=0)
    banned = ((packed[:, None] >> tl.arange(0, 32)[None, :]) & 1) == 0
    banned = tl.reshape(banned, (BLOCK,))
    t = blk * BLOCK + tl.arange(0, BLOCK)
    tl.store(logits + row * logits_stride + t, float("-inf"), mask=(t < vocab_size) & banned)


@triton.jit
def _splitmix64(z):
    """splitmix64's finaliser on uint64 (logical shifts, wrapping products)."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


# every argument unspecialized (values and pointer alignment): one compile per HAS_IDS, whatever
# the batch, candidate count or slicing of a step, so no request meets a compile after ready
_RACE_ARGS = ["cand", "cand_stride", "seeds", "positions", "ids", "ids_stride", "cols"]


@triton.jit(do_not_specialize=_RACE_ARGS, do_not_specialize_on_alignment=_RACE_ARGS)
def race_noise_kernel(cand, cand_stride, seeds, positions, ids, ids_stride, cols, HAS_IDS: tl.constexpr,
                      BITS: tl.constexpr, BLOCK: tl.constexpr):
    """The sampler's exponential race, in place: cand[b, c] -= log(-log(u)), u uniform from
    splitmix64(splitmix64(seed_b + (position_b + 1) * G) + (token + 1) * G), token = ids[b, c] (or
    c), u = (low BITS bits + 0.5) / 2**BITS (engine/run/sampler.py `_log_exp_noise`, its torch twin:
    engine/run/noise.py)."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = c < cols
    gamma = 0x9E3779B97F4A7C15
    seed = tl.load(seeds + b).to(tl.uint64, bitcast=True)
    pos = tl.load(positions + b).to(tl.uint64, bitcast=True)
    row = _splitmix64(seed + (pos + 1) * gamma)
    if HAS_IDS:
        token = tl.load(ids + b * ids_stride + c, mask=inside, other=0).to(tl.uint64, bitcast=True)
    else:
        token = c.to(tl.uint64)
    bits = _splitmix64(row + (token + 1) * gamma) & ((1 << BITS) - 1)
    u = bits.to(tl.float32) * (1.0 / (1 << BITS)) + 0.5 / (1 << BITS)
    x = tl.load(cand + b * cand_stride + c, mask=inside)
    tl.store(cand + b * cand_stride + c, x - tl.log(-tl.log(u)), mask=inside)


_RANK_ARGS = ["x", "x_stride", "keys", "cols"]  # unspecialized, as the race's: no compile after ready


@triton.jit(do_not_specialize=_RANK_ARGS, do_not_specialize_on_alignment=_RANK_ARGS)
def rank_key_kernel(x, x_stride, keys, cols, BLOCK: tl.constexpr):
    """keys[b, c] = int64 whose order is (value descending, id ascending) of x[b, c] float32: the
    value's bits made monotonic (-0.0 as +0.0, every NaN as the one largest) in the high word,
    0xFFFFFFFF - c in the low (engine/run/ranking.py `ranked_topk`, its torch twin)."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = c < cols
    v = tl.load(x + b * x_stride + c, mask=inside, other=0.0)
    bits = tl.where(v == 0.0, 0, v.to(tl.int32, bitcast=True))  # -0.0 as +0.0
    order = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    order = tl.where(v != v, 0x7FC00000, order).to(tl.int64)
    tl.store(keys + b * cols + c, order * 4294967296 + (4294967295 - c.to(tl.int64)), mask=inside)


@triton.jit(do_not_specialize=["n"])
def store_kernel(src, dst, n, BLOCK: tl.constexpr):
    """dst[:n] = src[:n], dst being host memory the device can write (pinned): the SMs store
    the bytes over PCIe, no copy engine is involved."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(dst + o, tl.load(src + o, mask=m), mask=m)


@triton.jit
def _kv_chunk(qv, k_cache, v_cache, trow, table_width, pos, kvh, j, sm_scale, m_i, l_i, acc,
              HKV: tl.constexpr, D: tl.constexpr, PS: tl.constexpr, C: tl.constexpr):
    """The online-softmax state (m_i, l_i, acc) of the query rows qv [M, D] (in the dot type,
    unscaled) advanced by KV chunk j of KV head kvh: the one chunk step of every kernel here,
    so the same bits. A row with no visible key so far keeps (-inf, 0, 0): its max is taken as 0
    for the exps (exp(-inf) = 0), where a plain exp(-inf - -inf) would be NaN."""
    d = tl.arange(0, D)
    kpos = j * C + tl.arange(0, C)
    col = kpos // PS
    page = tl.load(trow + col, mask=col < table_width, other=0).to(tl.int64)
    off = (page * PS + kpos % PS)[:, None] * (HKV * D) + kvh * D + d[None, :]
    kt = tl.load(k_cache + off).to(qv.dtype)
    vt = tl.load(v_cache + off).to(qv.dtype)
    s = tl.dot(qv, tl.trans(kt)) * sm_scale
    s = tl.where(kpos[None, :] <= pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(qv.dtype), vt)
    return m_new, l_i, acc


@triton.jit
def _merge_state(m_acc, l_acc, o_acc, m_p, l_p, o_p):
    """The running state (m_acc, l_acc, o_acc [R], [R], [R, D]) merged with the next partition's
    (m_p, l_p, o_p): the one formula both kernels use. An empty partition (m = -inf, l = 0, o = 0)
    leaves the state's bits unchanged: a = exp(0) = 1, b = exp(-inf) = 0."""
    mx = tl.maximum(m_acc, m_p)
    ms = tl.where(mx == float("-inf"), 0.0, mx)
    a = tl.exp(m_acc - ms)
    b = tl.exp(m_p - ms)
    return mx, l_acc * a + l_p * b, o_acc * a[:, None] + o_p * b[:, None]


@triton.jit
def _block_rows(q, q_stride, table, table_stride, blk_req, blk_rows, blk_pos, blk_reads, b, kvh,
                G: tl.constexpr, M: tl.constexpr, D: tl.constexpr, T: tl.constexpr, dot_t: tl.constexpr):
    """A block's (KV head kvh) M = T * G query rows: row index r, token t, q row, position, the
    block's chunks read, head, q (in the dot's dtype) and the request's page-table row."""
    r = tl.arange(0, M)
    t = r // G
    qrow = tl.load(blk_rows + b * T + t)
    pos = tl.load(blk_pos + b * T + t)
    req = tl.load(blk_req + b).to(tl.int64)
    reads = tl.load(blk_reads + b)
    d = tl.arange(0, D)
    head = kvh * G + r % G
    qv = tl.load(q + qrow[:, None] * q_stride + head[:, None] * D + d[None, :]).to(dot_t)
    return r, t, qrow, pos, reads, head, qv, table + req * table_stride


@triton.jit(do_not_specialize=["q_stride", "table_stride", "table_width"])
def invariant_attention_kernel(
    q, q_stride, k_cache, v_cache, table, table_stride, table_width, blk_req, blk_rows, blk_pos, blk_reads,
    blk_real, out, sm_scale,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PS: tl.constexpr, T: tl.constexpr, C: tl.constexpr,
    CP: tl.constexpr, F32_DOT: tl.constexpr, PDL: tl.constexpr,
):
    """Deterministic inference's attention (engine/layers/batch_invariant.py) for one (block of
    T query tokens of one request, KV head): the group's T * G query rows against the KV in
    partitions of CP chunks of C positions from position 0, each partition's state from a
    fresh one, chunk after chunk (_kv_chunk), merged in partition order (_merge_state): serially here, by
    invariant_split_kernel + invariant_merge_kernel for split decode, with the same bits. A
    row's arithmetic depends on nothing but its own q, its position and the KV: not on the batch."""
    pdl_start(PDL)  # q and the new token's KV are the previous launch's
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    G: tl.constexpr = HQ // HKV
    M: tl.constexpr = T * G
    act = out.dtype.element_ty
    r, t, qrow, pos, reads, head, qv, trow = _block_rows(
        q, q_stride, table, table_stride, blk_req, blk_rows, blk_pos, blk_reads, b, kvh, G, M, D, T,
        tl.float32 if F32_DOT else act)
    d = tl.arange(0, D)
    m_acc = tl.full([M], float("-inf"), tl.float32)
    l_acc = tl.zeros([M], tl.float32)
    o_acc = tl.zeros([M, D], tl.float32)
    # the partitions in one loop over the chunks (one software pipeline, not a drain and refill per
    # partition): a partition's state starts fresh and is merged at its last chunk, as a
    # loop per partition would do it, so the bits are the split kernels'
    mp = tl.full([M], float("-inf"), tl.float32)
    lp = tl.zeros([M], tl.float32)
    op = tl.zeros([M, D], tl.float32)
    for j in range(0, reads):
        mp, lp, op = _kv_chunk(qv, k_cache, v_cache, trow, table_width, pos, kvh, j, sm_scale, mp, lp, op,
                               HKV, D, PS, C)
        if ((j + 1) % CP == 0) | (j == reads - 1):
            m_acc, l_acc, o_acc = _merge_state(m_acc, l_acc, o_acc, mp, lp, op)
            mp = tl.full([M], float("-inf"), tl.float32)
            lp = tl.zeros([M], tl.float32)
            op = tl.zeros([M, D], tl.float32)
    o_out = (o_acc / l_acc[:, None]).to(act)  # as invariant_merge_kernel
    real = tl.load(blk_real + b * T + t) != 0
    tl.store(out + qrow[:, None] * (HQ * D) + head[:, None] * D + d[None, :], o_out, mask=real[:, None])


@triton.jit
def _rope_rows(x_ptr, pos, cos_sin, cs_stride, D: tl.constexpr):
    """Neox RoPE of the [R, D] rows at x_ptr ([R, D] pointers) at positions pos [R], in float32:
    qk_norm_rope_store_kernel's products and sums (x1 cos - x2 sin | x2 cos + x1 sin) on
    full-width loads; with floating-point fusion off in both, the same bits (a sign times a
    product is exact)."""
    half: tl.constexpr = D // 2
    d = tl.arange(0, D)
    cs = cos_sin + pos[:, None] * cs_stride + (d % half)[None, :]
    x = tl.load(x_ptr).to(tl.float32)
    xs = tl.load(x_ptr + tl.where(d < half, half, -half)[None, :]).to(tl.float32)
    sign = tl.where(d < half, -1.0, 1.0)[None, :]
    return x * tl.load(cs) + sign * xs * tl.load(cs + half)


@triton.jit(do_not_specialize=["q_stride", "table_stride", "table_width", "parts_max"])
def invariant_split_kernel(
    q, q_stride, k_cache, v_cache, table, table_stride, table_width, blk_req, blk_rows, blk_pos, blk_reads,
    sm_scale, part_o, part_ml, parts_max, cos_sin, cs_stride,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PS: tl.constexpr, T: tl.constexpr, C: tl.constexpr,
    CP: tl.constexpr, F32_DOT: tl.constexpr, PDL: tl.constexpr, ROPE: tl.constexpr,
):
    """Split decode, step 1: program (block, KV head, k) computes partitions k, k + splits, ...
    of its block (decode blocks: T copies of one token, computed as invariant_attention_kernel
    computes a block, so with its tile shapes and bits) and stores token 0's G rows' states in
    float32: part_o [blocks, parts_max, HQ, D], part_ml [blocks, parts_max, 2, HQ] (m, l).
    Programs past a block's partitions store nothing (the merge reads only its partitions).
    ROPE: q is the layer's QKV projection [T, (HQ + 2 HKV) * D] before RoPE (no q/k norm):
    every program rotates its q rows, and the program of the token's last partition (the one
    that reads its position) first stores the rotated K and the V, as qk_norm_rope_store would."""
    pdl_start(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    k = tl.program_id(2)
    G: tl.constexpr = HQ // HKV
    M: tl.constexpr = T * G
    dot_t = tl.float32 if F32_DOT else q.dtype.element_ty
    r, t, qrow, pos, reads, head, qv, trow = _block_rows(
        q, q_stride, table, table_stride, blk_req, blk_rows, blk_pos, blk_reads, b, kvh, G, M, D, T, dot_t)
    d = tl.arange(0, D)
    if ROPE:
        act = q.dtype.element_ty
        qv = _rope_rows(q + qrow[:, None] * q_stride + head[:, None] * D + d[None, :], pos, cos_sin, cs_stride,
                        D).to(act).to(dot_t)
        if k == ((reads + CP - 1) // CP - 1) % tl.num_programs(2):
            row0 = tl.load(blk_rows + b * T)
            p0 = tl.load(blk_pos + b * T + tl.arange(0, 1))  # [1]: _rope_rows' row positions
            kb = q + row0 * q_stride + HQ * D + kvh * D
            cache_t = k_cache.dtype.element_ty
            k_new = _rope_rows(kb + d[None, :], p0, cos_sin, cs_stride, D).to(act).to(cache_t)
            slot = (tl.load(trow + p0 // PS).to(tl.int64) * PS + p0 % PS)[:, None] * (HKV * D) + kvh * D
            tl.store(k_cache + slot + d[None, :], k_new)
            tl.store(v_cache + slot + d[None, :], tl.load(kb + HKV * D + d[None, :]).to(cache_t))
            tl.debug_barrier()  # the partition below reads the new position back from the pool
    first = r < G  # token 0's rows
    # this program's partitions k, k + S, ... in one loop over their chunks (one software pipeline,
    # as the serial kernel runs its partitions): a partition's state starts fresh and is stored at
    # its last chunk, as a loop per partition would compute it, so the serial kernel's bits
    nparts = (reads + CP - 1) // CP
    S = tl.num_programs(2)
    mine = tl.maximum(nparts - k + S - 1, 0) // S
    short = tl.where((mine > 0) & (k + (mine - 1) * S == nparts - 1), nparts * CP - reads, 0)  # its last's
    mp = tl.full([M], float("-inf"), tl.float32)
    lp = tl.zeros([M], tl.float32)
    op = tl.zeros([M, D], tl.float32)
    n_chunks = mine * CP - short
    for v in range(0, n_chunks):
        i = k + (v // CP) * S
        mp, lp, op = _kv_chunk(qv, k_cache, v_cache, trow, table_width, pos, kvh, i * CP + v % CP, sm_scale,
                               mp, lp, op, HKV, D, PS, C)
        if ((v + 1) % CP == 0) | (v == n_chunks - 1):
            slot = b.to(tl.int64) * parts_max + i
            tl.store(part_o + (slot * HQ + head)[:, None] * D + d[None, :], op, mask=first[:, None])
            tl.store(part_ml + slot * 2 * HQ + head, mp, mask=first)
            tl.store(part_ml + (slot * 2 + 1) * HQ + head, lp, mask=first)
            mp = tl.full([M], float("-inf"), tl.float32)
            lp = tl.zeros([M], tl.float32)
            op = tl.zeros([M, D], tl.float32)


@triton.jit(do_not_specialize=["parts_max"])
def invariant_merge_kernel(
    blk_rows, blk_reads, part_o, part_ml, parts_max, out,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, T: tl.constexpr, CP: tl.constexpr, PDL: tl.constexpr,
):
    """Split decode, step 2: program (block, KV head) merges its token's partition states in
    partition order from a fresh state by _merge_state, and stores the output as
    invariant_attention_kernel does (o / l in the output dtype)."""
    pdl_start(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    G: tl.constexpr = HQ // HKV
    head = kvh * G + tl.arange(0, G)
    d = tl.arange(0, D)
    reads = tl.load(blk_reads + b)
    m_acc = tl.full([G], float("-inf"), tl.float32)
    l_acc = tl.zeros([G], tl.float32)
    o_acc = tl.zeros([G, D], tl.float32)
    for i in range(0, (reads + CP - 1) // CP):
        slot = b.to(tl.int64) * parts_max + i
        op = tl.load(part_o + (slot * HQ + head)[:, None] * D + d[None, :])
        mp = tl.load(part_ml + slot * 2 * HQ + head)
        lp = tl.load(part_ml + (slot * 2 + 1) * HQ + head)
        m_acc, l_acc, o_acc = _merge_state(m_acc, l_acc, o_acc, mp, lp, op)
    row = tl.load(blk_rows + b * T)
    o_out = (o_acc / l_acc[:, None]).to(out.dtype.element_ty)
    tl.store(out + row * (HQ * D) + head[:, None] * D + d[None, :], o_out)
