"""The CPU's C kernels: cpu_attention.c (paged attention) and cpu_ops.c (add + RMSNorm, SiLU-and-mul,
rotary, the sampler's race noise), built here into one library with the machine's C compiler and
called through ctypes.

The library is compiled once per source, compiler and CPU (-march=native) into the cache directory
(STRATA_CACHE_DIR), at the first forward or the attention backend's bind: before the engine says
ready. Where it does not build (no compiler, a compile error, a cache directory it cannot write)
the torch ops run instead.

A call's rows are split between torch's threads (the caller takes the first share, the others a
small pool's: ctypes releases the GIL), each row computed by one thread whole, so its bits do not
depend on the split.

Measured on 2 cores (Xeon, AMX), a 2048-token row block of the default model, bf16: add + RMSNorm
(576 wide) 0.8 ms against torch's 7 ops 1-9 ms, SiLU-and-mul (2 x 1536) 1.3 against 1.4 ms, q and
k rotated in place 0.4 against 1.2 ms (docs/PERF.md, "CPU elementwise kernels").
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import subprocess
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import structlog
import torch

from engine.env import env

log = structlog.get_logger()

SOURCES = (Path(__file__).with_name("cpu_attention.c"), Path(__file__).with_name("cpu_ops.c"))
HEADERS = (Path(__file__).with_name("cpu_math.h"),)  # part of the build's key too
# -ffp-contract=off: FMAs only where the code says fmaf; -fno-math-errno and -fno-trapping-math let
# floorf and the float-int conversions of its exp vectorize (no result changes); 512-bit vectors where
# the CPU has them (an 8k-token prefill, a layer: 853 -> 747 ms)
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-fno-trapping-math",
         "-ffp-contract=off", "-shared", "-fPIC")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the kernels' dtype codes
MAX_NORM_DIM = 8192  # cpu_ops.c's row buffer
SPLIT_VALUES = 1 << 19  # a call splits its rows between threads from this many values (waking a pool thread
# costs ~100 us: on 2 cores SiLU-and-mul gains from 256 rows of 2 x 1536, RMSNorm from 1024 rows of 576)
_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


def cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        return "".join(line for line in info.splitlines() if line.startswith(("flags", "model name", "Features")))
    except OSError:
        return platform.processor()


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (logged) where they do not build here: no C compiler (`CC`,
    else cc), a compile error, or a cache directory it cannot write."""
    cc = shlex.split(os.environ.get("CC", "cc"))  # the build's compiler, read once (functools.cache)
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True, check=True).stdout
        texts = [f.read_bytes() for f in SOURCES + HEADERS]
        key = hashlib.sha256(b"\0".join([*texts, " ".join(cc + list(FLAGS)).encode(), version.encode(),
                                         cpu_identity().encode()]))
        out = env().cache_dir / "kernels" / f"cpu_kernels-{key.hexdigest()[:16]}.so"
        if not out.exists():
            _build(cc, out)
    except (OSError, subprocess.CalledProcessError) as e:
        err = e.stderr[-2000:] if isinstance(e, subprocess.CalledProcessError) and e.stderr else str(e)
        log.warning("the CPU's C kernels not built: attention and elementwise ops take the torch path", cc=cc,
                    error=err)
        return None
    lib = ctypes.CDLL(str(out))
    lib.strata_scratch.restype = ctypes.c_size_t
    lib.strata_scratch.argtypes = [_P, _I, _I, _I, _I, _I, _I]
    lib.strata_attend.restype = _I
    lib.strata_attend.argtypes = [_P, _L, _P, _P, _L, _L, _I, _I, _I, _I, _I, _I, _F, _P, _L, _P, _I, _I, _P, _I, _I,
                                  _P]
    lib.strata_bf16_dot.restype = _I
    lib.strata_bf16_dot.argtypes = [_I, _I, _I, _I]
    lib.strata_bf16_dot_unit.restype = _I
    lib.strata_add_rms_norm.restype = None
    lib.strata_add_rms_norm.argtypes = [_P, _P, _P, _P, _P, _L, _L, _I, _L, _L, _I, _L, _F, _I]
    lib.strata_silu_mul.restype = None
    lib.strata_silu_mul.argtypes = [_P, _P, _L, _L, _I, _L, _I]
    lib.strata_rope.restype = None
    lib.strata_rope.argtypes = [_P, _P, _P, _L, _L, _L, _I, _I, _I]
    lib.strata_scatter_rows.restype = _L
    lib.strata_scatter_rows.argtypes = [_P, _L, _P, _P, _L, _L, _L, _L]
    lib.strata_race_noise.restype = None
    lib.strata_race_noise.argtypes = [_P, _L, _P, _P, _P, _L, _L, _L, _L, _I]
    return lib


