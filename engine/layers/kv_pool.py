"""KVPool: the device KV cache of one rank, as flat token slots grouped in pages.

Each layer has a K and a V buffer shaped [num_pages * page_size, num_kv_heads, head_dim]
(views of one [num_layers, ...] tensor each: `k_all`, `v_all`).
Token slot `page * page_size + offset` holds the K/V of one token. Page 0 is the padding
page: the scheduler's allocator never hands it out, so padded page-table entries (0) and
padded slots always point at memory no live request owns.
"""

from __future__ import annotations

import torch

PAD_PAGE = 0  # reserved by the page allocator; padded page tables point here


class KVPool:
    """Per-layer K/V slot buffers. Not thread-safe; owned by one worker."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_pages < 2:
            raise ValueError(f"KV pool needs >= 2 pages (page 0 is padding), got {num_pages}")
        if min(num_layers, page_size, num_kv_heads, head_dim) < 1:
            raise ValueError("KV pool dimensions must all be >= 1")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        # zeros, not empty: padded slots are read (then masked) and must never hold NaN/Inf,
        # since 0 * NaN in a masked softmax would still poison the output.
        # One tensor per K and V across layers, so that a page range of every layer is one
        # strided view (the host tier copies all layers of a run with one call, host_tier.py).
        self.k_all = torch.zeros((num_layers, *shape), dtype=dtype, device=self.device)
        self.v_all = torch.zeros((num_layers, *shape), dtype=dtype, device=self.device)
        self.k, self.v = list(self.k_all.unbind(0)), list(self.v_all.unbind(0))  # per layer: contiguous views
        # 8-bit float KV is written and gathered through uint8 views of the same memory
        self._bytes = dtype.itemsize == 1 and dtype.is_floating_point
        self._k_raw = [t.view(torch.uint8) for t in self.k] if self._bytes else self.k
        self._v_raw = [t.view(torch.uint8) for t in self.v] if self._bytes else self.v

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v ([T, num_kv_heads, head_dim]) into `slots` (int64 [T]) of `layer`."""
        self._k_raw[layer].index_copy_(0, slots, self._raw(k))
        self._v_raw[layer].index_copy_(0, slots, self._raw(v))

    def _raw(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        return x.view(torch.uint8) if self._bytes else x

    def gather_pages(self, layer: int, pages: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole pages (int64 [b, n] page ids) of `layer` as [b, n * page_size,
        num_kv_heads, head_dim] in `dtype`: one contiguous page per index, several times faster
        on a CPU than gathering the same slots token by token."""
        if self.device.type == "cpu":
            # index_select copies each page as one row (a memcpy): 3-6x faster on a CPU than
            # advanced indexing, whose kernel computes an offset per element; the same values
            flat, out = pages.reshape(-1), (pages.shape[0], -1, self.num_kv_heads, self.head_dim)
            k = torch.index_select(self._k_raw[layer].view(self.num_pages, -1), 0, flat).view(out)
            v = torch.index_select(self._v_raw[layer].view(self.num_pages, -1), 0, flat).view(out)
        else:
            shape = (self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)
            k, v = self._k_raw[layer].view(shape)[pages], self._v_raw[layer].view(shape)[pages]
            k, v = k.flatten(1, 2), v.flatten(1, 2)
        if self._bytes:
            k, v = k.view(self.dtype), v.view(self.dtype)
        return k.to(dtype), v.to(dtype)

    def page_bytes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every layer as raw bytes, uint8 [num_layers, num_pages, page bytes of a
        layer] views: `[:, pages]` is a page range (or gather) of all layers at once."""
        n = (self.num_layers, self.num_pages, -1)
        return self.k_all.view(torch.uint8).view(n), self.v_all.view(torch.uint8).view(n)

    def page_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer` as [num_pages, page_size, num_kv_heads, head_dim] views (no copy)."""
        shape = (self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)
        return self.k[layer].view(shape), self.v[layer].view(shape)

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one page costs across all layers, K and V together."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * elem

    @classmethod
    def pages_for_bytes(
        cls,
        budget_bytes: int,
        num_layers: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        """How many pages (padding page included) fit in `budget_bytes`."""
        return max(0, budget_bytes // cls.bytes_per_page(num_layers, page_size, num_kv_heads, head_dim, dtype))

    def nbytes(self) -> int:
        return self.num_pages * self.bytes_per_page(
            self.num_layers, self.page_size, self.num_kv_heads, self.head_dim, self.dtype
        )
