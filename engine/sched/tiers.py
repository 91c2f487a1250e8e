"""The scheduler's part for the memory tiers (docs/architecture.md, Tiers): L1 + L2 under one radix tree,
and L3 files read into L2 on a match.

The tree (engine/cache/hiradix.py) makes the placement decisions and records them as ops;
this part connects it to the rest of the scheduler:

* `make_cache`: the plain tree, or the tiered one when the host tier is on;
* `load_back`: a match that reaches host-only nodes takes device pages for them (LoadBack
  ops; the worker copies before the forward) and moves the request's lock down;
* `on_committed`: the cache controller's Committed(obj) becomes ApplyCommit ops in the next
  Step (rule 5: messages that come back change state only as re-published ops);
* `l3_wait`: past what L1 and L2 hold, a waiting request's full prompt pages are looked up
  in L3 (once per request: a stat per page); found pages become a loading node (L3Load) and
  the request waits for the controller's L3Loaded, re-published as ApplyCommit (or
  HostEvict on a failed read: the request computes them);
* the controller's digests are checked against the mirror's at the same step;
* `stats` / `leak_free` for /metrics and the idle leak check.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog

from engine.cache import l3
from engine.cache.allocator import PageAllocator
from engine.cache.hiradix import TieredRadixCache
from engine.cache.radix import MatchResult, RadixCache
from engine.sched.digests import DigestMismatch
from msgs.done import L3Stats

if TYPE_CHECKING:
    from engine.sched.request import Req
    from engine.sched.state import SchedConfig

log = structlog.get_logger()
WARN_EVERY_S = 5.0


def make_cache(cfg: SchedConfig, alloc: PageAllocator) -> RadixCache:
    if not cfg.host_pages:
        return RadixCache(cfg.page_size, alloc)
    return TieredRadixCache(
        cfg.page_size, alloc, cfg.host_pages, cfg.write_policy, warn=_RateLimited().warn, page_bytes=cfg.page_bytes,
        num_layers=cfg.num_layers, kv_components=cfg.kv_components,
        l3_fingerprint=cfg.l3_fingerprint if cfg.l3_dir else b"",
    )


class _RateLimited:
    """A skipped backup is worth a warning, not one per step."""

    def __init__(self) -> None:
        self.last = -WARN_EVERY_S
        self.suppressed = 0

    def warn(self, msg: str) -> None:
        now = time.monotonic()  # only paces a log line: never decides anything replicated
        if now - self.last < WARN_EVERY_S:
            self.suppressed += 1
            return
        log.warning(msg, suppressed=self.suppressed)
        self.last, self.suppressed = now, 0


class Tiers:
    def __init__(self, cache: TieredRadixCache, l3_dir: str = "") -> None:
        self.cache = cache
        self.l3_dir = l3_dir if cache.fingerprint else ""  # "": no disk tier
        self.expected: dict[int, str] = {}  # DigestCheck seq -> the mirror's digest then
        self.hits = {"l2": 0, "l3": 0}  # prompt tokens of admitted requests, by the tier that served them
        self.l3_stats = L3Stats()  # the controller's latest

    def load_back(self, match: MatchResult) -> tuple[MatchResult, int, int]:
        """`match.node` is locked by the caller; on success the lock moves to the deepest
        loaded node (the pages below stay pinned as the request's prefix). Also returns the
        tokens loaded that came from L2 and from L3."""
        loaded = self.cache.load_back(match)
        if loaded is None:  # no device room even after eviction: use the device part only
            return match, 0, 0
        self.cache.lock(loaded.node)
        self.cache.unlock(match.node)
        return loaded, *self.cache.last_load

    def l3_wait(self, req: Req, match: MatchResult, ids: list[int]) -> bool:
        """After L1 and L2 (`match`, locked by the caller, ending on the device): whether req
        must wait for an L3 load of the pages that follow. A load in flight there: wait.
        Else, once per request, look the following full pages of `ids` up in L3 and start
        a load of those found (if L2 has room): wait for it."""
        if not self.l3_dir or match.host_nodes:
            return False
        ps, at = self.cache.page_size, match.num_tokens
        rest = ids[at : len(ids) // ps * ps]
        if self.cache.loading_at(match.node, rest):
            return True
        if req.l3_probed or len(rest) < ps:
            return False
        req.l3_probed = True
        keys = l3.chain(self.cache.chain_end(match.node), rest, ps)
        found = min(l3.probe(self.l3_dir, keys), self.cache.host.capacity)
        return found > 0 and self.cache.start_l3_load(match.node, rest, keys[:found])

    def on_l3_loaded(self, obj: int, ok: bool) -> None:
        self.cache.l3_loaded(obj, ok)

    def count_hits(self, l2: int, l3_tokens: int) -> None:
        self.hits["l2"] += l2
        self.hits["l3"] += l3_tokens

    @property
    def loading(self) -> int:
        return len(self.cache.loading)

    def on_committed(self, obj: int) -> None:
        self.cache.commit(obj)

    def expect(self, seq: int, digest: str) -> None:
        self.expected[seq] = digest

    def on_controller_digest(self, seq: int, digest: str) -> None:
        want = self.expected.pop(seq, None)
        if want is None:
            raise DigestMismatch(f"cache controller reported a digest for step {seq}, which asked for none")
        if want != digest:
            raise DigestMismatch(f"cache controller diverged at or before step {seq}: {digest} != {want}")

    def stats(self) -> dict[str, int]:
        c = self.cache
        d = self.l3_stats
        return {
            "l2_hit_tokens": self.hits["l2"],
            "l2_pages_used": c.host.num_used,
            "l2_pages_total": c.host.capacity,
            "backups_committed": c.stats["committed"],
            "backups_skipped": c.stats["skipped"],
            "load_backs": c.stats["load_backs"],
            "l3_hit_tokens": self.hits["l3"],
            "l3_reads": d.reads,
            "l3_writes": d.writes,
            "l3_bytes_read": d.bytes_read,
            "l3_bytes_written": d.bytes_written,
            "l3_corrupt": d.corrupt,
            "l3_write_skips": d.write_skips,
            "l3_files": d.files,
            "l3_bytes": d.bytes,
        }

    def leak_free(self) -> bool:
        """Every host page is free or held by a node of the tree, and the tree is sound."""
        try:
            self.cache.check_invariants()
        except AssertionError as exc:
            log.error("host tier out of sync with the tree", error=str(exc))
            return False
        return True
