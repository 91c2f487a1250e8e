"""Tensor parallelism on CPU (gloo): tp=2 gives tp=1's greedy tokens, every rank's replica
digest and token chain checked at every step (tp_harness: real ranks in spawned processes).

Cases: the default model (SmolLM2-135M: 3 K/V heads, split 2 + 1 over 2 ranks); random Qwen3
configs with one K/V head (replicated on both ranks), with 3 K/V heads and an odd vocabulary
and MLP width (uneven splits), untied LM head; each with chunked prefill, a second wave that
reuses cached prefixes, and overlap (one step planned ahead).

Also the layers alone: the triton GEMVs on shard shapes (triton's interpreter, float32) give
F.linear's result, a shard no tuning rule takes stays on F.linear, and the all-reduce takes the
one-shot path only for the messages it accepts.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported: the GEMVs run interpreted

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from model_harness import make_hf_dir, tiny_config  # noqa: E402
from tp_harness import run_tp  # noqa: E402

from engine.config import ServerConfig
from engine.layers import parallel, triton_ops
from engine.layers.parallel import (
    ColumnParallelLinear,
    ParallelState,
    RowParallelLinear,
    TPGroup,
    head_shard,
    parallel_state,
    range_split,
    set_parallel_state,
)
from engine.layers.tuning import load_tuning
from models.config import ModelConfig
from models.llama import LlamaForCausalLM
from models.loader import init_dummy, load_safetensors
from msgs.params import SamplingParams

pytestmark = pytest.mark.usefixtures("vendor_kernels")  # these test the default kernels

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


def _waves(vocab: int, n: int = 3, length: int = 37) -> list:
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, vocab, (24,), generator=g).tolist()  # a common prefix: cached in wave 2
    first = [shared + torch.randint(3, vocab, (length - 24 + i,), generator=g).tolist() for i in range(n)]
    second = [shared + torch.randint(3, vocab, (5 + i,), generator=g).tolist() for i in range(n)]
    return [(first, GREEDY), (second, GREEDY)]


def _cfg(model: Path, tp: int, **kw: object) -> ServerConfig:
    # page 4 and a 16-token budget: prompts are prefilled in chunks, prefixes cached page by page
    # float32: tp=2 must give tp=1's tokens (bf16 sums of two partial products round differently)
    return ServerConfig(model=str(model), device="cpu", dtype="float32", tp_size=tp, cpu_threads=1, page_size=4,
                        max_prefill_tokens=16, max_total_tokens=2048, max_running_requests=8, **kw)


def _check_same(model: Path, vocab: int, **kw: object) -> None:
    waves = _waves(vocab)
    one = run_tp(_cfg(model, 1, **kw), waves)
    two = run_tp(_cfg(model, 2, **kw), waves)
    assert [[o.output_ids for o in w] for w in two] == [[o.output_ids for o in w] for w in one]
    assert all(len(o.output_ids) == GREEDY.max_new_tokens for w in two for o in w)
    assert min(o.cached_tokens for o in two[1]) >= 20, "the second wave reuses the shared prefix"


def test_tp2_default_model(default_model_dir: Path) -> None:
    _check_same(default_model_dir, ModelConfig.from_dir(default_model_dir).vocab_size)


@pytest.mark.parametrize(("kv_heads", "heads", "vocab", "inter", "tied"), [
    (1, 4, 256, 96, True),  # fewer K/V heads than ranks: the one K/V head is replicated
    (3, 6, 251, 95, False),  # 3 K/V heads on 2 ranks (2 + 1), odd vocab and MLP: uneven shards
])
def test_tp2_random_qwen3(tmp_path: Path, kv_heads: int, heads: int, vocab: int, inter: int, tied: bool) -> None:
    cfg = tiny_config("tiny-qwen3") | {"num_key_value_heads": kv_heads, "num_attention_heads": heads,
                                       "vocab_size": vocab, "intermediate_size": inter, "tie_word_embeddings": tied}
    model = make_hf_dir(tmp_path / "m", cfg)
    _check_same(model, vocab)


def test_tp2_dummy_weights_no_overlap(tmp_path: Path) -> None:
    """The dummy load format gives each rank the slices of tp=1's weights (same tokens)."""
    model = make_hf_dir(tmp_path / "m", tiny_config("tiny-qwen3") | {"num_key_value_heads": 1})
    _check_same(model, 256, load_format="dummy", disable_overlap=True)