def _build(cc: list[str], out: Path) -> None:
    """Compile SOURCES into `out`, atomically: ranks that build at once each install a whole file."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([*cc, *FLAGS, "-o", tmp, *map(str, SOURCES), "-lm"], capture_output=True, text=True,
                       check=True)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_pool: ThreadPoolExecutor | None = None  # the threads beside the caller's, made at the first split
_pool_size = 0


def run_split(fn: Callable[[int, int], None], ranges: list[tuple[int, int]]) -> None:
    """fn(first, last) for each range, the first on the calling thread and the others on the pool's
    threads at once (fn calls into the library, which releases the GIL)."""
    global _pool, _pool_size
    if len(ranges) == 1:
        fn(*ranges[0])
        return
    if _pool is None or _pool_size < len(ranges) - 1:
        _pool_size = len(ranges) - 1
        _pool = ThreadPoolExecutor(_pool_size, thread_name_prefix="cpu-kernels")
    futures = [_pool.submit(fn, *r) for r in ranges[1:]]
    fn(*ranges[0])
    for f in futures:
        f.result()


def _row_ranges(rows: int, width: int) -> list[tuple[int, int]]:
    """rows split evenly between torch's threads, or one range below SPLIT_VALUES values."""
    n = max(1, min(torch.get_num_threads(), rows, rows * width // SPLIT_VALUES))
    cuts = [rows * i // n for i in range(n + 1)]
    return list(zip(cuts, cuts[1:], strict=False))


def elementwise_ok(x: torch.Tensor) -> bool:
    """Whether the C kernels take x: a CPU float32 or bf16 tensor whose last dim is contiguous,
    built here. Nothing else is asked of the layout (x.is_contiguous() can depend on the number of
    rows: a path chosen by it would give a row other bits in another batch)."""
    return x.device.type == "cpu" and x.dtype in DTYPES and x.stride(-1) == 1 and library() is not None


def heads_packed(x: torch.Tensor) -> bool:
    """Whether each row of x [T, heads, dim] is one run of memory (dims contiguous, heads adjacent;
    its rows may be any stride apart): how the kernels read a view of the QKV projection. Strides
    only, so the answer never depends on T."""
    return x.dim() == 3 and x.stride(2) == 1 and (x.shape[1] == 1 or x.stride(1) == x.shape[2])


def norm_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """elementwise_ok, for add_rms_norm: 2-D or 3-D, at most MAX_NORM_DIM wide, a weight of x's dtype."""
    return x.dim() in (2, 3) and x.shape[-1] <= MAX_NORM_DIM and weight.dtype == x.dtype and elementwise_ok(x)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual) of x [T, dim] or [T, heads, dim] (residual
    None: of x, which is then the second value; else x 2-D, residual [T, dim]); norm_ok(x, weight)."""
    dim = x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    rows = x.shape[0] * heads
    out = torch.empty(x.shape, dtype=x.dtype)
    total = x if residual is None else torch.empty(x.shape, dtype=x.dtype)
    lib, dt = library(), DTYPES[x.dtype]
    res_ptr, res_stride = (None, 0) if residual is None else (residual.data_ptr(), residual.stride(0))
    head_stride = x.stride(1) if x.dim() == 3 else 0
    w = weight.contiguous()
    run_split(lambda a, b: lib.strata_add_rms_norm(x.data_ptr(), res_ptr, w.data_ptr(), out.data_ptr(),
                                                   total.data_ptr(), a, b, dim, x.stride(0), head_stride, heads,
                                                   res_stride, eps, dt),
              _row_ranges(rows, dim))
    return out, total


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :d]) * x[:, d:] of 2-D x [rows, 2d] (elementwise_ok)."""
    rows, d = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, d, dtype=x.dtype)
    lib, dt = library(), DTYPES[x.dtype]
    run_split(lambda a, b: lib.strata_silu_mul(x.data_ptr(), out.data_ptr(), a, b, d, x.stride(0), dt),
              _row_ranges(rows, 2 * d))
    return out


def rope_(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate the first `heads` heads of each row of 2-D x in place by cos, sin [rows, head_dim]
    (rotate-half), each value rounded once; cos and sin of x's dtype, contiguous."""
    rows = x.shape[0]
    lib, dt = library(), DTYPES[x.dtype]
    run_split(lambda a, b: lib.strata_rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), a, b, x.stride(0), heads,
                                           head_dim, dt), _row_ranges(rows, heads * head_dim))


