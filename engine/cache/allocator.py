"""Deterministic device KV page allocator.

The scheduler owns one `PageAllocator` per device pool; workers replicate its
decisions from the Step stream, so every result here is a pure function of the
call sequence: `alloc` always hands out the lowest free page indices, ascending.

Page 0 is reserved as the padding page and is never handed out or accepted back:
usable pages are ``1 .. num_pages - 1``.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Iterable

_DIGEST_TAG = b"strata.page_allocator.v1"


class PageAllocator:
    """Lowest-first allocator over pages ``1 .. num_pages - 1``.

    Internals: a min-heap holding exactly the free pages (each once) plus a
    bytearray of free flags for O(1) membership checks. ``alloc``/``free`` of k
    pages cost O(k log F) where F is the number of free pages.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1 (page 0 is reserved), got {num_pages}")
        self._num_pages = num_pages
        self._free_flags = bytearray(b"\x01") * num_pages
        self._free_flags[0] = 0
        self._heap: list[int] = list(range(1, num_pages))  # ascending list is a valid heap

    @property
    def capacity(self) -> int:
        """Number of usable pages (``num_pages - 1``)."""
        return self._num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._heap)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._heap)

    def is_free(self, page: int) -> bool:
        """True when `page` is a usable page that is currently free."""
        return 0 < page < self._num_pages and self._free_flags[page] == 1

    def alloc(self, n: int) -> list[int] | None:
        """Take the `n` lowest free pages, ascending; None (and no change) if fewer are free."""
        if n < 0:
            raise ValueError(f"alloc of a negative page count: {n}")
        heap = self._heap
        if n > len(heap):
            return None
        if n * 8 >= len(heap):
            # Large request: one C-level sort beats n heappops; a sorted list stays a valid heap.
            heap.sort()
            out = heap[:n]
            del heap[:n]
        else:
            out = [heapq.heappop(heap) for _ in range(n)]
        flags = self._free_flags
        for p in out:
            flags[p] = 0
        return out

    def free(self, pages: Iterable[int]) -> None:
        """Return `pages` to the pool. Atomic: raises ValueError (changing nothing) on an
        out-of-range page, page 0, a page that is already free, or a duplicate in `pages`."""
        pages = list(pages)
        flags = self._free_flags
        for p in pages:
            if not 0 < p < self._num_pages:
                raise ValueError(f"free of out-of-range page {p} (usable 1..{self._num_pages - 1})")
            if flags[p]:
                raise ValueError(f"double free of page {p}")
        if len(set(pages)) != len(pages):
            raise ValueError(f"duplicate pages in one free call: {sorted(pages)}")
        for p in pages:
            flags[p] = 1
        heap = self._heap
        if len(pages) > len(heap):
            heap.extend(pages)
            heapq.heapify(heap)
        else:
            for p in pages:
                heapq.heappush(heap, p)

    def digest(self) -> str:
        """SHA-256 hex of the pool size and the free set (its flag bitmap): equal states
        hash equal regardless of the order in which pages were freed."""
        h = hashlib.sha256(_DIGEST_TAG)
        h.update(self._num_pages.to_bytes(8, "little"))
        h.update(self._free_flags)
        return h.hexdigest()
