"""Quantized expert stacks: an MoE layer's `w13` / `w2` (engine/layers/moe.py) in fp8 or NVFP4.

DeepSeek-V3/R1 and Qwen3-*-FP8 checkpoints store every expert's gate/up/down projection as e4m3
with 128x128 block scales (`weight_scale_inv`); compressed-tensors and ModelOpt FP8 ones per
channel or per tensor; ModelOpt NVFP4 ones as e2m1 pairs with a scale per 16 and a global scale.
A quantized stack keeps its Sharding (in packed or group units where it is coarser), with scale
parameters stacked over the experts like the weight:

* `fp8_block`: e4m3 [E, N, K]; `{name}_scale` float32 [E, ceil(N/128), ceil(K/128)];
* `fp8_row`: e4m3 [E, N, K]; `{name}_scale` float32 [E, N] (`quant.ROW_SCALE`: the loader
  broadcasts a per-tensor scalar over its piece's rows, so gate and up keep their own scales
  and every weight its checkpoint bits);
* `nvfp4`: uint8 [E, N, K/2] (two e2m1 codes a byte); `{name}_scale` e4m3 [E, N, K/16];
  `{name}_scale_2` float32 [E, N] (a row scale: each expert matrix's per-tensor
  `weight_scale_2` over its rows, so gate and up keep their own).

Each expert's [N, K] matrix is one Linear weight as far as the arithmetic goes: it is quantized
by `engine.layers.quant.quantize` and dequantized by `quant.dequantize`, so an expert's values
are bit for bit what a dense projection of the same checkpoint bits would get. On the CPU the
stacks are dequantized once at load (`to_plain`); on CUDA the fused kernels
(engine/layers/moe_kernels.py) read the e4m3 stacks and their scales as they are, widening each
weight tile in registers; only the torch path (deterministic inference) dequantizes each expert
that got tokens, every forward (`expert_weight`). The fused kernels do not read NVFP4
(`PLAIN_ONLY`): its stacks are dequantized once at load on every device (models/quant_weights.py
`runtime_form`); on Hopper, which has no FP4 tensor cores, that is for correctness, not speed.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from engine.layers import quant
from engine.layers.moe import Experts, copy_experts_mark
from engine.layers.parallel import Sharding, sharding_of
from engine.layers.parallel import _shard as shard

STACKS = ("w13", "w2")
FORMATS = ("fp8_row", "fp8_block", "nvfp4")
PLAIN_ONLY = ("nvfp4",)  # formats the fused CUDA kernels do not read: made plain at load everywhere
PLAIN_SHARDING = "moe_plain_sharding"  # on a quantized stack: the plain stack's Sharding (to_plain)
_ATTRS = {"": "weight", "_scale": "weight_scale", "_scale_2": "weight_scale_2"}  # stack suffix -> quant's


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _shard_scaled(p: nn.Parameter, sh: Sharding | None, units: dict[int, int]) -> None:
    """Give `p` the stack's Sharding `sh` in `units` (blocks, groups, packed pairs) per dim."""
    try:
        ssh = quant._scaled_sharding(sh, units, tuple(p.shape))
    except ValueError as exc:  # a tensor-parallel slice of every expert that cuts its blocks or groups
        raise ValueError(f"MoE experts: {exc}, or --ep-size equal to --tp-size (whole experts per rank)") from exc
    if ssh is not None:
        shard(p, ssh)


def _row_scale(sh: Sharding | None, e: int, n: int, device: torch.device) -> nn.Parameter:
    s = _param((e, n), torch.float32, device)
    if sh is not None and sh.dim == 1:  # rows split (w13); a split K (w2) leaves every row's scale
        shard(s, Sharding(1, sh.full_shape[:2], sh.pieces))
    setattr(s, quant.ROW_SCALE, True)
    return s


