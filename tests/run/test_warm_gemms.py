"""The GEMM warm-up's coverage: the row ladder and which weights it runs (on CPU here; on a
GPU the same calls load the kernels cuBLAS picks, before ready)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from engine.layers.moe import Router
from engine.layers.parallel import Linear, ParallelLMHead
from engine.layers.quant import ladder_rows
from engine.run.warmup import gemm_rows, warm_gemms


def test_gemm_rows_cover_every_small_count_then_a_ladder_up_to_the_largest_step() -> None:
    rows = gemm_rows(16640)
    assert rows[:256] == list(range(1, 257))
    assert rows == sorted(set(rows)) and rows[-1] == 16640
    gaps = [b - a for a, b in zip(rows, rows[1:], strict=False)]
    assert max(gaps) == 64 and max(g for a, g in zip(rows, gaps, strict=False) if a < 4096) == 16
    assert gemm_rows(10) == list(range(1, 11))
    assert gemm_rows(4100)[-2:] == [4096, 4100]



def test_deepgemm_runs_only_at_row_counts_the_warm_up_holds() -> None:
    """DeepGEMM compiles a kernel per tile choice, and picks its tiles by the exact row count: each
    call is padded to quant.ladder_rows, a count the warm-up runs (its ladder, or the top step's
    padded count), so no step meets a tile choice after ready."""
    for most in (300, 4100, 16640, 9999):
        warmed = {*gemm_rows(most), ladder_rows(most)}
        padded = {ladder_rows(m) for m in range(1, most + 1)}
        assert padded <= warmed and all(ladder_rows(m) >= m for m in range(1, most + 1))
    assert ladder_rows(4100) - 4100 < 64 and ladder_rows(257) == 272 and ladder_rows(256) == 256

class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        spec = SimpleNamespace(num_experts=6, topk_method="greedy", router_float32=False)
        self.gate = Router(8, spec, torch.float32)  # an MoE gate: a GEMM too, not a Linear
        self.q = Linear(8, 24, bias=False, dtype=torch.float32)
        self.k = Linear(8, 24, bias=False, dtype=torch.float32)  # the same shape as q: warmed once
        self.o = Linear(24, 8, bias=True, dtype=torch.float32)
        self.head = ParallelLMHead(8, 40, dtype=torch.float32)
        for p in self.parameters():
            nn.init.normal_(p)


def test_warm_gemms_runs_each_projection_and_router_at_every_count_and_the_head_at_every_batch(monkeypatch) -> None:
    model = _Tiny()
    calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    real = torch.nn.functional.linear

    def spy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        calls.append((tuple(x.shape), tuple(w.shape)))
        return real(x, w, b)

    monkeypatch.setattr(torch.nn.functional, "linear", spy)  # records, then runs the real GEMM
    runs = warm_gemms(model, most_rows=300, most_sampled=5, act_dtype=torch.float32)
    ladder = gemm_rows(300)
    assert runs == len(calls) == 3 * len(ladder) + 5
    assert [x[0] for x, w in calls if w == (6, 8)] == ladder
    assert [x[0] for x, w in calls if w == (24, 8)] == ladder
    assert [x[0] for x, w in calls if w == (8, 24)] == ladder
    assert [x[0] for x, w in calls if w == (40, 8)] == [1, 2, 3, 4, 5]


def test_warm_gemms_runs_a_quantized_projection_through_its_own_forward_at_every_count(capsys) -> None:
    """A quantized projection's forward picks its kernel by rows (GEMV, triton, cuBLASLt, DeepGEMM,
    which compiles a kernel per tile choice on first use): the ladder runs that forward, on the
    layer's own shard (no collective), with activation-dtype rows of its input width."""
    from engine.layers import quant

    model = nn.Module()
    model.up = Linear(256, 128, bias=False, dtype=torch.float32)
    model.up2 = Linear(256, 128, bias=False, dtype=torch.float32)  # the same shape and format: once
    seen: list[tuple[tuple[int, ...], torch.dtype]] = []
    for lin in (model.up, model.up2):
        quant.quantize(lin, "fp8_block")

        def forward(linear: nn.Module, x: torch.Tensor, gemv: tuple | None, silu_mul: bool = False) -> torch.Tensor:
            seen.append((tuple(x.shape), x.dtype))
            return x.float() @ quant.dequantize(linear).t()  # the product the CUDA kernels compute

        lin.quant_forward = forward
    runs = warm_gemms(model, most_rows=300, most_sampled=5, act_dtype=torch.bfloat16, progress=True)
    assert "warming GEMMs: 100%|" in capsys.readouterr().err  # minutes of DeepGEMM compiles on a first start
    rows = [*gemm_rows(300), 304]  # and DeepGEMM's padded count for the top step (quant.ladder_rows)
    assert runs == len(seen) == len(rows)
    assert [x[0] for x, _ in seen] == rows and {(x[1], d) for x, d in seen} == {(256, torch.bfloat16)}
