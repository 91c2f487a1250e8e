"""Which quantization a checkpoint carries: `QuantScheme`, read once from its config.

Read from config.json's `quantization_config`, or ModelOpt's hf_quant_config.json:

* `quant_method: fp8` (DeepSeek-V3/R1, Qwen3-*-FP8): e4m3 weights with `weight_block_size`
  [128, 128] block scales (`weight_scale_inv`, the multiplier despite its name); without a
  block size one per-tensor `weight_scale`.
* `quant_method: compressed-tensors`, `format: float-quantized` (llm-compressor's FP8): 8-bit
  float weights per channel (`weight_scale` [N, 1]) or per tensor, activations dynamic per token
  or static per tensor (`input_scale`).
* ModelOpt (`quant_algo` FP8: per-tensor weight and input scales; NVFP4: e2m1 weights packed two
  per byte, an e4m3 scale per group of 16 and a global fp32 `weight_scale_2`).

Anything else fails here, at start, with a message that names the field. `online_fp8()` is
`--quantization fp8`: a bf16 checkpoint quantized per channel at load, as vLLM and SGLang do.
How a scheme's weights are stored and multiplied is engine/layers/quant.py's business.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

# stored weight formats (engine/layers/quant.py): fp8 with one scale per output row, fp8 with
# [128, 128] block scales, NVFP4 (e2m1 pairs, e4m3 scale per 16, a global scale per row)
FORMATS = ("fp8_row", "fp8_block", "nvfp4")
QUANTIZATION_CHOICES = ("fp8",)  # --quantization


@dataclass(frozen=True)
class QuantScheme:
    """A checkpoint's (or `--quantization`'s) weight quantization.

    `format` is how the engine stores the weights (one of FORMATS): per-tensor checkpoint scales
    become per-row scales (a fused q/k/v holds three tensors, each with its own scale), which
    keeps every weight bit-exact. `activations` is "dynamic" (per token at run time) or
    "static" (the checkpoint has `input_scale`s; read and checked, and the engine still
    quantizes per token: as fast, and never coarser). `ignore` lists module-name patterns
    (exact names, suffixes, `*` wildcards as ModelOpt writes them, or `re:` regexes) that stay
    unquantized; the LM head and
    embeddings always do. `source` names where it came from, for logs and errors."""

    format: str
    source: str
    activations: str = "dynamic"
    block: tuple[int, int] = (128, 128)
    group_size: int = 16
    ignore: tuple[str, ...] = ()
    checkpoint_scale: str = "weight_scale"  # the tensor name of the weight scale in the checkpoint

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"unknown quantized weight format {self.format!r}; known: {FORMATS}")
        if self.activations not in ("dynamic", "static"):
            raise ValueError(f"activations must be dynamic or static, got {self.activations!r}")
        if self.format == "fp8_block" and self.block != (128, 128):
            raise ValueError(f"quantization_config.weight_block_size {list(self.block)} is not supported "
                             "(only [128, 128])")
        if self.format == "nvfp4" and self.group_size != 16:
            raise ValueError(f"NVFP4 group_size {self.group_size} is not supported (only 16)")

    def ignores(self, module: str) -> bool:
        """Whether the module named `module` (an HF name, e.g. model.layers.0.mlp.gate_proj) stays
        unquantized."""
        for pat in self.ignore:
            if pat.startswith("re:"):
                if re.fullmatch(pat[3:], module):
                    return True
            elif module == pat or module.endswith("." + pat) or (pat.endswith("*") and module.startswith(pat[:-1])):
                return True
            elif "*" in pat and fnmatchcase(module, pat):  # ModelOpt's wildcards: model.layers.*.self_attn*
                return True
        return False

    @property
    def name(self) -> str:
        """A short label for logs and the L3 fingerprint."""
        return f"{self.source}:{self.format}:{self.activations}"


def online_fp8() -> QuantScheme:
    """`--quantization fp8`: per-channel e4m3 weights computed at load, dynamic per-token activations."""
    return QuantScheme(format="fp8_row", source="online")


def read_scheme(config: dict[str, Any], model_dir: str | Path | None = None) -> QuantScheme | None:
    """The checkpoint's QuantScheme, None when it is not quantized; ValueError naming the field
    for a scheme the engine cannot run."""
    q = config.get("quantization_config")
    modelopt = _modelopt_file(model_dir)
    if q is None and modelopt is None:
        return None
    if q is None or (isinstance(q, dict) and q.get("quant_method") == "modelopt" and modelopt is not None):
        return _modelopt(modelopt if modelopt is not None else {}, "hf_quant_config.json quantization")
    if not isinstance(q, dict):
        raise ValueError(f"config.json quantization_config must be an object, got {type(q).__name__}")
    method = q.get("quant_method")
    if method == "fp8":
        return _fp8(q)
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method == "modelopt":
        return _modelopt(q, "quantization_config")
    raise ValueError(f"quantization_config.quant_method {method!r} is not supported "
                     "(supported: fp8, compressed-tensors float-quantized, modelopt FP8/NVFP4)")


def _modelopt_file(model_dir: str | Path | None) -> dict[str, Any] | None:
    if model_dir is None:
        return None
    f = Path(model_dir) / "hf_quant_config.json"
    if not f.is_file():
        return None
    d = json.loads(f.read_text())
    q = d.get("quantization")
    if not isinstance(q, dict):
        raise ValueError(f"{f} lacks a 'quantization' object")
    return q


def _fp8(q: dict[str, Any]) -> QuantScheme:
    if q.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"quantization_config.fmt {q.get('fmt')!r} is not supported (only e4m3)")
    acts = q.get("activation_scheme", "dynamic")
    if acts not in ("dynamic", "static"):
        raise ValueError(f"quantization_config.activation_scheme {acts!r} is not supported")
    ignore = tuple(q.get("modules_to_not_convert") or q.get("ignored_layers") or ())
    block = q.get("weight_block_size")
    if block is None:
        return QuantScheme("fp8_row", "fp8", acts, ignore=ignore)
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int for b in block)):
        raise ValueError(f"quantization_config.weight_block_size must be [n, k] (integers), got {block!r}")
    if acts != "dynamic":  # (vLLM's Fp8Config refuses it too: a block checkpoint has no activation scales)
        raise ValueError(f"quantization_config.activation_scheme {acts!r} with weight_block_size: block-wise "
                         "fp8 takes dynamic activations only")
    return QuantScheme("fp8_block", "fp8", acts, block=(block[0], block[1]), ignore=ignore,
                       checkpoint_scale="weight_scale_inv")


def _compressed_tensors(q: dict[str, Any]) -> QuantScheme:
    fmt = q.get("format")
    if fmt != "float-quantized":
        raise ValueError(f"quantization_config.format {fmt!r} is not supported (only float-quantized)")
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"quantization_config.config_groups must hold one group, got {len(groups)}")
    (gname, g), = groups.items()
    where = f"quantization_config.config_groups.{gname}"
    w, a = g.get("weights") or {}, g.get("input_activations")
    if w.get("num_bits") != 8 or w.get("type") != "float":
        raise ValueError(f"{where}.weights num_bits {w.get('num_bits')!r} type {w.get('type')!r} is not supported "
                         "(only 8-bit float)")
    if not w.get("symmetric", True):
        raise ValueError(f"{where}.weights.symmetric false is not supported")
    strategy = w.get("strategy")
    if strategy in ("channel", "tensor"):
        fmt_, block = "fp8_row", (128, 128)
    elif strategy == "block":
        fmt_, block = "fp8_block", tuple(w.get("block_structure") or (128, 128))
        if block != (128, 128):
            raise ValueError(f"{where}.weights.block_structure {list(block)} is not supported (only [128, 128])")
    else:
        raise ValueError(f"{where}.weights.strategy {strategy!r} is not supported (channel, tensor, block)")
    acts = "dynamic"
    if a is not None:
        if a.get("num_bits") != 8 or a.get("type") != "float":
            raise ValueError(f"{where}.input_activations (type {a.get('type')!r}, num_bits {a.get('num_bits')!r}) "
                             "is not supported (only 8-bit float)")
        acts = "dynamic" if a.get("dynamic", True) else "static"
    return QuantScheme(fmt_, "compressed-tensors", acts, block=block, ignore=tuple(q.get("ignore") or ()))


def _modelopt(q: dict[str, Any], where: str) -> QuantScheme:
    algo = q.get("quant_algo")
    ignore = tuple(q.get("exclude_modules") or q.get("ignore") or ())
    if algo == "FP8":
        return QuantScheme("fp8_row", "modelopt", "static", ignore=ignore)
    if algo == "NVFP4":
        return QuantScheme("nvfp4", "modelopt", "static", group_size=int(q.get("group_size", 16)), ignore=ignore)
    raise ValueError(f"{where}.quant_algo {algo!r} is not supported (supported: FP8, NVFP4)")
