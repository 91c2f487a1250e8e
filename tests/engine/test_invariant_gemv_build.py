"""Deterministic inference's CUDA GEMV (engine/layers/invariant_gemv.cu) builds with the machine's
nvcc for the Hopper architecture the tuning turns it on for, and its C entry refuses what it does
not take before any CUDA call (so this runs without a GPU). Its bits and speed are checked on the
GPU: tests/gpu/test_invariant_gemm_gpu.py, scripts/det_gemv_probe.py."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from engine.layers import invariant_gemv

pytestmark = pytest.mark.skipif(invariant_gemv.nvcc() is None, reason="no nvcc")

INVALID_VALUE = 1  # cudaErrorInvalidValue


def test_builds_and_refuses_what_it_does_not_take(tmp_path: Path) -> None:
    out = tmp_path / "invariant_gemv.so"
    invariant_gemv._build(invariant_gemv.nvcc(), ["-O1", "-std=c++17", "-arch=sm_90a", "-shared", "-Xcompiler",
                                                  "-fPIC"], out)
    lib = ctypes.CDLL(str(out))
    lib.strata_invariant_gemv.restype = ctypes.c_int
    lib.strata_invariant_gemv.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3 + [ctypes.c_longlong] * 3 + [
        ctypes.c_int] * 4 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p]
    lib.strata_row_scale.restype = ctypes.c_int
    lib.strata_row_scale.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_longlong,
                                     ctypes.c_int, ctypes.c_float, ctypes.c_int, ctypes.c_void_p]

    def call(m: int, split: int, stages: int = 4, n: int = 64, half: int = 0, bias: int | None = None,
             eps: float = -1.0, res: int | None = None, out: int | None = None, k: int = 64) -> int:
        return lib.strata_invariant_gemv(None, None, bias, out, m, n, k, 64, 64, 64, split, stages, half, 0, eps, res,
                                         64, None)

    assert call(0, 4) == INVALID_VALUE  # no rows
    assert call(invariant_gemv.MAX_ROWS + 1, 4) == INVALID_VALUE  # more rows than the mma's 8 columns
    assert call(1, 3) == INVALID_VALUE  # K slices not a power of two
    assert call(1, 64) == INVALID_VALUE  # more slices than a block's warps
    assert call(1, 4, stages=5) == INVALID_VALUE  # a ring depth not built
    # the SwiGLU epilogue: [gate | up] of whole 16-row blocks, no bias, a block's 2 x split warps
    assert call(1, 4, n=64, half=24) == INVALID_VALUE  # N is not 2 x half
    assert call(1, 4, n=48, half=24) == INVALID_VALUE  # half not a multiple of 16
    assert call(1, 4, n=64, half=32, bias=16) == INVALID_VALUE  # a bias
    assert call(1, 32, n=64, half=32) == INVALID_VALUE  # 64 warps a block
    assert call(1, 4, n=64, half=-32) == INVALID_VALUE
    # the folded norm: no bias; the residual add: not with the activation, not in place
    assert call(1, 4, eps=1e-5, bias=16) == INVALID_VALUE
    assert call(1, 4, n=64, half=32, res=16) == INVALID_VALUE
    assert call(1, 4, res=16, out=16) == INVALID_VALUE
    # the prefill's row scales: rows, a K, the GEMV's slices (a power of two, at most 32), eps >= 0
    assert lib.strata_row_scale(None, None, 0, 64, 64, 4, 1e-5, 0, None) == INVALID_VALUE
    assert lib.strata_row_scale(None, None, 4, 0, 64, 4, 1e-5, 0, None) == INVALID_VALUE
    assert lib.strata_row_scale(None, None, 4, 64, 64, 3, 1e-5, 0, None) == INVALID_VALUE
    assert lib.strata_row_scale(None, None, 4, 64, 64, 64, 1e-5, 0, None) == INVALID_VALUE
    assert lib.strata_row_scale(None, None, 4, 64, 64, 4, -1.0, 0, None) == INVALID_VALUE


def test_ring_depth_fits_the_slice_and_shared_memory() -> None:
    assert invariant_gemv.stages_for(4, 4096) == invariant_gemv.RING  # Llama-3.1-8B's qkv: 16 K tiles a slice
    assert invariant_gemv.stages_for(8, 128) == 2  # one K tile a slice: a ring of two
    for slices in (1, 2, 4, 8, 16, 32):
        depth = invariant_gemv.stages_for(slices, 1 << 14)
        assert depth in invariant_gemv.STAGES
        assert max(slices, 4) * depth * 3072 <= invariant_gemv.SMEM_BUDGET or depth == 2
