"""flashinfer's MLA decode as served (engine/layers/flashinfer_mla.py through MLABackend) on CUDA,
bf16: the tuning rule's choice per head count; at DeepSeek-V3's shapes (128 heads, latent 512 +
64) eager pure-decode and mixed steps against the torch absorbed path; a tiny DeepSeek-V3 of 64
heads (latent 512 + 64, YaRN scale) whose decode logits, eager and replayed from the graph
runner's CUDA graphs, match the triton kernel's; and the served model's greedy tokens with
flashinfer (graphs and eager) against the triton kernel's (a differing token only at a near tie of
transformers' float32 logits)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

CUDA = torch.device("cuda")
BF = torch.bfloat16
R, P = 512, 64
TINY64 = {  # DeepSeek-V3 at 64 heads with the latent flashinfer's kernels take; all dense (no MoE flips)
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 256,
    "intermediate_size": 384, "moe_intermediate_size": 32, "num_hidden_layers": 2, "first_k_dense_replace": 2,
    "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 96, "kv_lora_rank": R,
    "qk_nope_head_dim": 32, "qk_rope_head_dim": P, "v_head_dim": 32, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
    "vocab_size": 256, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_theta": 10000.0, "eos_token_id": 1, "bos_token_id": 0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}


@pytest.fixture(scope="module")
def mla_built() -> None:
    """flashinfer's MLA module for bf16 512 + 64 on this GPU, built once up front."""
    from flashinfer.jit.attention import gen_batch_mla_module
    from flashinfer.utils import determine_mla_backend

    spec = gen_batch_mla_module(determine_mla_backend(CUDA), BF, BF, BF, torch.int32, R, P, False)
    if not spec.is_aot:
        spec.build(verbose=False)


@pytest.fixture
def flashinfer_from_64() -> Iterator[None]:
    """The H200 rule on whatever GPU runs this (a GPU without a tuning file keeps ours)."""
    from engine.layers.tuning import override_tuning

    override_tuning(mla_flashinfer_min_heads=64)
    yield
    override_tuning()


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY64), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.1)
    path = tmp_path_factory.mktemp("tiny-v3-h64")
    model.save_pretrained(path, safe_serialization=True)
    return path


def _backend(heads: int, kv, max_batch: int = 16, max_pages: int = 2048):  # noqa: ANN001, ANN202
    from engine.layers.mla_attention import MLABackend

    b = MLABackend(CUDA)
    b.bind(num_q_heads=heads, kv_pool=kv, max_batch=max_batch, max_pages_per_req=max_pages, q_dtype=BF)
    return b


def test_kernel_choice_follows_the_tuning_rule() -> None:
    """No override: this GPU's file decides (the H200's: flashinfer from 64 heads); an fp8 pool or
    another latent keeps ours."""
    from engine.layers.kv_layout import KVLayout
    from engine.layers.kv_pool import KVPool
    from engine.layers.tuning import load_tuning

    tuning = load_tuning(torch.cuda.get_device_name())
    kv = KVPool.from_layout(KVLayout.latent(R, P), 1, 4, 16, BF, CUDA)
    for heads in (128, 64, 16):
        b = _backend(heads, kv)
        assert b.kernel == tuning.mla_decode_kernel(heads, True), heads
        assert (b.fi is not None) == (b.kernel == "flashinfer") and b.uses_table(8) == (b.fi is None)
    if torch.cuda.get_device_name() == "NVIDIA H200":
        assert [_backend(h, kv).kernel for h in (128, 64, 16)] == ["flashinfer", "flashinfer", "triton"]
    fp8 = KVPool.from_layout(KVLayout.latent(R, P), 1, 4, 16, torch.float8_e4m3fn, CUDA)
    small = KVPool.from_layout(KVLayout.latent(64, 16), 1, 4, 16, BF, CUDA)
    assert _backend(128, fp8).kernel == "triton" and _backend(128, small).kernel == "triton"


def _v3_step(lens: list[int], extend: list[int], ps: int, heads: int = 128):  # noqa: ANN202
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


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return (got.float() - want.float()).abs().amax(dim=(1, 2)) / want.float().abs().amax(dim=(1, 2))


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("mixed", [False, True], ids=["decode", "mixed"])
def test_v3_shapes_eager_steps_match_torch(page_size: int, mixed: bool, mla_built: None,
                                           flashinfer_from_64: None) -> None:
    """Uneven lengths (1, within a page, 16k+), shuffled pages; `mixed`: prefill rows beside the
    decode rows (these on flashinfer, those on today's expanded path), every row against torch."""
    from engine.layers.mla_attention import MLAPlan, mla_attend

    lens, extend = [1, 15, 1000, 4097, 16500, 777], [1] * 6
    if mixed:
        extend = [1, 15, 1, 40, 1, 1]
    kv, batch, q, w, s = _v3_step(lens, extend, page_size)
    backend = _backend(128, kv, max_pages=2048)
    assert backend.kernel == "flashinfer"
    want = mla_attend(*q, MLAPlan.build(batch, kernel=False), kv, 0, w, s)
    backend.prepare(batch)
    assert backend.graph is backend.fi and backend.fi.rows == extend.count(1)
    plan = MLAPlan.build(batch, kernel=True, graph=backend.graph)
    assert plan.decode_fi is backend.fi
    got = mla_attend(*q, plan, kv, 0, w, s)
    err = _rel_err(got, want)
    assert (err < 0.02).all(), err.tolist()  # bf16 q_lat, probabilities and output (ours: the same bound)
    backend.prepare(batch)  # planned again (the geometry known now): as close
    again = mla_attend(*q, MLAPlan.build(batch, kernel=True, graph=backend.graph), kv, 0, w, s)
    assert (_rel_err(again, want) < 0.02).all()


