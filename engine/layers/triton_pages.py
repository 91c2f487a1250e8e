"""Triton kernels that move whole KV pages, every layer's K and V at once, between the KV
pool and one contiguous staging buffer: the host tier's copies (engine/run/host_tier.py).

Imported only where it is used (host_tier on a CUDA device with triton; the tests, under
triton's CPU interpreter): it imports triton at the top, as engine/layers/triton_kernels.py does.

The KV pool keeps one K and one V tensor per layer (engine/layers/kv_pool.py), so a page's
bytes are spread over 2 * layers tensors. The kernels read those tensors' addresses from a
device int64 tensor `ptrs` = [k0, v0, k1, v1, ...] (their data pointers, `layer_pointers`),
and cast each to a pointer in the kernel (`.to(tl.pointer_type(tl.int64))`): one launch then
covers every layer, where torch needs a gather per layer and K/V. The cast works both compiled
for CUDA and in triton's interpreter (where a "pointer" is a host address), so the tests run
the same kernels on the CPU. The pool's tensors are never freed or moved, so `ptrs` stays
valid for the pool's life.

The staging buffer is laid out [page][layer][K, V][layer_bytes], the host slab's page layout:
staging page i holds device page pages[i]. Bytes move as 8-byte words (layer_bytes % 8 == 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

WORD = 8  # bytes per element the kernels move (int64)
MAX_BLOCK_WORDS = 1024  # words one program moves per loop iteration (8 KiB)


@triton.jit
def _gather_kernel(ptrs, pages, staging, LAYER_WORDS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (i, j): tensor j (layer j // 2, K or V) of device page pages[i] -> staging."""
    i = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    rows = tl.num_programs(1).to(tl.int64)
    src = tl.load(ptrs + j).to(tl.pointer_type(tl.int64)) + tl.load(pages + i) * LAYER_WORDS
    dst = staging + (i * rows + j) * LAYER_WORDS
    for at in range(0, LAYER_WORDS, BLOCK):
        offs = at + tl.arange(0, BLOCK)
        mask = offs < LAYER_WORDS
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def _scatter_kernel(ptrs, pages, staging, LAYER_WORDS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (i, j): staging -> tensor j (layer j // 2, K or V) of device page pages[i]."""
    i = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    rows = tl.num_programs(1).to(tl.int64)
    dst = tl.load(ptrs + j).to(tl.pointer_type(tl.int64)) + tl.load(pages + i) * LAYER_WORDS
    src = staging + (i * rows + j) * LAYER_WORDS
    for at in range(0, LAYER_WORDS, BLOCK):
        offs = at + tl.arange(0, BLOCK)
        mask = offs < LAYER_WORDS
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def layer_pointers(k: list[torch.Tensor], v: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The kernels' `ptrs`: int64 [k0, v0, k1, v1, ...] data pointers on `device` (build it
    once per pool: the tensors never move)."""
    return torch.tensor(
        [t.data_ptr() for pair in zip(k, v, strict=True) for t in pair], dtype=torch.int64, device=device
    )


def gather_pages(ptrs: torch.Tensor, pages: torch.Tensor, staging: torch.Tensor, layer_bytes: int) -> None:
    """Copy device pages `pages` (int64, on the pool's device; repeats allowed) of every
    tensor in `ptrs` into `staging` (uint8 [len(pages), len(ptrs) * layer_bytes], contiguous),
    one launch on the current stream."""
    _launch(_gather_kernel, ptrs, pages, staging, layer_bytes)


def scatter_pages(ptrs: torch.Tensor, pages: torch.Tensor, staging: torch.Tensor, layer_bytes: int) -> None:
    """The inverse of `gather_pages`: staging page i -> device page pages[i] of every tensor
    in `ptrs` (`pages` distinct: with repeats, which copy lands is undefined)."""
    _launch(_scatter_kernel, ptrs, pages, staging, layer_bytes)


def _launch(kernel, ptrs: torch.Tensor, pages: torch.Tensor, staging: torch.Tensor, layer_bytes: int) -> None:  # noqa: ANN001 - a triton JITFunction
    assert layer_bytes % WORD == 0, f"pages of {layer_bytes} bytes per layer: not whole 8-byte words"
    assert pages.dtype == torch.int64 and ptrs.dtype == torch.int64 and staging.is_contiguous()
    assert staging.numel() == pages.numel() * ptrs.numel() * layer_bytes, "staging is not [pages, tensors, bytes]"
    if pages.numel() == 0:
        return
    words = layer_bytes // WORD
    block = min(MAX_BLOCK_WORDS, triton.next_power_of_2(words))
    kernel[(pages.numel(), ptrs.numel())](ptrs, pages, staging.view(torch.int64), LAYER_WORDS=words, BLOCK=block)
