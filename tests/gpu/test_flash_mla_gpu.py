"""FlashMLA's dense SM90 decode as served (engine/layers/flash_mla.py through MLABackend), bf16,
64-token pages: the choice (tuning, page size, dtypes, deterministic inference); at DeepSeek-V3's
shapes (128 and 16 heads) eager decode and mixed steps against the torch absorbed path; a tiny
DeepSeek-V3 whose decode logits, eager and replayed from the graph runner's CUDA graphs, match the
triton kernel's; the served model (auto page size: 64) whose greedy tokens with FlashMLA equal
the triton kernel's (a differing token only at a near tie of transformers' float32 logits)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

CUDA = torch.device("cuda")
BF = torch.bfloat16
R, P = 512, 64
TINY = {  # DeepSeek-V3 at 16 heads (a rank of V3 at tp 8) with the latent FlashMLA takes; all dense
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 256,
    "intermediate_size": 384, "moe_intermediate_size": 32, "num_hidden_layers": 2, "first_k_dense_replace": 2,
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": 96, "kv_lora_rank": R,
    "qk_nope_head_dim": 32, "qk_rope_head_dim": P, "v_head_dim": 32, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
    "vocab_size": 256, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_theta": 10000.0, "eos_token_id": 1, "bos_token_id": 0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}


@pytest.fixture
def flashmla_on() -> Iterator[None]:
    """The H200 file's choice on whatever GPU runs this."""
    from engine.layers.tuning import override_tuning

    override_tuning(mla_flashmla=True)
    yield
    override_tuning()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.1)
    path = tmp_path_factory.mktemp("tiny-v3-h16")
    model.save_pretrained(path, safe_serialization=True)
    return path


def _backend(heads: int, kv, max_batch: int = 16, max_pages: int = 512):  # noqa: ANN001, ANN202
    from engine.layers.mla_attention import MLABackend

    b = MLABackend(CUDA)
    b.bind(num_q_heads=heads, kv_pool=kv, max_batch=max_batch, max_pages_per_req=max_pages, q_dtype=BF)
    return b


def test_choice_needs_the_tuning_64_token_pages_bf16_and_no_determinism(flashmla_on: None) -> None:
    from engine.layers import batch_invariant
    from engine.layers.kv_layout import KVLayout
    from engine.layers.kv_pool import KVPool
    from engine.layers.tuning import load_tuning

    if torch.cuda.get_device_name() == "NVIDIA H200":
        assert load_tuning("NVIDIA H200").mla_flashmla
    kv = KVPool.from_layout(KVLayout.latent(R, P), 1, 4, 64, BF, CUDA)
    for heads in (128, 16):
        b = _backend(heads, kv)
        assert b.kernel == "flashmla" and b.fm is not None and b.fi is None and b.uses_table(8)
    assert _backend(128, KVPool.from_layout(KVLayout.latent(R, P), 1, 4, 16, BF, CUDA)).kernel != "flashmla"
    assert _backend(128, KVPool.from_layout(KVLayout.latent(R, P), 1, 4, 64, torch.float8_e4m3fn, CUDA)).kernel \
        == "triton"
    batch_invariant.enable(True, "cuda")
    try:
        assert _backend(128, kv).kernel == "triton"
    finally:
        batch_invariant.enable(False)


