"""Weight loading: HF safetensors checkpoints (single or sharded) and dummy weights.

HF names map onto Strata's fused parameters: q_proj/k_proj/v_proj become row slices of
qkv_proj, gate_proj/up_proj row slices of gate_up_proj. Every parameter must be filled
exactly once; anything missing or unexpected is a ValueError naming the tensors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from models.config import ModelConfig

LOAD_FORMATS = ("auto", "safetensors", "dummy")
# (HF sub-name, fused sub-name, shard) for projections stored separately in HF checkpoints
_FUSED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", "gate"),
    (".up_proj.", ".gate_up_proj.", "up"),
)
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # recomputed, stored by some old checkpoints


def _shard_rows(cfg: ModelConfig, shard: str) -> tuple[int, int]:
    """Row range [start, end) of `shard` inside its fused parameter."""
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {
        "q": (0, q),
        "k": (q, q + kv),
        "v": (q + kv, q + 2 * kv),
        "gate": (0, inter),
        "up": (inter, 2 * inter),
    }[shard]


def map_name(hf_name: str) -> tuple[str, str | None]:
    """HF tensor name -> (Strata parameter name, shard or None when stored whole)."""
    for hf_part, fused_part, shard in _FUSED:
        if hf_part in hf_name:
            return hf_name.replace(hf_part, fused_part), shard
    return hf_name, None


def checkpoint_files(path: Path) -> list[Path]:
    """Safetensors files of a checkpoint dir: from the index if there is one, else all *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = [path / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in {path} (want model.safetensors or an index)")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"checkpoint {path} lacks shard files {missing}")
    return files


def _iter_tensors(files: list[Path], progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    total = 0
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            total += len(h.keys())
    bar = tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress)
    with bar:
        for f in files:
            with safe_open(str(f), framework="pt") as h:
                for name in h.keys():
                    yield name, h.get_tensor(name)
                    bar.update(1)


def load_safetensors(model: nn.Module, cfg: ModelConfig, path: str | Path, progress: bool = True) -> None:
    """Fill every parameter of `model` from the checkpoint in `path` (converting dtype/device).

    Raises ValueError for a quantized checkpoint, a shape mismatch, an unexpected tensor, or
    a parameter (or fused shard) the checkpoint does not provide.
    """
    if cfg.quant_method is not None:
        raise ValueError(f"quantized checkpoints ({cfg.quant_method}) are not supported yet")
    params = dict(model.named_parameters())
    pending = {(n, s) for n, s in _expected_pieces(params, cfg)}
    unexpected: list[str] = []
    for hf_name, tensor in _iter_tensors(checkpoint_files(Path(path)), progress):
        if hf_name.endswith(_IGNORED_SUFFIXES) or (hf_name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue  # tied checkpoints sometimes store a copy of the embedding; we read the embedding
        name, shard = map_name(hf_name)
        if name not in params:
            unexpected.append(hf_name)
            continue
        _copy_into(params[name], tensor, cfg, shard, hf_name)
        pending.discard((name, shard))
    if unexpected:
        raise ValueError(f"checkpoint {path} has {len(unexpected)} unexpected tensors: {_head(unexpected)}")
    if pending:
        missing = sorted(f"{n}[{s}]" if s else n for n, s in pending)
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensors: {_head(missing)}")


def _expected_pieces(params: dict[str, nn.Parameter], cfg: ModelConfig) -> Iterator[tuple[str, str | None]]:
    for name in params:
        if ".qkv_proj." in name:
            yield from ((name, s) for s in ("q", "k", "v"))
        elif ".gate_up_proj." in name:
            yield from ((name, s) for s in ("gate", "up"))
        else:
            yield name, None


def _copy_into(param: nn.Parameter, tensor: torch.Tensor, cfg: ModelConfig, shard: str | None, src: str) -> None:
    target = param.data
    if shard is not None:
        start, end = _shard_rows(cfg, shard)
        target = target[start:end]
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(f"tensor {src} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    target.copy_(tensor)


def _head(names: list[str], n: int = 8) -> str:
    more = f" ... (+{len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def init_dummy(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Deterministic random weights: N(0, std) for matrices, 1 for norms, 0 for biases.

    Each parameter draws from its own generator seeded by (seed, parameter index) on the
    parameter's device, so results depend only on the seed, the config and the device type.
    """
    for i, (name, p) in enumerate(sorted(model.named_parameters())):
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        elif name.endswith(".bias"):
            p.data.zero_()
        else:
            gen = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + i)
            # draw in float32 then cast, so bf16 and fp32 dummy models share one distribution
            buf = torch.empty(p.shape, dtype=torch.float32, device=p.device).normal_(0.0, std, generator=gen)
            p.data.copy_(buf)
