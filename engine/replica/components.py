"""The components of a rank's replica (and of the scheduler's mirror of it).

* PageTables: slot -> (rid, page table); AddReq / ExtendPages / FreeReq / TrimReq.
* SlotSampling: slot -> the sampling parameters the worker's sampler holds for it, and its token
  history (prompt and earlier output: the penalties, min_new_tokens and grammar replay read it).
* PrefixCachePages: the device pages the prefix cache holds; CachePages / EvictPages / Flush.
* HostTier (host.py): the host tier's (L2) allocator; the host ops and Flush.
* GrammarKeys: the grammars every rank holds, by key (PrepareGrammar, AddReq); the matchers
  themselves are an effect (engine/run/grammar.py).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import msgspec

from engine.replica.base import Component, Effect, Replica, ReplicaError
from engine.replica.host import HostTier
from msgs.codec import unpack_ids
from msgs.params import Grammar
from msgs.steps import AddReq, CachePages, EvictPages, ExtendPages, Flush, FreeReq, PrepareGrammar, TrimReq

_ENCODER = msgspec.msgpack.Encoder()


class PageTables(Component):
    name = "page_tables"
    ops = (AddReq, ExtendPages, FreeReq, TrimReq)

    def __init__(self) -> None:
        self.tables: dict[int, list[int]] = {}
        self.rids: dict[int, str] = {}

    def apply(self, op: AddReq | ExtendPages | FreeReq | TrimReq) -> None:
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
            case TrimReq(slot=slot, keep=keep):
                table = self.table(slot)
                if not 0 <= keep <= len(table):  # a trim never grows a table: the stream diverged
                    raise ReplicaError(f"TrimReq keeps {keep} of slot {slot}'s {len(table)} pages")
                del table[keep:]

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
        # slot -> canonical msgpack of its WorkerSampling, its history's lengths and their hash
        self.params: dict[int, bytes] = {}

    def apply(self, op: AddReq | FreeReq) -> None:
        if isinstance(op, AddReq):
            if op.slot in self.params:
                raise ReplicaError(f"AddReq for busy sampling slot {op.slot}")
            history = array("i", [len(op.prompt_ids), len(op.output_ids)]).tobytes()
            history += hashlib.blake2b(op.prompt_ids + op.output_ids, digest_size=16).digest()
            self.params[op.slot] = _ENCODER.encode(op.sampling) + history
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


class GrammarKeys(Component):
    """The grammars a rank holds: the keys PrepareGrammar brought in, least recently prepared or
    used by an AddReq first out, at most CAPACITY of them and BYTES of compiled grammars
    (`Grammar.compiled_bytes`, measured by the tokenizer's check: each grammar helper holds
    every one; the newest stays whatever its size). A grammar's data travels in the Step stream
    once, in its PrepareGrammar; an AddReq names a held key (its data is not read), and a key
    not held is a missing descriptor: fatal. `prepared` counts the PrepareGrammar ops: a rank's
    GrammarReady names the one it answers. The scheduler keeps one more instance, updated as
    it emits ops, to know what every rank holds; each rank's GrammarSlots runs one to know what
    it may drop (the same code on the same ops: the same keys everywhere, checked by the digest).
    A Flush drops every key (the count goes on: a late report on a key flushed is told apart)."""

    name = "grammar_keys"
    ops = (PrepareGrammar, AddReq, Flush)
    CAPACITY = 64
    BYTES = 512 << 20

    def __init__(self) -> None:
        self.keys: OrderedDict[str, int] = OrderedDict()  # key -> its compiled bytes
        self.bytes = 0
        self.prepared = 0

    def apply(self, op: PrepareGrammar | AddReq | Flush) -> None:
        if isinstance(op, Flush):
            self.keys.clear()
            self.bytes = 0
        elif isinstance(op, PrepareGrammar):
            self.prepare(op.grammar)
        elif op.grammar is not None:
            self.use(op.grammar.key)

    def prepare(self, grammar: Grammar) -> list[str]:
        """Take one PrepareGrammar (a held key is prepared again: its compile failed on some
        rank): the keys it evicts, oldest first."""
        if not grammar.data:
            raise ReplicaError(f"PrepareGrammar of {grammar.key[:12]} without its data")
        evicted = self.evicts(grammar)
        self.prepared += 1
        self.bytes -= self.keys.pop(grammar.key, 0)
        for key in evicted:
            self.bytes -= self.keys.pop(key)
        self.keys[grammar.key] = grammar.compiled_bytes
        self.bytes += grammar.compiled_bytes
        return evicted

    def evicts(self, grammar: Grammar) -> list[str]:
        """The keys preparing this grammar would evict, oldest first (nothing changes)."""
        count = len(self.keys) + (grammar.key not in self.keys)
        size = self.bytes - self.keys.get(grammar.key, 0) + grammar.compiled_bytes
        out = []
        for key, held in self.keys.items():
            if count <= 1 or (count <= self.CAPACITY and size <= self.BYTES):
                break
            if key == grammar.key:
                continue
            out.append(key)
            count -= 1
            size -= held
        return out

    def use(self, key: str) -> None:
        """An AddReq names this key: it must be held; it becomes the most recent."""
        if key not in self.keys:
            raise ReplicaError(f"AddReq names grammar {key[:12]}, which this rank does not hold")
        self.keys.move_to_end(key)

    def encode(self) -> bytes:
        return "\n".join([str(self.prepared), *self.keys]).encode()


def rank_replica(effects: list[Effect] | None = None) -> Replica:
    """The replica every rank and the scheduler's mirror hold."""
    return Replica([PageTables(), SlotSampling(), PrefixCachePages(), HostTier(), GrammarKeys()], effects or [])
