"""One token's routed experts as two GEMV launches (engine/layers/moe_gemv.py) against the torch
path of engine/layers/moe.py's `Experts` on the same weights, in triton's interpreter on tiny
shapes: float32, bfloat16 and fp8_row stacks, K and N not multiples of the tiles, an expert-parallel
rank (pairs routed elsewhere add nothing) and the counts.
tests/gpu/test_moe_gpu.py runs the compiled kernels at Qwen3-30B-A3B's shapes."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels module is first imported
pytest.importorskip("triton")

from engine.layers import moe_kernels as mk  # noqa: E402
from engine.layers.moe_gemv import GemvConfig, one_token_experts  # noqa: E402
from tests.run.test_moe_kernels import CFG as FUSED  # noqa: E402
from tests.run.test_moe_kernels import _experts, _rel, _routing, ep_rank  # noqa: E402, F401

CFG = GemvConfig(4, 32, 8, 16, 4)  # several programs and K tiles, the last ones partial


def _stacks(ex) -> list[mk.Stack]:  # noqa: ANN001
    return [mk.Stack(getattr(ex, n), getattr(ex, n + "_scale", None), ex.quant) for n in ("w13", "w2")]


@pytest.mark.parametrize(("dtype", "quant", "tol"), [
    (torch.float32, None, 1e-5), (torch.bfloat16, None, 3e-2), (torch.float32, "fp8_row", 1e-5),
])
def test_one_token_equals_torch_path(dtype: torch.dtype, quant: str | None, tol: float) -> None:
    e, k, h, inter = 9, 3, 72, 40  # h: two full K tiles and a partial one; inter: N tiles of 4 and 8, partial
    ex = _experts(e, h, inter, dtype, seed=4, quant=quant)
    w, ids = _routing(1, k, e, seed=6)
    x = torch.randn(1, h, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = ex(x, w, ids)  # bf16: rounded where torch's CPU matmuls round, not where the kernels do
    ex.token_counts.zero_()
    y = one_token_experts(x, w, ids, *_stacks(ex), ex.token_counts, ex.first, CFG)
    assert y.dtype == dtype and y.shape == (1, h)
    assert _rel(y, ref) < tol
    assert torch.equal(ex.token_counts, torch.bincount(ids.flatten(), minlength=e))
    fused = mk.fused_experts(x, w, ids, *_stacks(ex), ex.token_counts, ex.first, FUSED)
    assert _rel(y, fused) < 1e-3  # the fused path's rounding points: only the sums' order differs


def test_ep_rank(ep_rank: None) -> None:  # noqa: F811 - test_moe_kernels.ep_rank
    """ep=2, rank 1 (experts 4..7): the pairs routed to experts 0..3 add nothing but are counted."""
    e, h, inter = 8, 48, 24
    ex = _experts(e, h, inter, torch.float32, seed=8, ep=(1, 2))
    w = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    ids = torch.tensor([[5, 1, 7, 2]])
    x = torch.randn(1, h, generator=torch.Generator().manual_seed(2))
    ref = ex(x, w, ids)
    ex.token_counts.zero_()
    y = one_token_experts(x, w, ids, *_stacks(ex), ex.token_counts, ex.first, CFG)
    assert _rel(y, ref) < 1e-5 and ex.token_counts.tolist() == [0, 1, 1, 0, 0, 1, 0, 1]
