"""Mixture-of-experts models (models/moe.py, engine/layers/moe.py) vs transformers 5 (fp32, CPU).

Tiny random Qwen3-MoE and GLM-4.5 checkpoints saved by transformers (per-expert tensors, as the
released checkpoints store them) and loaded by our loader, with odd expert counts:
* Qwen3-MoE: 5 experts, top-2, softmax with norm_topk_prob, layer 1 dense (mlp_only_layers);
* GLM-4.5: 7 experts in one group and 9 experts in 3 groups (top-2 groups), sigmoid routing with
  a non-zero score-correction bias, routed_scaling_factor, a shared expert, the first layer
  dense, partial rotary (half of each head), q/k/v bias and q/k norm.
Checked: logits close and greedy tokens equal over 32 tokens (batched, chunked prefill, behind a
cached prefix); tp=2 gives tp=1's tokens (gloo); with deterministic inference a prompt's logits
are bit-identical alone and in a batch; bad MoE configs fail naming the field.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from model_harness import PagedGreedy, Seq, hf_greedy, load_hf, make_hf_dir

from engine.layers import batch_invariant
from engine.layers.moe import MoE
from models.config import ModelConfig
from models.registry import load_model

ATOL = 1e-3
MAX_NEW = 32

_BASE = {
    "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "eos_token_id": 2,
    "num_experts_per_tok": 2,
}
QWEN3_MOE = _BASE | {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 5,
    "norm_topk_prob": True, "mlp_only_layers": [1], "rope_theta": 10000.0,
}
GLM4_MOE = _BASE | {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "n_routed_experts": 7,
    "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "partial_rotary_factor": 0.5, "attention_bias": True, "use_qk_norm": True,
    "rope_theta": 10000.0,
}
GLM4_MOE_GROUPED = GLM4_MOE | {"n_routed_experts": 9, "n_group": 3, "topk_group": 2}
CONFIGS = {"qwen3-moe": QWEN3_MOE, "glm4-moe": GLM4_MOE, "glm4-moe-grouped": GLM4_MOE_GROUPED}


def make_moe_dir(path: Path, config: dict) -> Path:
    """make_hf_dir, then the score-correction bias (a buffer make_hf_dir leaves at 0) made
    non-zero and re-saved, so that it steers the choices."""
    make_hf_dir(path, config)
    if "n_routed_experts" in config:
        model = load_hf(path)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.copy_(0.05 * torch.randn(buf.shape, generator=gen))
        model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    path = make_moe_dir(tmp_path_factory.mktemp(request.param), CONFIGS[request.param])
    model, cfg = load_model(path, progress=False)
    return model, cfg, load_hf(path), path


def _prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _check_against_hf(hf: torch.nn.Module, seqs: list[Seq], prompts: list[list[int]], n: int) -> None:
    for s, prompt in zip(seqs, prompts, strict=True):
        want_toks, want_logits = hf_greedy(hf, prompt, n)
        assert s.out == want_toks, f"prompt of {len(prompt)} tokens diverged"
        torch.testing.assert_close(torch.stack(s.logits), want_logits, atol=ATOL, rtol=0)


@pytest.mark.usefixtures("vendor_kernels")
def test_structure(moe: tuple) -> None:
    """The layers the config asks for: MoE blocks where cfg.moe.layers says, dense elsewhere."""
    model, cfg, _, _ = moe
    kinds = [isinstance(layer.mlp, MoE) for layer in model.model.layers]
    assert kinds == [i in cfg.moe.layers for i in range(cfg.num_layers)]
    assert 0 < sum(kinds) < cfg.num_layers  # both kinds present
    blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE)]
    assert all((b.shared_experts is not None) == (cfg.moe.num_shared_experts > 0) for b in blocks)


@pytest.mark.usefixtures("vendor_kernels")
def test_batched_and_chunked_match_hf(moe: tuple) -> None:
    """Mixed-length prompts in one batch, then the same with prefill chunks of 7 (decodes and
    prefill chunks share steps)."""
    model, cfg, hf, _ = moe
    prompts = _prompts([1, 6, 19, 33], cfg.vocab_size)
    for chunk in (None, 7):
        runner = PagedGreedy(model, cfg)
        seqs = [runner.new_seq(p, MAX_NEW) for p in prompts]
        runner.run(seqs, MAX_NEW, chunk=chunk)
        _check_against_hf(hf, seqs, prompts, MAX_NEW)


@pytest.mark.usefixtures("vendor_kernels")
def test_cached_prefix_equals_fresh(moe: tuple) -> None:
    """B reuses A's first 3 pages (12 tokens) and prefills only its suffix: its logits are a fresh
    run's (and HF's)."""
    model, cfg, hf, _ = moe
    prefix, suf_a, suf_b = _prompts([12, 5, 9], cfg.vocab_size, seed=2)
    runner = PagedGreedy(model, cfg, page_size=4)
    a = runner.new_seq(prefix + suf_a, 4)
    runner.run([a], 4)
    b = runner.new_seq(prefix + suf_b, MAX_NEW, share=a, shared_tokens=12)
    runner.run([b], MAX_NEW)
    fresh_runner = PagedGreedy(model, cfg, page_size=4)
    fresh = fresh_runner.new_seq(prefix + suf_b, MAX_NEW)
    fresh_runner.run([fresh], MAX_NEW)
    assert b.out == fresh.out
    torch.testing.assert_close(torch.stack(b.logits), torch.stack(fresh.logits), atol=1e-5, rtol=0)
    _check_against_hf(hf, [b], [prefix + suf_b], MAX_NEW)


def test_deterministic_alone_equals_batched(moe: tuple) -> None:
    """With deterministic inference a prompt's logits keep their bits in a batch of others, with
    chunked prefill (its rows meet other rows in every expert's GEMM, in other numbers)."""
    model, cfg, _, _ = moe
    batch_invariant.enable(True, "cpu")
    prompt, *others = _prompts([21, 3, 40, 11, 29], cfg.vocab_size, seed=3)
    runner = PagedGreedy(model, cfg)
    alone = runner.new_seq(prompt, 8)
    runner.run([alone], 8)
    for chunk in (None, 5):
        runner = PagedGreedy(model, cfg)
        seqs = [runner.new_seq(p, 8) for p in [others[0], prompt, *others[1:]]]
        runner.run(seqs, 8, chunk=chunk)
        assert seqs[1].out == alone.out
        assert all(torch.equal(x, y) for x, y in zip(seqs[1].logits, alone.logits, strict=True)), chunk


# ---- bad configs ----------------------------------------------------------------------------


@pytest.mark.parametrize(("change", "field"), [
    ({"num_experts_per_tok": 8}, "num_experts_per_tok"),
    ({"n_group": 2}, "n_group"),  # 7 experts in 2 groups
    ({"topk_group": 2}, "topk_group"),  # more than n_group
    ({"n_routed_experts": 9, "n_group": 9, "topk_group": 3}, "n_group"),  # groups of one: no 2 best
    ({"topk_method": "mystery"}, "topk_method"),
    ({"scoring_func": "relu"}, "scoring_func"),
    ({"partial_rotary_factor": 0.1}, "partial_rotary_factor"),  # int(16 * 0.1) = 1: odd
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope"),
])
def test_bad_moe_config_names_the_field(change: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_dict(GLM4_MOE | change)


def test_partial_rotary_refused_where_not_implemented() -> None:
    llama = {k: v for k, v in QWEN3_MOE.items() if k not in ("num_experts", "mlp_only_layers")}
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelConfig.from_dict(llama | {"architectures": ["Qwen3ForCausalLM"], "partial_rotary_factor": 0.5})


def test_moe_layers_from_config() -> None:
    """Which layers are MoE: Qwen3's mlp_only_layers / decoder_sparse_step, GLM's first_k_dense_replace."""
    q = ModelConfig.from_dict(QWEN3_MOE | {"num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert q.moe.layers == (1, 5) and q.moe.scoring_func == "softmax" and q.moe.topk_method == "greedy"
    g = ModelConfig.from_dict(GLM4_MOE | {"num_hidden_layers": 4, "first_k_dense_replace": 2})
    assert g.moe.layers == (2, 3) and g.moe.scoring_func == "sigmoid" and g.moe.topk_method == "noaux_tc"
    assert g.rotary_dim == 8 and g.attention_bias and not g.o_proj_bias and g.qk_norm
    dense = ModelConfig.from_dict({k: v for k, v in QWEN3_MOE.items() if k != "num_experts"})
    assert dense.moe is None


# ---- tensor parallelism and loading ------------------------------------------------------------


@pytest.mark.usefixtures("vendor_kernels")
def test_tp2_equals_tp1(tmp_path: Path) -> None:
    """GLM-4.5 with grouped routing, a shared expert and odd expert / dense widths (33 and 95:
    uneven slices on 2 ranks) over gloo: the same greedy tokens, every rank's replica digest
    checked every step (tp_harness), prefill chunks, cached prefixes and overlap included."""
    from tp_harness import run_tp

    from engine.config import ServerConfig
    from msgs.params import SamplingParams

    path = make_moe_dir(tmp_path / "m", GLM4_MOE_GROUPED | {"moe_intermediate_size": 33, "intermediate_size": 95})
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    shared = _prompts([24], 256, seed=5)[0]
    waves = [([shared + p for p in _prompts([9, 14], 256, seed=6)], greedy),
             ([shared + p for p in _prompts([5, 3], 256, seed=7)], greedy)]

    def run(tp_size: int) -> list:
        cfg = ServerConfig(model=str(path), device="cpu", dtype="float32", tp_size=tp_size, cpu_threads=1,
                           page_size=4, max_prefill_tokens=16, max_total_tokens=1024, max_running_requests=4)
        return [[o.output_ids for o in w] for w in run_tp(cfg, waves)]

    one, two = run(1), run(2)
    assert two == one and all(len(ids) == 8 for w in two for ids in w)


def test_loader_fills_expert_stacks(tmp_path: Path) -> None:
    """Expert e's gate/up/down tensors land in row e of w13 (gate rows, then up rows) and w2."""
    from safetensors.torch import load_file

    path = make_moe_dir(tmp_path / "m", GLM4_MOE)
    model, cfg = load_model(path, progress=False)
    raw = load_file(str(path / "model.safetensors"))
    experts = model.model.layers[1].mlp.experts
    for e in range(cfg.moe.num_experts):
        pre = f"model.layers.1.mlp.experts.{e}"
        want13 = torch.cat([raw[f"{pre}.gate_proj.weight"], raw[f"{pre}.up_proj.weight"]])
        assert torch.equal(experts.w13[e], want13) and torch.equal(experts.w2[e], raw[f"{pre}.down_proj.weight"])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_weight_bytes_count_every_expert(name: str) -> None:
    """Memory sizing's parameter count (engine/run/memory.py) is the model's, experts and all;
    Qwen3-30B-A3B's config gives its published 30.5B parameters."""
    from engine.run.memory import weight_bytes
    from models.moe import MoeForCausalLM

    cfg = ModelConfig.from_dict(CONFIGS[name])
    with torch.device("meta"):
        model = MoeForCausalLM(cfg)
    assert weight_bytes(cfg, torch.float32) == 4 * sum(p.numel() for p in model.parameters())
    big = ModelConfig.from_dir(Path(__file__).resolve().parents[2] / "configs" / "qwen3-30b-a3b")
    assert 30.4e9 < weight_bytes(big, torch.bfloat16) / 2 < 30.6e9


# ---- served -----------------------------------------------------------------------------------


def test_served_glm4_moe_matches_hf(tmp_path: Path) -> None:
    """bin/serve on a GLM-4.5 checkpoint (grouped routing, shared expert, partial rotary): its
    greedy tokens over HTTP are transformers', fresh, in one batch and again from the prefix cache."""
    import concurrent.futures

    import httpx

    from tests.integration.conftest import start_server, stop_server

    path = make_moe_dir(tmp_path / "m", GLM4_MOE_GROUPED)
    prompts = _prompts([7, 30, 19], 256, seed=8)
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


# ---- routing alone --------------------------------------------------------------------------


def _hf_router(kind: str) -> tuple[torch.nn.Module, object]:
    """transformers' router of `kind` with random weights (and bias), and our MoEConfig for it."""
    from transformers import DeepseekV2Config, DeepseekV3Config, Qwen3MoeConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from models.config import MoEConfig

    common = {"hidden_size": 64, "num_experts_per_tok": 3, "moe_intermediate_size": 8}
    if kind == "qwen3":
        router = Qwen3MoeTopKRouter(Qwen3MoeConfig(**common, num_experts=7, norm_topk_prob=True))
        spec = MoEConfig(7, 3, 8, (), "softmax", "greedy", True)
    elif kind == "v2-group-limited":
        router = DeepseekV2TopkRouter(DeepseekV2Config(**common, n_routed_experts=12, n_group=4, topk_group=2,
                                                       topk_method="group_limited_greedy", routed_scaling_factor=1.5))
        spec = MoEConfig(12, 3, 8, (), "softmax", "group_limited_greedy", False, 4, 2, 1.5)
    else:
        router = DeepseekV3TopkRouter(DeepseekV3Config(**common, n_routed_experts=15, n_group=5, topk_group=2,
                                                       norm_topk_prob=True, routed_scaling_factor=2.5))
        spec = MoEConfig(15, 3, 8, (), "sigmoid", "noaux_tc", True, 5, 2, 2.5)
        router.e_score_correction_bias.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
    router.weight.data.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    return router, spec


@pytest.mark.parametrize("kind", ["qwen3", "v2-group-limited", "v3-noaux-grouped"])
def test_routing_matches_transformers(kind: str) -> None:
    """engine.layers.moe.route picks transformers' experts with its weights (compared per token as
    sets: transformers' grouped top-k does not sort)."""
    from engine.layers.moe import Router

    hf, spec = _hf_router(kind)
    ours = Router(64, spec, torch.float32)
    with torch.no_grad():
        ours.weight.copy_(hf.weight)
        if ours.e_score_correction_bias is not None:
            ours.e_score_correction_bias.copy_(hf.e_score_correction_bias)
        x = torch.randn(200, 64, generator=torch.Generator().manual_seed(3))
        _, want_w, want_ids = hf(x)
        got_w, got_ids = ours(x)
    order_w, order_g = want_ids.argsort(-1), got_ids.argsort(-1)
    assert torch.equal(want_ids.gather(1, order_w), got_ids.gather(1, order_g))
    torch.testing.assert_close(got_w.gather(1, order_g), want_w.float().gather(1, order_w), atol=1e-6, rtol=1e-5)


def test_router_logits_in_the_dtype_transformers_uses() -> None:
    """Qwen MoE's gate is an nn.Linear in the model's dtype (bf16 logits, then a float32
    softmax); DeepSeek's and GLM's routers compute float32 logits. Ours follow each, read from
    config.json: in a bf16 model Qwen3-MoE routes from transformers' very logits."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from engine.layers.moe import Router
    from models.config import _moe

    base = {"num_hidden_layers": 2, "num_experts_per_tok": 2, "moe_intermediate_size": 8}
    assert not _moe({**base, "num_experts": 8, "decoder_sparse_step": 1}, "Qwen3MoeForCausalLM").router_float32
    for arch in ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM", "Glm4MoeForCausalLM"):
        assert _moe({**base, "n_routed_experts": 8}, arch).router_float32, arch
    spec = _moe({**base, "num_experts": 7, "num_experts_per_tok": 3, "norm_topk_prob": True}, "Qwen3MoeForCausalLM")
    hf = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=64, num_experts_per_tok=3, moe_intermediate_size=8,
                                           num_experts=7, norm_topk_prob=True))
    hf.weight.data.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    hf = hf.bfloat16()
    ours = Router(64, spec, torch.bfloat16)
    assert ours.weight.dtype == torch.bfloat16
    with torch.no_grad():
        ours.weight.copy_(hf.weight)
        x = torch.randn(200, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
        want_logits, want_w, want_ids = hf(x)
        got_w, got_ids = ours(x)
    assert want_logits.dtype == torch.bfloat16
    assert torch.equal(got_ids.sort(-1).values, want_ids.sort(-1).values)
    torch.testing.assert_close(got_w.sort(-1).values, want_w.float().sort(-1).values, atol=4e-3, rtol=0)  # hf: bf16
