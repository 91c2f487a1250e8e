"""The replicated state: per-slot page tables, as changed by Step ops.

The scheduler applies every op it emits to its own ReplicaState; each worker applies the
ops it receives to its own. Both compute `digest()` with this same code, so a DigestCheck
compares like with like (DESIGN.md section 4, rule 3).
"""

from __future__ import annotations

import hashlib
from array import array

from msgs.codec import unpack_ids
from msgs.steps import AddReq, DigestCheck, ExtendPages, FreeReq, Op


class ReplicaError(RuntimeError):
    """A Step that cannot apply to this replica: a protocol bug, always fatal."""


class ReplicaState:
    def __init__(self) -> None:
        self.page_tables: dict[int, list[int]] = {}
        self.rids: dict[int, str] = {}

    def apply(self, op: Op) -> None:
        match op:
            case AddReq(slot=slot, rid=rid):
                if slot in self.page_tables:
                    raise ReplicaError(f"AddReq for busy slot {slot} ({self.rids[slot]})")
                self.page_tables[slot] = []
                self.rids[slot] = rid
            case ExtendPages(slot=slot, pages=pages):
                self._table(slot).extend(unpack_ids(pages))
            case FreeReq(slot=slot):
                self._table(slot)
                del self.page_tables[slot], self.rids[slot]
            case DigestCheck():
                pass

    def _table(self, slot: int) -> list[int]:
        table = self.page_tables.get(slot)
        if table is None:  # fail loudly: never invent an empty table for an unknown slot
            raise ReplicaError(f"op for unknown slot {slot}")
        return table

    def digest(self) -> str:
        h = hashlib.sha256()
        for slot in sorted(self.page_tables):
            h.update(array("i", [slot, len(self.page_tables[slot])]).tobytes())
            h.update(self.rids[slot].encode())
            h.update(array("i", self.page_tables[slot]).tobytes())
        return h.hexdigest()