def _v3_step(lens: list[int], extend: list[int], heads: int, ps: int = 64):  # noqa: ANN202
    from engine.layers.forward import ForwardBatch
    from engine.layers.kv_layout import KVLayout
    from engine.layers.kv_pool import KVPool
    from engine.layers.mla_attention import MLAShapes

    pages = sum(-(-n // ps) for n in lens) + 2
    kv = KVPool.from_layout(KVLayout.latent(R, P), 1, pages, ps, BF, CUDA)
    g = torch.Generator(device=CUDA).manual_seed(0)
    kv.latent[0].copy_(torch.randn(kv.latent[0].shape, generator=g, device=CUDA).to(BF))
    free = list(range(1, pages))
    random.Random(1).shuffle(free)
    reqs = [([1] * e, n - e, [free.pop() for _ in range(-(-n // ps))]) for n, e in zip(lens, extend, strict=True)]
    batch = ForwardBatch.from_requests(reqs, ps, CUDA)
    t, nope, v = batch.num_tokens, 128, 128
    q_nope = torch.randn(t, heads, nope, generator=g, device=CUDA).to(BF)
    q_pe = torch.randn(t, heads, P, generator=g, device=CUDA).to(BF)
    w = (torch.randn(heads * (nope + v), R, generator=g, device=CUDA) * R**-0.5).to(BF)
    return kv, batch, (q_nope, q_pe), w, MLAShapes(heads, R, nope, P, v, (nope + P) ** -0.5 * 1.3)


@pytest.mark.parametrize("heads", [128, 16])
@pytest.mark.parametrize("mixed", [False, True], ids=["decode", "mixed"])
def test_v3_shapes_eager_steps_match_torch(heads: int, mixed: bool, flashmla_on: None) -> None:
    """Uneven lengths (1, within a page, 16k+), shuffled pages; `mixed`: prefill rows beside the
    decode rows (those on the expanded path); every row against the torch absorbed path."""
    from engine.layers.mla_attention import MLAPlan, mla_attend

    lens, extend = [1, 15, 1000, 4097, 16500, 777], [1] * 6
    if mixed:
        extend = [1, 15, 1, 40, 1, 1]
    kv, batch, q, w, s = _v3_step(lens, extend, heads)
    backend = _backend(heads, kv, max_pages=512)
    want = mla_attend(*q, MLAPlan.build(batch, kernel=False), kv, 0, w, s)
    backend.prepare(batch)
    plan = MLAPlan.build(batch, kernel=True, graph=backend.graph, flashmla=backend.fm)
    assert plan.decode_fm is backend.fm and plan.decode_sched is not None
    got = mla_attend(*q, plan, kv, 0, w, s)
    err = (got.float() - want.float()).abs().amax(dim=(1, 2)) / want.float().abs().amax(dim=(1, 2))
    assert (err < 0.02).all(), err.tolist()  # bf16 q_lat, probabilities and output (ours: the same bound)


def _prefilled(path: Path, lens: list[int]):  # noqa: ANN202
    """The tiny model in bf16, a pool of 64-token pages holding `lens` prompt tokens each, and the
    next decode step."""
    from engine.layers.forward import ForwardBatch
    from engine.layers.kv_pool import KVPool
    from models.registry import kv_layout, load_model

    model, cfg = load_model(path, dtype=BF, device=CUDA, progress=False)
    ps = 64
    kv = KVPool.from_layout(kv_layout(cfg), cfg.num_layers, 64, ps, BF, CUDA)
    free = list(range(1, 64))
    random.Random(4).shuffle(free)
    tables = [[free.pop() for _ in range(-(-(n + 1) // ps))] for n in lens]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in lens]
    model(ForwardBatch.from_requests([(p, 0, t) for p, t in zip(prompts, tables, strict=True)], ps, CUDA), kv)
    step = ForwardBatch.from_requests([([7 + i], n, t) for i, (n, t) in enumerate(zip(lens, tables, strict=True))],
                                      ps, CUDA)
    return model, kv, tables, step


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.abs().amax(dim=1, keepdim=True).clamp(min=1)
    assert ((got - want).abs() / scale).amax() < 0.05
    assert (got.argmax(1) == want.argmax(1)).float().mean() >= 0.6  # bf16 near-ties aside


def test_tiny_v3_logits_eager_and_graphs_match_triton(tiny: Path, flashmla_on: None) -> None:
    """One decode step of 5 requests: FlashMLA eager and replayed from the graph runner's CUDA
    graphs (captured 1-8; the schedule made inside the graph) against the triton kernel's logits;
    a second replay at other lengths and fewer rows through the same graphs."""
    from engine.layers import ops
    from engine.layers.forward import ForwardBatch
    from engine.layers.tuning import override_tuning
    from engine.run.cuda_graph import CudaGraphRunner

    lens = [5, 40, 300, 129, 17]
    ops.set_fused(False)  # torch norms and activations: nothing JIT-compiles
    try:
        model, kv, tables, step = _prefilled(tiny, lens)
        fm = _backend(16, kv, max_batch=8, max_pages=64)
        override_tuning(mla_flashmla=False)
        tri = _backend(16, kv, max_batch=8, max_pages=64)
        assert (fm.kernel, tri.kernel) == ("flashmla", "triton")
        tri.prepare(step)
        want = model(step, kv, tri)
        fm.prepare(step)
        _close(model(step, kv, fm), want)
        with torch.inference_mode():  # as the runner captures and replays
            runner = CudaGraphRunner(model, kv, fm, 8, CUDA)
            runner.capture()
            last = torch.zeros(8, dtype=torch.int64, device=CUDA)
            ids = [7 + i for i in range(len(lens))]
            _close(runner.run_decode(ids, list(range(len(lens))), lens, tables, last).clone(), want)
            sub = [0, 2, 3]  # 3 rows: the size-4 graph, one padding row
            step_sub = ForwardBatch.from_requests([([ids[i]], lens[i], tables[i]) for i in sub], 64, CUDA)
            tri.prepare(step_sub)
            want_sub = model(step_sub, kv, tri)
            got_sub = runner.run_decode([ids[i] for i in sub], sub, [lens[i] for i in sub],
                                        [tables[i] for i in sub], last)
            _close(got_sub, want_sub)
        assert runner.replays == 2
    finally:
        ops.set_fused(True)


def _generate(path: Path, prompts: list[list[int]], graphs: bool, flashmla: bool):  # noqa: ANN202
    from engine.config import ServerConfig
    from engine.layers.tuning import override_tuning
    from engine.local import LocalEngine
    from msgs.params import SamplingParams

    override_tuning(mla_flashmla=flashmla)
    cfg = ServerConfig(model=str(path), load_format="auto", device="cuda", dtype="bfloat16",
                       max_total_tokens=8192, max_prefill_tokens=128, max_running_requests=8,
                       disable_cuda_graph=not graphs, grammar_helpers=0)
    assert cfg.page_size == 64  # auto: an MLA model on CUDA
    eng = LocalEngine(cfg)
    kernel = eng.runner.backend.kernel
    out = [r.output_ids for r in eng.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0,
                                                                       ignore_eos=True))]
    replays = eng.runner.graphs.replays if eng.runner.graphs is not None else 0
    assert eng.core.leak_free()
    del eng
    torch.cuda.empty_cache()
    return kernel, replays, out


def test_served_tiny_v3_greedy_flashmla_vs_triton(tiny: Path) -> None:
    """The served path (scheduler + runner, chunked prefill beside decode rows, overlap): greedy
    tokens with FlashMLA in CUDA graphs and eager equal the triton kernel's in CUDA graphs; a
    differing token only where transformers' float32 logits of the two are within 0.1."""
    from transformers import AutoModelForCausalLM

    from engine.layers import ops
    from engine.layers.tuning import override_tuning

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 70, 200, 130)]
    ops.set_fused(False)
    try:
        runs = {name: _generate(tiny, prompts, graphs, fm)
                for name, graphs, fm in (("fm-graphs", True, True), ("fm-eager", False, True), ("triton", True, False))}
    finally:
        ops.set_fused(True)
        override_tuning()
    assert {k: v[0] for k, v in runs.items()} == {"fm-graphs": "flashmla", "fm-eager": "flashmla", "triton": "triton"}
    assert runs["fm-graphs"][1] > 0 and runs["triton"][1] > 0 and runs["fm-eager"][1] == 0
    want = runs["triton"][2]
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).cuda().eval()
    bad = []
    for name in ("fm-graphs", "fm-eager"):
        for i, (p, w, o) in enumerate(zip(prompts, want, runs[name][2], strict=True)):
            j = next((k for k, (x, y) in enumerate(zip(w, o, strict=True)) if x != y), None)
            if j is None:
                continue
            with torch.inference_mode():
                row = hf(torch.tensor([p + w[:j]], device="cuda")).logits[0, -1].float()
            if abs(row[w[j]] - row[o[j]]).item() > 0.1:
                bad.append(f"{name} prompt {i} position {j}: {w[j]} vs {o[j]}")
    assert not bad, bad
