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

from engine.bench.roofline import graph_us  # noqa: E402
from engine.layers import batch_invariant, invariant_gemm  # noqa: E402

SHAPES = {  # (N, K): Llama-3.1-8B qkv, o, gate_up, down, LM head; Qwen3-0.6B qkv, o, gate_up, down
    "llama-qkv": (6144, 4096), "llama-o": (4096, 4096), "llama-gate_up": (28672, 4096),
    "llama-down": (4096, 14336), "llama-head": (128256, 4096), "qwen-qkv": (4096, 1024),
    "qwen-o": (1024, 2048), "qwen-gate_up": (6144, 1024), "qwen-down": (1024, 3072),
}
CANDIDATES = [(64, 256, 8, 4, 3), (64, 128, 8, 4, 4), (128, 128, 8, 8, 3), (128, 256, 8, 8, 3)]  # + the K slices
# mid-sized batches (the deterministic mode's large decode steps, 2x cuBLAS at 256 rows): split grids
# (GROUP_M 1) and in-loop slices (8), 4 warps per 64 rows as every tile (the bits' condition)
MID_CANDIDATES = [(64, 64, 1, 4, 4), (64, 128, 1, 4, 4), (64, 256, 1, 4, 3), (128, 128, 1, 8, 4), (128, 256, 1, 8, 3),
                  (64, 32, 8, 4, 4), (64, 64, 8, 4, 4), (64, 128, 8, 4, 4), (64, 256, 8, 4, 3), (128, 128, 8, 8, 3),
                  (128, 256, 8, 8, 3)]  # GROUP_M 8: TMA


def _time(f, reps: int = 20) -> float:  # noqa: ANN001
    return graph_us(f, ops=1, replays=reps)


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
    one = _in_one_program(invariant_gemm.tiles(17, n, k))
    decode_tiled = invariant_gemm.gemm(x, w, tile=one)  # every row in decode's tile, its slices added in one program
    rows = (1, 7, 16, 17, 64, 65, 129, 256, 300, 1024)  # the GEMV, decode, mid (split grid) and prefill tiles
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
    one = _in_one_program(invariant_gemm.tiles(17, n, k))
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
    """Mid-rows candidates at 64, 128, 256 and 512 rows: time (us, cuBLAS beside), and '!' where a
    candidate's rows would not keep the decode bits (printed, for choosing `tiles`' mid rule)."""
    for m in (64, 128, 256, 512):
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


