"""The host tier's page kernels (engine/layers/triton_pages.py) against plain torch, run by
triton's interpreter on the CPU: every layer's K and V page of a list of device pages into
one [page][layer][K, V][layer_bytes] staging buffer, and back. Skipped where triton is not
installed; the compiled kernels on CUDA: tests/cache/test_tier_gpu.py (marker gpu)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
pytest.importorskip("triton")

from engine.layers import triton_pages  # noqa: E402

LAYERS, PAGES, LAYER_BYTES = 3, 10, 256


def _pool(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """K and V per layer: random bytes, one row of LAYER_BYTES per device page."""
    g = torch.Generator().manual_seed(seed)
    make = lambda: torch.randint(0, 256, (PAGES, LAYER_BYTES), dtype=torch.uint8, generator=g)
    return [make() for _ in range(LAYERS)], [make() for _ in range(LAYERS)]


def _reference(k: list[torch.Tensor], v: list[torch.Tensor], pages: list[int]) -> torch.Tensor:
    idx = torch.tensor(pages)
    return torch.stack([torch.stack([k[layer][idx], v[layer][idx]], 1) for layer in range(LAYERS)], 1)


def test_gather_matches_torch_with_repeats_and_any_order() -> None:
    k, v = _pool(0)
    pages = [7, 2, 2, 9, 0, 5, 7]
    staging = torch.full((len(pages), 2 * LAYERS * LAYER_BYTES), 0xEE, dtype=torch.uint8)
    triton_pages.gather_pages(triton_pages.layer_pointers(k, v, k[0].device), torch.tensor(pages), staging, LAYER_BYTES)
    want = _reference(k, v, pages)  # [page, layer, K/V, bytes]
    assert torch.equal(staging.view(len(pages), LAYERS, 2, LAYER_BYTES), want)


def test_scatter_inverts_gather_into_other_pages() -> None:
    k, v = _pool(1)
    src, dst = [3, 8, 1, 6], [9, 0, 4, 2]  # out of order
    staging = _reference(k, v, src).reshape(len(src), -1).contiguous()
    before = ([t.clone() for t in k], [t.clone() for t in v])
    triton_pages.scatter_pages(triton_pages.layer_pointers(k, v, k[0].device), torch.tensor(dst), staging, LAYER_BYTES)
    for layer in range(LAYERS):
        for now, old in ((k[layer], before[0][layer]), (v[layer], before[1][layer])):
            want = old.clone()
            want[dst] = old[src]
            assert torch.equal(now, want)  # the pages written, every other page untouched


def test_gather_of_a_bf16_pool_with_odd_layer_sizes() -> None:
    """KV in bf16 viewed as bytes (as HostCopies passes it): 24-word pages, a block that does not
    divide them evenly is masked."""
    g = torch.Generator().manual_seed(2)
    k = [torch.randn(PAGES * 4, 3, 8, generator=g).to(torch.bfloat16) for _ in range(2)]
    v = [torch.randn(PAGES * 4, 3, 8, generator=g).to(torch.bfloat16) for _ in range(2)]
    layer_bytes = 4 * 3 * 8 * 2
    pages = [4, 1, 9]
    staging = torch.zeros(len(pages), 4 * layer_bytes, dtype=torch.uint8)
    triton_pages.gather_pages(triton_pages.layer_pointers(k, v, k[0].device), torch.tensor(pages), staging, layer_bytes)
    rows = lambda t: t.view(torch.uint8).view(PAGES, layer_bytes)[pages]
    want = torch.stack([rows(t) for pair in zip(k, v, strict=True) for t in pair], 1)
    assert torch.equal(staging.view(len(pages), 4, layer_bytes), want)
