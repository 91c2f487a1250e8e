"""Strided copies by the GPU's copy engines: `copy_rows` is cudaMemcpy2DAsync, called through
the CUDA runtime torch already loaded.

Why: a run of device pages spans every layer of the KV pool (`[layers, pages, bytes]`), so the
same stretch of every layer is `layers` rows of equal width at a fixed pitch, on both sides
(the host slab is `[layers, K/V, pages, bytes]`). One 2D copy moves all of them: a DMA that
takes no SM time from a concurrent forward (a gather kernel on a side stream does, measured
on the H200), launched by one call instead of one per layer (torch's `copy_` of a strided
device tensor to the host first packs it with a kernel). torch exposes no 2D memcpy, hence
ctypes; the call releases the GIL.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import torch

_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the pointers (unified addressing)


@functools.cache
def _memcpy_2d_async() -> ctypes._CFuncPtr:
    """cudaMemcpy2DAsync of the libcudart this process mapped (torch's)."""
    torch.cuda.init()
    with open("/proc/self/maps") as maps:
        mapped = {line.split()[-1] for line in maps}
    paths = sorted(p for p in mapped if p.rpartition("/")[2].startswith("libcudart.so"))
    # a torch that links the runtime statically maps none: then any libcudart (one driver context)
    path = paths[0] if paths else ctypes.util.find_library("cudart")
    if path is None:
        raise RuntimeError("no CUDA runtime (libcudart) found for the host tier's 2D copies")
    fn = ctypes.CDLL(path).cudaMemcpy2DAsync
    size = ctypes.c_size_t
    fn.argtypes = [ctypes.c_void_p, size, ctypes.c_void_p, size, size, size, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def load_runtime() -> None:
    """Find the runtime's cudaMemcpy2DAsync now (at start-up: a missing one fails there, not
    in a request's step)."""
    _memcpy_2d_async()


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
