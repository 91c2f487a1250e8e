"""Quantized projection weights: how each format is stored, filled, undone and multiplied.

A `Linear` (engine/layers/parallel.py) whose `quant` is set holds, instead of its plain weight:

* `fp8_row`: `weight` e4m3 [N, K] and `weight_scale` fp32 [N] (one multiplier per output row).
  Per-channel checkpoints map 1:1; a per-tensor scale fills the rows of its tensor, so a fused
  q/k/v keeps three scales and every weight stays the checkpoint's bits.
* `fp8_block`: `weight` e4m3 [N, K] and `weight_scale` fp32 [ceil(N/128), ceil(K/128)].
* `nvfp4`: `weight` uint8 [N, K/2] (two e2m1 values a byte, the even column in the low nibble),
  `weight_scale` e4m3 [N, K/16] and `weight_scale_2` fp32 [N] (the global scale, per row).

The value of a weight is always q * scale (* scale_2): `dequantize` computes it in float32.
Scales carry the same tensor-parallel `Sharding` as their weight (in block or group units),
so the loader fills them like any parameter; a row scale additionally takes a checkpoint's
scalar, [N] or [N, 1] (`ROW_SCALE`).

On the CPU, models are dequantized once at load (`to_plain`): every checkpoint runs everywhere.
On CUDA `forward` multiplies: fp8_row by a weight-only triton GEMV for small batches (the
weight bytes are the cost; the activation stays bf16) and above that by cuBLASLt's row-scaled
FP8 GEMM after a one-launch per-token activation quantization; fp8_block by a block-scaled
triton GEMM over per-token, per-128-column activation scales; nvfp4 by a triton GEMM that
dequantizes each weight tile in registers (weight-only: Hopper has no FP4 tensor cores).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers import batch_invariant, ops
from engine.layers.parallel import Piece, Sharding, sharding_of
from engine.layers.parallel import _shard as shard
from engine.layers.tuning import kernel_tuning

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP4_MAX = 6.0
BLOCK = 128  # fp8_block's block edge
GROUP = 16  # nvfp4's group
ROW_SCALE = "row_scale"  # attribute on a per-row scale parameter: the loader broadcasts scalars
# e2m1 codes 0..15 -> value (bit 3 the sign)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _scaled_sharding(sh: Sharding | None, dim_units: dict[int, int], shape: tuple[int, ...]) -> Sharding | None:
    """The weight's Sharding for a tensor of `shape` that is coarser along the sharded dim (block
    or group scales, packed pairs): ranges, offsets and lengths divided by the unit. Fused pieces
    must each be whole units, and a shard must start on a unit (it may end on a partial one)."""
    if sh is None:
        return None
    unit = dim_units.get(sh.dim, 1)
    full = list(shape)
    full[sh.dim] = -(-sh.full_shape[sh.dim] // unit)
    pieces = {}
    for name, p in sh.pieces.items():
        if (p.src[0] % unit or p.dst % unit or p.full_offset % unit or (p.src[1] % unit and p.src[1] != p.full_len)
                or (len(sh.pieces) > 1 and p.full_len % unit)):
            if len(sh.pieces) > 1 and p.full_len % unit:  # no tp size helps: the checkpoint's fused piece
                raise ValueError(f"a fused projection's piece {name!r} of {p.full_len} rows is not a whole number of "
                                 f"the quantization's {unit}-wide blocks (block-quantized checkpoints need it)")
            raise ValueError(f"a weight shard [{p.src[0]}, {p.src[1]}) of {p.full_len} is not aligned to the "
                             f"quantization's {unit}-wide blocks; choose a --tp-size that splits on block boundaries")
        pieces[name] = Piece((p.src[0] // unit, -(-p.src[1] // unit)), p.dst // unit, -(-p.full_len // unit),
                             p.full_offset // unit)
    return Sharding(sh.dim, tuple(full), pieces)


def _row_scale(n: int, sh: Sharding | None, device: torch.device) -> nn.Parameter:
    s = _param((n,), torch.float32, device)
    if sh is not None and sh.dim == 0:
        shard(s, Sharding(0, (sh.full_shape[0],), sh.pieces))
    setattr(s, ROW_SCALE, True)
    return s


def prepare(linear: nn.Module, fmt: str) -> None:
    """Give `linear` empty parameters of format `fmt` (the loader or `quantize` fills them)."""
    w = linear.weight
    n, k = w.shape
    sh, dev = sharding_of(w), w.device
    if fmt in ("fp8_row", "fp8_block"):
        linear.weight = _param((n, k), FP8, dev)
        if sh is not None:
            shard(linear.weight, sh)
        if fmt == "fp8_row":
            linear.weight_scale = _row_scale(n, sh, dev)
        else:
            bs = (-(-n // BLOCK), -(-k // BLOCK))
            linear.weight_scale = _param(bs, torch.float32, dev)
            ssh = _scaled_sharding(sh, {0: BLOCK, 1: BLOCK}, bs)
            if ssh is not None:
                shard(linear.weight_scale, ssh)
    elif fmt == "nvfp4":
        if k % GROUP:
            raise ValueError(f"NVFP4 needs in_features divisible by {GROUP}, got {k}")
        linear.weight = _param((n, k // 2), torch.uint8, dev)
        linear.weight_scale = _param((n, k // GROUP), FP8, dev)
        linear.weight_scale_2 = _row_scale(n, sh, dev)
        if sh is not None:
            shard(linear.weight, _scaled_sharding(sh, {1: 2}, (n, k // 2)))
            shard(linear.weight_scale, _scaled_sharding(sh, {1: GROUP}, (n, k // GROUP)))
    else:
        raise ValueError(f"unknown quantized format {fmt!r}")
    linear.quant = fmt
    linear.quant_forward = forward  # Linear.forward calls it (parallel.py cannot import this module)
    linear._gemv = False  # decide again for the new weight


def _fp8_round(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize(linear: nn.Module, fmt: str) -> None:
    """Replace `linear`'s plain weight by format `fmt` computed from it (dummy weights and
    `--quantization fp8`): scales from each row's, block's or group's largest magnitude."""
    w = linear.weight.detach().float()
    n, k = w.shape
    prepare(linear, fmt)
    if fmt == "fp8_row":
        s = w.abs().amax(1).clamp(min=1e-12) / FP8_MAX
        linear.weight.data.copy_(_fp8_round(w / s[:, None]))
        linear.weight_scale.data.copy_(s)
    elif fmt == "fp8_block":
        pn, pk = -(-n // BLOCK) * BLOCK, -(-k // BLOCK) * BLOCK
        blocks = torch.nn.functional.pad(w, (0, pk - k, 0, pn - n)).view(pn // BLOCK, BLOCK, pk // BLOCK, BLOCK)
        s = blocks.abs().amax((1, 3)).clamp(min=1e-12) / FP8_MAX
        q = _fp8_round(blocks / s[:, None, :, None]).view(pn, pk)[:n, :k]
        linear.weight.data.copy_(q)
        linear.weight_scale.data.copy_(s)
    else:
        groups = w.view(n, k // GROUP, GROUP)
        amax = groups.abs().amax(2)
        s2 = (amax.amax(1).clamp(min=1e-12) / (FP4_MAX * FP8_MAX))  # global: group scales fit e4m3
        gs = (amax / FP4_MAX / s2[:, None]).clamp(max=FP8_MAX).to(FP8)
        denom = gs.float() * s2[:, None]
        scaled = groups / torch.where(denom > 0, denom, 1.0)[:, :, None]
        flat = scaled.reshape(n, k)
        codes = (flat.abs()[..., None] - E2M1[:8].to(w.device)).abs().argmin(-1)  # the nearest magnitude
        codes = torch.where(flat < 0, codes + 8, codes).to(torch.uint8)
        linear.weight.data.copy_(codes[:, 0::2] | (codes[:, 1::2] << 4))
        linear.weight_scale.data.copy_(gs)
        linear.weight_scale_2.data.copy_(s2)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> float32 [N, K] values (low nibble first)."""
    table = E2M1.to(packed.device)
    lo, hi = table[(packed & 0xF).long()], table[(packed >> 4).long()]
    return torch.stack((lo, hi), -1).flatten(-2)


def dequantize(linear: nn.Module) -> torch.Tensor:
    """The float32 [N, K] weight that `linear`'s quantized parameters stand for."""
    fmt, q, s = linear.quant, linear.weight, linear.weight_scale.float()
    if fmt == "fp8_row":
        return q.float() * s[:, None]
    if fmt == "fp8_block":
        n, k = q.shape
        full = s.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
        return q.float() * full
    vals = unpack_e2m1(q)
    return vals * s.repeat_interleave(GROUP, 1) * linear.weight_scale_2.float()[:, None]


def to_plain(linear: nn.Module, dtype: torch.dtype) -> None:
    """Back to a plain weight in `dtype` (the CPU path: dequantized once, at load)."""
    w = dequantize(linear).to(dtype)
    sh = sharding_of(linear.weight) if linear.quant != "nvfp4" else None
    linear.weight = nn.Parameter(w, requires_grad=False)
    if sh is not None:
        shard(linear.weight, sh)
    for name in ("weight_scale", "weight_scale_2"):
        if hasattr(linear, name):
            delattr(linear, name)
    linear.quant = None
    linear._gemv = False


def ladder_rows(m: int) -> int:
    """The row count a DeepGEMM call runs at for m rows: m up to 256, else m rounded up to a multiple
    of 16 (up to 4096) or of 64 (beyond). DeepGEMM picks (and JIT-compiles) its tiles by the exact row
    count, so calls run only at counts the warm-up's ladder holds (engine/run/warmup.py gemm_rows):
    every tile choice a step can meet is compiled before ready, at <= 1.6% padded rows past 4096."""
    return m if m <= 256 else -(-m // 16) * 16 if m <= 4096 else -(-m // 64) * 64


def forward(linear: nn.Module, x: torch.Tensor, gemv: tuple | None, silu_mul: bool = False) -> torch.Tensor:
    """x W^T (no bias) for a quantized `linear` on CUDA; `gemv` the small-batch GEMV config or
    None; with silu_mul, x is [gate | up] and the product uses silu(gate) * up. With deterministic
    inference the GEMMs run in fixed row blocks, like the plain ones."""
    from engine.layers import quant_ops  # triton: imported on first use, CUDA only

    fmt = linear.quant
    if fmt == "fp8_row" and gemv is not None:
        return quant_ops.gemv_fp8(x, linear.weight, linear.weight_scale, *gemv, silu_mul=silu_mul)
    if silu_mul and token_quantized(linear, x):  # the activation and the quantization in one launch
        return _row_mm(linear, *quant_ops.silu_mul_quant(x), x.dtype)
    if silu_mul:
        x = ops.silu_and_mul(x)
    tuning = kernel_tuning(x.device)
    w, s = linear.weight, linear.weight_scale
    if fmt == "nvfp4":
        def gemm(a: torch.Tensor) -> torch.Tensor:
            return quant_ops.nvfp4_gemm(a, w, s, linear.weight_scale_2)
    else:
        def gemm(a: torch.Tensor) -> torch.Tensor:
            m = a.shape[0]
            # few rows: the weight bytes are the cost; and any shape cuBLASLt does not take
            if m <= tuning.fp8_weight_only_max_rows or (fmt == "fp8_row" and not quant_ops.cublas_ok(*w.shape, False)):
                return quant_ops.fp8_weight_only_gemm(a, w, s)
            if fmt == "fp8_row":
                return _row_mm(linear, *quant_ops.per_token_quant(a), a.dtype)
            if (0 < tuning.fp8_block_deepgemm_min_rows <= m and quant_ops.deepgemm_ok(*w.shape)
                    and quant_ops.deep_gemm() is not None):
                return quant_ops.fp8_block_deepgemm(a, w, s)
            if 0 < tuning.fp8_block_cublas_min_rows <= m and quant_ops.cublas_ok(*w.shape, True):
                return quant_ops.fp8_block_cublas(a, w, s)
            return quant_ops.fp8_block_gemm(a, w, s)
    return batch_invariant.rows_of(x, gemm) if batch_invariant.enabled() else gemm(x)


def token_quantized(linear: nn.Module, x: torch.Tensor) -> bool:
    """Whether `linear`'s forward quantizes x per token: fp8 row-scaled weights on CUDA, more rows
    than the weight-only GEMM takes, a shape cuBLASLt takes (the row-scaled GEMMs' own rule), the
    whole layer (no tensor-parallel reduce) and not deterministic inference (whose GEMMs run in row
    blocks). Then the launch before it quantizes instead: norm_forward, and the SwiGLU in forward
    (H200, Llama-3.1-8B fp8 offline 1000/1000: 15,502 against 15,339 out tok/s, docs/PERF.md)."""
    if getattr(linear, "quant", None) != "fp8_row" or not x.is_cuda or batch_invariant.enabled():
        return False
    from engine.layers import quant_ops

    tp = getattr(linear, "tp", None)
    return ((tp is None or tp.world == 1) and x.shape[0] > kernel_tuning(x.device).fp8_weight_only_max_rows
            and quant_ops.cublas_ok(*linear.weight.shape, False))


def norm_forward(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(RMSNorm(x + residual) * norm_weight), x + residual) for a linear that takes its input
    quantized per token (token_quantized): the norm's launch also quantizes (one launch fewer and
    no bf16 round trip of the normalized rows); the residual is updated in place as by the fused
    add-norm, and residual None means x is the stream (layer 0)."""
    from engine.layers import quant_ops

    y = _row_mm(linear, *quant_ops.add_rms_norm_quant(x, residual, norm_weight, eps), x.dtype)
    return (y if linear.bias is None else y + linear.bias), (x if residual is None else residual)


def _row_mm(linear: nn.Module, q: torch.Tensor, s: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    from engine.layers import quant_ops

    w = linear.weight
    cfg = kernel_tuning(w.device).fp8_row_config(q.shape[0], *w.shape)
    return quant_ops.fp8_row_mm(q, s, w, linear.weight_scale, out_dtype, cfg)
