"""Deterministic inference's GEMV of 1-8 rows as CUDA C++ (invariant_gemv.cu): the same sums as
invariant_gemm.py's triton tiles, each warp streaming its own 16 weight rows of one K slice
through a cp.async ring into mma.sync (the why is at the top of the .cu file).

Built once per source, nvcc and GPU architecture into the cache directory (STRATA_CACHE_DIR) by
the machine's nvcc, at the first deterministic GEMM (the warm-up, before the engine says ready),
and called through ctypes on torch's current stream. Where it does not build (no nvcc, a compile
error) the triton GEMV runs instead, with the same bits.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import structlog
import torch

from engine.env import env

log = structlog.get_logger()

SOURCE = Path(__file__).with_name("invariant_gemv.cu")
MAX_ROWS = 8
STAGES = (2, 3, 4)  # the kernel's instantiations
RING = 4  # K tiles in flight a warp, at most (4 beat 2, 3, 6 and 8 on an H100: docs/PERF.md)
SMEM_BUDGET = 96 << 10  # a block's rings: two blocks an SM fit
_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float


def nvcc() -> str | None:
    """The CUDA compiler: on PATH, else the default toolkit's."""
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


def arch(device: torch.device) -> str:
    """nvcc's -arch for the GPU (asked on every GEMV call: cached per device)."""
    return _arch(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}" + ("a" if major == 9 else "")  # 9.0a: griddepcontrol (PDL)


@functools.cache
def library(target: str) -> ctypes.CDLL | None:
    """The kernel built for GPU architecture `target`, or None (logged) where it does not build."""
    compiler = nvcc()
    if compiler is None:
        log.warning("no nvcc: deterministic inference's GEMV takes the triton kernel")
        return None
    flags = ["-O3", "-std=c++17", f"-arch={target}", "-shared", "-Xcompiler", "-fPIC"]
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
        key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join(flags).encode(), version.encode()]))
        out = env().cache_dir / "kernels" / f"invariant_gemv-{key.hexdigest()[:16]}.so"
        if not out.exists():
            _build(compiler, flags, out)
    except (OSError, subprocess.CalledProcessError) as e:
        err = e.stderr[-2000:] if isinstance(e, subprocess.CalledProcessError) and e.stderr else str(e)
        log.warning("deterministic inference's CUDA GEMV not built: the triton kernel runs", error=err)
        return None
    lib = ctypes.CDLL(str(out))
    lib.strata_invariant_gemv.restype = _I
    lib.strata_invariant_gemv.argtypes = [_P, _P, _P, _P, _I, _I, _I, _L, _L, _L, _I, _I, _I, _I, _F, _P, _L, _P]
    lib.strata_row_scale.restype = _I
    lib.strata_row_scale.argtypes = [_P, _P, _I, _I, _L, _I, _F, _I, _P]
    return lib


