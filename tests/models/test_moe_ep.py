"""Expert parallelism (`--ep-size`, engine/layers/moe.py `Experts`): whole experts per rank.

In process, a rank is simulated by setting its parallel state: each rank's stacks hold exactly
its experts' rows of the ep=1 model (from a checkpoint, an fp8 one, and dummy weights), and the
ranks' partial outputs sum to the ep=1 block's. Over gloo (tp_harness, 2 spawned ranks): ep=2
gives ep=1's greedy tokens. Sizes that do not divide fail at start, naming the flag."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_moe import GLM4_MOE_GROUPED, make_moe_dir

from engine.config import ServerConfig
from engine.layers.moe import Experts, route
from engine.layers.parallel import ParallelState, TPGroup, set_parallel_state
from models.registry import load_model
from scripts.quantize_checkpoint import quantize_dir

CONFIG = GLM4_MOE_GROUPED | {"n_routed_experts": 6, "n_group": 3, "topk_group": 2, "num_experts_per_tok": 3}
BLOCK = {"moe_intermediate_size": 128, "intermediate_size": 128, "hidden_size": 128, "head_dim": 64}  # fp8 blocks


@pytest.fixture
def ep_state() -> Iterator[None]:
    yield
    set_parallel_state(ParallelState())  # the default back for the other tests


def _load(path: Path, rank: int | None, **kw: object) -> Experts:
    """Layer 1's experts as ep rank `rank` of 2 (None: ep=1) loads them."""
    set_parallel_state(ParallelState(ep=TPGroup(rank, 2)) if rank is not None else ParallelState())
    model, _ = load_model(path, progress=False, **kw)
    return model.model.layers[1].mlp.experts


@pytest.mark.parametrize("source", ["checkpoint", "fp8-block", "dummy"])
def test_ep_ranks_hold_their_experts_and_sum_to_ep1(tmp_path: Path, ep_state: None, source: str) -> None:
    cfg = CONFIG | (BLOCK if source == "fp8-block" else {})
    path = make_moe_dir(tmp_path / "m", cfg)
    if source == "fp8-block":
        path = quantize_dir(path, tmp_path / "q", "fp8-block")
    kw = {"load_format": "dummy"} if source == "dummy" else {}
    one, ranks = _load(path, None, **kw), [_load(path, r, **kw) for r in (0, 1)]
    for r, x in enumerate(ranks):
        assert (x.first, x.local_experts) == (3 * r, 3) and x.w13.shape[0] == x.w2.shape[0] == 3
        assert torch.equal(x.w13, one.w13[3 * r : 3 * r + 3]) and torch.equal(x.w2, one.w2[3 * r : 3 * r + 3])
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(17, cfg["hidden_size"], generator=gen)
    weights, ids = route(torch.randn(17, 6, generator=gen), _spec(path), None)
    assert set(ids.flatten().tolist()) & {0, 1, 2} and set(ids.flatten().tolist()) & {3, 4, 5}
    want = one(h, weights, ids)
    got = ranks[0](h, weights, ids) + ranks[1](h, weights, ids)  # the block's all-reduce
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(x.token_counts, one.token_counts) for x in ranks)  # every rank counts every expert


def _spec(path: Path) -> object:
    from models.config import ModelConfig

    return ModelConfig.from_dir(path).moe


