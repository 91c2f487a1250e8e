"""Triton kernels for the decoder's attention prologue (CUDA only; triton is imported lazily).

`gemv` is a batch-1 matrix-vector product: one pass over the weights with fp32 accumulation
and no split-K reduce kernel, which beats cuBLAS's M=1 kernels by 5-70% per projection
(scripts/gemv_probe.py).

`qk_norm_rope_store` replaces, per layer, up to five small kernels (q RMSNorm, k RMSNorm,
RoPE over q and k, the K store and the V store) with one launch: each program takes one
token's row of the fused QKV projection, normalizes and rotates its q and k heads in
float32, writes q to a contiguous [T, Hq, D] tensor and k, v straight into their KV-pool
slot (cast to the pool's dtype, so an fp8 pool is quantized here). At batch 1 these
kernels are latency-bound, so the count matters more than their bytes.

Rounding follows the unfused path: the normalized q/k is rounded to the activation dtype
before RoPE, and k to the activation dtype before the pool's dtype.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def available() -> bool:
    """Whether triton imports (CUDA builds of torch ship it; CPU installs do not)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "use the unfused path"
        return False
    return True


def supported(head_dim: int, q: torch.Tensor) -> bool:
    """Whether the fused kernel handles this geometry and tensor (CUDA, half precision,
    power-of-two head_dim so a head splits into two aranges)."""
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and head_dim >= 16
        and head_dim & (head_dim - 1) == 0
        and available()
    )


@functools.cache
def _kernel():  # noqa: ANN202 - a triton JITFunction
    import triton
    import triton.language as tl

    @triton.jit
    def qk_norm_rope_store_kernel(
        qkv, qkv_stride, q_out, positions, slots, cos_sin, cs_stride,
        q_w, k_w, eps, k_cache, v_cache,
        HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
        HQ_P2: tl.constexpr, HKV_P2: tl.constexpr, NORM: tl.constexpr,
    ):
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

    return qk_norm_rope_store_kernel


