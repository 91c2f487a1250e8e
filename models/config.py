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

from models.quant import QuantScheme, read_scheme

# Architectures whose attention carries per-head RMSNorm on q and k before RoPE.
_QK_NORM_ARCHS = frozenset({"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"})
# Qwen2 hard-codes a bias on q/k/v (not on o_proj) and has no `attention_bias` key.
_QKV_BIAS_ONLY_ARCHS = frozenset({"Qwen2ForCausalLM"})
# Families with a `use_sliding_window` switch that is off for the released checkpoints.
_SWITCHED_WINDOW_ARCHS = frozenset({"Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"})
_DTYPES = frozenset({"float32", "bfloat16", "float16"})
# Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): q/kv low-rank projections, a latent KV cache
_MLA_ARCHS = frozenset({"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"})
# GLM-4.5's `attention_bias` is on q/k/v only: its o_proj has none.
_UNBIASED_O_PROJ_ARCHS = frozenset({"Glm4MoeForCausalLM"})
# Architectures whose model rotates part of each head (models/moe.py's PartialRotary).
_PARTIAL_ROTARY_ARCHS = frozenset({"Glm4MoeForCausalLM"})
# MoE families whose router scores by sigmoid with the score-correction bias (noaux_tc) when
# the config does not say (GLM-4.5 has no scoring_func / topk_method keys)
_SIGMOID_NOAUX_ARCHS = frozenset({"Glm4MoeForCausalLM", "DeepseekV3ForCausalLM"})
# transformers' Qwen MoE routers compute their logits in the model's dtype (nn.Linear, then a
# float32 softmax); DeepSeek's and GLM's in float32
_MODEL_DTYPE_ROUTER_ARCHS = frozenset({"Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"})
# transformers' config defaults where they differ from the generic ones below: a key a config.json
# leaves out means what it means to transformers (a stripped GLM-4.5 config rotates half of each
# head, a DeepSeek-V3 one routes in 8 groups), never silently something else
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "Glm4MoeForCausalLM": {"rms_norm_eps": 1e-5, "partial_rotary_factor": 0.5, "n_shared_experts": 1,
                           "first_k_dense_replace": 1},
    "DeepseekV3ForCausalLM": {"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "n_shared_experts": 1,
                              "first_k_dense_replace": 3},
    "DeepseekV2ForCausalLM": {"n_shared_experts": 2},
    "MistralForCausalLM": {"sliding_window": 4096},
}
# the routing each MoE family's reference code implements: (scoring_func, topk_methods) the config
# may name; a Qwen MoE config's DeepSeek-style routing keys are not read (transformers ignores them)
_ROUTING: dict[str, tuple[str, tuple[str, ...]]] = {
    "Glm4MoeForCausalLM": ("sigmoid", ("noaux_tc",)),
    "DeepseekV3ForCausalLM": ("sigmoid", ("noaux_tc",)),
    "DeepseekV2ForCausalLM": ("softmax", ("greedy", "group_limited_greedy")),
}


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 ("llama3") frequency scaling; the only scaled RoPE supported so far."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts part of a config (engine/layers/moe.py's MoESpec reads it).

    `layers`: the decoder layers whose MLP is an MoE block (the others are dense, of the
    model's intermediate_size): Qwen3-MoE's `mlp_only_layers` / `decoder_sparse_step`,
    DeepSeek/GLM's `first_k_dense_replace` (and `moe_layer_freq`). Routing as in moe.py.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    layers: tuple[int, ...]
    scoring_func: str = "softmax"  # softmax | sigmoid
    topk_method: str = "greedy"  # greedy | group_limited_greedy | noaux_tc (score-correction bias)
    norm_topk_prob: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0
    router_float32: bool = True  # router logits in float32 (else the model's dtype), as transformers

    def __post_init__(self) -> None:
        e, g, k = self.num_experts, self.n_group, self.top_k
        checks = [
            (e > 0, f"num_experts must be > 0, got {e}"),
            (0 < k <= e, f"num_experts_per_tok ({k}) must be in 1..the number of experts ({e})"),
            (self.intermediate_size > 0, f"moe_intermediate_size must be > 0, got {self.intermediate_size}"),
            (self.scoring_func in ("softmax", "sigmoid"), f"unsupported scoring_func {self.scoring_func!r}"),
            (self.topk_method in ("greedy", "group_limited_greedy", "noaux_tc"),
             f"unsupported topk_method {self.topk_method!r} (supported: greedy, group_limited_greedy, noaux_tc)"),
            (g > 0 and e % g == 0, f"n_group ({g}) must divide the number of experts ({e})"),
            (0 < self.topk_group <= g, f"topk_group ({self.topk_group}) must be in 1..n_group ({g})"),
            (g <= 0 or self.topk_group * (e // g) >= k,
             f"num_experts_per_tok ({k}) exceeds the experts in topk_group ({self.topk_group}) groups"),
            (self.topk_method != "noaux_tc" or g <= 0 or e // g >= 2,
             f"noaux_tc scores a group by its two best experts: n_group ({g}) leaves fewer than 2 per group"),
            (self.routed_scaling_factor > 0, f"routed_scaling_factor must be > 0, got {self.routed_scaling_factor}"),
            (self.num_shared_experts >= 0, f"n_shared_experts must be >= 0, got {self.num_shared_experts}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"invalid MoE config: {msg}")


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling (DeepSeek-V3): frequencies blended between interpolated and extrapolated
    by dimension, cos/sin scaled by `attention_factor`, and with `mscale_all_dim` the softmax scale
    multiplied by mscale(factor, mscale_all_dim)^2 (transformers' modeling_rope_utils / deepseek_v3)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    rope_type: str = "yarn"

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.original_max_position_embeddings <= 0:
            raise ValueError(f"yarn rope scaling: factor and original_max_position_embeddings must be > 0, got {self}")


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention shapes. q_lora_rank None: a plain q_proj (DeepSeek-V2-Lite).
    rope_interleave: the checkpoint's rope dims come in (even, odd) pairs (transformers' default)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"invalid MLA config: {name} must be > 0, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"invalid MLA config: q_lora_rank must be > 0 or null, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"invalid MLA config: qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values a token caches per layer: the compressed KV, then the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


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
    rope_scaling: RopeScaling | YarnScaling | None = None
    mla: MLAConfig | None = None  # multi-head latent attention (DeepSeek); None: GQA
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"
    quant: QuantScheme | None = None  # the checkpoint's weight quantization (models/quant.py)
    partial_rotary_factor: float = 1.0  # RoPE rotates the first head_dim * factor dims (GLM-4.5: 0.5)
    moe: MoEConfig | None = None  # mixture-of-experts models (Qwen3-MoE, GLM-4.5, DeepSeek)
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
            (0 < self.partial_rotary_factor <= 1 and self.rotary_dim % 2 == 0 and self.rotary_dim > 0,
             f"partial_rotary_factor ({self.partial_rotary_factor}) must give an even rotary dim in 2..head_dim "
             f"({self.head_dim}), got {self.rotary_dim}"),
            (self.moe is None or all(0 <= i < self.num_layers for i in self.moe.layers),
             f"MoE layers {self.moe and self.moe.layers} outside num_hidden_layers ({self.num_layers})"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"invalid model config ({self.architecture}): {msg}")

    @property
    def rotary_dim(self) -> int:
        """The head dims RoPE rotates (the first ones; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.moe is not None and layer_id in self.moe.layers

    def check_ep_size(self, ep_size: int) -> None:
        """--ep-size > 1 needs routed experts it divides (a ValueError naming the flag)."""
        if ep_size > 1 and self.moe is None:
            raise ValueError(f"--ep-size {ep_size}: the model has no experts (a dense model); leave it at 1")
        if ep_size > 1 and self.moe is not None and self.moe.num_experts % ep_size:
            raise ValueError(f"--ep-size {ep_size} does not divide the model's {self.moe.num_experts} routed "
                             "experts (config.json num_experts / n_routed_experts)")

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
        return cls.from_dict(json.loads(cfg_file.read_text()), generation=gen, model_dir=path)

    @classmethod
    def from_dict(cls, d: dict[str, Any], generation: dict[str, Any] | None = None,
                  model_dir: Path | None = None) -> ModelConfig:
        """Build from a config.json dict; raises ValueError on missing keys or unsupported features."""
        arch = _architecture(d)
        d = {**_ARCH_DEFAULTS.get(arch, {}), **d}
        _reject_unsupported(d, arch)
        hidden, heads = _req(d, "hidden_size"), _req(d, "num_attention_heads")
        mla = _mla(d) if arch in _MLA_ARCHS else None
        # MLA: RoPE covers the qk_rope_head_dim part of each head (transformers sets head_dim so too)
        for key in ("num_key_value_heads", "head_dim"):  # optional sizes: checked where given
            if d.get(key) is not None:
                _positive(d, key)
        head_dim = mla.qk_rope_head_dim if mla else d.get("head_dim") or _derived_head_dim(hidden, heads)
        rope_theta, scaling = _rope(d)
        bias = bool(d.get("attention_bias", False))
        qkv_bias_only = arch in _QKV_BIAS_ONLY_ARCHS
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
            mla=mla,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qk_norm=arch in _QK_NORM_ARCHS or bool(d.get("use_qk_norm", False)),
            attention_bias=True if qkv_bias_only else bias,
            o_proj_bias=False if qkv_bias_only or arch in _UNBIASED_O_PROJ_ARCHS else bias,
            eos_token_ids=_eos_ids(d, generation),
            dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            quant=read_scheme(d, model_dir),  # model_dir: ModelOpt's hf_quant_config.json
            partial_rotary_factor=_partial_rotary_factor(d),
            moe=_moe(d, arch),
            extra={k: d[k] for k in ("bos_token_id", "pad_token_id", "model_type") if k in d},
        )


def _req(d: dict[str, Any], key: str) -> int:
    """A required size: a positive integer (a bool or a string is named, not divided by)."""
    if d.get(key) is None:
        raise ValueError(f"config.json lacks required key {key!r}")
    return _positive(d, key)


def _positive(d: dict[str, Any], key: str) -> int:
    val = d[key]
    if isinstance(val, bool) or not isinstance(val, int) or val < 1:
        raise ValueError(f"config.json: {key} must be a positive integer, got {val!r}")
    return val


# architecture -> (module, class) of its plug-in (models/registry.py imports it lazily); the
# Llama family shares one implementation
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("models.llama", "LlamaForCausalLM"),
    "Qwen3MoeForCausalLM": ("models.moe", "MoeForCausalLM"),
    "Glm4MoeForCausalLM": ("models.moe", "MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("models.deepseek_v3", "DeepseekV3ForCausalLM"),  # V2's attention and routing: config
    "DeepseekV3ForCausalLM": ("models.deepseek_v3", "DeepseekV3ForCausalLM"),  # also Kimi-K2's config
}


def check_architecture(name: str) -> str:
    """`name` if a plug-in serves it, else a ValueError that lists the ones that do."""
    if name not in ARCHITECTURES:
        raise ValueError(f"unsupported model architecture {name!r}; supported: {', '.join(sorted(ARCHITECTURES))}")
    return name


def _architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures") or []
    if len(archs) != 1:
        raise ValueError(f"config.json must name exactly one architecture, got {archs!r}")
    return check_architecture(str(archs[0]))  # here, so the supervisor refuses it before any process starts


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
    if _partial_rotary_factor(d) != 1.0 and arch not in _PARTIAL_ROTARY_ARCHS:
        raise ValueError(f"partial_rotary_factor {_partial_rotary_factor(d)} is not supported for {arch}")


def _mla(d: dict[str, Any]) -> MLAConfig:
    return MLAConfig(
        q_lora_rank=d.get("q_lora_rank"),
        kv_lora_rank=int(_req(d, "kv_lora_rank")),
        qk_nope_head_dim=int(_req(d, "qk_nope_head_dim")),
        qk_rope_head_dim=int(_req(d, "qk_rope_head_dim")),
        v_head_dim=int(_req(d, "v_head_dim")),
        rope_interleave=bool(d.get("rope_interleave", True)),
    )


def _yarn(s: dict[str, Any], max_positions: int) -> YarnScaling:
    if s.get("original_max_position_embeddings") is None:
        raise ValueError("yarn rope scaling lacks 'original_max_position_embeddings'")
    orig = int(s["original_max_position_embeddings"])
    factor = s.get("factor")
    def opt(key: str) -> float | None:
        return None if s.get(key) is None else float(s[key])
    return YarnScaling(
        factor=float(factor) if factor is not None else max_positions / orig,
        original_max_position_embeddings=orig,
        beta_fast=float(s.get("beta_fast") or 32),
        beta_slow=float(s.get("beta_slow") or 1),
        mscale=opt("mscale"),
        mscale_all_dim=opt("mscale_all_dim"),
        attention_factor=opt("attention_factor"),
        truncate=bool(s.get("truncate", True)),
    )


def _rope(d: dict[str, Any]) -> tuple[float, RopeScaling | YarnScaling | None]:
    """(theta, scaling) from either `rope_parameters` (transformers 5) or the legacy keys."""
    params = d.get("rope_parameters")
    if isinstance(params, dict):  # its theta, else the top-level one (transformers merges them so)
        theta, scaling = params.get("rope_theta", d.get("rope_theta", 10000.0)), params
    else:
        theta, scaling = d.get("rope_theta", 10000.0), d.get("rope_scaling")
    if not scaling:
        return float(theta), None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return float(theta), None
    if kind == "yarn":
        return float(theta), _yarn(scaling, int(d.get("max_position_embeddings") or 0))
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling type {kind!r} in rope_scaling/rope_parameters "
                         f"(supported for {_architecture(d)}: none, llama3, yarn)")
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


def _partial_rotary_factor(d: dict[str, Any]) -> float:
    """GLM-4.5 keeps it at the top level (transformers 4) or in rope_parameters (5)."""
    params = d.get("rope_parameters")
    inner = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    return float(inner if inner is not None else d.get("partial_rotary_factor", 1.0))


def _moe(d: dict[str, Any], arch: str) -> MoEConfig | None:
    """The MoE part of a config.json, or None for a dense model (no expert count)."""
    experts = next((d[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if d.get(k)), 0)
    if not experts:
        return None
    layers = _req(d, "num_hidden_layers")
    if "decoder_sparse_step" in d or "mlp_only_layers" in d:  # Qwen3-MoE
        step, dense = int(d.get("decoder_sparse_step") or 1), set(d.get("mlp_only_layers") or [])
        if step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
        moe_layers = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    else:  # DeepSeek / GLM: dense first layers, then (every moe_layer_freq-th) MoE
        first, freq = int(d.get("first_k_dense_replace") or 0), int(d.get("moe_layer_freq") or 1)
        if freq < 1:
            raise ValueError(f"moe_layer_freq must be >= 1, got {freq}")
        moe_layers = tuple(i for i in range(layers) if i >= first and i % freq == 0)
    noaux = arch in _SIGMOID_NOAUX_ARCHS
    scoring, methods = _ROUTING.get(arch, ("softmax", ("greedy",)))
    deepseek_style = arch in _ROUTING
    scoring_func = str(d.get("scoring_func") or scoring) if deepseek_style else scoring
    topk_method = str(d.get("topk_method") or methods[0]) if deepseek_style else methods[0]
    if scoring_func != scoring or topk_method not in methods:
        raise ValueError(f"unsupported MoE routing for {arch}: scoring_func {scoring_func!r} with topk_method "
                         f"{topk_method!r} (its reference code scores by {scoring!r} with {' or '.join(methods)})")
    norm = bool(d.get("norm_topk_prob", noaux))  # transformers' defaults: on for GLM/DeepSeek-V3
    if arch == "DeepseekV2ForCausalLM" and norm:  # V2's own code normalizes instead of scaling; transformers never
        raise ValueError("unsupported norm_topk_prob=true for DeepseekV2ForCausalLM (its implementations disagree "
                         "on it: transformers ignores it, DeepSeek's code skips routed_scaling_factor)")
    return MoEConfig(
        num_experts=int(experts),
        top_k=int(_req(d, "num_experts_per_tok")),
        intermediate_size=int(_req(d, "moe_intermediate_size")),
        layers=moe_layers,
        scoring_func=scoring_func,
        topk_method=topk_method,
        norm_topk_prob=norm,
        n_group=int(d.get("n_group") or 1) if deepseek_style else 1,
        topk_group=int(d.get("topk_group") or 1) if deepseek_style else 1,
        routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0) if deepseek_style else 1.0,
        num_shared_experts=int(d.get("n_shared_experts") or 0),
        router_float32=arch not in _MODEL_DTYPE_ROUTER_ARCHS,
    )
