"""The scheduler's part for the memory tiers (DESIGN.md 6): L1 + L2 under one radix tree.

The tree (engine/cache/hiradix.py) makes the placement decisions and records them as ops;
this part connects it to the rest of the scheduler:

* `make_cache`: the plain tree, or the tiered one when the host tier is on;
* `load_back`: a match that reaches host-only nodes takes device pages for them (LoadBack
  ops; the worker copies before the forward) and moves the request's lock down;
* `on_committed`: the cache controller's Committed(obj) becomes ApplyCommit ops in the next
  Step (rule 5: messages that come back change state only as re-published ops);
* the controller's digests are checked against the mirror's at the same step;
* `stats` / `leak_free` for /metrics and the idle leak check.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog

from engine.cache.allocator import PageAllocator
from engine.cache.hiradix import TieredRadixCache
from engine.cache.radix import MatchResult, RadixCache
from engine.sched.digests import DigestMismatch

if TYPE_CHECKING:
    from engine.sched.state import SchedConfig

log = structlog.get_logger()
WARN_EVERY_S = 5.0


def make_cache(cfg: SchedConfig, alloc: PageAllocator) -> RadixCache:
    if not cfg.host_pages:
        return RadixCache(cfg.page_size, alloc)
    return TieredRadixCache(
        cfg.page_size, alloc, cfg.host_pages, cfg.write_policy, warn=_RateLimited().warn, page_bytes=cfg.page_bytes
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
    def __init__(self, cache: TieredRadixCache) -> None:
        self.cache = cache
        self.expected: dict[int, str] = {}  # DigestCheck seq -> the mirror's digest then

    def load_back(self, match: MatchResult) -> MatchResult:
        """`match.node` is locked by the caller; on success the lock moves to the deepest
        loaded node (the pages below stay pinned as the request's prefix)."""
        loaded = self.cache.load_back(match)
        if loaded is None:  # no device room even after eviction: use the device part only
            return match
        self.cache.lock(loaded.node)
        self.cache.unlock(match.node)
        return loaded

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
        return {
            "l2_hit_tokens": c.stats["l2_hit_tokens"],
            "l2_pages_used": c.host.num_used,
            "l2_pages_total": c.host.capacity,
            "backups_committed": c.stats["committed"],
            "backups_skipped": c.stats["skipped"],
            "load_backs": c.stats["load_backs"],
        }

    def leak_free(self) -> bool:
        """Every host page is free or held by a node of the tree, and the tree is sound."""
        try:
            self.cache.check_invariants()
        except AssertionError as exc:
            log.error("host tier out of sync with the tree", error=str(exc))
            return False
        return True