def _p2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def qk_norm_rope_store(
    qkv: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    out_slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """From qkv [T, (Hq + 2 Hkv) * D] (row stride free, last dim contiguous): optional per-head
    RMSNorm of q and k (both weights or neither), neox RoPE at `positions` (int64 [T]) from
    `cos_sin_cache` (float32 [max_pos, D]: cos | sin halves), K and V written to
    `out_slots` (int64 [T]) of k_cache/v_cache ([slots, Hkv, D], any dtype). Returns q
    [T, Hq, D], contiguous, in qkv's dtype."""
    t = qkv.shape[0]
    if qkv.stride(-1) != 1 or qkv.shape[1] != (num_q_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not a contiguous-row [T, (Hq+2Hkv)*D] projection")
    norm = q_norm_weight is not None
    if norm != (k_norm_weight is not None):
        raise ValueError("pass both q and k norm weights or neither")
    q = torch.empty(t, num_q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    _kernel()[(t,)](
        qkv, qkv.stride(0), q, positions, out_slots, cos_sin_cache, cos_sin_cache.stride(0),
        q_norm_weight if norm else qkv, k_norm_weight if norm else qkv, eps, k_cache, v_cache,
        HQ=num_q_heads, HKV=num_kv_heads, D=head_dim,
        HQ_P2=_p2(num_q_heads), HKV_P2=_p2(num_kv_heads), NORM=norm,
        num_warps=4 if num_q_heads * head_dim >= 2048 else 2,
    )
    return q


# ---------------------------------------------------------------- batch-1 GEMV


@functools.cache
def _gemv_kernel():  # noqa: ANN202 - a triton JITFunction
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_kernel(x, w, y, N, stride_w, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SILU_MUL: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            wt = tl.load(w + rows[:, None] * stride_w + cols[None, :], mask=rmask[:, None], other=0.0)
            if SILU_MUL:  # x = [gate | up] of width 2K: the input is silu(gate) * up, rounded like the kernel's
                g = tl.load(x + cols).to(tl.float32)
                xv = (g / (1.0 + tl.exp(-g)) * tl.load(x + K + cols).to(tl.float32)).to(x.dtype.element_ty)
            else:
                xv = tl.load(x + cols)
            acc += wt.to(tl.float32) * xv.to(tl.float32)[None, :]
        tl.store(y + rows, tl.sum(acc, 1).to(y.dtype.element_ty), mask=rmask)

    return gemv_kernel


@functools.cache
def _tuned() -> dict[str, list[int]]:
    """STRATA_GEMV_TUNE's per-shape configs (a tuning experiment's override), or none."""
    from engine.env import env

    path = env().gemv_tune
    if not path:
        return {}
    import json
    from pathlib import Path

    return json.loads(Path(path).read_text())


def gemv_config(w: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(block_n, block_k, num_warps, num_stages) for batch-1 GEMVs over w [N, K], or None where
    cuBLAS stays (CPU, float32, no triton, an odd K). From scripts/gemv_probe.py on an H200
    (bench/results/gemv_probe-h200.json): 8x512 blocks win almost everywhere; narrow outputs
    want 4 rows x 1024, very wide ones 16 x 256."""
    if not (w.is_cuda and w.dtype in (torch.float16, torch.bfloat16) and w.stride(1) == 1 and available()):
        return None
    n, k = w.shape
    tuned = _tuned().get(f"{n},{k}")
    if tuned is not None and k % tuned[1] == 0:
        return tuple(tuned)
    if n <= 2048 and k % 1024 == 0:
        return (4, 1024, 4, 3)
    if n >= 16384 and k % 256 == 0:
        return (16, 256, 4, 4)
    if k % 512 == 0:
        return (8, 512, 4, 3)
    return None


def gemv(x: torch.Tensor, w: torch.Tensor, block_n: int = 16, block_k: int = 512, num_warps: int = 4,
         num_stages: int = 3, silu_mul: bool = False) -> torch.Tensor:
    """x [1, K] @ w[N, K]^T -> [1, N] (fp32 accumulation): one pass over the weights, no split-K
    reduce kernel. With silu_mul, x is [1, 2K] = [gate | up] and the product uses
    silu(gate) * up (the SwiGLU activation folded into the down projection: one launch fewer).
    Needs K % block_k == 0 and contiguous rows."""
    n, k = w.shape
    if x.shape != (1, 2 * k if silu_mul else k) or k % block_k or w.stride(1) != 1 or not x.is_contiguous():
        raise ValueError(f"gemv: x {tuple(x.shape)} w {tuple(w.shape)} block_k {block_k} silu_mul {silu_mul}")
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel()[(-(-n // block_n),)](
        x, w, y, n, w.stride(0), K=k, BLOCK_N=block_n, BLOCK_K=block_k, SILU_MUL=silu_mul,
        num_warps=num_warps, num_stages=num_stages,
    )
    return y


@functools.cache
def _norm_gemv_kernel():  # noqa: ANN202 - a triton JITFunction
    import triton
    import triton.language as tl

    @triton.jit
    def add_norm_gemv_kernel(x, r, r_out, nw, eps, w, y, N, stride_w, K: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, HAS_RES: tl.constexpr):
        # one pass: y = rrms * W (s * nw) with s = x + r, so the sum of squares of s (every
        # program re-reads the 1 x K vector from L2) is applied after the dot products
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        ss = tl.zeros([BLOCK_K], dtype=tl.float32)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            wt = tl.load(w + rows[:, None] * stride_w + cols[None, :], mask=rmask[:, None], other=0.0)
            s = tl.load(x + cols).to(tl.float32)
            if HAS_RES:
                s = s + tl.load(r + cols).to(tl.float32)
                if pid == 0:
                    tl.store(r_out + cols, s.to(x.dtype.element_ty))
            ss += s * s
            acc += wt.to(tl.float32) * (s * tl.load(nw + cols).to(tl.float32))[None, :]
        rrms = tl.rsqrt(tl.sum(ss, 0) / K + eps)
        tl.store(y + rows, (tl.sum(acc, 1) * rrms).to(y.dtype.element_ty), mask=rmask)

    return add_norm_gemv_kernel


def add_norm_gemv(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, w: torch.Tensor,
    block_n: int, block_k: int, num_warps: int, num_stages: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch-1 (RMSNorm(x + residual) * norm_weight) @ w^T in one launch and one pass, the
    residual add and the norm's sum of squares recomputed per program from L2 (a 1 x hidden
    vector); the normalized input is not rounded to the activation dtype. Returns (y [1, N], the new
    residual x + residual, or x itself when residual is None: the first layer)."""
    n, k = w.shape
    if x.shape != (1, k) or k % block_k or w.stride(1) != 1 or not x.is_contiguous():
        raise ValueError(f"add_norm_gemv: x {tuple(x.shape)} w {tuple(w.shape)} block_k {block_k}")
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    r_out = torch.empty_like(x) if residual is not None else x
    _norm_gemv_kernel()[(-(-n // block_n),)](
        x, residual if residual is not None else x, r_out, norm_weight, eps, w, y, n, w.stride(0),
        K=k, BLOCK_N=block_n, BLOCK_K=block_k, HAS_RES=residual is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    return y, r_out