def _prefilled(path: Path, lens: list[int]):  # noqa: ANN202
    """The tiny model in bf16, a pool holding `lens` prompt tokens each, and the next decode step."""
    from engine.layers import ops
    from engine.layers.forward import ForwardBatch
    from engine.layers.kv_pool import KVPool
    from models.registry import kv_layout, load_model

    ops.set_fused(False)  # torch norms and activations: only the MLA module JIT-compiles
    model, cfg = load_model(path, dtype=BF, device=CUDA, progress=False)
    ps = 16
    kv = KVPool.from_layout(kv_layout(cfg), cfg.num_layers, 128, ps, BF, CUDA)
    free = list(range(1, 128))
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


def test_tiny_v3_64_heads_logits_eager_and_graphs_match_triton(tiny64: Path, mla_built: None,
                                                               flashinfer_from_64: None) -> None:
    """One decode step of 5 requests: flashinfer eager (MLABackend.prepare) and replayed from the
    graph runner's CUDA graphs (captured 1-8, planned by plan_graph_arrays at replay) against the
    triton kernel's logits; a second replay at other lengths re-plans the same graph."""
    from engine.layers import ops
    from engine.layers.forward import ForwardBatch
    from engine.layers.tuning import override_tuning
    from engine.run.cuda_graph import CudaGraphRunner

    lens = [5, 40, 300, 129, 17]
    try:
        model, kv, tables, step = _prefilled(tiny64, lens)
        fi = _backend(64, kv, max_batch=8, max_pages=64)
        override_tuning(mla_flashinfer_min_heads=0)
        tri = _backend(64, kv, max_batch=8, max_pages=64)
        assert (fi.kernel, tri.kernel) == ("flashinfer", "triton")
        tri.prepare(step)
        want = model(step, kv, tri)
        fi.prepare(step)
        _close(model(step, kv, fi), want)
        with torch.inference_mode():  # as the runner captures and replays
            runner = CudaGraphRunner(model, kv, fi, 8, CUDA)
            runner.capture()
            last = torch.zeros(8, dtype=torch.int64, device=CUDA)
            ids = [7 + i for i in range(len(lens))]
            got = runner.run_decode(ids, list(range(len(lens))), lens, tables, last).clone()
            _close(got, want)
            sub = [0, 2, 3]  # 3 rows: the size-4 graph, one padding row
            step_sub = ForwardBatch.from_requests([([ids[i]], lens[i], tables[i]) for i in sub], 16, CUDA)
            tri.prepare(step_sub)
            want_sub = model(step_sub, kv, tri)
            got_sub = runner.run_decode([ids[i] for i in sub], sub, [lens[i] for i in sub],
                                        [tables[i] for i in sub], last)
            _close(got_sub, want_sub)
        assert runner.replays == 2
    finally:
        ops.set_fused(True)


def _generate(path: Path, prompts: list[list[int]], graphs: bool, min_heads: int):  # noqa: ANN202
    from engine.config import ServerConfig
    from engine.layers.tuning import override_tuning
    from engine.local import LocalEngine
    from msgs.params import SamplingParams

    override_tuning(mla_flashinfer_min_heads=min_heads)
    cfg = ServerConfig(model=str(path), load_format="auto", device="cuda", dtype="bfloat16", page_size=16,
                       max_total_tokens=8192, max_prefill_tokens=64, max_running_requests=8,
                       disable_cuda_graph=not graphs, grammar_helpers=0)
    eng = LocalEngine(cfg)
    kernel = eng.runner.backend.kernel
    out = [r.output_ids for r in eng.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0,
                                                                       ignore_eos=True))]
    replays = eng.runner.graphs.replays if eng.runner.graphs is not None else 0
    assert eng.core.leak_free()
    del eng
    torch.cuda.empty_cache()
    return kernel, replays, out


def test_served_tiny_v3_64_heads_greedy_flashinfer_vs_triton(tiny64: Path, mla_built: None,
                                                            flashinfer_from_64: None) -> None:
    """The served path (scheduler + runner, chunked prefill beside decode rows, overlap; torch norms
    and activations, so only the MLA module JIT-compiles): greedy tokens with flashinfer in CUDA
    graphs and eager equal the triton kernel's in CUDA graphs; a differing token only where
    transformers' float32 logits of the two are within 0.1."""
    from transformers import AutoModelForCausalLM

    from engine.layers import ops

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 70, 40, 130)]
    ops.set_fused(False)
    try:
        runs = {name: _generate(tiny64, prompts, graphs, heads)
                for name, graphs, heads in (("fi-graphs", True, 64), ("fi-eager", False, 64), ("triton", True, 0))}
    finally:
        ops.set_fused(True)
    assert {k: v[0] for k, v in runs.items()} == {"fi-graphs": "flashinfer", "fi-eager": "flashinfer",
                                                  "triton": "triton"}
    assert runs["fi-graphs"][1] > 0 and runs["triton"][1] > 0 and runs["fi-eager"][1] == 0
    want = runs["triton"][2]
    hf = AutoModelForCausalLM.from_pretrained(tiny64, dtype=torch.float32).cuda().eval()
    bad = []
    for name in ("fi-graphs", "fi-eager"):
        for i, (p, w, o) in enumerate(zip(prompts, want, runs[name][2], strict=True)):
            j = next((k for k, (x, y) in enumerate(zip(w, o, strict=True)) if x != y), None)
            if j is None:
                continue
            with torch.inference_mode():
                row = hf(torch.tensor([p + w[:j]], device="cuda")).logits[0, -1].float()
            if abs(row[w[j]] - row[o[j]]).item() > 0.1:
                bad.append(f"{name} prompt {i} position {j}: {w[j]} vs {o[j]}")
    assert not bad, bad
