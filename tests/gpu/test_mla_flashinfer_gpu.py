"""flashinfer's MLA decode as served (engine/layers/flashinfer_mla.py through MLABackend) on CUDA,
bf16: the tuning rule's choice per head count; at DeepSeek-V3's shapes (128 heads, latent 512 +
64) eager pure-decode and mixed steps against the torch absorbed path; a tiny DeepSeek-V3 of 64
heads (latent 512 + 64, YaRN scale) whose decode logits, eager and replayed from the graph
runner's CUDA graphs, match the triton kernel's; and the served model's greedy tokens with
flashinfer (graphs and eager) against the triton kernel's (a differing token only at a near tie of
transformers' float32 logits)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.gpu.mla_helpers import (
    BF,
    CUDA,
    P,
    R,
    close,
    mla_backend,
    near_tie_failures,
    prefilled,
    rel_err,
    save_tiny,
    served_greedy,
    tiny_v3,
    v3_step,
)


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

    override_tuning(mla_flashinfer_min_heads=64, mla_flashmla=False)  # FlashMLA would take 64-token pages
    yield
    override_tuning()


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek-V3 at 64 heads with the latent flashinfer's kernels take."""
    return save_tiny(tiny_v3(64), tmp_path_factory.mktemp("tiny-v3-h64"))


def test_kernel_choice_follows_the_tuning_rule() -> None:
    """No override: this GPU's file decides (the H200's: flashinfer from 64 heads); an fp8 pool or
    another latent keeps ours."""
    from engine.layers.kv_layout import KVLayout
    from engine.layers.kv_pool import KVPool
    from engine.layers.tuning import load_tuning

    tuning = load_tuning(torch.cuda.get_device_name())
    kv = KVPool.from_layout(KVLayout.latent(R, P), 1, 4, 16, BF, CUDA)
    for heads in (128, 64, 16):
        b = mla_backend(heads, kv)
        assert b.kernel == tuning.mla_decode_kernel(heads, True), heads
        assert (b.fi is not None) == (b.kernel == "flashinfer") and b.uses_table(8) == (b.fi is None)
    if torch.cuda.get_device_name() == "NVIDIA H200":
        assert [mla_backend(h, kv).kernel for h in (128, 64, 16)] == ["flashinfer", "flashinfer", "triton"]
    fp8 = KVPool.from_layout(KVLayout.latent(R, P), 1, 4, 16, torch.float8_e4m3fn, CUDA)
    small = KVPool.from_layout(KVLayout.latent(64, 16), 1, 4, 16, BF, CUDA)
    assert mla_backend(128, fp8).kernel == "triton" and mla_backend(128, small).kernel == "triton"


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
    kv, batch, q, w, s = v3_step(lens, extend, page_size)
    backend = mla_backend(128, kv, max_pages=2048)
    assert backend.kernel == "flashinfer"
    want = mla_attend(*q, MLAPlan.build(batch, kernel=False), kv, 0, w, s)
    backend.prepare(batch)
    assert backend.graph is backend.fi and backend.fi.rows == extend.count(1)
    plan = MLAPlan.build(batch, kernel=True, graph=backend.graph)
    assert plan.decode_fi is backend.fi
    got = mla_attend(*q, plan, kv, 0, w, s)
    err = rel_err(got, want)
    assert (err < 0.02).all(), err.tolist()  # bf16 q_lat, probabilities and output (ours: the same bound)
    backend.prepare(batch)  # planned again (the geometry known now): as close
    again = mla_attend(*q, MLAPlan.build(batch, kernel=True, graph=backend.graph), kv, 0, w, s)
    assert (rel_err(again, want) < 0.02).all()


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
        ops.set_fused(False)  # torch norms and activations: only the MLA module JIT-compiles
        model, kv, tables, step, _ = prefilled(tiny64, lens, 16, 128)
        fi = mla_backend(64, kv, max_batch=8, max_pages=64)
        override_tuning(mla_flashinfer_min_heads=0)
        tri = mla_backend(64, kv, max_batch=8, max_pages=64)
        assert (fi.kernel, tri.kernel) == ("flashinfer", "triton")
        tri.prepare(step)
        want = model(step, kv, tri)
        fi.prepare(step)
        close(model(step, kv, fi), want)
        with torch.inference_mode():  # as the runner captures and replays
            runner = CudaGraphRunner(model, kv, fi, 8, CUDA)
            runner.capture()
            last = torch.zeros(8, dtype=torch.int64, device=CUDA)
            ids = [7 + i for i in range(len(lens))]
            got = runner.run_decode(ids, list(range(len(lens))), lens, tables, last).clone()
            close(got, want)
            sub = [0, 2, 3]  # 3 rows: the size-4 graph, one padding row
            step_sub = ForwardBatch.from_requests([([ids[i]], lens[i], tables[i]) for i in sub], 16, CUDA)
            tri.prepare(step_sub)
            want_sub = model(step_sub, kv, tri)
            got_sub = runner.run_decode([ids[i] for i in sub], sub, [lens[i] for i in sub],
                                        [tables[i] for i in sub], last)
            close(got_sub, want_sub)
        assert runner.replays == 2
    finally:
        ops.set_fused(True)


def test_served_tiny_v3_64_heads_greedy_flashinfer_vs_triton(tiny64: Path, mla_built: None,
                                                            flashinfer_from_64: None) -> None:
    """The served path (scheduler + runner, chunked prefill beside decode rows, overlap; torch norms
    and activations, so only the MLA module JIT-compiles): greedy tokens with flashinfer in CUDA
    graphs and eager equal the triton kernel's in CUDA graphs; a differing token only where
    transformers' float32 logits of the two are within 0.1."""
    from engine.layers import ops

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 70, 40, 130)]
    ops.set_fused(False)
    try:
        runs = {name: served_greedy(tiny64, prompts, graphs, 16, 64, mla_flashinfer_min_heads=heads)[1:]
                for name, graphs, heads in (("fi-graphs", True, 64), ("fi-eager", False, 64), ("triton", True, 0))}
    finally:
        ops.set_fused(True)
    assert {k: v[0] for k, v in runs.items()} == {"fi-graphs": "flashinfer", "fi-eager": "flashinfer",
                                                  "triton": "triton"}
    assert runs["fi-graphs"][1] > 0 and runs["triton"][1] > 0 and runs["fi-eager"][1] == 0
    bad = near_tie_failures(tiny64, prompts, runs["triton"][2], {k: runs[k][2] for k in ("fi-graphs", "fi-eager")},
                            0.1)
    assert not bad, bad
