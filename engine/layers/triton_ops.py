"""Triton kernels for batch-1 decode and the attention prologue (CUDA only; triton is imported
lazily: the kernels live in engine/layers/triton_kernels.py, these are their Python wrappers).

On SM90 with a recent triton, where the GPU's tuning file says so (engine/layers/tuning.py,
`triton_pdl`), every kernel here is launched with programmatic dependent launch: it starts
while its predecessor drains, loads the first tile of its weights (which do not depend on that
kernel), then waits on the grid dependency before it reads activations or writes anything.

`gemv` is a batch-1 matrix-vector product: one pass over the weights with fp32 accumulation
and no split-K reduce kernel, which beats cuBLAS's M=1 kernels by 5-70% per projection
(bench/results/gemv_probe-h200.json).

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
from typing import NamedTuple

import torch

from engine.layers import batch_invariant
from engine.layers.tuning import kernel_tuning


@functools.cache
def available() -> bool:
    """Whether triton imports (CUDA builds of torch ship it; CPU installs do not)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "use the unfused path"
        return False
    return True


@functools.cache
def pdl_supported() -> bool:
    """Whether triton can launch with programmatic dependent launch (SM90+, a triton with
    grid-dependency control): a kernel then starts while its predecessor drains, and loads
    what does not depend on it (the first weight tile) before `gdc_wait`."""
    try:
        import triton.language.extra.cuda as tlc
        from triton.backends.nvidia.compiler import CUDAOptions

        return (
            hasattr(tlc, "gdc_wait") and "launch_pdl" in CUDAOptions.__dataclass_fields__
            and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
        )
    except Exception:  # noqa: BLE001 - no CUDA triton: no PDL
        return False


def _pdl(device: torch.device) -> bool:
    return device.type == "cuda" and kernel_tuning(device).triton_pdl and pdl_supported()


def _launch_opts(pdl: bool) -> dict:
    return {"launch_pdl": True} if pdl else {}


def pdl_launch(device: torch.device, on: bool) -> dict:
    """A kernel's PDL constexpr (its `pdl_start`) and launch option: PDL where `on` (a tuning
    file's choice for that kernel family), the device is CUDA and triton has it."""
    pdl = on and device.type == "cuda" and pdl_supported()
    return {"PDL": pdl, **_launch_opts(pdl)}


def _k():  # noqa: ANN202 - the kernels module, imported on first use
    from engine.layers import triton_kernels

    return triton_kernels


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
def interpreted() -> bool:
    """Whether triton runs kernels in its CPU interpreter (the tests), whose bf16 tl.dot is
    wrong: kernels then multiply the same bf16 values in float32. Triton's own switch, read once."""
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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
    pdl = _pdl(qkv.device)
    _k().qk_norm_rope_store_kernel[(t,)](
        qkv, qkv.stride(0), q, positions, out_slots, cos_sin_cache, cos_sin_cache.stride(0),
        q_norm_weight if norm else qkv, k_norm_weight if norm else qkv, eps, k_cache, v_cache,
        HQ=num_q_heads, HKV=num_kv_heads, D=head_dim,
        HQ_P2=_p2(num_q_heads), HKV_P2=_p2(num_kv_heads), NORM=norm, PDL=pdl,
        num_warps=4 if num_q_heads * head_dim >= 2048 else 2, **_launch_opts(pdl),
        # deterministic inference: no FMA contraction, so the split kernel's RoPE prologue
        # (invariant_attention with cos_sin_cache) gives a token's K and q these bits
        enable_fp_fusion=not batch_invariant.enabled(),
    )
    return q


# ---------------------------------------------------------------- batch-1 GEMV




# rows of x a one-tile GEMV can take (its M loop is unrolled); the model uses up to the tuning's
# gemv_max_rows (4 on an H200: Qwen3-0.6B decode at batch 2 went 1.45 -> 1.02 ms, batch 4
# 1.49 -> 1.41, but batch 8 1.51 -> 2.20 (the per-row FMAs outgrow the weight read), so batch 8
# stays on cuBLAS; latency-qwen3-0.6b-gemv-rows{1,8}-h200.json)
GEMV_MAX_ROWS = 8


def gemv_rows_ok(cfg: tuple[int, int, int, int] | None, k: int, rows: int) -> bool:
    """Whether a GEMV with config cfg over K takes `rows` rows of x: one always; up to
    GEMV_MAX_ROWS with a one-tile config (each program holds its weight tile and meets every row)."""
    return cfg is not None and (rows == 1 or (1 < rows <= GEMV_MAX_ROWS and cfg[1] >= k))