def race_noise_(cand: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor | None,
                bits: int) -> torch.Tensor:
    """The sampler's race noise subtracted from cand [B, C] float32 in place (the CPU's twin of
    triton_ops.race_noise_, same arguments): one pass instead of torch's ~20 over [B, C] int64.
    Raises ValueError where the C library does not take these tensors (`race_noise_ok`)."""
    if not race_noise_ok(cand, ids):
        raise ValueError("race_noise_: float32 CPU candidates and int64 ids with contiguous rows, and the C library")
    rows, cols = cand.shape
    if seeds.shape != (rows,) or positions.shape != (rows,):
        raise ValueError("race_noise_: a seed and a position a row")
    seeds, positions = seeds.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
    ids_ptr, ids_stride = (None, 0) if ids is None else (ids.data_ptr(), ids.stride(0))
    lib = library()
    run_split(lambda a, b: lib.strata_race_noise(cand.data_ptr(), cand.stride(0), seeds.data_ptr(),
                                                 positions.data_ptr(), ids_ptr, ids_stride, a, b, cols, bits),
              _row_ranges(rows, cols))
    return cand


def race_noise_ok(cand: torch.Tensor, ids: torch.Tensor | None) -> bool:
    """Whether race_noise_ takes these: float32 CPU candidates [B, C] and int64 ids [B, C] (or None)
    with contiguous rows, the library built. Strides only, never the row count (elementwise_ok)."""
    return (cand.device.type == "cpu" and cand.dtype == torch.float32 and cand.dim() == 2 and cand.stride(1) == 1
            and (ids is None or (ids.dtype == torch.int64 and ids.shape == cand.shape and ids.stride(1) == 1))
            and library() is not None)


def scatter_rows_(dst: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
    """dst[slots[i]] = src[i] (dst.index_copy_(0, slots, src)) for dst [S, ...] contiguous and src
    [T, ...] of its dtype, each row's inner dims contiguous (its rows may be a stride apart: a view
    of the QKV projection); slots int64 [T]. IndexError (nothing else written wrong) for a slot
    outside [0, S)."""
    rows, row_bytes = src.shape[0], dst[0].numel() * dst.element_size()
    slots = slots.contiguous()
    lib, bad = library(), []  # one count a range (list.append is atomic across the threads)

    def run(a: int, b: int) -> None:
        bad.append(lib.strata_scatter_rows(src.data_ptr(), src.stride(0) * src.element_size(), slots.data_ptr(),
                                           dst.data_ptr(), row_bytes, dst.shape[0], a, b))

    run_split(run, _row_ranges(rows, dst[0].numel()))
    if sum(bad):
        raise IndexError(f"KV store: {sum(bad)} of {rows} slots outside the pool's {dst.shape[0]}")
