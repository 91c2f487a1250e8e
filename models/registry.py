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
from models.config import ModelConfig
from models.loader import LOAD_FORMATS, init_dummy, load_safetensors

# architecture -> (module, class); the Llama family shares one implementation
_ARCHS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("models.llama", "LlamaForCausalLM"),
    "Qwen3MoeForCausalLM": ("models.moe", "MoeForCausalLM"),
    "Glm4MoeForCausalLM": ("models.moe", "MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("models.deepseek_v3", "DeepseekV3ForCausalLM"),  # V2's attention and routing: config
    "DeepseekV3ForCausalLM": ("models.deepseek_v3", "DeepseekV3ForCausalLM"),  # also Kimi-K2's config
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHS)


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class implementing `architecture`; ValueError if it is not supported."""
    if architecture not in _ARCHS:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        )
    module, cls = _ARCHS[architecture]
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
) -> tuple[nn.Module, ModelConfig]:
    """Build and load the model in directory `path` (config.json plus weights).

    load_format: "auto"/"safetensors" read the checkpoint's safetensors; "dummy" needs only
    config.json and fills deterministic random weights from `seed`. dtype None picks
    `default_dtype(device)`. Returns (model in eval mode, its ModelConfig).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; choose from {LOAD_FORMATS}")
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    cfg = ModelConfig.from_dir(path)
    cls = get_model_class(cfg.architecture)
    with torch.device(device):  # allocate straight on the target device, no CPU staging copy
        model = cls(cfg, dtype)
    if load_format == "dummy":
        init_dummy(model, seed)
    else:
        load_safetensors(model, cfg, path, progress=progress)
    return model.eval(), cfg