def _build(compiler: str, flags: list[str], out: Path) -> None:
    """Compile SOURCE into `out`, atomically (ranks that build at once each install a whole file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True, check=True)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the kernel takes this product: CUDA bf16, 1-8 rows, unit column strides and 16-byte
    aligned rows (its 16-byte cp.async chunks)."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and 1 <= x.shape[0] <= MAX_ROWS
            and x.stride(1) == 1 and w.stride(1) == 1 and x.stride(0) % 8 == 0 and w.stride(0) % 8 == 0
            and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0)


def stages_for(slices: int, k: int, want: int = RING) -> int:
    """The ring depth: `want`, at most the slice's K tiles plus one, within SMEM_BUDGET for the
    block's warps (4 row blocks x slices below 4 slices, else one row block's slices), a stage a
    K tile of 16 weight rows and 8 rows of x (3 KB). gemv's `act` takes the same depth: from 4
    slices up it doubles a block's warps (a gate and an up block), so one such block holds what
    two plain ones do (at most 208 KB with the partials, 16 slices)."""
    k_tiles = -(-k // 64)
    per = -(-k_tiles // slices)
    fits = [s for s in STAGES if s <= max(2, per + 1) and max(slices, 4) * s * 3072 <= SMEM_BUDGET]
    return max((s for s in fits if s <= want), default=2)


def act_takes(x: torch.Tensor, w: torch.Tensor, slices: int) -> bool:
    """Whether the kernel takes silu(gate) * up of x [gate | up]^T (gemv's `act`): `takes`, gate and
    up of whole 16-row blocks, and at most 16 K slices (a block's 2 x slices warps)."""
    half = w.shape[0] // 2
    return takes(x, w) and w.shape[0] == 2 * half and half % 16 == 0 and slices <= 16


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, slices: int,
         stages: int, pdl: bool, act: bool = False, norm_eps: float | None = None,
         residual: torch.Tensor | None = None) -> bool:
    """out = x w^T (+ bias) on torch's current stream, or with `act` (w = [gate | up], act_takes,
    no bias) out [M, N / 2] = silu(x gate^T) * (x up^T) with the products rounded to bf16 first;
    `norm_eps` (no bias): each product scaled by `row_scale(x, norm_eps)`'s value for its row before
    rounding (the RMSNorm folded, its weight in w); `residual` [M, N] (not with act): out =
    bf16(product) + residual, rounded once more. False where the kernel is not built here."""
    lib = library(arch(x.device))
    if lib is None:
        return False
    m, k = x.shape
    n = w.shape[0]
    if residual is not None:
        assert residual.shape == out.shape and residual.stride(1) == 1 and residual.dtype == out.dtype
    err = lib.strata_invariant_gemv(
        x.data_ptr(), w.data_ptr(), bias.data_ptr() if bias is not None else None, out.data_ptr(), m, n, k,
        x.stride(0), w.stride(0), out.stride(0), slices, stages, n // 2 if act else 0, int(pdl),
        -1.0 if norm_eps is None else norm_eps, residual.data_ptr() if residual is not None else None,
        residual.stride(0) if residual is not None else 0, torch.cuda.current_stream(x.device).cuda_stream)
    if err != 0:
        raise RuntimeError(f"invariant GEMV [{m}, {k}] x [{n}, {k}]^T{' (act)' if act else ''}: CUDA error {err}")
    return True


def row_scale(x: torch.Tensor, eps: float, slices: int, pdl: bool) -> torch.Tensor | None:
    """float32 [M]: rsqrt(mean(x_row^2) + eps) of each bf16 row of x, its squares summed in the order
    in which the GEMV of a weight of `slices` K slices sums them from its B fragments (the .cu's
    add_squares / quad_sum / norm_scale), for the prefill tiles' folded norm; None where the kernel is
    not built here."""
    lib = library(arch(x.device))
    if lib is None:
        return None
    m, k = x.shape
    out = torch.empty(m, dtype=torch.float32, device=x.device)
    if m == 0:
        return out
    err = lib.strata_row_scale(x.data_ptr(), out.data_ptr(), m, k, x.stride(0), slices, eps, int(pdl),
                               torch.cuda.current_stream(x.device).cuda_stream)
    if err != 0:
        raise RuntimeError(f"row scale [{m}, {k}], {slices} slices: CUDA error {err}")
    return out


def row_squares_reference(x: torch.Tensor, slices: int) -> torch.Tensor:
    """float32 [M]: each row's sum of squares in the GEMV's order, in torch: K in tiles of 64, `slices`
    slices of whole tiles (zeros past K); in a slice, quad lane q adds, k16 step by k16 step, the squares
    of the step's values 2q, 2q + 1, 2q + 8, 2q + 9 in turn to a zero; the quad's four partials meet as
    (q0 + q1) + (q2 + q3); the slices are added in order to a zero. Squares of bf16 values are exact in
    float32, so each add is the kernel's one rounding."""
    m, k = x.shape
    kt = -(-k // 64)
    per = -(-kt // slices)
    v = torch.zeros(m, slices * per * 64, dtype=torch.float32, device=x.device)
    v[:, :k] = x.float()
    v = v.view(m, slices, per * 4, 16)  # [rows, slice, k16 step of the slice, value in the step]
    lanes = torch.zeros(m, slices, 4, dtype=torch.float32, device=x.device)
    quad = torch.arange(4, device=x.device) * 2
    for step in range(per * 4):
        for off in (0, 1, 8, 9):
            lanes = lanes + v[:, :, step, quad + off] ** 2
    quads = (lanes[..., 0] + lanes[..., 1]) + (lanes[..., 2] + lanes[..., 3])
    total = torch.zeros(m, dtype=torch.float32, device=x.device)
    for s in range(slices):
        total = total + quads[:, s]
    return total


def row_scale_reference(x: torch.Tensor, eps: float, slices: int) -> torch.Tensor:
    """row_scale in torch (row_squares_reference's sums; the rsqrt aside: the GPU's approximate one
    may differ in the last bit): for the CPU tests of the epilogues."""
    return torch.rsqrt(row_squares_reference(x, slices) / x.shape[1] + eps)
