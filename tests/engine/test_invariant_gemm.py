"""Deterministic inference's CUDA GEMM (engine/layers/invariant_gemm.py) run by triton's
interpreter on the CPU: tiles, masks (rows, columns, a K that is not a multiple of BLOCK_K),
the grouped tile order and the bias give x W^T, and a row's values do not depend on how many
rows are beside it, across the decode and prefill tile regimes. The compiled kernel's bits on
the H200 are tests/gpu/test_invariant_gemm_gpu.py."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module is first imported
pytest.importorskip("triton")

from engine.layers import invariant_gemm  # noqa: E402
from engine.layers.invariant_gemm import split  # noqa: E402


@pytest.mark.parametrize("bias", [False, True])
def test_rows_equal_the_reference_whatever_their_count(bias: bool) -> None:
    g = torch.Generator().manual_seed(3)
    n, k = 40, 80  # 80: a masked K tail; 40 columns: masked column tiles
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(130, k, generator=g)
    full = invariant_gemm.gemm(x, w, b)  # 130 rows: the prefill tiles, 3 row tiles in one group
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    torch.testing.assert_close(full.double(), ref, rtol=1e-5, atol=1e-5)
    for m in (1, 3, 16, 17, 64, 65):  # the GEMV up to 16 rows, decode tiles up to 64
        assert torch.equal(invariant_gemm.gemm(x[:m], w, b), full[:m]), m
    assert torch.equal(invariant_gemm.gemm(x[60:61], w, b), full[60:61])


def test_bf16_rows_are_float32_sums_rounded_once() -> None:
    g = torch.Generator().manual_seed(4)
    w = torch.randn(24, 64, generator=g).bfloat16()
    x = torch.randn(5, 64, generator=g).bfloat16()
    out = invariant_gemm.gemm(x, w)
    assert out.dtype == torch.bfloat16
    ref = x.double() @ w.double().T
    torch.testing.assert_close(out.double(), ref, rtol=2**-8, atol=1e-6)  # one bf16 rounding, no more


def test_split_k_programs_give_the_one_program_bits() -> None:
    """K in slices: decode's slices as programs (partials in the workspace, the last program
    adds them) equal prefill's slices added in one program, and the reference."""
    g = torch.Generator().manual_seed(5)
    n, k = 48, 64 * 16 + 24  # 17 K tiles, the last masked: 4 slices of 5, 5, 5, 2; 8 of 3 (the last two empty)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g)
    x = torch.randn(70, k, generator=g)
    for slices in (2, 4, 8):
        prefill = invariant_gemm.gemm(x, w, b, tile=(64, 32, 8, 4, 3, slices))  # 70 rows: one program a tile
        decode = invariant_gemm.gemm(x[:5], w, b, tile=(64, 16, 1, 4, 4, slices))  # slices as programs
        assert torch.equal(decode, prefill[:5]), slices
        assert torch.equal(invariant_gemm.gemm(x[:5], w, b, tile=(64, 16, 1, 4, 4, slices)), decode)  # counters reset
        torch.testing.assert_close(prefill.double(), x.double() @ w.double().T + b.double(), rtol=1e-5, atol=1e-4)


