"""KVPool: the device KV cache of one rank, as flat token slots grouped in pages.

What a token caches is the model's declared layout (engine/layers/kv_layout.py): one buffer
per component, shaped [num_pages * page_size, heads, dim] per layer, a view of one
[num_layers, ...] tensor (`all[name]`). A Llama-family model's components are `k` and `v`
(`k_all`/`v_all`, and per layer `k[layer]`/`v[layer]`, which the attention kernels read); an
MLA model's is one `latent` (`latent[layer]`).
Token slot `page * page_size + offset` holds the KV of one token. Page 0 is the padding
page: the scheduler's allocator never hands it out, so padded page-table entries (0) and
padded slots always point at memory no live request owns.
"""

from __future__ import annotations

import math
import mmap

import torch

from engine.layers import cpu_kernels
from engine.layers.kv_layout import KVLayout

PAD_PAGE = 0  # reserved by the page allocator; padded page tables point here


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros; on a CPU, in fresh anonymous memory (mmap): the kernel hands out zeroed pages
    as they are first written, so a pool of GiBs costs no start-up time (torch.zeros wrote every
    byte: 1.6 s for the default model's 1.5 GiB pool on 2 cores) and only what is used is resident.
    The tensor holds the mapping; it is unmapped when the last view of it goes."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


class KVPool:
    """Per-layer KV slot buffers, one per layout component. Not thread-safe; owned by one worker.

    `KVPool(num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device)` is the
    GQA (K and V) pool; `KVPool.from_layout` takes any declared layout."""

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
        if min(num_kv_heads, head_dim) < 1:
            raise ValueError("KV pool dimensions must all be >= 1")
        self._setup(KVLayout.gqa(num_kv_heads, head_dim), num_layers, num_pages, page_size, dtype, device)

    @classmethod
    def from_layout(
        cls, layout: KVLayout, num_layers: int, num_pages: int, page_size: int, dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVPool:
        pool = cls.__new__(cls)
        pool._setup(layout, num_layers, num_pages, page_size, dtype, device)
        return pool

    def _setup(
        self, layout: KVLayout, num_layers: int, num_pages: int, page_size: int, dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_pages < 2:
            raise ValueError(f"KV pool needs >= 2 pages (page 0 is padding), got {num_pages}")
        if min(num_layers, page_size) < 1:
            raise ValueError("KV pool dimensions must all be >= 1")
        self.layout = layout
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        first = layout.components[0]
        # the first component's geometry (K's for GQA, the latent's for MLA): what backends bind to
        self.num_kv_heads, self.head_dim = first.heads, first.dim
        self.dtype = dtype
        self.device = torch.device(device)
        slots = num_pages * page_size
        # zeros, not empty: padded slots are read (then masked) and must never hold NaN/Inf,
        # since 0 * NaN in a masked softmax would still poison the output.
        # One tensor per component across layers, so that a page range of every layer is one
        # strided view (the host tier copies all layers of a run with one call, host_tier.py).
        self.all: dict[str, torch.Tensor] = {
            c.name: zeros((num_layers, slots, c.heads, c.dim), c.dtype_in(dtype), self.device)
            for c in layout.components
        }
        self.per_layer: dict[str, list[torch.Tensor]] = {n: list(t.unbind(0)) for n, t in self.all.items()}
        # 8-bit float KV is written and gathered through uint8 views of the same memory
        self._raw_layers = [
            [t.view(torch.uint8) for t in self.per_layer[c.name]] if _bytewise(c.dtype_in(dtype))
            else self.per_layer[c.name]
            for c in layout.components
        ]
        self._dtypes = [c.dtype_in(dtype) for c in layout.components]
        self._shapes = [(c.heads, c.dim) for c in layout.components]
        # per component, what a gather needs (a hot path: once per layer and step)
        self._parts = [(raw, shape, stored, _bytewise(stored))
                       for raw, shape, stored in zip(self._raw_layers, self._shapes, self._dtypes, strict=True)]
        # on a CPU with the C kernels, a store copies rows where they lie (index_copy_: 19 of a 16 x
        # 128 prefill's ~450 ms on 2 cores); float32/bf16 pools, whose raw layers are x's dtype
        self._cpu_scatter = (self.device.type == "cpu" and cpu_kernels.library() is not None
                             and all(not b for *_, b in self._parts))
        if layout.is_gqa:  # the names the attention backends and triton kernels use
            self.k_all, self.v_all = self.all["k"], self.all["v"]
            self.k, self.v = self.per_layer["k"], self.per_layer["v"]  # per layer: contiguous views
        if "latent" in self.all:
            self.latent = self.per_layer["latent"]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def store(self, layer: int, slots: torch.Tensor, *values: torch.Tensor) -> None:
        """Write each component's values ([T, heads, dim], in layout order: k, v for GQA) into
        `slots` (int64 [T]) of `layer`."""
        for (raw, _, stored, bytewise), x in zip(self._parts, values, strict=True):
            x = x.to(stored)
            if self._cpu_scatter and cpu_kernels.heads_packed(x):  # a memcpy a row, from where x lies
                cpu_kernels.scatter_rows_(raw[layer], slots, x)
                continue
            raw[layer].index_copy_(0, slots, x.view(torch.uint8) if bytewise else x)

    def gather_pages(self, layer: int, pages: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Each component (K and V for GQA) of whole pages (int64 [b, n] page ids) of `layer` as
        [b, n * page_size, heads, dim] in `dtype`: one contiguous page per index, several times
        faster on a CPU than gathering the same slots token by token."""
        out = []
        cpu, flat, b = self.device.type == "cpu", pages.reshape(-1), pages.shape[0]
        for raw, shape, stored, bytewise in self._parts:
            if cpu:
                # index_select copies each page as one row (a memcpy): 3-6x faster on a CPU than
                # advanced indexing, whose kernel computes an offset per element; the same values
                x = torch.index_select(raw[layer].view(self.num_pages, -1), 0, flat).view(b, -1, *shape)
            else:
                x = raw[layer].view(self.num_pages, self.page_size, *shape)[pages].flatten(1, 2)
            out.append((x.view(stored) if bytewise else x).to(dtype))
        return tuple(out)

    def gather_heads(self, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """gather_pages head-major and as stored: each component of whole pages (int64 [b, n]) of
        `layer` as [heads, b, n * page_size, dim], by one index_select a head (a page's rows of
        that head): deterministic inference's torch path multiplies each (head, request) run of
        keys as it comes, with no transposing copy."""
        out = []
        flat, b = pages.reshape(-1), pages.shape[0]
        for raw, (heads, _), stored, bytewise in self._parts:
            src = raw[layer].view(self.num_pages, self.page_size, heads, -1)
            x = torch.empty(heads, flat.numel(), self.page_size, src.shape[-1], dtype=src.dtype, device=src.device)
            for h in range(heads):
                torch.index_select(src[:, :, h], 0, flat, out=x[h])
            x = x.view(heads, b, -1, src.shape[-1])
            out.append(x.view(stored) if bytewise else x)
        return tuple(out)

    def page_bytes(self) -> tuple[torch.Tensor, ...]:
        """Each component (K and V for GQA) of every layer as raw bytes, uint8 [num_layers,
        num_pages, page bytes of a layer] views: `[:, pages]` is a page range (or gather) of all
        layers at once."""
        n = (self.num_layers, self.num_pages, -1)
        return tuple(t.view(torch.uint8).view(n) for t in self.all.values())

    def page_view(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Each component (K and V for GQA) of `layer` as [num_pages, page_size, heads, dim] views."""
        return tuple(
            t[layer].view(self.num_pages, self.page_size, *shape)
            for t, shape in zip(self.all.values(), self._shapes, strict=True)
        )

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one GQA page costs across all layers, K and V together."""
        return page_size * KVLayout.gqa(num_kv_heads, head_dim).bytes_per_token(num_layers, dtype)

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
        """How many GQA pages (padding page included) fit in `budget_bytes`."""
        return max(0, budget_bytes // cls.bytes_per_page(num_layers, page_size, num_kv_heads, head_dim, dtype))

    def nbytes(self) -> int:
        return self.num_pages * self.page_size * self.layout.bytes_per_token(self.num_layers, self.dtype)


def _bytewise(dtype: torch.dtype) -> bool:
    return dtype.itemsize == 1 and dtype.is_floating_point