def _fp8(sh: Sharding | None, fmt: str, shape: tuple[int, ...], device: torch.device) -> dict[str, nn.Parameter]:
    """An fp8 stack of `shape` [E, N, K] sharded by `sh`: e4m3 values and their scale."""
    e, n, k = shape
    w = _param(shape, quant.FP8, device)
    if sh is not None:
        shard(w, sh)
    if fmt == "fp8_row":
        return {"": w, "_scale": _row_scale(sh, e, n, device)}
    s = _param((e, -(-n // quant.BLOCK), -(-k // quant.BLOCK)), torch.float32, device)
    _shard_scaled(s, sh, {1: quant.BLOCK, 2: quant.BLOCK})
    return {"": w, "_scale": s}


def _nvfp4(sh: Sharding | None, shape: tuple[int, ...], device: torch.device) -> dict[str, nn.Parameter]:
    """An NVFP4 stack of `shape` [E, N, K] sharded by `sh` (w13 by rows, w2 by K, like the dense
    nvfp4 Linear): packed e2m1 pairs, group scales, row scales."""
    e, n, k = shape
    full_k = k if sh is None else sh.full_shape[2]
    if full_k % quant.GROUP:
        raise ValueError(f"NVFP4 experts need in_features divisible by {quant.GROUP} (hidden_size for gate/up, "
                         f"moe_intermediate_size for down), got {full_k}")
    s = _param((e, n, k // quant.GROUP), quant.FP8, device)
    _shard_scaled(s, sh, {2: quant.GROUP})  # first: a cut group is the error to name
    w = _param((e, n, k // 2), torch.uint8, device)
    _shard_scaled(w, sh, {2: 2})
    return {"": w, "_scale": s, "_scale_2": _row_scale(sh, e, n, device)}


def prepare(experts: Experts, fmt: str) -> None:
    """Give `experts` empty quantized stacks and scales of format `fmt` (the loader fills them)."""
    if fmt not in FORMATS:
        raise ValueError(f"quantized expert weights in {fmt!r} are not supported ({', '.join(FORMATS)}); "
                         "list the experts in the quantization config's ignore list to load them unquantized")
    for name in STACKS:
        old = getattr(experts, name)
        sh, dev, shape = sharding_of(old), old.device, tuple(old.shape)
        params = _nvfp4(sh, shape, dev) if fmt == "nvfp4" else _fp8(sh, fmt, shape, dev)
        setattr(params[""], PLAIN_SHARDING, sh)
        for suffix, p in params.items():
            copy_experts_mark(old, p)
            setattr(experts, name + suffix, p)
    experts.quant = fmt


class _One(nn.Module):
    """One expert's matrix as a bare Linear-shaped module, for engine/layers/quant.py."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(w, requires_grad=False)


def quantize(experts: Experts, fmt: str) -> None:
    """Quantize `experts`' plain stacks to `fmt` (dummy weights, `--quantization fp8`), expert by
    expert with quant.quantize's arithmetic (one expert in float32 at a time)."""
    plain = {name: getattr(experts, name).detach() for name in STACKS}
    prepare(experts, fmt)
    for name, w in plain.items():
        parts = {suffix: getattr(experts, name + suffix) for suffix in _ATTRS if hasattr(experts, name + suffix)}
        for e in range(w.shape[0]):
            one = _One(w[e].float())
            quant.quantize(one, fmt)
            for suffix, p in parts.items():
                p.data[e].copy_(getattr(one, _ATTRS[suffix]))


def dequantize(fmt: str, q: torch.Tensor, s: torch.Tensor, s2: torch.Tensor | None = None) -> torch.Tensor:
    """One expert's float32 [N, K] matrix from its stored values and scales (`s2`: nvfp4's row
    scale), by quant.dequantize."""
    return quant.dequantize(SimpleNamespace(quant=fmt, weight=q, weight_scale=s, weight_scale_2=s2))


def expert_weight(experts: Experts, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e's matrix of stack `name`, in `dtype`: a quantized stack's dequantized now."""
    w = getattr(experts, name)
    if experts.quant is None:
        return w[e]
    s, s2 = getattr(experts, name + "_scale"), getattr(experts, name + "_scale_2", None)
    return dequantize(experts.quant, w[e], s[e], None if s2 is None else s2[e]).to(dtype)


def to_plain(experts: Experts, dtype: torch.dtype) -> None:
    """Back to plain stacks in `dtype` (dequantized once, at load: on the CPU every format, on
    CUDA those in PLAIN_ONLY), filled expert by expert (one float32 matrix at a time)."""
    for name in STACKS:
        q = getattr(experts, name)
        e, n = q.shape[:2]
        k = q.shape[2] * 2 if experts.quant == "nvfp4" else q.shape[2]  # nvfp4: two codes a byte
        p = nn.Parameter(torch.empty((e, n, k), dtype=dtype, device=q.device), requires_grad=False)
        for i in range(e):
            p.data[i].copy_(expert_weight(experts, name, i, dtype))
        sh = getattr(q, PLAIN_SHARDING, sharding_of(q))
        if sh is not None:
            shard(p, sh)
        copy_experts_mark(q, p)
        setattr(experts, name, p)
        for suffix in ("_scale", "_scale_2"):
            if hasattr(experts, name + suffix):
                delattr(experts, name + suffix)
    experts.quant = None
