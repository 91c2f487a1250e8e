"""The host tier's (L2) page allocator: deterministic first-fit over page ranges.

The scheduler owns one; every replica (each worker, the cache controller, the scheduler's
mirror) holds another, driven by the same ops (engine/replica/components.py: HostTier),
so placement is a pure function of the Step stream and `digest()` proves it (docs/architecture.md, Tiers).

* An object (a radix node's KV copy) holds ONE contiguous range of host pages: a copy is
  one span per object and a split (the node split) cuts it in two without moving data.
* `reserve` takes the lowest-addressed free range that fits (first fit); `release`
  coalesces the freed range with its neighbours, so the free list is always the minimal
  sorted list of maximal runs: equal free sets have equal encodings.
* `committed` is the set of objects every rank finished copying (ApplyCommit).
"""

from __future__ import annotations

import bisect
import hashlib
from array import array

_TAG = b"strata.host_alloc.v1"


class HostAllocError(RuntimeError):
    """An operation that does not fit the allocator's state: a protocol bug, fatal."""


class HostAllocator:
    def __init__(self, capacity: int = 0) -> None:
        self.capacity = 0
        self.free: list[tuple[int, int]] = []  # (start, length), sorted, coalesced
        self.ranges: dict[int, tuple[int, int]] = {}  # obj -> (start, length)
        self.committed: set[int] = set()
        if capacity:
            self.init(capacity)

    # ---- state changes -------------------------------------------------------------

    def init(self, capacity: int) -> None:
        if capacity < 1 or self.capacity:
            raise HostAllocError(f"host tier init with {capacity} pages (already {self.capacity})")
        self.capacity = capacity
        self.reset()

    def reset(self) -> None:
        """Everything free, no object (Flush): the freshly built state, digest included."""
        self.free = [(0, self.capacity)] if self.capacity else []
        self.ranges.clear()
        self.committed.clear()

    def find(self, n: int) -> int | None:
        """The start of the first free run that holds n pages (None: no run does)."""
        for start, length in self.free:
            if length >= n:
                return start
        return None

    def reserve(self, obj: int, n: int) -> int | None:
        """Give `obj` n contiguous pages, first fit; None (and no change) when none fits."""
        if n < 1 or obj in self.ranges:
            raise HostAllocError(f"reserve of {n} pages for object {obj} (held: {obj in self.ranges})")
        for i, (start, length) in enumerate(self.free):
            if length >= n:
                if length == n:
                    del self.free[i]
                else:
                    self.free[i] = (start + n, length - n)
                self.ranges[obj] = (start, n)
                return start
        return None

    def release(self, obj: int) -> None:
        start, n = self._range(obj)
        del self.ranges[obj]
        self.committed.discard(obj)
        i = bisect.bisect(self.free, (start, n))
        # merge with the run after, then the run before: keeps runs maximal
        if i < len(self.free) and self.free[i][0] == start + n:
            n += self.free.pop(i)[1]
        if i > 0 and sum(self.free[i - 1]) == start:
            start, n = self.free[i - 1][0], self.free[i - 1][1] + n
            self.free[i - 1] = (start, n)
        else:
            self.free.insert(i, (start, n))

    def commit(self, obj: int) -> None:
        self._range(obj)
        if obj in self.committed:
            raise HostAllocError(f"object {obj} committed twice")
        self.committed.add(obj)

    def split(self, obj: int, cut: int, new_obj: int) -> None:
        """The first `cut` pages of obj become new_obj (same committed state)."""
        start, n = self._range(obj)
        if not 0 < cut < n or new_obj in self.ranges:
            raise HostAllocError(f"split of object {obj} ({n} pages) at {cut} into {new_obj}")
        self.ranges[new_obj] = (start, cut)
        self.ranges[obj] = (start + cut, n - cut)
        if obj in self.committed:
            self.committed.add(new_obj)

    def _range(self, obj: int) -> tuple[int, int]:
        r = self.ranges.get(obj)
        if r is None:  # fail loudly: never invent a range for an unknown object
            raise HostAllocError(f"unknown host object {obj}")
        return r

    # ---- reading ---------------------------------------------------------------------

    @property
    def num_used(self) -> int:
        return sum(n for _, n in self.ranges.values())

    def encode(self) -> bytes:
        """Canonical bytes: capacity, the free runs, each object's range and commit bit
        (objects by id): equal states, equal bytes, whatever the order of events."""
        parts = [array("q", [self.capacity, len(self.free)]).tobytes()]
        parts.append(array("q", [x for run in self.free for x in run]).tobytes())
        rows = [(o, s, n, int(o in self.committed)) for o, (s, n) in sorted(self.ranges.items())]
        parts.append(array("q", [x for row in rows for x in row]).tobytes())
        return b"".join(parts)

    def digest(self) -> str:
        return hashlib.sha256(_TAG + self.encode()).hexdigest()

    def check(self) -> None:
        """Free runs and object ranges tile [0, capacity) exactly (tests, leak checks)."""
        spans = sorted([*self.free, *self.ranges.values()])
        at = 0
        for start, n in spans:
            if start != at or n < 1:
                raise AssertionError(f"host pages: gap or overlap at {at} ({spans})")
            at += n
        if at != self.capacity:
            raise AssertionError(f"host pages: {at} covered of {self.capacity}")
        for a, b in zip(self.free, self.free[1:], strict=False):
            if sum(a) == b[0]:
                raise AssertionError(f"free runs {a} and {b} not coalesced")
        if not self.committed <= set(self.ranges):
            raise AssertionError("a committed object without a range")
