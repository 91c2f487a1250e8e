"""Deterministic device KV page allocator.

The scheduler owns one `PageAllocator` per device pool; workers replicate its
decisions from the Step stream, so every result here is a pure function of the
call sequence: `alloc` always hands out the lowest free page indices, ascending.

Page 0 is reserved as the padding page and is never handed out or accepted back:
usable pages are ``1 .. num_pages - 1``.

Under context parallelism (`--cp-size`) a request's page i lives in the pool of rank i % cp
(engine/layers/cp_attention.page_owner). `OwnedPageAllocator` runs one `PageAllocator` per owner
pool and names a page globally as ``local * cp + owner``: the owner is the id's residue, so a
free, a digest, a host-tier copy or a replica read the owner from the id alone, and every place
that stores page ids (page tables, the radix tree, the Step stream) is unchanged. Both take
``alloc(n, first)``: pages for a request's page indices first .. first + n - 1 (the plain one
ignores `first`).
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

    def used_per_owner(self) -> list[int]:
        return [self.num_used]

    def is_used(self, page: int) -> bool:
        """True when `page` is a usable page that is handed out."""
        return 0 < page < self._num_pages and self._free_flags[page] == 0

    def shortfall(self, n: int, first: int = 0) -> int:
        """How many more pages must be freed before alloc(n) can succeed."""
        return max(0, n - len(self._heap))

    def alloc(self, n: int, first: int = 0) -> list[int] | None:
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


class OwnedPageAllocator:
    """Pages of `owners` pools (context parallelism), `num_pages` each (page 0 of each is its
    padding): the page for a request's page index i comes from pool i % owners, lowest free
    first, and is named ``local * owners + owner`` (module doc). Same interface as
    PageAllocator; a pure function of the call sequence, so every replica agrees."""

    def __init__(self, num_pages: int, owners: int) -> None:
        if owners < 2:
            raise ValueError(f"OwnedPageAllocator needs >= 2 owners, got {owners} (use PageAllocator)")
        self.owners = owners
        self.parts = [PageAllocator(num_pages) for _ in range(owners)]

    @property
    def capacity(self) -> int:
        return sum(p.capacity for p in self.parts)

    @property
    def num_free(self) -> int:
        return sum(p.num_free for p in self.parts)

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    def used_per_owner(self) -> list[int]:
        return [p.num_used for p in self.parts]

    def is_free(self, page: int) -> bool:
        return page >= 0 and self.parts[page % self.owners].is_free(page // self.owners)

    def is_used(self, page: int) -> bool:
        return page >= 0 and self.parts[page % self.owners].is_used(page // self.owners)

    def _need(self, n: int, first: int) -> list[int]:
        """Pages each owner gives for the request page indices first .. first + n - 1."""
        w = self.owners
        return [len(range(first + (o - first) % w, first + n, w)) for o in range(w)]

    def shortfall(self, n: int, first: int = 0) -> int:
        return sum(max(0, k - p.num_free) for k, p in zip(self._need(n, first), self.parts, strict=True))

    def alloc(self, n: int, first: int = 0) -> list[int] | None:
        """Pages for a request's page indices first .. first + n - 1 (page i from owner i % owners),
        in index order; None (and no change) if some owner has too few free."""
        if n < 0:
            raise ValueError(f"alloc of a negative page count: {n}")
        need = self._need(n, first)
        if any(k > p.num_free for k, p in zip(need, self.parts, strict=True)):
            return None
        taken = [iter(p.alloc(k) or []) for k, p in zip(need, self.parts, strict=True)]
        w = self.owners
        return [next(taken[i % w]) * w + i % w for i in range(first, first + n)]

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to their owners. Atomic (checked first): ValueError on a padding, unknown
        or free page, or a duplicate."""
        pages = list(pages)
        bad = [p for p in pages if not self.is_used(p)]
        if bad or len(set(pages)) != len(pages):
            raise ValueError(f"free of pages not handed out (or duplicated): {sorted(bad) or sorted(pages)}")
        by_owner: list[list[int]] = [[] for _ in range(self.owners)]
        for p in pages:
            by_owner[p % self.owners].append(p // self.owners)
        for part, local in zip(self.parts, by_owner, strict=True):
            if local:
                part.free(local)

    def digest(self) -> str:
        h = hashlib.sha256(_DIGEST_TAG + b"/owned")
        h.update(self.owners.to_bytes(8, "little"))
        for p in self.parts:
            h.update(bytes.fromhex(p.digest()))
        return h.hexdigest()


def make_allocator(num_pages: int, owners: int = 1) -> PageAllocator | OwnedPageAllocator:
    """The scheduler's device page allocator: one pool, or one per context-parallel owner."""
    return PageAllocator(num_pages) if owners == 1 else OwnedPageAllocator(num_pages, owners)
