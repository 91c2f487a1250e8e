"""DeepSeek-V3 (MLA) against transformers on the same random weights (float32, CPU).

Tiny configs with YaRN on (mscale != mscale_all_dim, so both the cos/sin factor and the softmax
scale correction matter), q_lora and plain q_proj, interleaved and rotate-half rope; one with MoE
layers (an odd expert count, grouped noaux_tc routing with a non-zero score-correction bias,
shared experts, a first dense layer). Plus: absorbed decode equals the expanded form, a cached
prefix and chunked prefill equal fresh, the latent pool's bytes at V3 shapes, deterministic
inference, and bad configs failing at start naming the field.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from model_harness import CONFIGS, PagedGreedy, Seq, hf_greedy, load_hf
from transformers import AutoConfig, AutoModelForCausalLM

from engine.layers import batch_invariant
from engine.layers.kv_layout import KVLayout
from engine.layers.kv_pool import KVPool
from engine.run.memory import kv_bytes_per_token
from models.config import ModelConfig
from models.registry import kv_layout, load_model

ATOL = 1e-3
MAX_NEW = 32

TINY_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 2,  # all dense
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 24,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 9,
    "num_experts_per_tok": 3,
    "n_group": 3,
    "topk_group": 2,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8},
    "eos_token_id": 1,
    "bos_token_id": 0,
}
VARIANTS = {
    "q_lora": {},
    "q_proj": {"q_lora_rank": None, "rope_interleave": False},  # DeepSeek-V2-Lite's plain q_proj
    "moe": {"num_hidden_layers": 3, "first_k_dense_replace": 1},
    # DeepSeek-V2(-Lite): softmax routing limited to the best groups (no correction bias), plain
    # q_proj; its rope rotates (even, odd) pairs in place, V3's interleave takes them apart: the same
    # dot products
    "v2": {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "num_hidden_layers": 3,
           "first_k_dense_replace": 1, "q_lora_rank": None, "topk_method": "group_limited_greedy",
           "scoring_func": "softmax", "norm_topk_prob": False, "routed_scaling_factor": 1.0},
    # Kimi-K2's shape of V3: one expert group, beta_fast = beta_slow (a zero-width YaRN ramp)
    "kimi": {"num_hidden_layers": 2, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
             "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                              "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}},
}


def make_v3_dir(path: Path, config: dict, seed: int = 0) -> Path:
    """A random DeepseekV3 checkpoint saved by transformers; norms around 1, the router's
    score-correction bias non-zero (it is a buffer, not a parameter)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def v3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    path = make_v3_dir(tmp_path_factory.mktemp(f"v3-{request.param}"), {**TINY_V3, **VARIANTS[request.param]})
    model, cfg = load_model(path, progress=False)
    yield model, cfg, load_hf(path)


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_V3["vocab_size"]) for _ in range(n)] for n in lengths]


def _check(hf: torch.nn.Module, seqs: list[Seq], prompts: list[list[int]], n: int) -> None:
    for s, prompt in zip(seqs, prompts, strict=True):
        want_toks, want_logits = hf_greedy(hf, prompt, n)
        assert s.out == want_toks, f"prompt of {len(prompt)} tokens diverged"
        torch.testing.assert_close(torch.stack(s.logits), want_logits, atol=ATOL, rtol=0)


def test_config_reads_mla_and_yarn(v3: tuple) -> None:
    _, cfg, hf = v3
    assert cfg.mla is not None and cfg.mla.kv_lora_rank == 32 and cfg.mla.qk_head_dim == 24
    rope = hf.config.rope_parameters
    assert cfg.rope_scaling.factor == rope["factor"] and cfg.rope_scaling.mscale_all_dim == rope["mscale_all_dim"]
    assert cfg.rope_scaling.beta_fast == rope["beta_fast"]
    assert kv_layout(cfg) == KVLayout.latent(32, 8)
    first, n = hf.config.first_k_dense_replace, hf.config.num_hidden_layers
    assert cfg.moe is not None and cfg.moe.layers == tuple(range(first, n))


