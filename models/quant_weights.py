"""A model's quantized projections: which `Linear`s a QuantScheme covers, and the three passes
the registry runs over them (before loading, after dummy or online quantization, and
`runtime_form` last: on the CPU everything plain, on CUDA the NVFP4 expert stacks).

Names follow the checkpoint: our fused `qkv_proj` is HF's q/k/v_proj and `gate_up_proj` its
gate/up_proj, so an `ignore` pattern written for the checkpoint means what it says. A fused
projection whose pieces disagree (q quantized, k not) cannot be one tensor: a clear error.
The LM head and the embedding are never quantized (every format here leaves them in bf16).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers import moe_quant, quant
from engine.layers.moe import Experts
from engine.layers.parallel import Linear
from models.quant import QuantScheme

_FUSED_HF = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def covered(model: nn.Module, scheme: QuantScheme) -> list[Linear]:
    """The Linears that `scheme` quantizes."""
    out = []
    for name, m in model.named_modules():
        if not isinstance(m, Linear):
            continue
        parent, _, leaf = name.rpartition(".")
        hf = [f"{parent}.{p}" for p in _FUSED_HF.get(leaf, (leaf,))]
        ignored = [scheme.ignores(h) for h in hf]
        if any(ignored) and not all(ignored):
            raise ValueError(f"quantization ignore list covers only part of the fused {name} ({hf}); "
                             "the engine fuses them into one tensor")
        if not any(ignored):
            out.append(m)
    return out


_EXPERT_HF = ("gate_proj", "up_proj", "down_proj")


def covered_experts(model: nn.Module, scheme: QuantScheme) -> list[Experts]:
    """The MoE expert stacks that `scheme` quantizes (engine/layers/moe_quant.py): HF names each
    expert's projections `{...}.experts.{e}.gate_proj` etc.; a stack is quantized whole or not at
    all. The router (`mlp.gate`) is never a Linear here: it stays unquantized, as checkpoints keep it."""
    out = []
    for name, m in model.named_modules():
        if not isinstance(m, Experts):
            continue
        ignored = {scheme.ignores(f"{name}.{e}.{p}") for e in range(m.num_experts) for p in _EXPERT_HF}
        if len(ignored) > 1:
            raise ValueError(f"quantization ignore list covers only some projections of the experts in {name}; "
                             "the engine stacks them into one tensor per layer")
        if not ignored.pop():
            out.append(m)
    return out


def _each_covered(model: nn.Module, scheme: QuantScheme, linear_op, stack_op) -> int:  # noqa: ANN001
    """linear_op(m, format) on every covered Linear, stack_op(x, format) on every covered expert
    stack; how many there were."""
    mods, stacks = covered(model, scheme), covered_experts(model, scheme)
    for m in mods:
        linear_op(m, scheme.format)
    for x in stacks:
        stack_op(x, scheme.format)
    return len(mods) + len(stacks)


def prepare_model(model: nn.Module, scheme: QuantScheme) -> int:
    """Empty quantized parameters (and scales) for every covered Linear and expert stack, for the
    loader to fill."""
    return _each_covered(model, scheme, quant.prepare, moe_quant.prepare)


@torch.inference_mode()
def quantize_model(model: nn.Module, scheme: QuantScheme) -> int:
    """Quantize every covered Linear's (and expert stack's) loaded plain weight (dummy weights,
    `--quantization fp8`)."""
    return _each_covered(model, scheme, quant.quantize, moe_quant.quantize)


@torch.inference_mode()
def dequantize_model(model: nn.Module, dtype: torch.dtype) -> int:
    """Every quantized Linear and expert stack back to a plain weight in `dtype` (CPU: dequantized
    once, at load)."""
    mods = [m for m in model.modules() if isinstance(m, Linear) and m.quant is not None]
    for m in mods:
        quant.to_plain(m, dtype)
    stacks = [m for m in model.modules() if isinstance(m, Experts) and m.quant is not None]
    for x in stacks:
        moe_quant.to_plain(x, dtype)
    return len(mods) + len(stacks)


@torch.inference_mode()
def runtime_form(model: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """After loading (and any quantize_model): on the CPU every quantized weight back to `dtype`
    (dequantize_model); on CUDA only the expert stacks the fused MoE kernels do not read (NVFP4:
    `moe_quant.PLAIN_ONLY`, dequantized once here). How many were made plain."""
    if device.type == "cpu":
        return dequantize_model(model, dtype)
    stacks = [m for m in model.modules() if isinstance(m, Experts) and m.quant in moe_quant.PLAIN_ONLY]
    for x in stacks:
        moe_quant.to_plain(x, dtype)
    return len(stacks)
