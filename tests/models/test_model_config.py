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
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn'"),
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
