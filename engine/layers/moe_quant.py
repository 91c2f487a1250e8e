"""Quantized expert stacks: an MoE layer's `w13` / `w2` (engine/layers/moe.py) in fp8.

DeepSeek-V3/R1 and Qwen3-*-FP8 checkpoints store every expert's gate/up/down projection as e4m3
with 128x128 block scales (`weight_scale_inv`); compressed-tensors and ModelOpt FP8 ones per
channel or per tensor. A quantized stack keeps its shape and Sharding, with e4m3 values, plus
one scale parameter `{name}_scale` stacked over the experts like the weight:

* `fp8_block`: float32 [E, ceil(N/128), ceil(K/128)] (the stack's Sharding in block units);
* `fp8_row`: float32 [E, N] (`quant.ROW_SCALE`: the loader broadcasts a per-tensor scalar over
  its piece's rows, so gate and up keep their own scales and every weight its checkpoint bits).

Each expert's [N, K] matrix is one Linear weight as far as the arithmetic goes: it is quantized
by `engine.layers.quant.quantize` and dequantized by `quant.dequantize`, so an expert's values
are bit for bit what a dense projection of the same checkpoint bits would get. On the CPU the
stacks are dequantized once at load (`to_plain`); on CUDA the fused kernels
(engine/layers/moe_kernels.py) read the e4m3 stacks and their scales as they are, widening each
weight tile in registers; only the torch path (deterministic inference) dequantizes each expert
that got tokens, every forward (`expert_weight`). NVFP4 experts are refused at load with a
message.
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


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _scale(sh: Sharding | None, fmt: str, shape: tuple[int, ...], device: torch.device) -> nn.Parameter:
    """The scale parameter of a stack of `shape` [E, N, K] sharded by `sh`."""
    e, n, k = shape
    if fmt == "fp8_block":
        bs = (e, -(-n // quant.BLOCK), -(-k // quant.BLOCK))
        s = _param(bs, torch.float32, device)
        try:
            ssh = quant._scaled_sharding(sh, {1: quant.BLOCK, 2: quant.BLOCK}, bs)
        except ValueError as exc:  # a tensor-parallel slice of every expert that cuts its blocks
            raise ValueError(f"MoE experts: {exc}, or --ep-size equal to --tp-size (whole experts per rank)") from exc
        if ssh is not None:
            shard(s, ssh)
        return s
    s = _param((e, n), torch.float32, device)
    if sh is not None and sh.dim == 1:  # rows split (w13); a split K (w2) leaves every row's scale
        shard(s, Sharding(1, sh.full_shape[:2], sh.pieces))
    setattr(s, quant.ROW_SCALE, True)
    return s


def prepare(experts: Experts, fmt: str) -> None:
    """Give `experts` empty e4m3 stacks and scales of format `fmt` (the loader fills them)."""
    if fmt not in ("fp8_row", "fp8_block"):
        raise ValueError(f"quantized expert weights in {fmt!r} are not supported yet (fp8_row, fp8_block); "
                         "list the experts in the quantization config's ignore list to load them unquantized")
    for name in STACKS:
        old = getattr(experts, name)
        sh, dev = sharding_of(old), old.device
        w = _param(tuple(old.shape), quant.FP8, dev)
        if sh is not None:
            shard(w, sh)
        s = _scale(sh, fmt, tuple(old.shape), dev)
        for p in (w, s):
            copy_experts_mark(old, p)
        setattr(experts, name, w)
        setattr(experts, name + "_scale", s)
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
        q, s = getattr(experts, name), getattr(experts, name + "_scale")
        for e in range(w.shape[0]):
            one = _One(w[e].float())
            quant.quantize(one, fmt)
            q.data[e].copy_(one.weight)
            s.data[e].copy_(one.weight_scale)


def dequantize(fmt: str, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """One expert's float32 [N, K] matrix from its e4m3 values and scales (quant.dequantize)."""
    return quant.dequantize(SimpleNamespace(quant=fmt, weight=q, weight_scale=s))


def expert_weight(experts: Experts, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e's matrix of stack `name`, in `dtype`: a quantized stack's dequantized now."""
    w = getattr(experts, name)
    if experts.quant is None:
        return w[e]
    return dequantize(experts.quant, w[e], getattr(experts, name + "_scale")[e]).to(dtype)


def to_plain(experts: Experts, dtype: torch.dtype) -> None:
    """Back to plain stacks in `dtype` (the CPU path: dequantized once, at load)."""
    for name in STACKS:
        q = getattr(experts, name)
        w = torch.stack([expert_weight(experts, name, e, dtype) for e in range(q.shape[0])])
        p = nn.Parameter(w, requires_grad=False)
        sh = sharding_of(q)
        if sh is not None:
            shard(p, sh)
        copy_experts_mark(q, p)
        setattr(experts, name, p)
        delattr(experts, name + "_scale")
    experts.quant = None
