"""Fused MoE on CUDA (engine/layers/moe_kernels.py) at real shapes, and a served MoE model in
CUDA graphs.

1. Experts' fused path against a float32 reference on the same weights (and no worse than the
   torch path, which runs on CUDA under deterministic inference): Qwen3-30B-A3B's experts
   (hidden 2048, 128 experts, top 8, 768) and DeepSeek-V3's (7168, 256, top 8, 2048), bf16 and
   fp8 (row, 128 x 128 blocks) stacks, 1 to 512 tokens, uneven routing, an expert-parallel rank's
   quarter of the experts; per-expert counts equal the routed pairs; no host sync
   (torch.cuda.set_sync_debug_mode("error")).
2. The layer captured in a CUDA graph: replays with new tokens equal eager calls, and a
   graph's padding rows are not counted.
3. A tiny random Qwen3-MoE served by LocalEngine: CUDA graphs captured (the MoE blocks no longer
   block them) and the same greedy tokens as eager (a differing token only at a near-tie), and
   the expert counts top_k per forwarded token in both.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

SHAPES = {"qwen3-30b-a3b": (2048, 128, 8, 768), "deepseek-v3": (7168, 256, 8, 2048)}
CASES = [("qwen3-30b-a3b", None), ("qwen3-30b-a3b", "fp8_row"), ("qwen3-30b-a3b", "fp8_block"),
         ("deepseek-v3", None), ("deepseek-v3", "fp8_block")]


@contextmanager
def torch_path() -> Iterator[None]:
    """Experts' torch path on CUDA: it serves deterministic inference there."""
    from engine.layers import batch_invariant

    batch_invariant.enable(True, "cuda")
    try:
        yield
    finally:
        batch_invariant.enable(False, "cuda")


def make_experts(shape: str, quant: str | None, ep: tuple[int, int] | None = None):  # noqa: ANN201
    from engine.layers import moe_quant
    from engine.layers.moe import Experts
    from engine.layers.parallel import ParallelState, TPGroup, set_parallel_state

    h, e, _, inter = SHAPES[shape]
    set_parallel_state(ParallelState(ep=TPGroup(*ep)) if ep else ParallelState())
    try:
        with torch.device("cuda"):
            ex = Experts(h, SimpleNamespace(num_experts=e, intermediate_size=inter), torch.bfloat16)
    finally:
        set_parallel_state(ParallelState())
    torch.manual_seed(e + (ep[0] if ep else 0))
    for p in (ex.w13, ex.w2):
        p.data.normal_(0, 0.02)
    if quant:
        moe_quant.quantize(ex, quant)
    return ex


