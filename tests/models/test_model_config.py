"""ModelConfig parsing and validation, and RoPE frequencies vs transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_harness import CONFIGS

from models.config import ModelConfig, RopeScaling
from models.llama import rope_inv_freq


def _base(**over: object) -> dict:
    d = json.loads((CONFIGS / "tiny-llama" / "config.json").read_text())
    d.update(over)
    return d


def test_qwen3_0_6b_shapes() -> None:
    c = ModelConfig.from_dir(CONFIGS / "qwen3-0.6b")
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size) == ("Qwen3ForCausalLM", 28, 1024, 3072)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (16, 8, 128, 151936)
    assert c.head_dim != c.hidden_size // c.num_heads  # Qwen3 sets head_dim explicitly
    assert c.qk_norm and c.tie_word_embeddings and not c.attention_bias and not c.o_proj_bias
    assert c.rope_theta == 1e6 and c.rope_scaling is None
    assert c.eos_token_ids == (151645,) and c.dtype == "bfloat16"
    assert (c.q_size, c.kv_size) == (2048, 1024)


def test_llama_3_1_8b_shapes() -> None:
    c = ModelConfig.from_dir(CONFIGS / "llama-3.1-8b")
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.vocab_size) == (32, 4096, 14336, 128256)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (32, 8, 128)
    assert not c.qk_norm and not c.tie_word_embeddings
    assert c.rope_theta == 500000.0 and c.max_position_embeddings == 131072
    assert c.rope_scaling == RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=8192)


def test_transformers5_rope_parameters_layout() -> None:
    d = _base(rope_parameters={"rope_theta": 100000.0, "rope_type": "default"})
    del d["rope_scaling"], d["rope_theta"]
    c = ModelConfig.from_dict(d)
    assert c.rope_theta == 100000.0 and c.rope_scaling is None


@pytest.mark.parametrize("top_theta", [True, False])
def test_rope_parameters_without_their_own_theta(top_theta: bool) -> None:
    """A rope_parameters block without rope_theta still scales (the theta from the top level, as
    transformers merges them), and an unsupported type in it is refused."""
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    d = _base(rope_parameters=llama3, rope_theta=500000.0 if top_theta else None)
    del d["rope_scaling"]
    if not top_theta:
        del d["rope_theta"]
    c = ModelConfig.from_dict(d)
    assert c.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192) and c.rope_theta == (500000.0 if top_theta else 10000.0)
    with pytest.raises(ValueError, match="rope scaling type 'linear'"):
        ModelConfig.from_dict({**d, "rope_parameters": {"rope_type": "linear", "factor": 2.0}})


_STRIPPED = ("rms_norm_eps", "partial_rotary_factor", "n_group", "topk_group", "routed_scaling_factor",
             "n_shared_experts", "first_k_dense_replace", "sliding_window", "rope_parameters", "rope_scaling")


@pytest.mark.parametrize("arch", ["Glm4MoeForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM",
                                  "Qwen3MoeForCausalLM", "MistralForCausalLM"])
def test_keys_a_config_leaves_out_mean_what_transformers_reads(arch: str) -> None:
    """A config.json without the keys that have per-family defaults: each is read as transformers'
    config class reads it (GLM-4.5 rotates half a head, DeepSeek-V3 routes in 8 groups of 4 ...)."""
    import transformers

    moe = {"n_routed_experts": 16, "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
           "kv_lora_rank": 32, "q_lora_rank": 48, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}
    full = _base(architectures=[arch], max_position_embeddings=8192, **moe)
    d = {k: v for k, v in full.items() if k not in _STRIPPED}
    kind = {"Glm4MoeForCausalLM": "Glm4MoeConfig", "DeepseekV3ForCausalLM": "DeepseekV3Config",
            "DeepseekV2ForCausalLM": "DeepseekV2Config", "Qwen3MoeForCausalLM": "Qwen3MoeConfig",
            "MistralForCausalLM": "MistralConfig"}[arch]
    hf = getattr(transformers, kind)(**{k: v for k, v in d.items() if k != "architectures"})
    if arch == "MistralForCausalLM":  # its default window (4096) is one Strata refuses, by name
        with pytest.raises(ValueError, match="sliding-window attention \\(window 4096\\)"):
            ModelConfig.from_dict(d)
        return
    c = ModelConfig.from_dict(d)
    assert c.rms_norm_eps == hf.rms_norm_eps
    rotary = hf.rope_parameters.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None)) or 1.0
    assert c.partial_rotary_factor == rotary
    assert c.moe is not None
    if arch != "Qwen3MoeForCausalLM":  # Qwen's router reads none of these
        assert (c.moe.n_group, c.moe.topk_group) == (hf.n_group or 1, hf.topk_group or 1)
        assert c.moe.routed_scaling_factor == hf.routed_scaling_factor
        assert c.moe.num_shared_experts == hf.n_shared_experts
        assert c.moe.layers == tuple(range(hf.first_k_dense_replace, c.num_layers))


@pytest.mark.parametrize(("arch", "over", "msg"), [
    ("Glm4MoeForCausalLM", {"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ("DeepseekV3ForCausalLM", {"topk_method": "greedy"}, "topk_method 'greedy'"),
    ("DeepseekV2ForCausalLM", {"norm_topk_prob": True}, "norm_topk_prob=true"),
])
def test_moe_routing_its_reference_code_lacks_is_refused(arch: str, over: dict, msg: str) -> None:
    moe = {"n_routed_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 32, "kv_lora_rank": 32,
           "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}
    with pytest.raises(ValueError, match=msg):
        ModelConfig.from_dict(_base(architectures=[arch], **moe, **over))


def test_qwen3_moe_ignores_deepseek_routing_keys() -> None:
    """transformers' Qwen3-MoE router reads no routed_scaling_factor or groups: neither does ours."""
    c = ModelConfig.from_dict(_base(architectures=["Qwen3MoeForCausalLM"], num_experts=16, num_experts_per_tok=4,
                                    moe_intermediate_size=32, routed_scaling_factor=2.5, n_group=4, topk_group=2))
    assert c.moe is not None and (c.moe.routed_scaling_factor, c.moe.n_group, c.moe.topk_group) == (1.0, 1, 1)


