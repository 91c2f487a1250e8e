"""The decode roofline of an MoE model (engine/bench/roofline.py): a step reads the attention,
dense and shared weights in full but only the routed experts its tokens touch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.bench import roofline
from engine.layers.moe import MoE
from models.registry import load_model

QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 96,
    "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "vocab_size": 256, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "eos_token_id": 2, "num_experts": 8, "num_experts_per_tok": 2,
    "norm_topk_prob": True, "mlp_only_layers": [1], "rope_theta": 10000.0,
}


def test_expected_distinct_experts() -> None:
    assert roofline.experts_read(128, 8, 1) == pytest.approx(8)
    assert roofline.experts_read(128, 8, 2) == pytest.approx(8 + 8 * 120 / 128)  # the second token's new ones
    assert 127.9 < roofline.experts_read(128, 8, 256) < 128
    assert roofline.experts_read(4, 4, 3) == pytest.approx(4)


def test_moe_weight_bytes_count_the_experts_a_step_reads(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_MOE))
    model = load_model(tmp_path, load_format="dummy", progress=False)[0]
    full = roofline.weight_bytes(model, False)
    stacks = [m.experts for m in model.modules() if isinstance(m, MoE)]
    assert len(stacks) == 2  # layer 1 is dense: read in full at every batch
    experts = sum(p.nbytes for s in stacks for p in (s.w13, s.w2))
    assert roofline.weight_bytes(model, False, batch=1) == full - experts + experts * 2 // 8
    e3 = roofline.experts_read(8, 2, 3)
    assert abs(roofline.weight_bytes(model, False, batch=3) - (full - experts + experts * e3 / 8)) <= 2
    assert full - 1 <= roofline.weight_bytes(model, False, batch=10_000) <= full