def test_greedy_matches_hf(v3: tuple) -> None:
    """Batched prefill of mixed lengths then batched decode (the absorbed form), 32 tokens."""
    model, cfg, hf = v3
    prompts = _prompts([1, 5, 17, 30])
    runner = PagedGreedy(model, cfg)
    seqs = [runner.new_seq(p, MAX_NEW) for p in prompts]
    runner.run(seqs, MAX_NEW)
    _check(hf, seqs, prompts, MAX_NEW)


def test_chunked_prefill_and_cached_prefix_match_hf(v3: tuple) -> None:
    """Chunks of 7 beside decodes; then B reuses A's first 3 pages and prefills only its suffix."""
    model, cfg, hf = v3
    prompts = _prompts([3, 20], seed=1)
    runner = PagedGreedy(model, cfg)
    seqs = [runner.new_seq(p, MAX_NEW) for p in prompts]
    runner.run(seqs, MAX_NEW, chunk=7)
    _check(hf, seqs, prompts, MAX_NEW)
    prefix, suf_a, suf_b = _prompts([12, 5, 9], seed=2)
    a = runner.new_seq(prefix + suf_a, 4)
    runner.run([a], 4)
    b = runner.new_seq(prefix + suf_b, 16, share=a, shared_tokens=12)
    runner.run([b], 16)
    _check(hf, [b], [prefix + suf_b], 16)


