"""The components of a rank's replica (and of the scheduler's mirror of it).

* PageTables: slot -> (rid, page table); AddReq / ExtendPages / FreeReq.
* SlotSampling: slot -> the sampling parameters the worker's sampler holds for it.
* PrefixCachePages: the device pages the prefix cache holds; CachePages / EvictPages / Flush.
* HostTier (host.py): the host tier's (L2) allocator; the host ops and Flush.
Coming: grammar matchers.
"""

from __future__ import annotations

from array import array

import msgspec

from engine.replica.base import Component, Effect, Replica, ReplicaError
from engine.replica.host import HostTier
from msgs.codec import unpack_ids
from msgs.steps import AddReq, CachePages, EvictPages, ExtendPages, Flush, FreeReq

_ENCODER = msgspec.msgpack.Encoder()


class PageTables(Component):
    name = "page_tables"
    ops = (AddReq, ExtendPages, FreeReq)

    def __init__(self) -> None:
        self.tables: dict[int, list[int]] = {}
        self.rids: dict[int, str] = {}

    def apply(self, op: AddReq | ExtendPages | FreeReq) -> None:
        match op:
            case AddReq(slot=slot, rid=rid):
                if slot in self.tables:
                    raise ReplicaError(f"AddReq for busy slot {slot} ({self.rids[slot]})")
                self.tables[slot] = []
                self.rids[slot] = rid
            case ExtendPages(slot=slot, pages=pages):
                self.table(slot).extend(unpack_ids(pages))
            case FreeReq(slot=slot):
                self.table(slot)
                del self.tables[slot], self.rids[slot]

    def table(self, slot: int) -> list[int]:
        table = self.tables.get(slot)
        if table is None:  # fail loudly: never invent an empty table for an unknown slot
            raise ReplicaError(f"op for unknown slot {slot}")
        return table

    def encode(self) -> bytes:
        parts = []
        for slot in sorted(self.tables):
            rid = self.rids[slot].encode()
            parts.append(array("i", [slot, len(rid), len(self.tables[slot])]).tobytes() + rid)
            parts.append(array("i", self.tables[slot]).tobytes())
        return b"".join(parts)


class SlotSampling(Component):
    name = "slot_sampling"
    ops = (AddReq, FreeReq)

    def __init__(self) -> None:
        self.params: dict[int, bytes] = {}  # slot -> canonical msgpack of its WorkerSampling

    def apply(self, op: AddReq | FreeReq) -> None:
        if isinstance(op, AddReq):
            if op.slot in self.params:
                raise ReplicaError(f"AddReq for busy sampling slot {op.slot}")
            self.params[op.slot] = _ENCODER.encode(op.sampling)
        elif self.params.pop(op.slot, None) is None:
            raise ReplicaError(f"FreeReq for unknown sampling slot {op.slot}")

    def encode(self) -> bytes:
        return b"".join(array("i", [s, len(self.params[s])]).tobytes() + self.params[s] for s in sorted(self.params))


class PrefixCachePages(Component):
    name = "prefix_cache"
    ops = (CachePages, EvictPages, Flush)

    def __init__(self) -> None:
        self.pages: set[int] = set()

    def apply(self, op: CachePages | EvictPages | Flush) -> None:
        match op:
            case CachePages(pages=packed):
                pages = unpack_ids(packed)
                if self.pages.intersection(pages):
                    raise ReplicaError(f"CachePages for pages already cached: {sorted(self.pages.intersection(pages))}")
                self.pages.update(pages)
            case EvictPages(pages=packed):
                pages = unpack_ids(packed)
                if not self.pages.issuperset(pages):
                    raise ReplicaError(f"EvictPages for pages not cached: {sorted(set(pages) - self.pages)}")
                self.pages.difference_update(pages)
            case Flush():
                self.pages.clear()

    def encode(self) -> bytes:
        return array("i", sorted(self.pages)).tobytes()


def rank_replica(effects: list[Effect] | None = None) -> Replica:
    """The replica every rank and the scheduler's mirror hold."""
    return Replica([PageTables(), SlotSampling(), PrefixCachePages(), HostTier()], effects or [])
