"""The fused MoE kernels (engine/layers/moe_kernels.py) against the torch path of
engine/layers/moe.py's `Experts` on the same weights, run by triton's interpreter on the CPU on
tiny shapes: plain (float32, bfloat16) and fp8 (row and 128 x 128 block scales) stacks, uneven
routing, experts without tokens, one token, and expert-parallel ranks holding half the experts.
Also the alignment's invariants (segments padded to BLOCK_M, flat order kept within an expert)
and the per-expert counts (a CUDA graph's padding rows not counted). Skipped where triton is not
installed; tests/gpu/test_moe_gpu.py runs the compiled kernels at real shapes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels module is first imported
pytest.importorskip("triton")

from engine.layers import moe_kernels as mk  # noqa: E402
from engine.layers import moe_quant  # noqa: E402
from engine.layers.moe import Experts, PadRows, is_grouped, route  # noqa: E402
from engine.layers.parallel import ParallelState, TPGroup, set_parallel_state  # noqa: E402
from engine.layers.tuning import KernelTuning, parse_tuning  # noqa: E402

CFG = mk.GemmConfig(16, 16, 32, 2, 4, 1)  # interpreter-sized blocks (a few programs)


@pytest.fixture
def ep_rank() -> Iterator[None]:
    yield
    set_parallel_state(ParallelState())


def _experts(e: int, h: int, inter: int, dtype: torch.dtype, seed: int, quant: str | None = None,
             ep: tuple[int, int] | None = None) -> Experts:
    spec = SimpleNamespace(num_experts=e, intermediate_size=inter)
    set_parallel_state(ParallelState(ep=TPGroup(*ep)) if ep else ParallelState())
    ex = Experts(h, spec, torch.float32)
    g = torch.Generator().manual_seed(seed)
    for p in (ex.w13, ex.w2):
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    if quant:
        moe_quant.quantize(ex, quant)  # the torch path dequantizes them every forward
    else:
        ex.to(dtype)
    set_parallel_state(ParallelState())
    return ex


def _routing(t: int, k: int, e: int, seed: int, hot: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 weights [t, k], distinct ids [t, k]); `hot`: every token's first choice."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    if hot is not None:
        for r in ids:
            j = int((r == hot).nonzero()[0, 0]) if (r == hot).any() else k - 1
            r[0], r[j] = hot, r[0]
    return torch.rand(t, k, generator=g) + 0.05, ids


def _fused(ex: Experts, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    stacks = [mk.Stack(getattr(ex, n), getattr(ex, n + "_scale", None), ex.quant) for n in ("w13", "w2")]
    return mk.fused_experts(x, w, ids, *stacks, ex.token_counts, ex.first, CFG)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.parametrize(("t", "k", "e", "hot", "dtype", "tol"), [
    (7, 3, 6, None, torch.float32, 1e-5),
    (1, 2, 5, None, torch.float32, 1e-5),  # one token: two experts, the others idle
    (19, 2, 9, 4, torch.float32, 1e-5),  # every token to expert 4: its segment spans two blocks
    (6, 4, 11, 0, torch.bfloat16, 2e-2),
])
def test_fused_equals_torch_path(t: int, k: int, e: int, hot: int | None, dtype: torch.dtype, tol: float) -> None:
    h, inter = 48, 40
    ex = _experts(e, h, inter, dtype, seed=t + e)
    w, ids = _routing(t, k, e, seed=t, hot=hot)
    x = torch.randn(t, h).to(dtype)
    ref = ex(x, w, ids)
    ref_counts = ex.token_counts.clone()
    ex.token_counts.zero_()
    y = _fused(ex, x, w, ids)
    assert y.dtype == dtype and y.shape == (t, h)
    assert _rel(y, ref) < tol
    assert torch.equal(ex.token_counts, ref_counts)
    assert torch.equal(ref_counts, torch.bincount(ids.flatten(), minlength=e))


@pytest.mark.parametrize("fmt", ["fp8_row", "fp8_block"])
def test_fp8_stacks_dequantized_in_the_kernel(fmt: str) -> None:
    """e4m3 stacks with their scales, against the torch path's per-forward dequantization; K of
    w13 (hidden 144) spans two 128-column scale blocks, the gate and up rows share one."""
    t, k, e, h, inter = 5, 2, 4, 144, 128 if fmt == "fp8_block" else 40  # block: gate and up start on blocks
    ex = _experts(e, h, inter, torch.float32, seed=3, quant=fmt)
    assert ex.w13.dtype == torch.float8_e4m3fn
    w, ids = _routing(t, k, e, seed=5, hot=1)
    x = torch.randn(t, h)
    assert _rel(_fused(ex, x, w, ids), ex(x, w, ids)) < 1e-5


@pytest.mark.parametrize("quant", [None, "fp8_block"])
def test_ep_ranks_sum_to_all_experts(ep_rank: None, quant: str | None) -> None:
    """ep=2: each rank's fused partial sum equals its torch path's (the pairs routed to the other
    rank's experts contribute zeros), and the two sum to ep=1's output."""
    t, k, e, h, inter = 6, 3, 8, 48, 128 if quant else 40
    whole = _experts(e, h, inter, torch.float32, seed=11, quant=quant)
    w, ids = _routing(t, k, e, seed=2)
    x = torch.randn(t, h)
    parts = []
    for rank in range(2):
        ex = _experts(e, h, inter, torch.float32, seed=11, ep=(rank, 2))
        assert ex.first == rank * e // 2 and ex.w13.shape[0] == e // 2
        for n in ("w13", "w2"):  # the rank's rows of the whole stacks
            getattr(ex, n).data = getattr(whole, n).data[ex.first : ex.first + e // 2].clone()
            if quant:
                setattr(ex, n + "_scale", getattr(whole, n + "_scale")[ex.first : ex.first + e // 2].clone())
        ex.quant = quant
        y = _fused(ex, x, w, ids)
        assert _rel(y, ex(x, w, ids)) < 1e-5
        parts.append(y)
    assert _rel(parts[0] + parts[1], whole(x, w, ids)) < 1e-5


def _spec(e: int, k: int, scoring: str, method: str, norm: bool, scale: float, groups: int = 1,
          kept: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(num_experts=e, top_k=k, scoring_func=scoring, topk_method=method, norm_topk_prob=norm,
                           n_group=groups, topk_group=kept or groups, routed_scaling_factor=scale)


@pytest.mark.parametrize("spec", [
    _spec(5, 2, "softmax", "greedy", True, 1.0),  # Qwen3-MoE
    _spec(16, 3, "softmax", "greedy", False, 1.0),
    _spec(9, 4, "sigmoid", "noaux_tc", True, 2.5),  # GLM-4.5: one group, the correction bias steers
    _spec(12, 2, "sigmoid", "noaux_tc", True, 2.5, groups=3),  # every group kept: no grouping
    _spec(16, 4, "sigmoid", "noaux_tc", True, 2.5, groups=4, kept=2),  # DeepSeek-V3
    _spec(12, 3, "softmax", "group_limited_greedy", False, 1.0, groups=4, kept=1),  # V2, 3 experts a group
], ids=["qwen3", "softmax-nonorm", "glm", "groups-all-kept", "v3-grouped", "v2-grouped"])
def test_route_kernel_equals_route(spec: SimpleNamespace) -> None:
    assert is_grouped(spec) == (spec.topk_group < spec.n_group)
    g = torch.Generator().manual_seed(spec.num_experts)
    logits = torch.randn(6, spec.num_experts, generator=g)
    bias = 0.05 * torch.randn(spec.num_experts, generator=g) if spec.topk_method == "noaux_tc" else None
    w_ref, ids_ref = route(logits, spec, bias)
    w, ids = mk.route(logits, spec, bias)
    assert torch.equal(ids, ids_ref)
    if is_grouped(spec):  # the groups change the choice of these tokens
        assert not torch.equal(ids_ref, route(logits, SimpleNamespace(**{**vars(spec), "topk_group": spec.n_group}),
                                              bias)[1])
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7)
    w16, ids16 = mk.route(logits.bfloat16(), spec, bias)  # Qwen MoE's logits come in the model's dtype
    w16_ref, ids16_ref = route(logits.bfloat16(), spec, bias)
    assert torch.equal(ids16, ids16_ref)
    torch.testing.assert_close(w16, w16_ref, rtol=1e-6, atol=1e-7)


def test_align_pads_segments_and_keeps_flat_order() -> None:
    """sorted_ids: each local expert's pairs in flat order, its segment padded to BLOCK_M with
    `numel`; block_expert names each block's expert; experts without pairs get no block. EP
    rank 1 of 2 (experts 3..5 of 6) sees only its pairs. Padding rows (keys below) left out."""
    ids = torch.tensor([[3, 1], [4, 3], [3, 5], [0, 4], [3, 2]])
    counts = torch.zeros(6, dtype=torch.int64)
    keys = torch.tensor([9, 9, 9, 9, 0])  # the last row is padding
    sorted_ids, block_expert, num_padded, blocks, numel = mk.align(ids, counts, 3, 3, 4, (keys, 1))
    assert numel == 10 and blocks == mk.triton.cdiv(10 + 3 * 3, 4)
    n = int(num_padded)
    flat = ids.flatten().tolist()
    want = {3: [0, 3, 4], 4: [2, 7], 5: [5]}  # flat positions, in order (the padding row's 8 left out)
    got: dict[int, list[int]] = {}
    for b in range(n // 4):
        rows = sorted_ids[4 * b : 4 * b + 4].tolist()
        got.setdefault(3 + int(block_expert[b]), []).extend(r for r in rows if r < numel)
        assert all(flat[r] == 3 + int(block_expert[b]) for r in rows if r < numel)
    assert got == want and n == 4 + 4 + 4
    assert counts.tolist() == [1, 1, 0, 3, 2, 1]  # the padding row's pairs (3, 2) left out


def test_fused_leaves_padding_rows_out() -> None:
    """A CUDA graph's padding rows: their pairs are not computed (segments hold only the real
    rows', so a padding row alone on an expert costs that expert no block) and their output is
    zeros; the real rows get the bits of a forward without them."""
    ex = _experts(6, 48, 40, torch.float32, seed=2)
    w, ids = _routing(5, 2, 6, seed=4)
    ids[3:] = torch.tensor([[5, 4], [5, 4]])  # rows 3, 4 (padding) alone on experts 4 and 5
    ids[:3] = torch.tensor([[0, 1], [2, 3], [1, 0]])
    x = torch.randn(5, 48)
    want = _fused(ex, x[:3].contiguous(), w[:3].contiguous(), ids[:3].contiguous())
    ex.token_counts.zero_()
    stacks = [mk.Stack(ex.w13, None, None), mk.Stack(ex.w2, None, None)]
    keys = torch.tensor([9, 9, 9, 0, 0])
    y = mk.fused_experts(x, w, ids, *stacks, ex.token_counts, 0, CFG, (keys, 1))
    assert torch.equal(y[:3], want) and not y[3:].any()
    assert ex.token_counts.tolist() == [2, 2, 1, 1, 0, 0]
    counts = torch.zeros(6, dtype=torch.int64)
    *_, num_padded, _, _ = mk.align(ids, counts, 0, 6, CFG.block_m, (keys, 1))
    assert int(num_padded) == 4 * CFG.block_m  # experts 0..3 only


@pytest.mark.parametrize("quant", [None, "fp8_block"])
def test_det_config_rows_keep_their_bits(quant: str | None) -> None:
    """mk.DET_CONFIG (deterministic inference's candidate): a token's output has the same bits
    alone, among 5 and among 23 tokens (other tokens on its experts or not). In float32, where
    the interpreter's sums show a change of config (a BLOCK_K of 32 for one batch breaks it)."""
    ex = _experts(6, 128, 128, torch.float32, seed=5, quant=quant)
    w, ids = _routing(23, 2, 6, seed=6, hot=3)
    x = torch.randn(23, 128)
    stacks = [mk.Stack(getattr(ex, n), getattr(ex, n + "_scale", None), ex.quant) for n in ("w13", "w2")]

    def run(rows: slice) -> torch.Tensor:
        return mk.fused_experts(x[rows].contiguous(), w[rows].contiguous(), ids[rows].contiguous(), *stacks,
                                ex.token_counts, 0, mk.DET_CONFIG)

    full = run(slice(0, 23))
    assert torch.equal(run(slice(0, 5)), full[:5])
    for t in (0, 4, 22):
        assert torch.equal(run(slice(t, t + 1)), full[t : t + 1])


def test_torch_path_counts_skip_padding_rows() -> None:
    ex = _experts(5, 32, 16, torch.float32, seed=1)
    w, ids = _routing(4, 2, 5, seed=9)
    ex(torch.randn(4, 32), w, ids, PadRows(torch.tensor([0, 7, 7, 0]), 4))
    assert torch.equal(ex.token_counts, torch.bincount(ids[1:3].flatten(), minlength=5))


def test_tuning_picks_blocks_by_rows_per_expert() -> None:
    t = parse_tuning({"moe_gemm": [{"config": [16, 32, 64, 1, 4, 2], "max_rows": 8},
                                   {"config": [64, 64, 64, 8, 4, 3]}]}, "gpu")
    assert t.moe_config(1) == (16, 32, 64, 1, 4, 2) and t.moe_config(9) == (64, 64, 64, 8, 4, 3)
    assert KernelTuning().moe_config(4)[0] == 16 and KernelTuning().moe_config(4096)[0] == 128
    with pytest.raises(ValueError, match="moe_gemm"):
        parse_tuning({"moe_gemm": [{"config": [16, 32, 64]}]}, "gpu")