def test_ep2_equals_ep1_over_gloo(tmp_path: Path, ep_state: None) -> None:
    """2 ranks: attention tensor-parallel, experts 0-2 on rank 0 and 3-5 on rank 1; the same
    greedy tokens as one rank (replica digests checked every step by tp_harness). The checkpoint
    is fp8-block with 128-wide experts: tensor parallelism would cut each expert's blocks (it
    refuses), so ep=2 running at all shows the experts are whole on each rank."""
    from tp_harness import run_tp

    from msgs.params import SamplingParams

    cfg = CONFIG | BLOCK | {"num_key_value_heads": 4, "n_shared_experts": 2, "intermediate_size": 256}
    path = quantize_dir(make_moe_dir(tmp_path / "m", cfg), tmp_path / "q", "fp8-block")
    set_parallel_state(ParallelState(tp=TPGroup(0, 2)))
    with pytest.raises(ValueError, match="128-wide blocks; choose a --tp-size .*, or --ep-size equal to --tp-size"):
        load_model(path, progress=False)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    waves = [([[5, 17, 99, 3, 42, 7, 8, 1, 4], [200, 11, 64, 9, 30]], greedy)]

    def run(tp: int, ep: int) -> list:
        cfg = ServerConfig(model=str(path), device="cpu", dtype="float32", tp_size=tp, ep_size=ep, cpu_threads=1,
                           page_size=4, max_prefill_tokens=16, max_total_tokens=1024, max_running_requests=4)
        return [[o.output_ids for o in w] for w in run_tp(cfg, waves)]

    one, two = run(1, 1), run(2, 2)
    assert two == one and all(len(ids) == 8 for w in two for ids in w)


def test_sizes_that_do_not_divide_are_named(tmp_path: Path, ep_state: None) -> None:
    with pytest.raises(ValueError, match=r"--ep-size 2 must be 1 or equal to --tp-size 4"):
        ServerConfig(model="", device="cpu", tp_size=4, ep_size=2)
    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIG | {"n_routed_experts": 9}))
    set_parallel_state(ParallelState(ep=TPGroup(0, 2)))
    with pytest.raises(ValueError, match=r"--ep-size 2 does not divide the model's 9 routed experts"):
        load_model(path, load_format="dummy", progress=False)


def test_expert_parallelism_of_a_dense_model_is_refused(default_model_dir: Path) -> None:
    from engine.run.assembly import load_checked

    cfg = ServerConfig(model=str(default_model_dir), device="cpu", tp_size=2, ep_size=2)
    with pytest.raises(ValueError, match="--ep-size 2: the model has no experts"):
        load_checked(cfg, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("state", ["ep", "tp"])
def test_dummy_draws_in_row_chunks_fill_a_rank_as_one_draw(tmp_path: Path, ep_state: None, state: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A big dummy tensor is drawn in chunks of rows (models/loader.py, DUMMY_DRAW_ELEMS): every
    parameter of an ep rank and of a tp rank (shards along dim 0 and dim 1, fused pieces) gets from
    chunks of 1-3 rows what it gets from the whole tensor at once; and an ep rank's dummy experts,
    drawn in chunks, are the ep=1 model's rows drawn in the same chunks."""
    from engine.layers.parallel import sharding_of
    from models import loader

    path = make_moe_dir(tmp_path / "m", CONFIG)
    monkeypatch.setattr(loader, "DUMMY_DRAW_ELEMS", 3000)
    group = ParallelState(ep=TPGroup(1, 2)) if state == "ep" else ParallelState(tp=TPGroup(1, 2))
    set_parallel_state(group)
    model, _ = load_model(path, progress=False, load_format="dummy")
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        sh = sharding_of(p)
        full = tuple(p.shape) if sh is None else sh.full_shape
        if not full:
            continue
        x = torch.randn(full, generator=gen)
        whole, chunked = torch.zeros_like(p), torch.zeros_like(p)
        for dst in (whole, chunked):  # the parameter's marks, which fill_from_rows reads
            for attr in ("tp_sharding", "moe_experts", "moe_expert_range"):
                if hasattr(p, attr):
                    setattr(dst, attr, getattr(p, attr))
        loader.fill_from_rows(whole, full, iter([(0, x)]))
        step = 1 + len(name) % 3
        loader.fill_from_rows(chunked, full, ((r, x[r : r + step]) for r in range(0, full[0], step)))
        assert torch.equal(whole, chunked), name
    if state == "ep":
        one = _load(path, None, load_format="dummy")
        mine = model.model.layers[1].mlp.experts
        assert torch.equal(mine.w13, one.w13[3:6]) and torch.equal(mine.w2, one.w2[3:6])