def routing(t: int, e: int, k: int, seed: int, skew: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k weights and ids; `skew`: logits favour a few experts (uneven segments, idle experts)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(t, e, device="cuda", generator=g)
    if skew:
        logits[:, :5] += 3.0
    w, ids = logits.softmax(-1).topk(k, dim=-1)
    return (w / w.sum(-1, keepdim=True)).float(), ids


def reference(ex, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """float32 sum_j w[t, j] * expert(x[t]) over this rank's experts, weights dequantized exactly."""
    from engine.layers.moe_quant import dequantize

    out = torch.zeros(x.shape[0], x.shape[1], device=x.device)
    for e in ids.unique().tolist():
        le = e - ex.first
        if not 0 <= le < ex.local_experts:
            continue
        mats = []
        for n in ("w13", "w2"):
            q = getattr(ex, n)[le]
            mats.append(q.float() if ex.quant is None else dequantize(ex.quant, q, getattr(ex, n + "_scale")[le]))
        t, j = (ids == e).nonzero(as_tuple=True)
        h = x[t].float() @ mats[0].t()
        g, u = h.chunk(2, -1)
        out.index_add_(0, t, ((F.silu(g) * u) @ mats[1].t()) * w[t, j, None])
    return out


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


@pytest.fixture(scope="module", params=CASES, ids=[f"{s}-{q or 'bf16'}" for s, q in CASES])
def experts(request: pytest.FixtureRequest) -> Iterator[tuple]:
    shape, quant = request.param
    ex = make_experts(shape, quant)
    yield shape, quant, ex
    del ex
    torch.cuda.empty_cache()


@pytest.mark.parametrize(("t", "skew"), [(1, False), (7, True), (64, False), (512, True)])
def test_fused_matches_float32_reference(experts: tuple, t: int, skew: bool) -> None:
    shape, quant, ex = experts
    h, e, k, _ = SHAPES[shape]
    w, ids = routing(t, e, k, seed=t, skew=skew)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    ref = reference(ex, x, w, ids)
    with torch_path():
        base = _rel(ex(x, w, ids), ref)
    ex.token_counts.zero_()
    assert ex.fused
    ex(x[:1], w[:1], ids[:1])  # compiles (warm) outside the sync check
    ex.token_counts.zero_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = ex(x, w, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    err = _rel(y, ref)
    assert y.dtype == torch.bfloat16 and err < 0.02 and err <= 1.5 * base + 2e-3, (err, base)
    assert torch.equal(ex.token_counts, torch.bincount(ids.flatten(), minlength=e))


def test_ep_rank_holds_a_quarter_of_the_experts() -> None:
    """ep 4, rank 1: experts 32..63 of Qwen3-30B-A3B's 128; pairs routed elsewhere add nothing."""
    ex = make_experts("qwen3-30b-a3b", None, ep=(1, 4))
    assert ex.first == 32 and ex.local_experts == 32
    w, ids = routing(40, 128, 8, seed=3, skew=False)
    x = torch.randn(40, 2048, device="cuda", dtype=torch.bfloat16)
    assert _rel(ex(x, w, ids), reference(ex, x, w, ids)) < 0.02


def test_captured_layer_replays_equal_eager() -> None:
    """One CUDA graph of the layer at 16 rows (3 of them padding: keys below the bound), replayed
    for three new batches: equal to eager calls bit for bit, only real rows counted and computed."""
    from engine.layers.moe import PadRows

    ex = make_experts("qwen3-30b-a3b", "fp8_block")
    t, real = 16, 13
    sx = torch.zeros(t, 2048, device="cuda", dtype=torch.bfloat16)
    sw, sids = routing(t, 128, 8, seed=0, skew=False)
    keys = torch.cat([torch.full((real,), 100, device="cuda"), torch.zeros(t - real, dtype=torch.int64, device="cuda")])
    pad = PadRows(keys, 16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ex(sx, sw, sids, pad)  # warm: compiles
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ex(sx, sw, sids, pad)
    ex.token_counts.zero_()
    want_counts = torch.zeros_like(ex.token_counts)
    for seed in (1, 2, 3):
        w, ids = routing(t, 128, 8, seed=seed, skew=seed == 2)
        x = torch.randn(t, 2048, device="cuda", dtype=torch.bfloat16)
        sx.copy_(x)
        sw.copy_(w)
        sids.copy_(ids)
        graph.replay()
        want_counts += torch.bincount(ids[:real].flatten(), minlength=128)
        replayed = out.clone()
        counts = ex.token_counts.clone()
        eager = ex(x, w, ids, pad)
        ex.token_counts.copy_(counts)
        assert torch.equal(replayed, eager) and not replayed[real:].any()  # padding rows: left out, zeros
    assert torch.equal(ex.token_counts, want_counts)


@pytest.mark.parametrize("quant", [None, "fp8_block"])
def test_det_config_rows_keep_their_bits(quant: str | None) -> None:
    """moe_kernels.DET_CONFIG, deterministic inference's candidate (the engine keeps the torch
    expert path under the mode until this passes): Qwen3-30B-A3B shapes in bf16, a token's output
    has the same bits alone and among 7, 64 and 300 tokens (skewed routing: crowded experts)."""
    from engine.layers import moe_kernels as mk

    ex = make_experts("qwen3-30b-a3b", quant)
    stacks = [mk.Stack(getattr(ex, n), getattr(ex, n + "_scale", None), ex.quant) for n in ("w13", "w2")]
    w, ids = routing(300, 128, 8, seed=4, skew=True)
    x = torch.randn(300, 2048, device="cuda", dtype=torch.bfloat16)

    def run(n: int, t0: int = 0) -> torch.Tensor:
        return mk.fused_experts(x[t0 : t0 + n].contiguous(), w[t0 : t0 + n].contiguous(),
                                ids[t0 : t0 + n].contiguous(), *stacks, ex.token_counts, 0, mk.DET_CONFIG)

    full = run(300)
    for n in (7, 64):
        assert torch.equal(run(n), full[:n]), n
    for t in (0, 5, 299):
        assert torch.equal(run(1, t), full[t : t + 1]), t


@pytest.mark.parametrize(("e", "k", "scoring", "method", "scale", "groups"), [
    (128, 8, "softmax", "greedy", 1.0, (1, 1)),  # Qwen3-30B-A3B
    (160, 8, "sigmoid", "noaux_tc", 2.5, (1, 1)),  # GLM-4.5: one group, the correction bias
    (256, 8, "sigmoid", "noaux_tc", 2.5, (8, 4)),  # DeepSeek-V3: the 4 best of 8 groups
])
def test_route_kernel_matches_route(e: int, k: int, scoring: str, method: str, scale: float,
                                    groups: tuple[int, int]) -> None:
    from engine.layers import moe_kernels
    from engine.layers.moe import route

    spec = SimpleNamespace(num_experts=e, top_k=k, scoring_func=scoring, topk_method=method, norm_topk_prob=True,
                           n_group=groups[0], topk_group=groups[1], routed_scaling_factor=scale)
    logits = torch.randn(300, e, device="cuda")
    bias = 0.05 * torch.randn(e, device="cuda") if method == "noaux_tc" else None
    w_ref, ids_ref = route(logits, spec, bias)
    w, ids = moe_kernels.route(logits, spec, bias)
    same = (ids == ids_ref).all(-1)
    assert same.float().mean() > 0.99  # a row may differ only at a near-tie of two experts
    torch.testing.assert_close(w[same], w_ref[same], rtol=1e-5, atol=1e-6)


def test_bf16_router_takes_the_gemv_at_decode_rows() -> None:
    """A bf16 router (Qwen3-30B-A3B's 128 x 2048) computes 1-4 rows' logits with the triton GEMV
    (the kernel is counted), close to the float32 product; 5 rows, and deterministic inference
    at any rows, keep the matmul."""
    from engine.layers import triton_ops
    from engine.layers.moe import Router

    spec = SimpleNamespace(num_experts=128, top_k=8, scoring_func="softmax", topk_method="greedy", norm_topk_prob=True,
                           n_group=1, topk_group=1, routed_scaling_factor=1.0, router_float32=False)
    with torch.device("cuda"):
        gate = Router(2048, spec, torch.bfloat16)
    gate.weight.data.normal_(0, 0.02)
    calls = []
    real = triton_ops.gemv
    triton_ops.gemv = lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw)
    try:
        for rows in (1, 3, 4, 5):
            x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ gate.weight.float().T
            torch.testing.assert_close(gate.logits(x).float(), ref, rtol=1e-2, atol=1e-2)
            w, ids = gate(x)
            assert ids.shape == (rows, 8) and torch.allclose(w.sum(-1), torch.ones(rows, device="cuda"))
        with torch_path():
            gate(torch.randn(2, 2048, device="cuda", dtype=torch.bfloat16))
    finally:
        triton_ops.gemv = real
    assert calls == [1, 1, 3, 3, 4, 4], calls


TINY_QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 512, "intermediate_size": 1024,
    "moe_intermediate_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 128, "vocab_size": 2048, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "eos_token_id": 2, "bos_token_id": 1, "num_experts": 16, "num_experts_per_tok": 4,
    "norm_topk_prob": True, "mlp_only_layers": [1], "rope_theta": 1000000.0,
}


def test_served_moe_in_cuda_graphs_equals_eager(tmp_path: Path, flashinfer_built: None) -> None:
    from engine.local import LocalEngine
    from msgs.params import SamplingParams
    from tests.gpu.test_gpu_path import Mode, engine_cfg, token_mismatches

    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN3_MOE))
    greedy = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 2045, (n,), generator=g).tolist() for n in (5, 17, 40, 100, 33)]
    prompts2 = [torch.randint(3, 2045, (n,), generator=g).tolist() for n in (9, 21, 64)]  # batch 3: graph of 4
    want = 4 * sum(len(p) + greedy.max_new_tokens - 1 for p in prompts + prompts2)
    runs, engines = {}, {}
    for graphs in (False, True):
        eng = LocalEngine(engine_cfg(tmp_path, Mode(), "flashinfer", graphs))
        r1, r2 = eng.generate(prompts, greedy), eng.generate(prompts2, greedy)
        runs[graphs] = ([r.output_ids for r in r1], [r.output_ids for r in r2])
        engines[graphs] = eng
        counts = eng.runner.expert_counts.read()
        assert sorted(counts) == [0, 2] and all(sum(c) == want for c in counts.values()), (graphs, counts)
    runner = engines[True].runner
    assert runner.graphs is not None and runner.graphs.replays > 0, "the MoE model was not captured"
    ref = engines[False]
    bad = token_mismatches(ref, prompts, runs[False][0], runs[True][0], 0.05)
    bad += token_mismatches(ref, prompts2, runs[False][1], runs[True][1], 0.05)
    assert not bad, bad