def test_head_shard_layouts() -> None:
    assert [head_shard(9, 3, r, 2) for r in range(2)] == [
        type(head_shard(9, 3, 0, 2))((0, 6), (0, 2)), type(head_shard(9, 3, 0, 2))((6, 9), (2, 3))]
    assert [head_shard(8, 2, r, 4).kv for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    with pytest.raises(ValueError, match="divisible"):
        head_shard(8, 2, 0, 3)
    assert [range_split(251, 2, r) for r in range(2)] == [(0, 126), (126, 251)]


def test_loader_fills_shards_like_dummy_slices(tmp_path: Path) -> None:
    """A checkpoint read at tp 1 equals the fused parameters the shards are cut from (the
    loader's piece arithmetic); the dummy init at tp 1 is unchanged by the sharding metadata."""
    path = make_hf_dir(tmp_path / "m", tiny_config("tiny-qwen3"))
    mcfg = ModelConfig.from_dir(path)
    model = LlamaForCausalLM(mcfg)
    load_safetensors(model, mcfg, path, progress=False)
    from safetensors.torch import load_file

    raw = load_file(str(path / "model.safetensors"))
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    want = torch.cat([raw[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(qkv, want)
    a, b = LlamaForCausalLM(mcfg), LlamaForCausalLM(mcfg)
    init_dummy(a, 3)
    init_dummy(b, 3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


# ---- the layers alone ------------------------------------------------------------------------

H200 = load_tuning("NVIDIA H200")


@pytest.fixture
def gemv_on_cpu(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """The H200's GEMV rules for float32 weights on the CPU (triton's interpreter runs them):
    what the layers decide on an H200, with exact float32 arithmetic to compare against."""
    pytest.importorskip("triton")

    def cfg(w: torch.Tensor) -> tuple | None:
        c = H200.gemv_config(*w.shape)
        return c if c is not None and triton_ops._fits(w.shape[1], c[1]) else None

    monkeypatch.setattr(triton_ops, "gemv_config", cfg)
    monkeypatch.setattr(parallel, "kernel_tuning", lambda device: H200)
    yield
    set_parallel_state(ParallelState())


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """float32 products of a different summation order: equal to a few ulps of the largest output"""
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-5 * ref.abs().max().item())


# (hidden, heads, kv heads, head_dim, intermediate): each shard shape meets a different rule:
# one-tile (K < 4096), looped (K = 4096: several rows then take F.linear), column-masked one
# tile (K = 768), and K that no rule takes (3 K/V heads x 20 split 2 + 1: K = 60 / 40, F.linear)
SHAPES = [(1024, 8, 4, 64, 1536), (4096, 8, 4, 32, 1024), (256, 6, 3, 20, 60)]


@pytest.mark.parametrize(("hidden", "heads", "kv", "d", "inter"), SHAPES)
@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_on_shards_matches_f_linear(gemv_on_cpu: None, hidden: int, heads: int, kv: int, d: int, inter: int,
                                         rows: int) -> None:
    """At tp 2 every shard's projection equals F.linear of that shard (float32, interpreter);
    the row-parallel partial products sum to the unsharded product."""
    x = _rand(rows, hidden, seed=1)
    w_o, w_down = _rand(hidden, heads * d, seed=2), _rand(hidden, inter, seed=3)
    o_in, down_in = _rand(rows, heads * d, seed=4), _rand(rows, 2 * inter, seed=5)
    used = []
    partial_o, partial_down = torch.zeros(rows, hidden), torch.zeros(rows, hidden)
    for rank in range(2):
        set_parallel_state(ParallelState(tp=TPGroup(rank, 2)))
        sh = head_shard(heads, kv, rank, 2)
        (qs, qe), (ks, ke) = sh.q, sh.kv
        qkv = ColumnParallelLinear(hidden, [("q", heads * d, (qs * d, qe * d)), ("k", kv * d, (ks * d, ke * d)),
                                            ("v", kv * d, (ks * d, ke * d))], False, torch.float32)
        qkv.weight.data.copy_(_rand(*qkv.weight.shape, seed=10 + rank))
        o = RowParallelLinear(heads * d, (qs * d, qe * d), hidden, False, torch.float32)
        o.weight.data.copy_(w_o[:, qs * d: qe * d])
        ms, me = range_split(inter, 2, rank)
        down = RowParallelLinear(inter, (ms, me), hidden, False, torch.float32)
        down.weight.data.copy_(w_down[:, ms:me])
        _close(qkv(x), F.linear(x, qkv.weight))
        partial_o += o.partial(o_in[:, qs * d: qe * d].contiguous())
        h = torch.cat([down_in[:, ms:me], down_in[:, inter + ms: inter + me]], dim=1)
        partial_down += down.partial(h, silu_mul=True)
        # a caller running the row-parallel GEMV itself would skip the all-reduce: it gets None
        assert o.gemv_config(o_in[:, qs * d: qe * d].contiguous()) is None
        used += [qkv.gemv_config(x[:1]) is not None, o._local_gemv(o_in[:1, qs * d: qe * d].contiguous()) is not None]
    _close(partial_o, F.linear(o_in, w_o))
    gate, up = down_in.chunk(2, dim=1)
    _close(partial_down, F.linear(F.silu(gate) * up, w_down))
    # (qkv, o_proj) per rank; o_proj's K of 80 / 40 columns (4 + 2 q heads of 20): no rule, F.linear
    assert used == ([True, False] * 2 if d == 20 else [True] * 4)


def test_shard_without_rule_is_exactly_f_linear(gemv_on_cpu: None) -> None:
    set_parallel_state(ParallelState(tp=TPGroup(1, 2)))
    lin = RowParallelLinear(95, range_split(95, 2, 1), 64, True, torch.float32)
    lin.weight.data.copy_(_rand(64, 47, seed=7))
    x = _rand(1, 47, seed=8)
    assert lin._local_gemv(x) is None
    assert torch.equal(lin.partial(x), F.linear(x, lin.weight))


def test_all_reduce_takes_the_one_shot_path_only_for_accepted_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    class FakeSymm:
        max_bytes = 64

        def takes(self, x: torch.Tensor) -> bool:
            return x.numel() * x.element_size() <= self.max_bytes

        def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
            calls.append("symm")
            return x * 2

    monkeypatch.setattr(parallel.dist, "all_reduce", lambda x, group=None: calls.append("nccl"))
    t = TPGroup(0, 2, None, FakeSymm())
    small, big = torch.ones(16), torch.ones(17)
    assert torch.equal(t.all_reduce(small), torch.full((16,), 2.0))  # a new tensor: callers use the result
    assert t.all_reduce(big) is big
    assert calls == ["symm", "nccl"]
    assert TPGroup(0, 1, None, FakeSymm()).all_reduce(small) is small and calls == ["symm", "nccl"]
    assert not parallel.symm_all_reduce_ok(1 << 20, torch.device("cpu"))
    assert not parallel.symm_all_reduce_ok(0, torch.device("cuda", 0))


def test_parallel_state_holds_every_group_and_dist_sets_it() -> None:
    """One object holds a rank's groups: tp as set, ep/cp/dp of world 1 until their flags exist;
    a rank outside its world is refused naming the group; a tp=1 worker's set-up resets it."""
    from engine.run.dist import init_distributed

    state = ParallelState(tp=TPGroup(1, 2))
    assert (state.tp.rank, state.tp.world) == (1, 2)
    assert all((g.rank, g.world) == (0, 1) for g in (state.ep, state.cp, state.dp))
    with pytest.raises(ValueError, match="ep group: rank 1 outside a world of 1"):
        ParallelState(ep=TPGroup(1, 1))
    try:
        set_parallel_state(state)
        assert RowParallelLinear(10, range_split(10, 2, 1), 4, False, torch.float32).tp is state.tp
        assert init_distributed(ServerConfig(device="cpu"), 0) == torch.device("cpu")
        assert parallel_state() == ParallelState() and parallel_state().tp.world == 1
    finally:
        set_parallel_state(ParallelState())