@pytest.mark.parametrize("name", list(SHAPES))
def test_decode_candidates_at_few_rows(name: str) -> None:
    """Decode GEMMs at 1 and 16 rows, bf16: today's split grid (BM 64) at other column tiles and
    stages, and the swapped-operand GEMV (BM 16: invariant_gemv_kernel, the weight as the dot's
    64-row side) at its tiles, stages and K slices: time in us and TB/s of weight (printed), '!'
    where a candidate's rows differ from the prefill tiles' at the same slices (asserted for the
    GEMV at today's slices, the condition for serving it)."""
    n, k = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(1)
    w = (torch.randn(n, k, generator=g, device="cuda") * k**-0.5).to(torch.bfloat16)
    big = 256
    x = torch.randn(big, k, generator=g, device="cuda").to(torch.bfloat16)
    s = invariant_gemm.split(n, k)
    mb = n * k * 2 / 1e6  # the weight's MB: MB / us = TB/s

    def full_at(slices: int) -> torch.Tensor:
        return invariant_gemm.gemm(x, w, tile=(64, 128, 8, 4, 4, slices))

    fulls = {sl: full_at(sl) for sl in {max(1, s // 2), s, 2 * s}}
    cells, bad = [], []
    for m in (1, 16):
        t_now = _time(lambda m=m: invariant_gemm.gemm(x[:m], w))
        t_cublas = _time(lambda m=m: F.linear(x[:m], w))
        cells.append(f"M={m} now {t_now:.1f} us ({mb / t_now:.2f} TB/s) cuBLAS {t_cublas:.1f}")
        for bn, st in ((16, 4), (32, 4), (64, 4), (128, 4), (invariant_gemm.decode_bn(n), 6)):
            tile = (64, bn, 1, 4, st, s)
            same = torch.equal(invariant_gemm.gemm(x[:m], w, tile=tile), fulls[s][:m])
            t = _time(lambda m=m, tile=tile: invariant_gemm.gemm(x[:m], w, tile=tile))
            cells.append(f"grid{bn}/{st} {t:.1f}" + ("" if same else "!"))
        for sl in sorted(fulls):
            for bn in (64, 128):
                for st in (3, 4, 6, 8) if (sl, bn) == (s, 64) else (4, 6):
                    try:
                        tile = (16, bn, 1, 4, st, sl)
                        out = invariant_gemm.gemm(x[:m], w, tile=tile)
                    except Exception as e:  # noqa: BLE001 - a config past shared memory: printed
                        cells.append(f"gemv{bn}/{st}/s{sl} {type(e).__name__}")
                        continue
                    same = torch.equal(out, fulls[sl][:m])
                    if not same and sl == s:
                        bad.append((m, bn, st))
                    t = _time(lambda m=m, tile=tile: invariant_gemm.gemm(x[:m], w, tile=tile))
                    cells.append(f"gemv{bn}/{st}/s{sl} {t:.1f} ({mb / t:.2f})" + ("" if same else "!"))
    print(f"{name} N={n} K={k} slices {s}: " + ", ".join(cells))
    assert not bad, (name, bad)


@pytest.mark.parametrize("name", list(SHAPES))
def test_cuda_gemv_keeps_the_prefill_bits(name: str) -> None:
    """The CUDA C++ GEMV (engine/layers/invariant_gemv.cu) at 1-8 rows and every ring depth it takes:
    each row's bits equal the prefill tiles' (the condition for the tuning file to turn it on), with
    and without PDL, and with a bias."""
    from engine.layers import invariant_gemv

    if invariant_gemv.library(invariant_gemv.arch(torch.device("cuda"))) is None:
        pytest.skip("the CUDA GEMV does not build here (no nvcc)")
    n, k = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(2)
    w = (torch.randn(n, k, generator=g, device="cuda") * k**-0.5).to(torch.bfloat16)
    bias = torch.randn(n, generator=g, device="cuda").to(torch.bfloat16)
    x = torch.randn(64, k, generator=g, device="cuda").to(torch.bfloat16)
    s = invariant_gemm.split(n, k)
    bad = []
    for b in (None, bias):
        full = invariant_gemm.gemm(x, w, b, tile=(64, 128, 8, 4, 4, s))
        for m in (1, 2, 5, 8):
            for st in invariant_gemv.STAGES:
                for pdl in (False, True):
                    if invariant_gemv.stages_for(s, k, st) != st:
                        continue
                    out = torch.empty(m, n, dtype=x.dtype, device="cuda")
                    assert invariant_gemv.gemv(x[:m], w, b, out, s, st, pdl)
                    if not torch.equal(out, full[:m]):
                        bad.append((m, st, pdl, b is not None))
    assert not bad, (name, bad)


@pytest.mark.parametrize(("n", "k"), [SHAPES["llama-gate_up"], SHAPES["qwen-gate_up"], (2016, 1000), (96, 4096)])
def test_cuda_gemv_act_keeps_the_unfused_bits(n: int, k: int) -> None:
    """The CUDA GEMV's SwiGLU epilogue (invariant_gemm.gemm_act: gate_up and silu(gate) * up in one
    launch) at 1-8 rows, every ring depth, with and without PDL: the bits of the prefill tiles'
    gate_up followed by flashinfer's silu_and_mul (ops.silu_and_mul, the unfused path)."""
    from engine.layers import invariant_gemv, ops

    if invariant_gemv.library(invariant_gemv.arch(torch.device("cuda"))) is None:
        pytest.skip("the CUDA GEMV does not build here (no nvcc)")
    if not ops.fused_ok(torch.empty(1, device="cuda", dtype=torch.bfloat16)):
        pytest.skip("no flashinfer: the unfused path's activation is not the epilogue's")
    g = torch.Generator(device="cuda").manual_seed(3)
    w = (torch.randn(n, k, generator=g, device="cuda") * k**-0.5 * 4).to(torch.bfloat16)
    x = torch.randn(64, k, generator=g, device="cuda").to(torch.bfloat16)
    s = invariant_gemm.split(n, k)
    assert invariant_gemv.act_takes(x[:1], w, s), (n, k, s)
    want = ops.silu_and_mul(invariant_gemm.gemm(x, w, tile=(64, 128, 8, 4, 4, s)))
    bad = []
    for m in (1, 2, 5, 8):
        for st in invariant_gemv.STAGES:
            for pdl in (False, True):
                if invariant_gemv.stages_for(s, k, st) != st:
                    continue
                out = torch.full((m, n // 2), float("nan"), dtype=x.dtype, device="cuda")
                assert invariant_gemv.gemv(x[:m], w, None, out, s, st, pdl, act=True)
                if not torch.equal(out, want[:m]):
                    bad.append((m, st, pdl, (out.float() - want[:m].float()).abs().max().item()))
    assert not bad, (n, k, bad)