def test_long_cached_prefix_attended_in_chunks_matches_hf(v3: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill chunk after a cached prefix longer than PREFIX_CHUNK (here 4 tokens) expands the
    prefix a chunk at a time and merges the parts by log-sum-exp: transformers' tokens and logits."""
    from engine.layers import mla_attention

    monkeypatch.setattr(mla_attention, "PREFIX_CHUNK", 4)
    model, cfg, hf = v3
    prompts = _prompts([3, 21], seed=4)
    runner = PagedGreedy(model, cfg)
    seqs = [runner.new_seq(p, MAX_NEW) for p in prompts]
    runner.run(seqs, MAX_NEW, chunk=6)  # chunks after 6, 12 and 18 cached tokens: 2 to 5 parts
    _check(hf, seqs, prompts, MAX_NEW)


def test_absorbed_equals_expanded(v3: tuple) -> None:
    """Every row in the absorbed form (prefill too) against the expanded prefill + absorbed
    decode: the same greedy tokens and logits (fp32)."""
    model, cfg, _ = v3
    prompts = _prompts([6, 19], seed=3)
    outs = []
    for absorb in (False, True):
        model.absorb_all = absorb
        try:
            runner = PagedGreedy(model, cfg)
            seqs = [runner.new_seq(p, 8) for p in prompts]
            runner.run(seqs, 8)
        finally:
            model.absorb_all = False
        outs.append(seqs)
    for s, t in zip(*outs, strict=True):
        assert s.out == t.out
        torch.testing.assert_close(torch.stack(s.logits), torch.stack(t.logits), atol=1e-4, rtol=0)


def test_deterministic_inference_is_batch_invariant(v3: tuple) -> None:
    """With the mode on, a request's logits are the same bits alone, batched with others, and
    prefilled in chunks (every row the absorbed form in fixed blocks), and close to transformers."""
    model, cfg, hf = v3
    target, *others = _prompts([11, 4, 23], seed=4)
    before = batch_invariant.enabled()
    batch_invariant.enable(True, "cpu")
    try:
        runs = []
        for batch, chunk in (([], None), (others, None), (others, 5)):
            runner = PagedGreedy(model, cfg)
            seqs = [runner.new_seq(p, 6) for p in [target, *batch]]
            runner.run(seqs, 6, chunk=chunk)
            runs.append(seqs[0])
    finally:
        batch_invariant.enable(before, "cpu")
    for r in runs[1:]:
        assert r.out == runs[0].out
        assert torch.equal(torch.stack(r.logits), torch.stack(runs[0].logits))
    _check(hf, runs[:1], [target], 6)


KIMI_K2 = {  # Kimi-K2-Instruct's config.json (its values that Strata reads)
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": 163840, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
    "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 384, "routed_scaling_factor": 2.827,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8, "moe_layer_freq": 1,
    "first_k_dense_replace": 1, "norm_topk_prob": True, "scoring_func": "sigmoid", "max_position_embeddings": 131072,
    "rope_theta": 50000.0, "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "bos_token_id": 163584, "eos_token_id": 163585, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
}


def test_kimi_k2_config_loads_as_v3() -> None:
    cfg = ModelConfig.from_dict(KIMI_K2)
    assert cfg.mla is not None and cfg.mla.q_lora_rank == 1536 and cfg.num_heads == 64
    assert cfg.moe is not None and cfg.moe.num_experts == 384 and cfg.moe.layers == tuple(range(1, 61))
    assert cfg.rope_scaling.factor == 32.0 and cfg.rope_theta == 50000.0
    assert kv_layout(cfg).token_bytes(torch.bfloat16) == 1152


def test_latent_pool_bytes_at_v3_shapes() -> None:
    """DeepSeek-V3's layout (cut to 5 layers): 576 values, 1152 bytes a token and layer in bf16,
    what the pool allocates; Llama-3.1-8B's GQA pool keeps its bytes."""
    d = json.loads((CONFIGS / "deepseek-v3" / "config.json").read_text())
    cfg = ModelConfig.from_dict({**d, "num_hidden_layers": 5})
    layout = kv_layout(cfg)
    assert layout == KVLayout.latent(512, 64) and layout.token_bytes(torch.bfloat16) == 1152
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 5 * 1152
    pool = KVPool.from_layout(layout, cfg.num_layers, 3, 16, torch.bfloat16, "cpu")
    assert tuple(pool.all) == ("latent",)
    assert sum(t.numel() * t.element_size() for t in pool.all.values()) == 3 * 16 * 5 * 1152 == pool.nbytes()
    assert pool.latent[0].shape == (3 * 16, 1, 576)
    llama = ModelConfig.from_dir(CONFIGS / "llama-3.1-8b")
    assert kv_bytes_per_token(llama, torch.bfloat16) == 2 * 32 * 8 * 128 * 2
    gqa = KVPool(2, 3, 16, 8, 128, torch.bfloat16, "cpu")
    assert gqa.k_all.shape == gqa.v_all.shape == (2, 48, 8, 128) and gqa.nbytes() == 2 * 2 * 48 * 8 * 128 * 2


@pytest.mark.parametrize(("change", "field"), [
    ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "'longrope'"),
    ({"kv_lora_rank": 0}, "kv_lora_rank"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "original_max_position_embeddings"),
])
def test_bad_mla_configs_fail_naming_the_field(change: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_dict({**TINY_V3, **change})


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_yarn_on_dense_models_matches_transformers(name: str, tmp_path: Path) -> None:
    """An audit: YaRN (Qwen's model cards add it for long context; vLLM and SGLang serve it) was
    refused for dense models. Frequencies blended and cos/sin scaled as transformers does, over
    prompts past the original context (64) where the interpolation shows."""
    from model_harness import make_hf_dir, tiny_config

    d = tiny_config(name)
    d["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    path = make_hf_dir(tmp_path / name, d)
    model, cfg = load_model(path, progress=False)
    assert cfg.rope_scaling is not None and model.rotary.factor > 1
    hf = load_hf(path)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, cfg.vocab_size) for _ in range(n)] for n in (5, 90)]
    runner = PagedGreedy(model, cfg)
    seqs = [runner.new_seq(p, 12) for p in prompts]
    runner.run(seqs, 12)
    for s, prompt in zip(seqs, prompts, strict=True):
        want_toks, want_logits = hf_greedy(hf, prompt, 12)
        assert s.out == want_toks
        torch.testing.assert_close(torch.stack(s.logits), want_logits, atol=1e-3, rtol=0)


def test_weight_bytes_count_mla_parameters(v3: tuple) -> None:
    """engine/run/memory.py's weight_bytes (the GPU's does-it-fit check) counts exactly the
    parameters the model has (MLA's projections and norms, dense MLPs and MoE blocks)."""
    from engine.run.memory import weight_bytes

    model, cfg, _ = v3
    assert weight_bytes(cfg, torch.float32) == 4 * sum(p.numel() for p in model.parameters())