def test_qwen2_bias_only_on_qkv() -> None:
    c = ModelConfig.from_dict(_base(architectures=["Qwen2ForCausalLM"]))
    assert c.attention_bias and not c.o_proj_bias and not c.qk_norm
    c = ModelConfig.from_dict(_base(attention_bias=True))  # Llama: both
    assert c.attention_bias and c.o_proj_bias


def test_eos_ids_merge_generation_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_base(eos_token_id=[7, 2])))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7]}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (9, 7, 2)


def test_head_dim_derived() -> None:
    c = ModelConfig.from_dict(_base())
    assert c.head_dim == 64 // 4


@pytest.mark.parametrize(
    ("over", "msg"),
    [
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn rope scaling lacks 'original_max"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope scaling type 'dynamic'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks 'low_freq_factor'"),
        ({"vocab_size": None}, "vocab_size"),
        ({"architectures": []}, "exactly one architecture"),
        ({"num_attention_heads": 3, "hidden_size": 64}, "not divisible"),
        ({"torch_dtype": "int8"}, "unsupported torch dtype"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 512}, "sliding-window"),
    ],
)
def test_invalid_configs_raise(over: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        ModelConfig.from_dict(_base(**over))


def test_missing_config_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-0.6b"])
def test_rope_inv_freq_matches_transformers(name: str) -> None:
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    ours_cfg = ModelConfig.from_dir(CONFIGS / name)
    hf_cfg = AutoConfig.from_pretrained(CONFIGS / name)
    kind = "llama3" if ours_cfg.rope_scaling else None
    if kind:
        want, _ = ROPE_INIT_FUNCTIONS[kind](hf_cfg, "cpu")
    else:
        want = 1.0 / (ours_cfg.rope_theta ** (torch.arange(0, ours_cfg.head_dim, 2).float() / ours_cfg.head_dim))
    got = rope_inv_freq(ours_cfg.head_dim, ours_cfg.rope_theta, ours_cfg.rope_scaling)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
