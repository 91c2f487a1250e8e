"""ModelConfig: the decoder shapes Strata needs, parsed once from an HF config.json.

Accepts both the transformers 4.x layout (`rope_theta` + `rope_scaling`) and the 5.x
layout (`rope_parameters`), and validates on construction so a bad checkpoint fails
with one clear ValueError instead of a shape error deep inside a forward.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Architectures whose attention carries per-head RMSNorm on q and k before RoPE.
_QK_NORM_ARCHS = frozenset({"Qwen3ForCausalLM"})
# Qwen2 hard-codes a bias on q/k/v (not on o_proj) and has no `attention_bias` key.
_QKV_BIAS_ONLY_ARCHS = frozenset({"Qwen2ForCausalLM"})
# Families with a `use_sliding_window` switch that is off for the released checkpoints.
_SWITCHED_WINDOW_ARCHS = frozenset({"Qwen2ForCausalLM", "Qwen3ForCausalLM"})
_DTYPES = frozenset({"float32", "bfloat16", "float16"})


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 ("llama3") frequency scaling; the only scaled RoPE supported so far."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and hyper-parameters of a Llama-family decoder.

    `attention_bias` is the bias on the fused q/k/v projection, `o_proj_bias` the one on
    the output projection (Llama's `attention_bias` sets both, Qwen2 only the first).
    `eos_token_ids` merges generation_config.json (first) and config.json, de-duplicated.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"
    quant_method: str | None = None  # read from the checkpoint; loaders refuse what they can't run
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        checks = [
            (self.vocab_size > 0, f"vocab_size must be > 0, got {self.vocab_size}"),
            (self.hidden_size > 0, f"hidden_size must be > 0, got {self.hidden_size}"),
            (self.intermediate_size > 0, f"intermediate_size must be > 0, got {self.intermediate_size}"),
            (self.num_layers > 0, f"num_hidden_layers must be > 0, got {self.num_layers}"),
            (self.num_heads > 0 and self.num_kv_heads > 0, "attention/kv head counts must be > 0"),
            (
                self.num_heads % self.num_kv_heads == 0,
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})",
            ),
            (self.head_dim > 0 and self.head_dim % 2 == 0, f"head_dim must be even and > 0, got {self.head_dim}"),
            (self.rms_norm_eps > 0, f"rms_norm_eps must be > 0, got {self.rms_norm_eps}"),
            (self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta}"),
            (self.max_position_embeddings > 0, "max_position_embeddings must be > 0"),
            (self.dtype in _DTYPES, f"unsupported torch dtype {self.dtype!r} (want one of {sorted(_DTYPES)})"),
            (all(t >= 0 for t in self.eos_token_ids), f"negative eos token id in {self.eos_token_ids}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"invalid model config ({self.architecture}): {msg}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Parse `path/config.json` (and `path/generation_config.json` for eos ids if present)."""
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"no config.json in model directory {path}")
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else None
        return cls.from_dict(json.loads(cfg_file.read_text()), generation=gen)

    @classmethod
    def from_dict(cls, d: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        """Build from a config.json dict; raises ValueError on missing keys or unsupported features."""
        arch = _architecture(d)
        _reject_unsupported(d, arch)
        hidden, heads = _req(d, "hidden_size"), _req(d, "num_attention_heads")
        head_dim = d.get("head_dim") or _derived_head_dim(hidden, heads)
        rope_theta, scaling = _rope(d)
        bias = bool(d.get("attention_bias", False))
        qkv_bias_only = arch in _QKV_BIAS_ONLY_ARCHS
        quant = d.get("quantization_config")
        return cls(
            architecture=arch,
            vocab_size=_req(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_req(d, "intermediate_size"),
            num_layers=_req(d, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=_req(d, "max_position_embeddings"),
            rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qk_norm=arch in _QK_NORM_ARCHS,
            attention_bias=True if qkv_bias_only else bias,
            o_proj_bias=False if qkv_bias_only else bias,
            eos_token_ids=_eos_ids(d, generation),
            dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            quant_method=quant.get("quant_method") if isinstance(quant, dict) else None,
            extra={k: d[k] for k in ("bos_token_id", "pad_token_id", "model_type") if k in d},
        )


def _req(d: dict[str, Any], key: str) -> Any:
    if d.get(key) is None:
        raise ValueError(f"config.json lacks required key {key!r}")
    return d[key]


def _architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures") or []
    if len(archs) != 1:
        raise ValueError(f"config.json must name exactly one architecture, got {archs!r}")
    return str(archs[0])


def _derived_head_dim(hidden: int, heads: int) -> int:
    if hidden % heads:
        raise ValueError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}; set head_dim")
    return hidden // heads


def _reject_unsupported(d: dict[str, Any], arch: str) -> None:
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}: only SwiGLU (silu) MLPs are implemented")
    if d.get("mlp_bias"):
        raise ValueError("unsupported mlp_bias=true")
    window = d.get("sliding_window")
    window_on = d.get("use_sliding_window", arch not in _SWITCHED_WINDOW_ARCHS)
    if window and window_on and window < d.get("max_position_embeddings", 0):
        raise ValueError(f"sliding-window attention (window {window}) is not supported")


def _rope(d: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from either `rope_parameters` (transformers 5) or the legacy keys."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta, scaling = params["rope_theta"], params
    else:
        theta, scaling = d.get("rope_theta", 10000.0), d.get("rope_scaling")
    if not scaling:
        return float(theta), None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: none, llama3)")
    try:
        return float(theta), RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ValueError(f"llama3 rope scaling lacks {e.args[0]!r}") from None


def _as_ids(v: Any) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, list | tuple) else [int(v)]


def _eos_ids(d: dict[str, Any], generation: dict[str, Any] | None) -> tuple[int, ...]:
    ids = _as_ids((generation or {}).get("eos_token_id")) + _as_ids(d.get("eos_token_id"))
    return tuple(dict.fromkeys(ids))