@pytest.mark.usefixtures("vendor_kernels")
def test_tp2_equals_tp1(tmp_path: Path) -> None:
    """MLA with its heads split over 2 ranks (q_b_proj, kv_b_proj column-parallel by head, o_proj
    row-parallel, the latent replicated; 3 heads: 2 + 1) and the MoE layer's experts sliced, over
    gloo: tp=1's greedy tokens, every rank's replica digest checked every step (tp_harness),
    prefill chunks, cached prefixes and overlap included."""
    from tp_harness import run_tp

    from engine.config import ServerConfig
    from msgs.params import SamplingParams

    path = make_v3_dir(tmp_path / "m", {**TINY_V3, **VARIANTS["moe"], "num_attention_heads": 3,
                                        "num_key_value_heads": 3})
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    shared = _prompts([24], seed=5)[0]
    waves = [([shared + p for p in _prompts([9, 14], seed=6)], greedy),
             ([shared + p for p in _prompts([5, 3], seed=7)], greedy)]

    def run(tp_size: int) -> list:
        cfg = ServerConfig(model=str(path), device="cpu", dtype="float32", tp_size=tp_size, cpu_threads=1,
                           page_size=4, max_prefill_tokens=16, max_total_tokens=1024, max_running_requests=4)
        return [[o.output_ids for o in w] for w in run_tp(cfg, waves)]

    one, two = run(1), run(2)
    assert two == one and all(len(ids) == 8 for w in two for ids in w)


def test_served_v3_matches_hf(tmp_path: Path) -> None:
    """bin/serve on a DeepSeek-V3 checkpoint with MoE layers: its greedy tokens over HTTP are
    transformers', in one batch and again from the prefix cache (latent pages reused)."""
    import concurrent.futures

    import httpx

    from tests.integration.conftest import start_server, stop_server

    path = make_v3_dir(tmp_path / "m", {**TINY_V3, **VARIANTS["moe"]})
    prompts = _prompts([7, 30, 19], seed=8)
    hf = load_hf(path)
    want = [hf_greedy(hf, p, 16)[0] for p in prompts]
    srv = start_server(tmp_path / "logs", "--model", str(path), "--max-total-tokens", "2048", "--page-size", "4",
                       "--dtype", "float32")  # transformers' float32 tokens (the CPU default may be bf16)
    try:
        def gen(ids: list[int]) -> dict:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
            return httpx.post(f"{srv.http}/generate", json=body, timeout=60).json()

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            first = list(pool.map(gen, prompts))
        again = gen(prompts[1])
    finally:
        assert stop_server(srv) == 0
    assert [r["output_ids"] for r in first] == want
    assert again["output_ids"] == want[1] and again["meta_info"]["cached_tokens"] >= 28


def test_fp8_latent_cache(v3: tuple) -> None:
    """--kv-cache-dtype fp8_e4m3 for MLA: the latent stored in 8 bits (576 bytes a token and layer at
    V3 shapes, half of bf16) and read back through the same paths; lossy, so only the prefill
    logits are compared: within 10% of the largest logit of the float32 cache's."""
    model, cfg, _ = v3
    assert KVLayout.latent(512, 64).token_bytes(torch.float8_e4m3fn) == 576
    prompts = _prompts([9, 21], seed=9)
    firsts = []
    for dtype in (torch.float32, torch.float8_e4m3fn):
        runner = PagedGreedy(model, cfg)
        runner.kv = KVPool.from_layout(kv_layout(cfg), cfg.num_layers, 256, 4, dtype, "cpu")
        assert runner.kv.all["latent"].dtype == dtype
        seqs = [runner.new_seq(p, 4) for p in prompts]
        runner.run(seqs, 4)
        firsts.append(torch.stack([s.logits[0] for s in seqs]))
    scale = firsts[0].abs().max()
    assert (firsts[1] - firsts[0]).abs().max() < 0.1 * scale
