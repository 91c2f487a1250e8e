"""Copies by the GPU's copy engines (DMA: no kernel, so no SM time taken from a concurrent
forward), called through the CUDA runtime torch already loaded (torch exposes neither call,
hence ctypes; both release the GIL):

* `copy_batch`: many 1D copies in one call (cudaMemcpyBatchAsync, CUDA 12.8+), the host
  tier's backups: a step's list of (destination, source, bytes), built by
  engine/run/host_tier.batch_copies;
* `copy_rows`: one 2D copy (cudaMemcpy2DAsync), the host tier's load-backs of a stretch of
  pages: the same stretch of every layer is `layers` rows of equal width at a fixed pitch
  on both sides (the pool is `[layers, pages, bytes]`, the slab `[layers, K/V, pages,
  bytes]`), so one call moves all of them (torch's `copy_` of a strided device tensor to
  the host first packs it with a kernel).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import torch

_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the pointers (unified addressing)


@functools.cache
def _runtime_path() -> str:
    """The libcudart this process mapped (torch's: one runtime)."""
    torch.cuda.init()
    with open("/proc/self/maps") as maps:
        mapped = {line.split()[-1] for line in maps}
    paths = sorted(p for p in mapped if p.rpartition("/")[2].startswith("libcudart.so"))
    # a torch that links the runtime statically maps none: then any libcudart (one driver context)
    path = paths[0] if paths else ctypes.util.find_library("cudart")
    if path is None:
        raise RuntimeError("no CUDA runtime (libcudart) found for the host tier's copies")
    return path


@functools.cache
def _memcpy_2d_async() -> ctypes._CFuncPtr:
    """cudaMemcpy2DAsync of the libcudart this process mapped (torch's)."""
    fn = ctypes.CDLL(_runtime_path()).cudaMemcpy2DAsync
    size = ctypes.c_size_t
    fn.argtypes = [ctypes.c_void_p, size, ctypes.c_void_p, size, size, size, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


class _Attributes(ctypes.Structure):
    """cudaMemcpyAttributes (CUDA 12.8+): source access order, two location hints, flags."""

    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_loc_type", ctypes.c_int),
        ("src_loc_id", ctypes.c_int),
        ("dst_loc_type", ctypes.c_int),
        ("dst_loc_id", ctypes.c_int),
        ("flags", ctypes.c_uint),
    ]


_ACCESS_STREAM = 1  # cudaMemcpySrcAccessOrderStream: the source is read in stream order
# cudaMemcpyFlagPreferOverlapWithCompute: copy engines, not SMs (the forward runs meanwhile)
_OVERLAP_WITH_COMPUTE = 1


@functools.cache
def _batch() -> tuple[ctypes._CFuncPtr, int]:
    """cudaMemcpyBatchAsync and the runtime's version (13.0 dropped its failIdx argument)."""
    lib = ctypes.CDLL(_runtime_path())
    version = ctypes.c_int()
    lib.cudaRuntimeGetVersion(ctypes.byref(version))
    fn = lib.cudaMemcpyBatchAsync
    size, ptr = ctypes.c_size_t, ctypes.c_void_p
    args = [ptr, ptr, ptr, size, ptr, ptr, size]
    fn.argtypes = [*args, ptr] if version.value >= 13000 else [*args, ptr, ptr]
    fn.restype = ctypes.c_int
    return fn, version.value


def copy_batch(dsts: torch.Tensor, srcs: torch.Tensor, sizes: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """Many 1D copies by the copy engines in one call (cudaMemcpyBatchAsync), in `stream`'s
    order: int64 CPU tensors of destination and source addresses and byte counts. The stream
    must not be the legacy default one (the API rejects it)."""
    fn, version = _batch()
    n = sizes.numel()
    attrs = _Attributes(_ACCESS_STREAM, 0, 0, 0, 0, _OVERLAP_WITH_COMPUTE)
    first = ctypes.c_size_t(0)
    args = [dsts.data_ptr(), srcs.data_ptr(), sizes.data_ptr(), n, ctypes.addressof(attrs), ctypes.addressof(first), 1]
    if version < 13000:
        fail = ctypes.c_size_t(0)
        args.append(ctypes.addressof(fail))
    err = fn(*args, stream.cuda_stream)
    if err != 0:
        raise RuntimeError(f"cudaMemcpyBatchAsync of {n} copies failed with CUDA error {err}")


def load_runtime() -> None:
    """Find both calls now (at start-up: a missing one fails there, not in a request's step)."""
    try:
        _memcpy_2d_async()
        _batch()
    except AttributeError as e:  # ctypes: the symbol is not in this libcudart
        raise RuntimeError(f"the host tier needs CUDA runtime 12.8 or newer ({_runtime_path()}): {e}") from e


def copy_rows(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """Copy `src` into `dst` on `stream`, asynchronously: two 2D byte tensors of equal shape
    [rows, width] whose rows are each contiguous (any row pitch), one on the GPU and one in
    pinned (registered) host memory, or both on the GPU. Either side's memory must stay valid
    until the stream has run the copy."""
    if dst.shape != src.shape or dst.dim() != 2 or dst.dtype != torch.uint8 or src.dtype != torch.uint8:
        raise ValueError(f"copy_rows needs two uint8 [rows, width] tensors of one shape: {dst.shape} {src.shape}")
    if dst.stride(1) != 1 or src.stride(1) != 1:
        raise ValueError("copy_rows needs contiguous rows")
    rows, width = src.shape
    dpitch, spitch = (dst.stride(0), src.stride(0)) if rows > 1 else (width, width)  # one row: no pitch
    err = _memcpy_2d_async()(dst.data_ptr(), dpitch, src.data_ptr(), spitch, width, rows, _DEFAULT, stream.cuda_stream)
    if err != 0:
        raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {err}")
