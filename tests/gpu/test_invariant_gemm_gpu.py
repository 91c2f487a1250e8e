"""Deterministic inference's GEMM (engine/layers/invariant_gemm.py) on the GPU: a row's bits
equal across row counts 1 .. 4096, i.e. across the decode tiles (<= 64 rows) and the prefill
tiles, at the projections of Llama-3.1-8B and Qwen3-0.6B, bf16 and float32; close to cuBLAS.
Prints (not asserts) each shape's time against cuBLAS and against the 64-row blocks it
replaces, and which other prefill tiles would keep the bits (the data for changing them)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from engine.layers import batch_invariant, invariant_gemm  # noqa: E402

SHAPES = {  # (N, K): Llama-3.1-8B qkv, o, gate_up, down, LM head; Qwen3-0.6B qkv, o, gate_up, down
    "llama-qkv": (6144, 4096), "llama-o": (4096, 4096), "llama-gate_up": (28672, 4096),
    "llama-down": (4096, 14336), "llama-head": (128256, 4096), "qwen-qkv": (4096, 1024),
    "qwen-o": (1024, 2048), "qwen-gate_up": (6144, 1024), "qwen-down": (1024, 3072),
}
CANDIDATES = [(64, 256, 8, 4, 3), (64, 128, 8, 4, 4), (128, 128, 8, 8, 3), (128, 256, 8, 8, 3)]  # + the K slices
# mid-sized batches (the deterministic mode's large decode steps, 2x cuBLAS at 256 rows): split grids
# (GROUP_M 1) and in-loop slices (8), 4 warps per 64 rows as every tile (the bits' condition)
MID_CANDIDATES = [(64, 64, 1, 4, 4), (64, 128, 1, 4, 4), (64, 256, 1, 4, 3), (128, 128, 1, 8, 4),
                  (64, 128, 8, 4, 4), (64, 256, 8, 4, 3), (128, 128, 8, 8, 3), (128, 256, 8, 8, 3)]  # GROUP_M 8: TMA


def _time(f, reps: int = 20) -> float:  # noqa: ANN001
    f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        f()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3  # us


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", list(SHAPES))
def test_rows_keep_their_bits_across_row_counts(name: str, dtype: torch.dtype) -> None:
    n, k = SHAPES[name]
    if dtype == torch.float32 and n > 30000:
        pytest.skip("float32 LM head: slow, same code path as the other float32 shapes")
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(n, k, generator=g, device="cuda") * k**-0.5).to(dtype)
    big = 4096 if n < 30000 else 512
    x = torch.randn(big, k, generator=g, device="cuda").to(dtype)
    full = invariant_gemm.gemm(x, w)  # the prefill tiles
    torch.testing.assert_close(full.float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2)
    one = _in_one_program(invariant_gemm.tiles(1, n, k))
    decode_tiled = invariant_gemm.gemm(x, w, tile=one)  # every row in decode's tile, its slices added in one program
    rows = (1, 7, 64, 65, 129, 256, 300, 1024)  # decode, mid (split grid) and prefill tiles
    differ = [m for m in rows if not torch.equal(invariant_gemm.gemm(x[:m], w), full[:m])]
    differ += [] if torch.equal(invariant_gemm.gemm(x[100:101], w), full[100:101]) else ["row 100 alone"]
    differ += [] if torch.equal(full, decode_tiled) else ["all rows decode-tiled"]
    if dtype == torch.bfloat16:
        _report(name, x, w, decode_tiled)  # before asserting: the data for choosing other tiles
    assert not differ, (name, differ)


def _in_one_program(tile: tuple[int, int, int, int, int, int]) -> tuple[int, int, int, int, int, int]:
    """The tile with GROUP_M 8: its K slices added in one program (a split grid of 4096 rows
    would not fit the workspace); the same bits as the split grid, which the row counts check."""
    return (*tile[:2], 8, *tile[3:])


def _report(name: str, x: torch.Tensor, w: torch.Tensor, decode_tiled: torch.Tensor) -> None:
    (n, k), big = w.shape, x.shape[0]
    one = _in_one_program(invariant_gemm.tiles(1, n, k))
    keep = {c: torch.equal(invariant_gemm.gemm(x, w, tile=(*c, one[5])), decode_tiled) for c in CANDIDATES}
    t = {m: _time(lambda m=m: invariant_gemm.gemm(x[:m], w)) for m in (1, 64, 256, big)}
    t_one = _time(lambda: invariant_gemm.gemm(x, w, tile=one))
    cub = {m: _time(lambda m=m: F.linear(x[:m], w)) for m in (1, 64, 256, big)}
    batch_invariant.enable(True, "cuda")
    try:
        blocks = _time(lambda: batch_invariant.rows_of(x, lambda a: F.linear(a, w)))
    finally:
        batch_invariant.enable(False)
    tflops = 2 * big * n * k / (t[big] * 1e-6) / 1e12
    print(f"{name} N={n} K={k} slices {one[5]}: ours M=1 {t[1]:.1f} us (cuBLAS {cub[1]:.1f}), "
          f"M=64 {t[64]:.1f} ({cub[64]:.1f}), "
          f"M=256 {t[256]:.1f} ({cub[256]:.1f}) tiles {invariant_gemm.tiles(256, n, k)}, "
          f"M={big} {t[big]:.1f} us = {tflops:.0f} TFLOPS (cuBLAS {cub[big]:.1f}, 64-row blocks {blocks:.1f}, "
          f"decode tiles {t_one:.1f}); prefill tiles keeping the decode bits: {keep}")
    _report_mid(name, x, w, decode_tiled, one[5])


def _report_mid(name: str, x: torch.Tensor, w: torch.Tensor, decode_tiled: torch.Tensor, slices: int) -> None:
    """Mid-rows candidates at 128, 256 and 512 rows: time (us, cuBLAS beside), and '!' where a
    candidate's rows would not keep the decode bits (printed, for choosing `tiles`' mid rule)."""
    for m in (128, 256, 512):
        row = []
        for c in MID_CANDIDATES:
            tile = (*c, slices)
            try:
                same = torch.equal(invariant_gemm.gemm(x[:m], w, tile=tile), decode_tiled[:m])
            except ValueError:  # a split grid past the workspace
                row.append(f"{c[:3]} -")
                continue
            row.append(f"{c[:3]} {_time(lambda tile=tile, m=m: invariant_gemm.gemm(x[:m], w, tile=tile)):.1f}"
                       + ("" if same else "!"))
        print(f"{name} mid M={m}: now {invariant_gemm.tiles(m, *w.shape)[:3]}, cuBLAS "
              f"{_time(lambda m=m: F.linear(x[:m], w)):.1f} us; " + ", ".join(row))
