"""FlashMLA's dense SM90 decode as served (engine/layers/flash_mla.py through MLABackend), bf16,
64-token pages: the choice (tuning, page size, dtypes, deterministic inference); at DeepSeek-V3's
shapes (128 and 16 heads) eager decode and mixed steps against the torch absorbed path; a tiny
DeepSeek-V3 whose decode logits, eager and replayed from the graph runner's CUDA graphs, match the
triton kernel's; the served model (auto page size: 64) whose greedy tokens with FlashMLA equal
the triton kernel's (a differing token only at a near tie of transformers' float32 logits)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# FlashMLA is an optional package (README: sgl-flash-mla); without it the engine serves MLA by its
# other kernels, and these tests of FlashMLA's path have nothing to run
pytest.importorskip("flash_mla", reason="sgl-flash-mla is not installed")

from tests.gpu.mla_helpers import (  # noqa: E402
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


@pytest.fixture
def flashmla_on() -> Iterator[None]:
    """The H200 file's choice on whatever GPU runs this."""
    from engine.layers.tuning import override_tuning

    override_tuning(mla_flashmla=True)
    yield
    override_tuning()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek-V3 at 16 heads (a rank of V3 at tp 8) with the latent FlashMLA takes."""
    return save_tiny(tiny_v3(16), tmp_path_factory.mktemp("tiny-v3-h16"))


def test_choice_needs_the_tuning_64_token_pages_bf16_and_no_determinism(flashmla_on: None) -> None:
    from engine.layers import batch_invariant
    from engine.layers.kv_layout import KVLayout
    from engine.layers.kv_pool import KVPool
    from engine.layers.tuning import load_tuning

    if torch.cuda.get_device_name() == "NVIDIA H200":
        assert load_tuning("NVIDIA H200").mla_flashmla
    kv = KVPool.from_layout(KVLayout.latent(R, P), 1, 4, 64, BF, CUDA)
    for heads in (128, 16):
        b = mla_backend(heads, kv)
        assert b.kernel == "flashmla" and b.fm is not None and b.fi is None and b.uses_table(8)
    assert mla_backend(128, KVPool.from_layout(KVLayout.latent(R, P), 1, 4, 16, BF, CUDA)).kernel != "flashmla"
    assert mla_backend(128, KVPool.from_layout(KVLayout.latent(R, P), 1, 4, 64, torch.float8_e4m3fn, CUDA)).kernel \
        == "triton"
    batch_invariant.enable(True, "cuda")
    try:
        assert mla_backend(128, kv).kernel == "triton"
    finally:
        batch_invariant.enable(False)


@pytest.mark.parametrize("heads", [128, 16])
@pytest.mark.parametrize("mixed", [False, True], ids=["decode", "mixed"])
def test_v3_shapes_eager_steps_match_torch(heads: int, mixed: bool, flashmla_on: None) -> None:
    """Uneven lengths (1, within a page, 16k+), shuffled pages; `mixed`: prefill rows beside the
    decode rows (those on the expanded path); every row against the torch absorbed path."""
    from engine.layers.mla_attention import MLAPlan, mla_attend

    lens, extend = [1, 15, 1000, 4097, 16500, 777], [1] * 6
    if mixed:
        extend = [1, 15, 1, 40, 1, 1]
    kv, batch, q, w, s = v3_step(lens, extend, 64, heads)
    backend = mla_backend(heads, kv, max_pages=512)
    want = mla_attend(*q, MLAPlan.build(batch, kernel=False), kv, 0, w, s)
    backend.prepare(batch)
    plan = MLAPlan.build(batch, kernel=True, graph=backend.graph, flashmla=backend.fm)
    assert plan.decode_fm is backend.fm and plan.decode_sched is not None
    got = mla_attend(*q, plan, kv, 0, w, s)
    err = rel_err(got, want)
    assert (err < 0.02).all(), err.tolist()  # bf16 q_lat, probabilities and output (ours: the same bound)


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
        model, kv, tables, step, _ = prefilled(tiny, lens, 64, 64)
        fm = mla_backend(16, kv, max_batch=8, max_pages=64)
        override_tuning(mla_flashmla=False)
        tri = mla_backend(16, kv, max_batch=8, max_pages=64)
        assert (fm.kernel, tri.kernel) == ("flashmla", "triton")
        tri.prepare(step)
        want = model(step, kv, tri)
        fm.prepare(step)
        close(model(step, kv, fm), want)
        with torch.inference_mode():  # as the runner captures and replays
            runner = CudaGraphRunner(model, kv, fm, 8, CUDA)
            runner.capture()
            last = torch.zeros(8, dtype=torch.int64, device=CUDA)
            ids = [7 + i for i in range(len(lens))]
            close(runner.run_decode(ids, list(range(len(lens))), lens, tables, last).clone(), want)
            sub = [0, 2, 3]  # 3 rows: the size-4 graph, one padding row
            step_sub = ForwardBatch.from_requests([([ids[i]], lens[i], tables[i]) for i in sub], 64, CUDA)
            tri.prepare(step_sub)
            want_sub = model(step_sub, kv, tri)
            got_sub = runner.run_decode([ids[i] for i in sub], sub, [lens[i] for i in sub],
                                        [tables[i] for i in sub], last)
            close(got_sub, want_sub)
        assert runner.replays == 2
    finally:
        ops.set_fused(True)


def test_served_tiny_v3_greedy_flashmla_vs_triton(tiny: Path) -> None:
    """The served path (scheduler + runner, chunked prefill beside decode rows, overlap): greedy
    tokens with FlashMLA in CUDA graphs and eager equal the triton kernel's in CUDA graphs; a
    differing token only where transformers' float32 logits of the two are within 0.1."""
    from engine.layers import ops
    from engine.layers.tuning import override_tuning

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 70, 200, 130)]
    ops.set_fused(False)
    try:
        cases = (("fm-graphs", True, True), ("fm-eager", False, True), ("triton", True, False))
        served = {name: served_greedy(tiny, prompts, graphs, 0, 128, mla_flashmla=fm) for name, graphs, fm in cases}
        assert {v[0] for v in served.values()} == {64}  # the auto page size of an MLA model on CUDA
        runs = {name: v[1:] for name, v in served.items()}
    finally:
        ops.set_fused(True)
        override_tuning()
    assert {k: v[0] for k, v in runs.items()} == {"fm-graphs": "flashmla", "fm-eager": "flashmla", "triton": "triton"}
    assert runs["fm-graphs"][1] > 0 and runs["triton"][1] > 0 and runs["fm-eager"][1] == 0
    bad = near_tie_failures(tiny, prompts, runs["triton"][2], {k: runs[k][2] for k in ("fm-graphs", "fm-eager")}, 0.1)
    assert not bad, bad