def _fits(k: int, block_k: int) -> bool:
    """Whether a GEMV kernel takes K with this block: whole blocks, or one power-of-two block
    covering all of K (column-masked; every weight load issued before the grid-dependency wait)."""
    return k % block_k == 0 or (block_k >= k and block_k & (block_k - 1) == 0)


_GEMV_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)  # fp8: with per-row scales


def gemv_config(w: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(block_n, block_k, num_warps, num_stages) for small-batch GEMVs over w [N, K], or None where
    cuBLAS stays (CPU, float32, no triton, a K no config takes, a GPU whose tuning does not turn
    them on). The configs come from the GPU's tuning file (engine/layers/tuning.py); on an H200:
    below K = 4096 each program takes its rows' whole K as one (padded) tile of 8-16K elements, so
    every weight load is in flight before the PDL wait (Qwen3-0.6B batch 1: 1.09 -> 0.94 ms/step,
    latency-qwen3-0.6b-b1-gemv-*.json); at K = 4096 that measured even (Llama-3.1-8B), so wider
    K keeps the looped kernel (gemv_probe-h200.json): 8x512 blocks win almost everywhere; narrow
    outputs want 4 rows x 1024, very wide ones 16 x 256."""
    if not (w.is_cuda and w.dtype in _GEMV_DTYPES and w.stride(1) == 1 and available()):
        return None
    cfg = kernel_tuning(w.device).gemv_config(*w.shape, fp8=w.dtype == torch.float8_e4m3fn)
    return cfg if cfg is not None and _fits(w.shape[1], cfg[1]) else None


class PreNormed(NamedTuple):
    """An RMSNorm split across two GEMVs (batch-1 decode, one launch fewer a norm): the GEMV that
    produced s = x W^T + residual wrote s into the residual (in place), u = s * norm weight, and
    ss [M, P], the sums of s^2 over its P programs' columns; the GEMV that reads u scales its
    outputs by rsqrt(sum(ss) / hidden + eps). Equal to RMSNorm(s) up to where it rounds: u once,
    after the weight, and the rsqrt applied in float32 after the products."""

    u: torch.Tensor
    ss: torch.Tensor
    eps: float


def gemv(x: torch.Tensor | PreNormed, w: torch.Tensor, block_n: int = 16, block_k: int = 512, num_warps: int = 4,
         num_stages: int = 3, silu_mul: bool = False, scale: torch.Tensor | None = None,
         norm_out: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor | PreNormed:
    """x [M, K] @ w[N, K]^T -> [M, N] (fp32 accumulation): one pass over the weights, no split-K
    reduce kernel. With silu_mul, x is [M, 2K] = [gate | up] and the product uses
    silu(gate) * up (the SwiGLU activation folded into the down projection: one launch fewer).
    Needs K % block_k == 0 (then M = 1), or one power-of-two block_k >= K (then M <=
    GEMV_MAX_ROWS), and contiguous rows. `scale` [N] float32: w is fp8 and row n is multiplied by
    scale[n] (engine/layers/quant.py's fp8_row format). x a PreNormed: the product of its norm.
    norm_out (residual [M, N], the next RMSNorm's weight, its eps): returns a PreNormed for the
    GEMV that reads that norm's output, and the residual holds x W^T + residual."""
    n, k = w.shape
    xt = x.u if isinstance(x, PreNormed) else x
    m = xt.shape[0]
    if (xt.shape[1] != (2 * k if silu_mul else k) or not _fits(k, block_k) or w.stride(1) != 1
            or not xt.is_contiguous() or not gemv_rows_ok((block_n, block_k, 0, 0), k, m)
            or (norm_out is not None and (norm_out[0].shape != (m, n) or not norm_out[0].is_contiguous()))):
        raise ValueError(f"gemv: x {tuple(xt.shape)} w {tuple(w.shape)} block_k {block_k} silu_mul {silu_mul}")
    y = torch.empty(m, n, dtype=xt.dtype, device=xt.device)
    programs = -(-n // block_n)
    pre = x if isinstance(x, PreNormed) else None
    ss_out = torch.empty(m, programs, dtype=torch.float32, device=xt.device) if norm_out is not None else w
    r, nw, eps_out = norm_out if norm_out is not None else (w, w, 0.0)  # w: pointers the kernel does not read
    pdl = _pdl(xt.device)
    _k().gemv_kernel[(programs,)](
        xt, w, w if scale is None else scale, y, n, w.stride(0), xt.stride(0),
        w if pre is None else pre.ss, 1 if pre is None else pre.ss.shape[1], 0.0 if pre is None else pre.eps,
        r, nw, ss_out, K=k, BLOCK_N=block_n, BLOCK_K=block_k, M=m, SILU_MUL=silu_mul,
        HAS_SCALE=scale is not None, PDL=pdl, NORM_IN=pre is not None, P_IN=1 if pre is None else _p2(pre.ss.shape[1]),
        NORM_OUT=norm_out is not None, num_warps=num_warps, num_stages=num_stages, **_launch_opts(pdl),
    )
    return PreNormed(y, ss_out, eps_out) if norm_out is not None else y


def add_norm_gemv(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, w: torch.Tensor,
    block_n: int, block_k: int, num_warps: int, num_stages: int, h_out: bool = False,
) -> tuple[torch.Tensor, ...]:
    """(RMSNorm(x + residual) * norm_weight) @ w^T for M rows (1, or up to GEMV_MAX_ROWS with a
    one-tile config) in one launch and one pass, the residual add and the norm's sum of squares
    recomputed per program from L2 (M x hidden); the normalized input is not rounded to the
    activation dtype. Returns (y [M, N], the new residual x + residual, or x itself when
    residual is None: the first layer), and with h_out (a one-tile config) the normalized input
    [M, K] in x's dtype as a third (the norm's output, for another reader)."""
    n, k = w.shape
    m = x.shape[0]
    if (x.shape[1] != k or not _fits(k, block_k) or w.stride(1) != 1 or not x.is_contiguous()
            or not gemv_rows_ok((block_n, block_k, 0, 0), k, m)
            or (residual is not None and (residual.shape != x.shape or not residual.is_contiguous()))
            or (h_out and block_k < k)):
        raise ValueError(f"add_norm_gemv: x {tuple(x.shape)} w {tuple(w.shape)} block_k {block_k}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    r_out = torch.empty_like(x) if residual is not None else x
    h = torch.empty_like(x) if h_out else y
    pdl = _pdl(x.device)
    _k().add_norm_gemv_kernel[(-(-n // block_n),)](
        x, residual if residual is not None else x, r_out, norm_weight, eps, w, y, h, n, w.stride(0),
        K=k, BLOCK_N=block_n, BLOCK_K=block_k, M=m, HAS_RES=residual is not None, PDL=pdl, H_OUT=h_out,
        num_warps=num_warps, num_stages=num_stages, **_launch_opts(pdl),
    )
    return (y, r_out, h) if h_out else (y, r_out)


# ---------------------------------------------------------------- small-batch decode attention

DECODE_BLOCK_H = 16  # query rows per program: a GQA group padded to one tensor-core tile
DECODE_MAX_PARTS = 2  # a GQA group's query rows in at most this many programs (decode_parts)


def decode_splits(batch: int, num_kv_heads: int, sm_count: int) -> int:
    """Splits of each sequence so that batch * Hkv * splits programs about fill the GPU twice
    over (1..32; fixed per batch size, so a CUDA graph keeps one grid)."""
    return max(1, min(32, -(-2 * sm_count // (batch * num_kv_heads))))


def decode_parts(batch: int, num_q_heads: int, num_kv_heads: int, splits: int, sm_count: int) -> int:
    """Programs that share a KV head's query group (1 or 2; fixed per batch size, as the splits):
    two, of half the rows each, for a group of 8 or more (an even one) where the grid would
    otherwise fill at most one wave. A group of 8 in one program takes 255 registers and spills
    (the merge tile is [splits, group, D] float32); in two it takes 200 and the K/V tiles load
    twice, the second time from L2. Qwen3-30B-A3B (32 / 4 heads), batch 1, on an H200: 2.47
    against 2.62 ms a step at ctx 1024, 2.85 against 3.01 at 8192; at batch 8 (a fuller grid)
    8.66 against 8.56 (docs/PERF.md, twenty-third session)."""
    group = num_q_heads // num_kv_heads
    fits = batch * num_kv_heads * splits <= sm_count
    return DECODE_MAX_PARTS if group >= 8 and group % DECODE_MAX_PARTS == 0 and fits else 1


def decode_workspace(max_batch: int, num_kv_heads: int, head_dim: int, sm_count: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(partial outputs fp32, partial log-sum-exps fp32, zeroed merge counters int32) for
    decode_attention up to max_batch requests; the counters return to zero after each launch."""
    rows = max(max_batch * num_kv_heads * decode_splits(b, num_kv_heads, sm_count)
               for b in range(1, max_batch + 1))
    return (
        torch.empty(rows * DECODE_BLOCK_H * head_dim, dtype=torch.float32, device=device),
        torch.empty(rows * DECODE_BLOCK_H, dtype=torch.float32, device=device),
        torch.zeros(DECODE_MAX_PARTS * max_batch * num_kv_heads, dtype=torch.int32, device=device),
    )


def decode_attention(
    x: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    positions: torch.Tensor,
    table: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_size: int,
    workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    splits: int,
    cos_sin_cache: torch.Tensor | None = None,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    parts: int = 1,
) -> torch.Tensor:
    """Decode attention of B requests, one new token each at `positions` (int64 [B]), over the
    pages in `table` (int32 [B, W]; row i holds positions 0..positions[i]), in one launch:
    each (request, KV head, split) program attends its GQA group over one slice of the
    sequence and writes a partial result; the last program of a (request, head) to finish
    (an atomic counter) merges them, so there is no separate merge kernel. With `parts` 2
    (decode_parts), two programs share a (request, KV head, split), each with half the group.

    Without cos_sin_cache, x is q [B, Hq * D] (row stride free) and the new K/V are already
    in the pool. With it, x is the layer's QKV projection [B, (Hq + 2 Hkv) * D] and the
    prologue runs in the same launch: optional per-head q/k RMSNorm (both weights or
    neither), neox RoPE from cos_sin_cache (float32 [max_pos, D], cos | sin), and the new
    K/V written to their slot by the program whose split owns the new token (which attends
    them from registers: no program reads a slot written in this launch). Returns out
    [B, Hq, D] in x's dtype."""
    bsz = x.shape[0]
    prologue = cos_sin_cache is not None
    width = (num_q_heads + 2 * num_kv_heads) * head_dim if prologue else num_q_heads * head_dim
    if x.stride(-1) != 1 or x.shape[1] != width or num_q_heads % num_kv_heads:
        raise ValueError(f"decode_attention: x {tuple(x.shape)} for Hq {num_q_heads} Hkv {num_kv_heads} "
                         f"D {head_dim} prologue {prologue}")
    group = num_q_heads // num_kv_heads
    if group > DECODE_BLOCK_H or group % parts or table.dtype != torch.int32 or table.stride(-1) != 1:
        raise ValueError(f"decode_attention: group {group} > {DECODE_BLOCK_H} or not in {parts} parts, "
                         f"or table {table.dtype} not contiguous int32 rows")
    norm = q_norm_weight is not None
    if norm != (k_norm_weight is not None):
        raise ValueError("pass both q and k norm weights or neither")
    part_o, part_lse, counters = workspace
    if bsz * num_kv_heads * parts > counters.numel() or bsz * num_kv_heads * splits * DECODE_BLOCK_H > part_lse.numel():
        raise ValueError(f"decode_attention: batch {bsz} x {splits} splits exceeds the workspace")
    out = torch.empty(bsz, num_q_heads, head_dim, dtype=x.dtype, device=x.device)
    if bsz == 0:
        return out
    cs = cos_sin_cache if prologue else x
    pdl = _pdl(x.device)
    _k().decode_attention_kernel[(bsz, num_kv_heads * parts, splits)](
        x, x.stride(0), positions, cs, cs.stride(0), q_norm_weight if norm else x,
        k_norm_weight if norm else x, eps, k_cache, v_cache, table, table.stride(0),
        part_o, part_lse, counters, out, head_dim ** -0.5,
        HQ=num_q_heads, HKV=num_kv_heads, D=head_dim, PS=page_size, NSPLIT=splits, BLOCK_N=block_n,
        BLOCK_H=DECODE_BLOCK_H, G_P2=_p2(group // parts), SPLIT_P2=_p2(splits),
        PROLOGUE=prologue, NORM=norm, PDL=pdl, F32_DOT=interpreted(), PARTS=parts,
        num_warps=num_warps, num_stages=num_stages, **_launch_opts(pdl),
    )
    return out


def invariant_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_size: int, table: torch.Tensor,
    blocks: tuple[torch.Tensor, ...], chunk: int, part: int | None = None, splits: int = 1,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None, cos_sin_cache: torch.Tensor | None = None,
) -> torch.Tensor:
    """Deterministic inference's attention (triton_kernels.invariant_attention_kernel): q [T, Hq,
    D] contiguous (with `cos_sin_cache`: the layer's QKV projection [T, Hq + 2 Hkv, D] before
    RoPE, as qk_norm_rope_store takes it without q/k norms; split-KV only: the split kernel
    rotates q and stores the new K/V itself); blocks = (req int32 [nb], rows int64 [nb, tokens], positions int64 [nb,
    tokens], reads int32 [nb], real int8 [nb, tokens]) from batch_invariant.plan (tokens per
    block: kernel_tokens); the KV in
    partitions of `part` positions (batch_invariant.kv_part) merged in order.

    splits > 1 (decode blocks only: one token each) is split-KV: `splits` programs per (block,
    KV head) store the partitions' float32 states in `scratch` (batch_invariant.split_scratch:
    part_o [>= nb, parts, Hq, D], part_ml [>= nb, parts, 2, Hq]; `parts` at least any block's
    partition count), then a second kernel merges them in order. Both kernel pairs are compiled
    with floating-point fusion off: the serial kernel and the split pair share the partition and
    merge code (@triton.jit helpers), and with no FMA contraction the compiler cannot fuse a
    multiply-add in one and not in the other, so a token's output has the same bits on either."""
    t, hq, d = q.shape
    hkv = k_cache.shape[1]
    rope = cos_sin_cache is not None
    if rope:
        if splits <= 1 or q.stride(1) != d or q.stride(2) != 1:
            raise ValueError("invariant_attention: the RoPE prologue is split-KV's, on a [T, Hq + 2 Hkv, D] QKV")
        hq -= 2 * hkv
    out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    nb = blocks[0].shape[0]
    if not nb:
        return out
    if part is None:
        from engine.layers.batch_invariant import kv_part

        part = kv_part(page_size)
    req, rows, pos, reads, real = blocks
    tokens = rows.shape[1]
    head = (q, q.stride(0), k_cache, v_cache, table, table.stride(0), table.shape[1], req, rows, pos, reads)
    geom = dict(HQ=hq, HKV=hkv, D=d, PS=page_size, T=tokens, C=chunk, CP=part // chunk)
    # the serial kernel holds two [T * G, D] float32 states (the partition's and the merged one):
    # 8 warps where 4 would need over 128 registers a thread for them. The split kernel must take
    # the same warps (the same tl.dot lowering); the merge kernel is elementwise (any layout)
    warps = 8 if tokens * (hq // hkv) * d >= 8192 else 4
    pdl = _pdl(q.device)  # a sync only: no bits move
    opts = dict(enable_fp_fusion=False, PDL=pdl, **_launch_opts(pdl))
    k = _k()
    if splits <= 1:
        k.invariant_attention_kernel[(nb, hkv)](*head, real, out, d**-0.5, **geom, F32_DOT=interpreted(),
                                                num_warps=warps, **opts)
        return out
    if scratch is None:
        raise ValueError("invariant_attention: split-KV needs a scratch (batch_invariant.split_scratch)")
    part_o, part_ml = scratch
    if part_o.shape[0] < nb:
        raise ValueError(f"invariant_attention: scratch for {part_o.shape[0]} blocks, {nb} given")
    cs = (cos_sin_cache, cos_sin_cache.stride(0)) if rope else (q, 0)
    k.invariant_split_kernel[(nb, hkv, splits)](*head, d**-0.5, part_o, part_ml, part_o.shape[1], *cs, **geom,
                                                F32_DOT=interpreted(), ROPE=rope, num_warps=warps, **opts)
    k.invariant_merge_kernel[(nb, hkv)](rows, reads, part_o, part_ml, part_o.shape[1], out, HQ=hq, HKV=hkv, D=d,
                                        T=tokens, CP=part // chunk, num_warps=4, **opts)
    return out


MASK_BLOCK = 4096  # tokens per program of the grammar mask (128 bitmask words)


class HostPointer:
    """A host buffer the GPU reads in place (pinned, or registered with cudaHostRegister: with
    unified addressing its address is valid on the device), passed to a triton kernel as a
    pointer: triton takes any object with `data_ptr()` and `dtype`."""

    def __init__(self, t: torch.Tensor) -> None:
        self._ptr = t.data_ptr()
        self.dtype = t.dtype

    def data_ptr(self) -> int:
        return self._ptr


def mask_by_slot(
    logits: torch.Tensor, bitmask: torch.Tensor | HostPointer, words: int, pairs: torch.Tensor | HostPointer, n: int,
    vocab_size: int,
) -> None:
    """Grammar masks in place: for i < n, logits row pairs[2i] is masked with bitmask row
    pairs[2i + 1] (int32 rows of `words` words, bit t set = token t allowed; tokens past the
    bitmask are masked too). The bitmask and pairs may stay in host memory (HostPointer):
    the kernel reads the n rows it needs, with no gather and no copy."""
    if n == 0:
        return
    if logits.stride(-1) != 1:
        raise ValueError("mask_by_slot: logits rows must be contiguous")
    grid = (n, (vocab_size + MASK_BLOCK - 1) // MASK_BLOCK)
    _k().mask_by_slot_kernel[grid](logits, logits.stride(0), bitmask, words, pairs, vocab_size, BLOCK=MASK_BLOCK,
                                   num_warps=4)


RACE_BLOCK = 1024


def race_noise_(cand: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor | None,
                bits: int) -> torch.Tensor:
    """The sampler's race noise subtracted from cand [B, C] float32 in place, in one launch
    (race_noise_kernel): seeds, positions int64 [B]; ids int64 [B, C] (the candidates' token
    ids) or None (column c is token c). Bit for bit the same for a row whatever the batch."""
    b, c = cand.shape
    if (cand.dtype != torch.float32 or cand.stride(1) != 1 or (ids is not None and ids.stride(1) != 1)
            or seeds.shape != (b,) or positions.shape != (b,)):
        raise ValueError("race_noise_: float32 candidates and ids with contiguous rows, a seed and a position a row")
    seeds, positions = seeds.contiguous(), positions.contiguous()  # the kernel reads element b at offset b
    if b and c:
        grid = (b, (c + RACE_BLOCK - 1) // RACE_BLOCK)
        _k().race_noise_kernel[grid](cand, cand.stride(0), seeds, positions, seeds if ids is None else ids,
                                     0 if ids is None else ids.stride(0), c, HAS_IDS=ids is not None, BITS=bits,
                                     BLOCK=RACE_BLOCK, num_warps=4)
    return cand


RANK_BLOCK = 1024


def rank_keys(x: torch.Tensor) -> torch.Tensor:
    """int64 [B, V] keys of x [B, V] float32 (contiguous rows) in one launch (rank_key_kernel):
    their topk is x's in the order value descending, id ascending (ranking.ranked_topk)."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("rank_keys: float32 [B, V] with contiguous rows")
    b, v = x.shape
    keys = torch.empty(b, v, dtype=torch.int64, device=x.device)
    if b and v:
        _k().rank_key_kernel[(b, (v + RANK_BLOCK - 1) // RANK_BLOCK)](x, x.stride(0), keys, v, BLOCK=RANK_BLOCK,
                                                                       num_warps=4)
    return keys


STORE_BLOCK = 1024
STORE_DTYPES = (torch.int64, torch.int32, torch.float32)  # what a step's results are (warmed at start)


def to_host(src: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of a CUDA tensor, written by a kernel on the current stream (valid
    once the stream passed it: the caller syncs on a later event). Why not `.to("cpu",
    non_blocking=True)`: a device-to-host copy goes through a copy engine, in line behind
    whatever other streams queued there; with the host tier's backups in flight (32 MB
    copies, a prefill's 1.8 GB a step) a step's 2 KB of tokens waited 30 ms on the H200
    (scripts/l2_probe.py), against 9 us stored by a kernel."""
    src = src.contiguous()
    out = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    n = src.numel()
    if n:
        grid = ((n + STORE_BLOCK - 1) // STORE_BLOCK,)
        _k().store_kernel[grid](src, HostPointer(out), n, BLOCK=STORE_BLOCK)
    return out


def warm_to_host(device: torch.device) -> None:
    """Compile `to_host` for every result dtype now (nothing compiles after ready)."""
    for dtype in STORE_DTYPES:
        to_host(torch.zeros(3, dtype=dtype, device=device))
    torch.cuda.synchronize(device)