def test_tiles_depend_on_rows_only_through_the_regime() -> None:
    shapes = [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (151936, 1024), (1024, 2048), (16, 64)]
    for n, k in shapes:
        stages = invariant_gemm.gemv_stages(n, k, split(n, k))  # the pipeline's depth: no sums depend on it
        assert invariant_gemm.tiles(1, n, k) == invariant_gemm.tiles(16, n, k) == (16, 64, 1, 4, stages, split(n, k))
        assert invariant_gemm.tiles(17, n, k) == invariant_gemm.tiles(64, n, k)
        decode = invariant_gemm.tiles(17, n, k)
        for m in (65, 256, 1024, 16384):
            other = invariant_gemm.tiles(m, n, k)
            assert decode[5] == other[5]  # the K slices, which decide the sums, follow the weight only
            assert other[0] * 4 == 64 * other[3]  # one warp group per 64 rows: the same instruction
        assert invariant_gemm.tiles(16384, n, k)[2] > 1 or decode[5] == 1  # a large prefill: one program a tile
        cols = -(-n // invariant_gemm.decode_bn(n))  # the slice rule's columns (the 17-64-row tile is twice as wide)
        assert decode[1] == 2 * invariant_gemm.decode_bn(n)
        assert cols * decode[5] >= invariant_gemm.DECODE_PROGRAMS or decode[5] == 1 or k // 64 // decode[5] < 8
    assert invariant_gemm.split(4096, 14336) == 4 and invariant_gemm.split(128256, 4096) == 1
    # the GEMV's depth: 6 for long slices (Llama's down, LM head), 3 for a one-wave wide grid (gate_up), else 4
    assert [invariant_gemm.tiles(1, n, k)[4] for n, k in [(4096, 14336), (128256, 4096), (28672, 4096),
                                                          (6144, 4096), (151936, 1024)]] == [6, 6, 3, 4, 4]
    assert invariant_gemm.tiles(128, 1024, 2048) == (64, 32, 8, 4, 6, 8)  # Qwen3-0.6B o at 128 rows: one wave of 64
    assert invariant_gemm.tiles(256, 1024, 2048) == (64, 32, 8, 4, 6, 8)  # at 256: 128 programs of 64 x 32
    assert invariant_gemm.tiles(1024, 1024, 2048) == (64, 128, 8, 4, 6, 8)  # 128 programs of 64 x 128
    assert invariant_gemm.tiles(256, 4096, 14336) == (64, 128, 8, 4, 6, 4)  # Llama's down: one wave of 128
    assert invariant_gemm.tiles(128, 4096, 14336) == (64, 128, 1, 4, 4, 4)  # Llama's down: 224 K tiles, split
    assert invariant_gemm.tiles(128, 28672, 4096) == (128, 256, 8, 8, 4, 2)  # Llama's gate_up: 112 programs
    assert invariant_gemm.tiles(256, 128256, 4096) == (128, 256, 8, 8, 3, 1)  # the LM head: 1002 tiles
    assert invariant_gemm.tiles(256, 28672, 4096) == (128, 256, 8, 8, 3, 2)  # Llama's gate_up: 224 tiles of 128 x 256
    assert invariant_gemm.tiles(4096, 1024, 2048) == (128, 256, 8, 8, 3, 8)  # Qwen3-0.6B o, a prefill: 128 tiles


def test_one_wave_tiles_fill_the_sms_once_within_shared_memory() -> None:
    """A mid-sized batch's one-wave tile: about half to all of the SMs, one program each, the
    pipeline within WAVE_SMEM; the fewest bytes a program reads among those that qualify."""
    low, high = invariant_gemm.WAVE_PROGRAMS
    for m in range(65, 1025, 7):
        for n in (1024, 2048, 4096, 6144, 14336, 28672):
            wave = invariant_gemm.one_wave(m, n)
            fits = [(bm, bn) for bm, bn in invariant_gemm.WAVE_TILES if low <= -(-m // bm) * -(-n // bn) <= high]
            assert (wave is None) == (not fits), (m, n)
            if wave is None:
                continue
            bm, bn, stages = wave
            assert 3 <= stages <= invariant_gemm.WAVE_STAGES and stages * (bm + bn) * 64 * 2 <= invariant_gemm.WAVE_SMEM
            reads = {t: (t[0] + t[1]) / (t[0] * t[1] * -(-m // t[0]) * -(-n // t[1])) for t in fits}
            assert reads[(bm, bn)] == min(reads.values()), (m, n)


def test_mid_rows_split_grid_gives_the_prefill_bits() -> None:
    """A large decode batch's split grid (several row tiles, K slices as programs) equals the
    decode tiles and the one-program prefill tiles, row for row."""
    g = torch.Generator().manual_seed(6)
    n, k = 40, 64 * 9
    w, x = torch.randn(n, k, generator=g), torch.randn(150, k, generator=g)
    prefill = invariant_gemm.gemm(x, w, tile=(64, 32, 8, 4, 3, 2))
    mid = invariant_gemm.gemm(x[:130], w, tile=(64, 16, 1, 4, 4, 2))  # 3 row tiles x 3 column tiles x 2 slices
    assert torch.equal(mid, prefill[:130])
    assert torch.equal(invariant_gemm.gemm(x[:2], w, tile=(64, 16, 1, 4, 4, 2)), prefill[:2])


def test_warm_up_compiles_each_tile_choice_once() -> None:
    """Ready means warm: engine/run/warmup.py runs the first row count of each tile choice."""
    rows = list(range(1, 2000))
    firsts = invariant_gemm.regime_rows(rows, 1024, 2048)  # Qwen3-0.6B o: GEMV, decode, then one wave of
    assert firsts == [1, 17, 65, 257, 513, 1025]  # 64 x 32, 64 x 64, 64 x 128 and 64 x 256 tiles
    assert {invariant_gemm.tiles(m, 1024, 2048) for m in rows} == {invariant_gemm.tiles(m, 1024, 2048) for m in firsts}


def test_tma_tiles_give_the_pointer_tiles_bits() -> None:
    """The one-program tiles' TMA kernel (CUDA's path for 16-bit operands) sums as the pointer
    kernel does: the same bits in float32 at 1, 4 and 8 K slices (two of them empty), masked
    rows, columns and K; run here by triton's interpreter, on the H200 by the GPU test."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    g = torch.Generator().manual_seed(9)
    for m, n, k, slices in [(70, 48, 64 * 16 + 24, 4), (130, 96, 512, 8), (5, 40, 256, 1)]:
        x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        out = torch.empty(m, n)
        grid = -(-m // 64) * -(-n // 32)
        invariant_gemm.invariant_gemm_tma_kernel[(grid,)](
            TensorDescriptor.from_tensor(x, [64, 64]), TensorDescriptor.from_tensor(w, [32, 64]), b, out, m, n, k,
            out.stride(0), x, x, 0, HAS_BIAS=True, FOLD=0, BM=64, BN=32, BK=64, GROUP_M=8, SPLIT=slices, PDL=False)
        assert torch.equal(out, invariant_gemm.gemm(x, w, b, tile=(64, 32, 8, 4, 3, slices))), (m, n, k, slices)


def test_swapped_gemv_gives_the_tiles_bits() -> None:
    """Up to 16 rows the weight is the dot's wide side (invariant_gemv_kernel): its K slices as
    programs add to the prefill tiles' bits and the decode tile's, with a bias, masked columns
    and a masked K tail, and its counters are reset for the next launch."""
    g = torch.Generator().manual_seed(7)
    for n, k, slices in [(48, 64 * 16 + 24, 4), (200, 320, 2), (130, 256, 1), (40, 80, 8)]:
        w, b, x = torch.randn(n, k, generator=g), torch.randn(n, generator=g), torch.randn(40, k, generator=g)
        prefill = invariant_gemm.gemm(x, w, b, tile=(64, 32, 8, 4, 3, slices))
        for m in (1, 5, 16):
            gemv = invariant_gemm.gemm(x[:m], w, b, tile=(16, 64, 1, 4, 2, slices))
            assert torch.equal(gemv, prefill[:m]), (n, k, slices, m)
            assert torch.equal(gemv, invariant_gemm.gemm(x[:m], w, b, tile=(64, 16, 1, 4, 2, slices)))
        assert torch.equal(invariant_gemm.gemm(x[:3], w, b, tile=(16, 64, 1, 4, 2, slices)), prefill[:3])
    with pytest.raises(ValueError, match="at most 16"):
        invariant_gemm.gemm(x[:17], w, tile=(16, 64, 1, 4, 2, 1))


def test_folded_norm_and_residual_epilogues_at_every_tile() -> None:
    """The folded RMSNorm (each row's sums times its rsqrt(mean(x^2) + eps), the norm's weight in w)
    and the residual add in the epilogue give the unfused products at every tile kind (the swapped
    GEMV, the decode tile's split grid, the one-program prefill tiles) and keep a row's bits across
    row counts; in the interpreter the scales are the reference's (on CUDA the kernel's, the GPU test)."""
    from engine.layers import invariant_gemv

    g = torch.Generator().manual_seed(11)
    n, k, eps = 48, 512, 1e-5
    w, x, r = torch.randn(n, k, generator=g), torch.randn(70, k, generator=g) * 3, torch.randn(70, n, generator=g)
    s = invariant_gemv.row_scale_reference(x, eps, invariant_gemm.split(n, k))
    torch.testing.assert_close(s.double(), torch.rsqrt(x.double().pow(2).mean(-1) + eps), rtol=1e-6, atol=0)
    normed = invariant_gemm.gemm(x, w, norm_eps=eps)
    torch.testing.assert_close(normed.double(), (x.double() * s.double()[:, None]) @ w.double().T, rtol=1e-5,
                               atol=1e-5)
    added = invariant_gemm.gemm(x, w, residual=r)
    torch.testing.assert_close(added.double(), x.double() @ w.double().T + r.double(), rtol=1e-5, atol=1e-4)
    assert torch.equal(added, invariant_gemm.gemm(x, w) + r)  # float32: bf16(sum) is the sum itself here
    for m in (1, 5, 16, 17, 64):  # the swapped GEMV, the decode tile, then one program a tile
        assert torch.equal(invariant_gemm.gemm(x[:m], w, norm_eps=eps), normed[:m]), m
        assert torch.equal(invariant_gemm.gemm(x[:m], w, residual=r[:m]), added[:m]), m
    with pytest.raises(ValueError, match="folded norm"):
        invariant_gemm.gemm(x, w, torch.zeros(n), norm_eps=eps)
    with pytest.raises(ValueError, match="one GEMM"):
        invariant_gemm.gemm(x, w, norm_eps=eps, residual=r)


def _squares_by_lanes(row: torch.Tensor, slices: int) -> torch.Tensor:
    """One row's sum of squares as the CUDA GEMV's lanes add it, a scalar at a time: slice by slice,
    quad lane q walks its slice's k16 steps adding the squares of values 2q, 2q + 1, 2q + 8, 2q + 9."""
    k = row.numel()
    kt = -(-k // 64)
    per = -(-kt // slices)
    total = torch.tensor(0.0)
    for s in range(slices):
        lanes = []
        for q in range(4):
            acc = torch.tensor(0.0)
            for step in range(s * per * 4, min((s + 1) * per, kt) * 4):
                for off in (2 * q, 2 * q + 1, 2 * q + 8, 2 * q + 9):
                    kk = step * 16 + off
                    acc = acc + (row[kk] * row[kk] if kk < k else torch.tensor(0.0))
            lanes.append(acc)
        total = total + ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
    return total


def test_row_squares_reference_sums_in_the_gemvs_order() -> None:
    """row_squares_reference's order is the CUDA GEMV's (its lanes' B fragments, the quads, the slices
    in order), against a scalar emulation at 1, 2 and 4 slices, with K past the last whole tile: rows
    of values over 2^-8..2^8, whose float32 sums move with the order (so a reference in another order
    fails here: checked by mutating it)."""
    from engine.layers import invariant_gemv

    g = torch.Generator().manual_seed(5)
    k = 520  # 8 whole tiles and 8 values
    x = (torch.randn(5, k, generator=g) * 2.0 ** torch.randint(-8, 9, (5, k), generator=g)).to(torch.bfloat16)
    for slices in (1, 2, 4):
        ref = invariant_gemv.row_squares_reference(x, slices)
        for i in range(x.shape[0]):
            assert torch.equal(ref[i], _squares_by_lanes(x[i].float(), slices)), (slices, i)
    torch.testing.assert_close(invariant_gemv.row_scale_reference(x, 1e-6, 2),
                               torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6), rtol=1e-5, atol=0)