@pytest.mark.parametrize(("shape", "quant", "ep"), [("qwen3-30b-a3b", None, None), ("qwen3-30b-a3b", "fp8_row", None),
                                                    ("deepseek-v3", None, None), ("qwen3-30b-a3b", None, (1, 4))])
def test_one_token_gemv_matches_reference_in_a_graph(shape: str, quant: str | None, ep: tuple | None) -> None:
    """engine/layers/moe_gemv.py at real shapes, for every config of the sweep's grid corner:
    within the fused path's error of the float32 reference, counts as routed; captured in a CUDA
    graph, replays equal eager."""
    from engine.layers import moe_kernels as mk
    from engine.layers.moe_gemv import GemvConfig, one_token_experts

    h, e, k, _ = SHAPES[shape]
    ex = make_experts(shape, quant, ep)
    stacks = [mk.Stack(getattr(ex, n), getattr(ex, n + "_scale", None), ex.quant) for n in ("w13", "w2")]
    w, ids = routing(1, e, k, seed=9, skew=False)
    x = torch.randn(1, h, device="cuda", dtype=torch.bfloat16)
    ref = reference(ex, x, w, ids)
    fused = _rel(mk.fused_experts(x, w, ids, *stacks, ex.token_counts, ex.first, mk.config_for(x.device, k, e)), ref)
    for cfg in (GemvConfig(4, 2048, 4, 1024, 4), GemvConfig(2, 1024, 8, 256, 8)):
        ex.token_counts.zero_()
        y = one_token_experts(x, w, ids, *stacks, ex.token_counts, ex.first, cfg)
        assert _rel(y, ref) <= 1.2 * fused + 1e-3, (cfg, _rel(y, ref), fused)
        assert torch.equal(ex.token_counts, torch.bincount(ids.flatten(), minlength=e))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = one_token_experts(x, w, ids, *stacks, ex.token_counts, ex.first, cfg)
    ex.token_counts.zero_()
    graph.replay()
    assert torch.equal(out, one_token_experts(x, w, ids, *stacks, torch.zeros_like(ex.token_counts), ex.first, cfg))
    assert torch.equal(ex.token_counts, torch.bincount(ids.flatten(), minlength=e))


