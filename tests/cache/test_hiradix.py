"""The two-tier radix tree: write-through backups, commits, eviction to the host tier,
load-back, splits of host objects, evict-to-fit; every change replayed on a replica must
give the scheduler's own state."""

from __future__ import annotations

import random

import pytest

from engine.cache.allocator import PageAllocator
from engine.cache.hiradix import TieredRadixCache
from engine.replica import rank_replica
from msgs.steps import BackupPrepare, HostEvict, LoadBack, Step

PS = 2


def _cache(device_pages: int = 16, host_pages: int = 16) -> tuple[TieredRadixCache, list]:
    warnings: list[str] = []
    return TieredRadixCache(PS, PageAllocator(device_pages + 1), host_pages, warn=warnings.append), warnings


def _insert(cache: TieredRadixCache, tokens: list[int]) -> int:
    pages = cache.allocator.alloc(len(tokens) // PS)
    assert pages is not None
    kept, _ = cache.insert_node(tokens, pages)
    cache.allocator.free(pages[: kept // PS])  # the caller's duplicates
    return kept


def _commit_all(cache: TieredRadixCache) -> None:
    for obj in sorted(o for o, n in cache.objects.items() if not n.committed and o not in cache.origin):
        cache.commit(obj)


class Follower:
    """A replica fed with the cache's changes, one step per call."""

    def __init__(self) -> None:
        self.replica = rank_replica()

    def sync(self, cache: TieredRadixCache, ops: list | None = None) -> None:
        ops = cache.take_changes() if ops is None else ops
        self.replica.apply_step(Step(seq=self.replica.seq + 1, ops=ops))
        cache.check_invariants()
        assert self.replica["host_tier"].alloc.encode() == cache.host.encode()
        assert self.replica["prefix_cache"].pages == cache.pages_in_tree()


def test_backup_commit_evict_to_host_and_load_back() -> None:
    cache, _ = _cache()
    f = Follower()
    _insert(cache, [1, 2, 3, 4, 5, 6])
    changes = cache.changes[:]
    assert any(isinstance(c, BackupPrepare) for c in changes)
    f.sync(cache)
    assert cache.evict(3) == 0  # pending: its device pages stay
    _commit_all(cache)
    assert cache.evict(3) == 3
    f.sync(cache)
    assert cache.total_pages == 0 and cache.host.num_used == 3
    match = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert match.num_tokens == 0 and len(match.host_nodes) == 1
    cache.lock(match.node)  # the root: a no-op, as in admission
    loaded = cache.load_back(match)
    assert loaded is not None and loaded.num_tokens == 6 and len(loaded.pages) == 3
    assert any(isinstance(c, LoadBack) for c in cache.changes)
    assert cache.last_load == (6, 0)  # tokens loaded from (L2, L3)
    f.sync(cache)


def test_a_split_pending_object_commits_with_its_origin() -> None:
    cache, _ = _cache()
    f = Follower()
    _insert(cache, [1, 2, 3, 4, 5, 6])
    obj = next(iter(cache.objects))
    assert _insert(cache, [1, 2, 9, 9]) == 2  # splits the pending node after one page
    assert len(cache.objects) == 3  # the two pieces and the new leaf's object
    f.sync(cache)
    cache.commit(obj)  # the controller commits what the workers copied: the original object
    assert sum(n.committed for n in cache.objects.values()) == 2
    f.sync(cache)


def test_insert_over_host_only_nodes_adopts_the_callers_pages() -> None:
    cache, _ = _cache()
    f = Follower()
    _insert(cache, [1, 2, 3, 4])
    _commit_all(cache)
    cache.evict(10)
    f.sync(cache)
    kept = _insert(cache, [1, 2, 3, 4, 5, 6])  # the first two pages were host-only
    assert kept == 0 and cache.total_pages == 3
    f.sync(cache)


def test_evict_to_fit_takes_the_coldest_committed_leaf_first() -> None:
    cache, warnings = _cache(device_pages=16, host_pages=4)
    f = Follower()
    for i, first in enumerate((10, 20)):  # two objects of 2 pages, 20 the hotter
        cache.tick()
        _insert(cache, [first, i, 1, 1])
    _commit_all(cache)
    cache.tick()
    cache.match_prefix([20, 1, 1, 1])  # another hit on 20
    f.sync(cache)
    _insert(cache, [30, 0, 0, 0])  # needs 2 host pages: the coldest (10...) goes
    evicted = [c.obj for c in cache.changes if isinstance(c, HostEvict)]
    assert len(evicted) == 1
    assert cache.match_prefix([10, 0, 1, 1]).num_tokens == 4  # still on the device
    assert cache.match_prefix([10, 0, 1, 1], touch=False).node.host == -1  # but its host copy is gone
    f.sync(cache)
    _insert(cache, [40, 0, 0, 0, 0, 0, 0, 0, 0, 0])  # 5 pages never fit 4: skipped, warned
    assert cache.stats["skipped"] == 1 and warnings
    f.sync(cache)


def test_random_workload_replays_identically_on_eight_replicas() -> None:
    rng = random.Random(3)
    cache, _ = _cache(device_pages=12, host_pages=10)
    followers = [Follower() for _ in range(8)]
    for step in range(200):
        cache.tick()
        toks = [rng.randint(0, 2) for _ in range(rng.randint(1, 4) * PS)]
        match = cache.match_prefix(toks)
        cache.lock(match.node)
        if match.host_nodes and rng.random() < 0.5:
            loaded = cache.load_back(match)
            if loaded is not None:
                cache.lock(loaded.node)
                cache.unlock(match.node)
                match = loaded
        cache.unlock(match.node)
        if cache.allocator.num_free < 4:
            cache.evict(4)
        if cache.allocator.num_free >= len(toks) // PS:
            _insert(cache, toks)
        if step % 3 == 0:
            _commit_all(cache)
        ops = cache.take_changes()
        for f in followers:
            f.sync(cache, ops)
    digests = {f.replica.digest() for f in followers}
    assert len(digests) == 1
    assert cache.stats["load_backs"] > 0 and cache.stats["host_evicted"] > 0


def test_write_back_is_refused() -> None:
    with pytest.raises(ValueError, match="not implemented"):
        TieredRadixCache(PS, PageAllocator(4), 4, policy="write_back")


def test_write_through_selective_backs_up_on_the_second_hit() -> None:
    cache = TieredRadixCache(PS, PageAllocator(17), 16, policy="write_through_selective")
    f = Follower()
    _insert(cache, [1, 2, 3, 4])
    assert not cache.objects  # no backup on insert
    for _ in range(2):
        m = cache.match_prefix([1, 2, 3, 4, 5], touch=False)
        cache.touch(m.node)
    assert len(cache.objects) == 1  # the second hit backed it up
    f.sync(cache)


def test_a_host_copy_with_only_device_children_can_make_room() -> None:
    """A prompt whose decode tail was not backed up (device-only child) is still an L2 victim, and
    an object's own ancestors never are (its copy needs theirs). Before: the prompt was pinned in
    L2 for as long as its tail stayed on the device, and a backup with a locked other copy failed."""
    cache = TieredRadixCache(PS, PageAllocator(17), 4, policy="write_through_selective")
    f = Follower()

    def hot(tokens: list[int]) -> None:  # two hits: backed up (selective), then committed
        for _ in range(2):
            cache.tick()
            cache.touch(cache.match_prefix(tokens, touch=False).node)
        _commit_all(cache)

    _insert(cache, [10, 0, 1, 1])
    hot([10, 0, 1, 1])
    _insert(cache, [20, 0, 1, 1])
    hot([20, 0, 1, 1])
    _insert(cache, [10, 0, 1, 1, 5, 5])  # a device-only tail under 10...
    busy = cache.match_prefix([20, 0, 1, 1], touch=False).node
    cache.lock(busy)  # ...and 20 in use
    f.sync(cache)
    _insert(cache, [30, 0, 0, 0])
    hot([30, 0, 0, 0])  # needs 2 host pages: 10's copy goes, its device pages and tail stay
    evicted = [c.obj for c in cache.changes if isinstance(c, HostEvict)]
    ten = cache.match_prefix([10, 0, 1, 1], touch=False).node
    assert evicted == [ten.id] and ten.host == -1 and ten.pages and cache.stats["skipped"] == 0
    assert cache.match_prefix([10, 0, 1, 1, 5, 5], touch=False).num_tokens == 6
    cache.unlock(busy)
    f.sync(cache)


def test_a_backup_never_evicts_its_own_parents_copy() -> None:
    cache, _ = _cache(device_pages=16, host_pages=4)
    f = Follower()
    _insert(cache, [10, 0, 1, 1])
    _insert(cache, [20, 0, 1, 1])
    _commit_all(cache)
    cache.tick()
    cache.touch(cache.match_prefix([20, 0, 1, 1], touch=False).node)  # 10 is the colder
    f.sync(cache)
    _insert(cache, [10, 0, 1, 1, 5, 5])  # the tail's backup needs a page: 20's copy goes, not 10's
    assert cache.match_prefix([10, 0, 1, 1], touch=False).node.host >= 0
    assert cache.match_prefix([20, 0, 1, 1], touch=False).node.host == -1
    f.sync(cache)
