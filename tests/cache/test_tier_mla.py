"""Latent pages (MLA, DeepSeek-V3's one-component KV layout) through the host tier and L3: the
engine of test_tier_differential (scheduler core, a ModelRunner, the cache controller, a real
slab) on a tiny random DeepseekV3 with dummy weights. Multi-turn conversations with a small L1
and L2 give the tokens and logprobs of a fresh compute, bit for bit (bf16, deterministic
inference), whether a prefix was computed, hit in L1 or loaded back from L2, and after a
restart from L3 files; the slab and the L3 files hold one latent row per layer and page."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
from test_tier_differential import Engine, _cfg

from engine.cache.slab import create_slab, remove_slab

V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
    "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 3, "first_k_dense_replace": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 6,
    "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1, "vocab_size": 512,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "eos_token_id": 1,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "mscale": 1.0,
                     "mscale_all_dim": 1.0},
}


@pytest.fixture(scope="module")
def slab():
    path = create_slab("strata-test-mla")
    yield path
    remove_slab(path)


def test_latent_pages_through_l2_and_l3(slab: str, tmp_path: Path) -> None:
    model = tmp_path / "tiny-v3"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(V3))
    rng = random.Random(0)
    fresh = Engine(_cfg(model, load_format="dummy", disable_radix_cache=True))
    tier_cfg = _cfg(model, load_format="dummy", enable_hierarchical_cache=True, hicache_ratio=2.0,
                    hicache_path=slab, l3_dir=str(tmp_path / "l3"))
    tiered = Engine(tier_cfg)
    copies = tiered.runner.host_tier
    # one latent row (kv_lora_rank + rope = 48 bf16 values a token) per layer and page
    assert tiered.runner.kv_layout.names == ("latent",)
    assert copies.page_bytes == 3 * 16 * 48 * 2
    convs = [[rng.randrange(3, 512) for _ in range(80)] for _ in range(3)]
    for turn in range(2):
        for c in (range(3) if turn == 0 else reversed(range(3))):
            ref = fresh.run([convs[c]])[0]
            got = tiered.run([convs[c]])[0]
            assert got == ref and tiered.logprobs == fresh.logprobs, f"conversation {c} turn {turn}"
            convs[c] = convs[c] + got + [rng.randrange(3, 512) for _ in range(10)]
    assert copies.slab is not None and copies.slab.shape[:2] == (3, 1)  # [layer][component] rows
    stats = tiered.core.state.tiers.stats()
    assert stats["load_backs"] > 0 and stats["l2_hit_tokens"] > 0 and stats["backups_committed"] > 0
    tiered.l3.store.drain()
    assert tiered.l3.store.stats()["writes"] > 0
    slab2 = create_slab("strata-test-mla")
    try:
        again = Engine(replace(tier_cfg, hicache_path=slab2))
        for c in range(3):
            assert again.run([convs[c]]) == fresh.run([convs[c]]) and again.logprobs == fresh.logprobs
        assert again.core.state.tiers.stats()["l3_hit_tokens"] >= 3 * 80
        again.l3.store.drain()
    finally:
        remove_slab(slab2)
