"""Launchers of the quantized projections' GEMMs (CUDA; formats in engine/layers/quant.py).

* `gemv_fp8`: the small-batch triton GEMV (engine/layers/triton_kernels.py) over fp8 weights,
  each row's sum scaled once: weight-only, the activation stays bf16.
* `fp8_row_gemm`: per-token e4m3 activations (one triton launch) times row-scaled e4m3 weights
  by cuBLASLt (`torch._scaled_mm` with row-wise scales, bf16 out); `fp8_row_mm` the product of
  already-quantized activations, on cuBLASLt or our triton kernel; `add_rms_norm_quant` and
  `silu_mul_quant` quantize inside the launch before (the norm, the SwiGLU).
* `fp8_block_gemm`: per-(token, 128 columns) activation scales, then the block-scaled triton GEMM;
  `fp8_block_cublas` and `fp8_block_deepgemm` the same product by cuBLASLt and by DeepGEMM (the
  `sgl-deep-gemm` package, where it imports: it JIT-compiles its kernels on first use).
* `nvfp4_gemm`: the weight dequantized tile by tile inside a triton GEMM.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton

from engine.layers import quant, triton_ops

FP8 = torch.float8_e4m3fn


def _k():  # noqa: ANN202 - the kernels module, imported on first use
    from engine.layers import quant_kernels

    return quant_kernels


def gemv_fp8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int, num_warps: int,
             num_stages: int, silu_mul: bool = False) -> torch.Tensor:
    return triton_ops.gemv(x, w, block_n, block_k, num_warps, num_stages, silu_mul=silu_mul, scale=scale)


def per_token_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], float32 scales [M, 1]) with x ~= q * scale row by row."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        _k().per_token_quant_kernel[(m,)](x, q, s, k, x.stride(0), BLOCK=min(4096, triton.next_power_of_2(k)),
                                          num_warps=8)
    return q, s


def add_rms_norm_quant(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """per_token_quant(RMSNorm(x + residual) * weight) in one launch, the residual stream (x +
    residual) written into `residual` in place (as flashinfer's fused add-norm does); residual
    None: RMSNorm(x) (layer 0, x the stream). The norm rounds as ops.rms_norm's torch path."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if residual is not None and (residual.shape != x.shape or not residual.is_contiguous()):
        raise ValueError(f"add_rms_norm_quant: residual {tuple(residual.shape)} for x {tuple(x.shape)}")
    if m:
        block = triton.next_power_of_2(k)
        _k().add_rms_norm_quant_kernel[(m,)](x.contiguous(), x if residual is None else residual, weight, q, s, eps, k,
                                             HAS_RES=residual is not None, BLOCK=block,
                                             num_warps=8 if block >= 4096 else 4)
    return q, s


def silu_mul_quant(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """per_token_quant(silu(gate) * up) for h = [gate | up] [M, 2K] in one launch."""
    m, k = h.shape[0], h.shape[1] // 2
    q = torch.empty(m, k, dtype=FP8, device=h.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=h.device)
    if m:
        _k().silu_mul_quant_kernel[(m,)](h.contiguous(), q, s, k, BLOCK=min(4096, triton.next_power_of_2(k)),
                                         num_warps=8)
    return q, s


def group_quant(x: torch.Tensor, group: int = 128, mn_major: bool = False,
                rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], float32 scales [M, ceil(K/group)]): one scale per row and `group` columns.
    With mn_major the scales are column-major with columns of M rounded up to 4 (stride(1)), the
    layout cuBLASLt's and DeepGEMM's 1x128 scaled GEMMs read, written by the same launch. `rows`
    (>= M) sizes both outputs, the rows past M left unwritten."""
    m, k = x.shape
    r = m if rows is None else rows
    g = -(-k // group)
    q = torch.empty(r, k, dtype=FP8, device=x.device)
    s = (torch.empty(g, -(-r // 4) * 4, dtype=torch.float32, device=x.device).t()[:r] if mn_major
         else torch.empty(r, g, dtype=torch.float32, device=x.device))
    if m:
        tile = 16 if m >= 16 else 1
        _k().group_quant_kernel[(triton.cdiv(m, tile), g)](x, q, s, m, k, x.stride(0), s.stride(0), s.stride(1),
                                                           ROWS=tile, GROUP=group, num_warps=4 if tile > 1 else 1)
    return q, s


def fp8_row_gemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16) @ (w [N, K] e4m3 * scale [N])^T -> [M, N] in x's dtype on cuBLASLt, x
    quantized per token (the served choice of kernel is quant.py's, through fp8_row_mm)."""
    q, s = per_token_quant(x)
    return fp8_row_mm(q, s, w, scale, x.dtype)


def fp8_row_mm(q: torch.Tensor, s: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
               config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """(q * s) @ (w * scale)^T for e4m3 q [M, K] with row scales s [M, 1] and e4m3 w [N, K] with
    row scales [N]: on cuBLASLt, or with `config` (block_m, block_n, block_k, warps, stages) our
    triton kernel (K a multiple of block_k), which the H200 tuning picks where cuBLASLt's tiles
    leave SMs idle (Llama-3.1-8B's o and down at 128-256 rows: 64 tiles of 128 x 128)."""
    if config is None:
        return torch._scaled_mm(q, w.t(), scale_a=s, scale_b=scale.view(1, -1), out_dtype=out_dtype)
    m, k = q.shape
    n = w.shape[0]
    bm, bn, bk, warps, stages = config
    if k % bk:
        raise ValueError(f"fp8_row_mm: K {k} is not a multiple of block_k {bk}")
    out = torch.empty(m, n, dtype=out_dtype, device=q.device)
    _k().fp8_row_gemm_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](
        q, w, out, s, scale, m, n, k, BM=bm, BN=bn, BK=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    return out


def fp8_block_gemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                   config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ (w [N, K] e4m3 with 128x128 block scales [N/128, K/128])^T -> [M, N];
    config (BM, BN, warps, stages), BN at most 128 (one weight block row per tile)."""
    m, k = x.shape
    n = w.shape[0]
    q, s = group_quant(x)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        bm, bn, warps, stages = config or ((64 if m > 32 else 16), 128, 4, 3)
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
        _k().fp8_block_gemm_kernel[grid](q, w, out, s, scale, m, n, k, s.shape[1], q.stride(0), w.stride(0),
                                         scale.stride(0), BM=bm, BN=bn, BK=128, GROUP_M=8, num_warps=warps,
                                         num_stages=stages)
    return out


def fp8_weight_only_gemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block_n: int = 32,
                         num_stages: int = 4) -> torch.Tensor:
    """x [M, K] (bf16, a few rows) @ W^T with W = w (e4m3 [N, K]) times `scale`: per row ([N]) or
    per 128 x 128 block ([N/128, K/128]); the weight is widened in registers, x is not rounded."""
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        blocks = scale.dim() == 2
        bm = 16 if m <= 16 else 32 if m <= 32 else 64
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, block_n),)
        _k().fp8_weight_only_gemm_kernel[grid](
            x, w, scale, out, m, n, k, x.stride(0), w.stride(0), scale.stride(0) if blocks else 0,
            BLOCK_SCALES=blocks, BM=bm, BN=block_n, BK=128, GROUP_M=8, num_warps=4, num_stages=num_stages)
    return out


def cublas_ok(n: int, k: int, block: bool) -> bool:
    """Whether cuBLASLt's FP8 GEMM takes weights [n, k]: N and K multiples of 16 (its e4m3 operands'
    16-byte rows), and with block scales whole 128-column K blocks (tests/gpu/test_quant_gpu.py's
    [200, 272] failed there); the triton kernels take any shape."""
    return n % 16 == 0 and k % (128 if block else 16) == 0


def fp8_block_cublas(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The block-scaled GEMM by cuBLASLt (torch's scaled_mm, 1x128 activation and 128x128 weight
    scales): activation scales token-major with M padded to 4 (rows left unwritten: a row's output
    reads only its own row, and those are cut off), weight K-blocks padded to 4."""
    import torch.nn.functional as F

    m = x.shape[0]
    q, s = group_quant(x, mn_major=True, rows=-(-m // 4) * 4)
    kb = scale.shape[1]
    ws = F.pad(scale, (0, -kb % 4)) if kb % 4 else scale
    return F.scaled_mm(q, w.t(), s, F.ScalingType.BlockWise1x128, ws.t(),
                       F.ScalingType.BlockWise128x128, output_dtype=x.dtype)[:m]


@functools.cache
def deep_gemm() -> Any | None:
    """The `deep_gemm` module where it imports on this machine (`sgl-deep-gemm` built for this torch,
    or scripts/build_deepgemm.sh's build), else None: the block-scaled GEMMs stay on cuBLASLt / triton."""
    try:
        import deep_gemm as dg
    except Exception:  # noqa: BLE001 - an optional kernel package: any failure to load means not here
        return None
    return dg


def deepgemm_ok(n: int, k: int) -> bool:
    """Whether DeepGEMM's block-scaled GEMM takes weights [n, k] (whole 128 x 128 blocks, as every
    DeepSeek-V3 projection has)."""
    return n % 128 == 0 and k % 128 == 0


def fp8_block_deepgemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The block-scaled GEMM by DeepGEMM's `fp8_gemm_nt` (SM90: 1x128 activation scales, float32,
    in the column-major layout group_quant writes; 128x128 weight scales), bf16 out; run at
    ladder_rows(M) rows, the padding rows' codes left unwritten (a row's output reads only its own
    row, and those rows are cut off)."""
    m = x.shape[0]
    q, s = group_quant(x, mn_major=True, rows=quant.ladder_rows(m))
    out = torch.empty(q.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    deep_gemm().fp8_gemm_nt((q, s), (w, scale), out)
    return out[:m]


def nvfp4_gemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W^T with W the NVFP4 weight (w uint8 [N, K/2], scale e4m3 [N, K/16], scale_2 [N])."""
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        bm = 64 if m > 32 else 16
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, 64),)
        _k().nvfp4_gemm_kernel[grid](x, w, scale, scale_2, out, m, n, k, x.stride(0), w.stride(0), scale.stride(0),
                                     BM=bm, BN=64, BK=64, GROUP_M=8, num_warps=4, num_stages=3)
    return out