def test_norm_folded_into_the_one_token_gemvs() -> None:
    """MoE.add_norm_forward (Qwen3-30B-A3B's block at one token: the residual add and the RMSNorm
    in the router's GEMV, which stores the normalized row for the experts; no norm launch) against
    the norm's launch then forward: outputs within rounding (the router's input is not rounded to
    bf16 in the fold: at this seed no expert changes), the same new residual; captured, replays
    equal eager."""
    from engine.layers import ops
    from engine.layers.moe import MoE

    h, e, k, inter = SHAPES["qwen3-30b-a3b"]
    spec = SimpleNamespace(num_experts=e, top_k=k, intermediate_size=inter, scoring_func="softmax",
                           topk_method="greedy", norm_topk_prob=True, n_group=1, topk_group=1,
                           routed_scaling_factor=1.0, num_shared_experts=0, router_float32=False)
    torch.manual_seed(3)
    with torch.device("cuda"):
        moe = MoE(h, spec, torch.bfloat16)
    for p in (moe.gate.weight, moe.experts.w13, moe.experts.w2):
        p.data.normal_(0, 0.02)
    nw = (torch.rand(h, device="cuda") + 0.5).to(torch.bfloat16)
    x, res = (torch.randn(1, h, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    got = moe.add_norm_forward(x, res, nw, 1e-6)
    assert got is not None, "one token on one rank takes the fold"
    hn, s = ops.fused_add_rms_norm(x.clone(), res.clone(), nw, 1e-6)
    assert torch.equal(got[1], s)
    want = moe(hn)
    assert _rel(got[0], want) < 2e-2, _rel(got[0], want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = moe.add_norm_forward(x, res, nw, 1e-6)
    graph.replay()
    assert torch.equal(out, moe.add_norm_forward(x, res, nw, 1e-6)[0])
