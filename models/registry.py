"""Architecture registry: HF `architectures[0]` -> model class, imported lazily.

`load_model` is the one entry point workers use: parse config, build the model on the
target device, fill its weights (from safetensors or dummy).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch
from torch import nn

from engine.layers.kv_layout import KVLayout
from models.config import ARCHITECTURES as _ARCHS
from models.config import ModelConfig, check_architecture
from models.loader import LOAD_FORMATS, init_dummy, load_safetensors
from models.quant import QUANTIZATION_CHOICES, QuantScheme, online_fp8
from models.quant_weights import prepare_model, quantize_model, runtime_form


def supported_architectures() -> list[str]:
    return sorted(_ARCHS)


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class implementing `architecture`; ValueError if it is not supported."""
    module, cls = _ARCHS[check_architecture(architecture)]
    return getattr(importlib.import_module(module), cls)


def kv_layout(cfg: ModelConfig) -> KVLayout:
    """The KV layout (engine/layers/kv_layout.py) the plug-in of `cfg.architecture` declares for
    `cfg` (a rank's shard at tp > 1): what its KV pool holds per token and layer."""
    return get_model_class(cfg.architecture).kv_layout(cfg)  # type: ignore[attr-defined]


def default_dtype(device: torch.device) -> torch.dtype:
    """float32 on CPU (the reference path), bfloat16 on accelerators."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def load_model(
    path: str | Path,
    load_format: str = "auto",
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
    progress: bool = True,
    quantization: str | None = None,
) -> tuple[nn.Module, ModelConfig]:
    """Build and load the model in directory `path` (config.json plus weights).

    load_format: "auto"/"safetensors" read the checkpoint's safetensors; "dummy" needs only
    config.json and fills deterministic random weights from `seed`. dtype None picks
    `default_dtype(device)`. Returns (model in eval mode, its ModelConfig).

    Quantized weights (models/quant.py): a quantized checkpoint's projections are loaded as
    stored; `quantization="fp8"` quantizes a plain checkpoint per channel after loading; dummy
    weights are drawn plain and then quantized to the scheme. On the CPU every quantized
    projection is then dequantized to `dtype` (the same values, run by the plain kernels); on
    CUDA, NVFP4 expert stacks are (the fused MoE kernels read bf16 and fp8 stacks only).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; choose from {LOAD_FORMATS}")
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    cfg = ModelConfig.from_dir(path)
    scheme = quant_scheme(cfg, quantization)
    cls = get_model_class(cfg.architecture)
    with torch.device(device):  # allocate straight on the target device, no CPU staging copy
        model = cls(cfg, dtype)
    if load_format == "dummy":
        init_dummy(model, seed)
    else:
        if cfg.quant is not None:  # the checkpoint's bits and scales go straight in
            prepare_model(model, cfg.quant)
        load_safetensors(model, cfg, path, progress=progress)
    if scheme is not None and (load_format == "dummy" or cfg.quant is None):
        quantize_model(model, scheme)
    runtime_form(model, dtype, device)  # CPU: all plain; CUDA: NVFP4 expert stacks plain
    return model.eval(), cfg


def quant_scheme(cfg: ModelConfig, quantization: str | None) -> QuantScheme | None:
    """The weight quantization the model runs with: the checkpoint's, else `--quantization`'s."""
    if quantization is not None and quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"unknown --quantization {quantization!r}; choose from {QUANTIZATION_CHOICES}")
    if cfg.quant is not None:  # already quantized: the checkpoint's own FP8 scheme wins (as in vLLM and SGLang)
        if quantization == "fp8" and not cfg.quant.format.startswith("fp8"):  # vLLM refuses a mismatch too
            raise ValueError(f"--quantization fp8: the checkpoint is already quantized ({cfg.quant.format}, "
                             f"{cfg.quant.source}); drop the flag")
        return cfg.quant
    return online_fp8() if quantization == "fp8" else None
