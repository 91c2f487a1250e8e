"""Tests for the page-granular radix prefix cache."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from engine.cache.allocator import PageAllocator
from engine.cache.radix import RadixCache

PS = 4


def make(num_pages: int = 64, page_size: int = PS) -> RadixCache:
    return RadixCache(page_size, PageAllocator(num_pages))


def put(cache: RadixCache, tokens: Sequence[int]) -> list[int]:
    """Scheduler-style insert: reuse the matched prefix, allocate the rest, hand them over.
    Returns the pages the tree now holds for `tokens`."""
    m = cache.match_prefix(tokens)
    new = cache.allocator.alloc(len(tokens) // cache.page_size - len(m.pages))
    assert new is not None
    assert cache.insert(tokens, m.pages + new) == m.num_tokens
    return m.pages + new


def assert_no_leak(cache: RadixCache, held: Sequence[int] = ()) -> None:
    a = cache.allocator
    tree = cache.pages_in_tree()
    free = {p for p in range(1, a.capacity + 1) if a.is_free(p)}
    held_set = set(held)
    assert len(held_set) == len(held)
    assert not (tree & free) and not (tree & held_set) and not (free & held_set)
    assert len(tree) + len(free) + len(held_set) == a.capacity
    assert len(free) == a.num_free and len(tree) == cache.total_pages
    cache.check_invariants()


def test_match_on_empty_cache() -> None:
    c = make()
    for toks in ([], [1, 2, 3], list(range(16))):
        m = c.match_prefix(toks)
        assert m.pages == [] and m.num_tokens == 0 and m.node is c.root
    assert c.total_pages == 0 and c.evictable_pages == 0 and c.locked_pages == 0
    assert_no_leak(c)


def test_insert_then_match() -> None:
    c = make()
    toks = list(range(12))
    pages = c.allocator.alloc(3)
    assert pages is not None
    assert c.insert(toks, pages) == 0
    assert c.total_pages == 3 and c.evictable_pages == 3
    m = c.match_prefix(toks)
    assert m.pages == pages and m.num_tokens == 12 and m.node.key == tuple(toks)
    longer = c.match_prefix(toks + [50, 51, 52, 53, 54])
    assert longer.pages == pages and longer.num_tokens == 12
    assert_no_leak(c)


def test_partial_match_splits_node() -> None:
    c = make()
    pages = put(c, list(range(12)))
    leaf = c.match_prefix(list(range(12))).node
    m = c.match_prefix(list(range(8)) + [99, 98, 97, 96])
    assert m.num_tokens == 8 and m.pages == pages[:2]
    assert m.node.key == tuple(range(8)) and m.node is not leaf
    # the suffix keeps its identity, so a holder of `leaf` still holds the deepest node
    assert leaf.key == (8, 9, 10, 11) and leaf.pages == pages[2:] and leaf.parent is m.node
    assert list(m.node.children.values()) == [leaf]
    full = c.match_prefix(list(range(12)))
    assert full.pages == pages and full.node is leaf
    assert_no_leak(c)


def test_page_alignment() -> None:
    c = make()
    pages = put(c, list(range(20)))
    m = c.match_prefix(list(range(17)))
    assert m.num_tokens == 16 and m.pages == pages[:4]
    # a mismatch inside a page drops the whole page
    m = c.match_prefix([0, 1, 2, 3, 4, 5, 77, 7, 8])
    assert m.num_tokens == 4 and m.pages == pages[:1]
    assert c.match_prefix([0, 1, 2]).num_tokens == 0
    with pytest.raises(ValueError):
        c.insert(list(range(6)), [1])
    assert_no_leak(c)


def test_insert_returns_present_length_and_ownership() -> None:
    c = make()
    a = c.allocator
    first = put(c, list(range(12)))
    toks = list(range(8)) + [20, 21, 22, 23, 24, 25, 26, 27]
    mine = a.alloc(4)
    assert mine is not None
    assert c.insert(toks, mine) == 8
    # the first two pages stay the caller's; the last two now belong to the tree
    assert c.pages_in_tree() == set(first) | set(mine[2:])
    assert c.match_prefix(toks).pages == first[:2] + mine[2:]
    assert_no_leak(c, held=mine[:2])
    a.free(mine[:2])
    # fully present: nothing is taken
    again = a.alloc(3)
    assert again is not None
    assert c.insert(list(range(12)), again) == 12
    assert c.total_pages == 5
    assert_no_leak(c, held=again)
    a.free(again)
    with pytest.raises(ValueError, match="not allocated"):
        c.insert(list(range(100, 104)), again[:1])
    assert_no_leak(c)


def test_lock_protects_from_evict() -> None:
    c = make()
    put(c, list(range(8)))
    put(c, [9] * 8)
    node = c.match_prefix(list(range(8))).node
    c.lock(node)
    c.lock(node)
    assert c.locked_pages == 2 and c.evictable_pages == 2
    assert c.evict(100) == 2
    assert c.match_prefix(list(range(8))).num_tokens == 8
    assert c.evict(100) == 0
    c.unlock(node)
    assert c.evict(100) == 0 and c.locked_pages == 2
    c.unlock(node)
    assert c.locked_pages == 0 and c.evictable_pages == 2
    assert c.evict(1) == 2
    assert c.total_pages == 0 and c.allocator.num_free == c.allocator.capacity
    assert_no_leak(c)


def test_lock_covers_ancestors_and_splits() -> None:
    c = make()
    put(c, list(range(12)))
    leaf = c.match_prefix(list(range(12))).node
    c.lock(leaf)
    put(c, list(range(4)) + [7] * 4)  # splits the locked node; the prefix inherits the lock
    assert c.locked_pages == 3 and c.evictable_pages == 1
    assert leaf.parent is not None and leaf.parent.lock_ref == 1
    assert c.evict(10) == 1
    c.unlock(leaf)
    assert c.locked_pages == 0
    assert c.evict(10) == 3
    assert_no_leak(c)


def test_unlock_underflow_raises() -> None:
    c = make()
    put(c, list(range(8)))
    node = c.match_prefix(list(range(8))).node
    with pytest.raises(ValueError):
        c.unlock(node)
    c.lock(node)
    c.unlock(node)
    with pytest.raises(ValueError):
        c.unlock(node)
    c.lock(c.root)  # the root is never locked nor evicted: no-ops
    c.unlock(c.root)
    c.evict(10)
    with pytest.raises(ValueError):  # a node evicted from the tree cannot be locked
        c.lock(node)
    assert_no_leak(c)


def test_eviction_is_lru_on_logical_clock_with_id_tiebreak() -> None:
    c = make()
    a = put(c, [1] * 4)
    b = put(c, [2] * 4)  # same clock as a: a has the lower id, so it goes first
    c.tick()
    d = put(c, [3] * 4)
    c.tick()
    c.match_prefix([1] * 4)  # a is now the most recent (one hit: still probationary)
    freed: list[list[int]] = []
    for _ in range(3):
        before = c.pages_in_tree()
        assert c.evict(1) == 1
        freed.append(sorted(before - c.pages_in_tree()))
    assert freed == [b, d, a]
    assert_no_leak(c)


def test_protected_segment_evicted_last() -> None:
    c = make()
    hot = put(c, [1] * 4)  # put's match is a miss, so these hits are the 1st and 2nd
    c.match_prefix([1] * 4)
    c.match_prefix([1] * 4)
    c.tick()
    warm = put(c, [2] * 4)
    c.match_prefix([2] * 4)  # one hit: probationary
    c.tick()
    cold = put(c, [3] * 4)
    order = []
    for _ in range(3):
        before = c.pages_in_tree()
        c.evict(1)
        order.append(sorted(before - c.pages_in_tree()))
    assert order == [warm, cold, hot]  # hot is the oldest but protected
    assert_no_leak(c)


def test_cascading_eviction_of_parents() -> None:
    c = make()
    c.tick()
    put(c, list(range(8)) + [8, 9, 10, 11])  # b: single node, last_access 1
    c.tick()
    put(c, list(range(8)) + [20, 21, 22, 23])  # splits: prefix P and leaf c at clock 2
    c.tick()
    z = put(c, [5] * 8)  # newest
    assert c.total_pages == 6
    freed = c.evict(3)  # b (1 page), c (1 page), then P becomes a leaf older than z (2 pages)
    assert freed == 4
    assert c.pages_in_tree() == set(z)
    assert c.match_prefix(list(range(8))).num_tokens == 0
    assert c.allocator.num_free == c.allocator.capacity - 2
    assert c.evict(100) == 2 and c.evict(1) == 0
    assert_no_leak(c)


def test_evict_returns_pages_to_allocator() -> None:
    c = make(num_pages=17)  # 16 usable pages
    held = c.allocator.alloc(2)
    assert held is not None
    for i in range(3):
        put(c, [i] * 16)  # 4 pages each
    assert c.allocator.num_free == 16 - 2 - 12
    assert_no_leak(c, held=held)
    assert c.evict(5) == 8
    assert c.allocator.num_free == 10
    assert_no_leak(c, held=held)
    c.reset()
    assert c.total_pages == 0 and c.allocator.num_free == 14
    assert_no_leak(c, held=held)


def test_reset_refuses_locked_and_restarts_state() -> None:
    c = make()
    put(c, list(range(8)))
    node = c.match_prefix(list(range(8))).node
    c.lock(node)
    with pytest.raises(RuntimeError):
        c.reset()
    c.unlock(node)
    c.tick()
    c.reset()
    assert c.clock == 0 and c.total_pages == 0
    assert c.digest() == make().digest()
    assert_no_leak(c)


def _scripted(c: RadixCache, diverge: bool = False) -> None:
    put(c, list(range(16)))
    c.tick()
    put(c, list(range(8)) + [1] * 8)
    c.match_prefix(list(range(12)))
    c.tick()
    put(c, [7] * 12)
    node = c.match_prefix([7] * 12).node
    c.lock(node)
    if diverge:
        c.match_prefix(list(range(4)))  # splits a node: a different tree shape
    c.evict(2)


def test_digest_equal_for_same_ops_and_differs_after_divergence() -> None:
    a, b = make(), make()
    assert a.digest() == b.digest()
    _scripted(a)
    _scripted(b)
    assert a.digest() == b.digest() and a.allocator.digest() == b.allocator.digest()
    c = make()
    _scripted(c, diverge=True)
    assert c.digest() != a.digest()
    node = b.match_prefix([7] * 12).node
    b.lock(node)  # lock counts are part of the digest
    assert b.digest() != a.digest()
    b.unlock(node)
    assert b.digest() == a.digest()


def _simulate(seed: int, page_size: int, steps: int = 600) -> list[str]:
    """Seeded random scheduler traffic; checks invariants every step, returns digests."""
    rng = random.Random(seed)
    c = make(num_pages=49, page_size=page_size)
    alloc = c.allocator
    bases = [[rng.randrange(4) for _ in range(32)] for _ in range(4)]
    content: dict[int, tuple[int, ...]] = {}  # page -> the token prefix it ends
    running: list[tuple[list[int], object, list[int], list[int]]] = []  # toks, node, prefix, own
    trace: list[str] = []

    def tokens() -> list[int]:
        toks = rng.choice(bases)[: rng.randrange(0, 33)]
        toks = toks + [rng.randrange(4) for _ in range(rng.randrange(0, 12))]
        return toks[: len(toks) // page_size * page_size]

    def check_match(toks: list[int]) -> None:
        m = c.match_prefix(toks)
        assert m.num_tokens == len(m.pages) * page_size and m.num_tokens <= len(toks)
        for j, p in enumerate(m.pages):
            assert content[p] == tuple(toks[: (j + 1) * page_size])

    for _ in range(steps):
        op = rng.random()
        if op < 0.3:
            toks = tokens()
            m = c.match_prefix(toks)
            need = len(toks) // page_size - len(m.pages)
            c.lock(m.node)
            own = alloc.alloc(need)
            if own is None:
                c.evict(need - alloc.num_free)
                own = alloc.alloc(need)
            if own is None:
                c.unlock(m.node)
            else:
                for j, p in enumerate(own, start=len(m.pages)):
                    content[p] = tuple(toks[: (j + 1) * page_size])
                running.append((toks, m.node, m.pages, own))
        elif op < 0.5 and running:
            toks, node, prefix, own = running.pop(rng.randrange(len(running)))
            got = c.insert(toks, prefix + own)
            assert got >= len(prefix) * page_size
            alloc.free(own[: got // page_size - len(prefix)])  # duplicates stay ours to free
            c.unlock(node)  # type: ignore[arg-type]
            assert c.match_prefix(toks).num_tokens == len(toks)
        elif op < 0.58 and running:
            _, node, _, own = running.pop(rng.randrange(len(running)))
            c.unlock(node)  # type: ignore[arg-type]
            alloc.free(own)
        elif op < 0.8:
            check_match(tokens())
        elif op < 0.9:
            locked, evictable, want = c.locked_pages, c.evictable_pages, rng.randrange(1, 8)
            freed = c.evict(want)
            assert c.locked_pages == locked and freed <= evictable
            assert freed >= want or c.evictable_pages == 0
        else:
            c.tick()
        for toks, _, prefix, _ in running:  # locked prefixes survive everything
            assert c.match_prefix(toks).pages[: len(prefix)] == prefix
        assert_no_leak(c, held=[p for r in running for p in r[3]])
        trace.append(c.digest() + alloc.digest())
    for _, node, _, own in running:
        c.unlock(node)  # type: ignore[arg-type]
        alloc.free(own)
    c.evict(alloc.capacity)
    assert c.total_pages == 0 and alloc.num_free == alloc.capacity
    return trace


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_ops_keep_invariants_and_are_deterministic(seed: int, page_size: int) -> None:
    trace = _simulate(seed, page_size)
    assert trace == _simulate(seed, page_size)
    assert len(set(trace)) > 10


def test_untouched_match_counts_no_hit_until_touch() -> None:
    """A match that is not used (a blocked admission) leaves recency and hits alone; touch()
    counts the hit on the whole path once it is used."""
    cache = make()
    put(cache, list(range(2 * PS)))
    cache.tick()
    first = cache.match_prefix(list(range(2 * PS)), touch=False)
    assert first.num_tokens == 2 * PS and first.node.hits == 0 and first.node.last_access == 0
    for _ in range(3):
        cache.match_prefix(list(range(2 * PS)), touch=False)
    assert first.node.hits == 0
    cache.touch(first.node)
    assert first.node.hits == 1 and first.node.last_access == cache.clock


def test_continuation_follows_the_most_recent_matching_path() -> None:
    """NGRAM's tree drafts: what cached sequences went on with after a given token history."""
    c = make()
    base = list(range(100, 108))  # two pages
    put(c, base + [1, 2, 3, 4, 5, 6, 7, 8])
    c.tick()
    put(c, base + [1, 2, 9, 9, 9, 9, 9, 9])  # parts from the first mid-page, used later
    node = c.match_prefix(base, touch=False).node
    assert c.depth(node) == 8
    assert c.continuation(node, [1, 2], 4) == [9, 9, 9, 9]  # the later path wins
    assert c.continuation(node, [1, 2, 3], 10) == [4, 5, 6, 7, 8]  # only one path goes on with 3
    assert c.continuation(c.root, base + [1], 2) == [2, 9]  # from the root, rest spanning whole pages
    assert c.continuation(node, [7], 3) == [] and c.continuation(node, [1, 2], 0) == []
    assert c.total_pages == 6  # reads only: no split
    assert_no_leak(c)


def test_an_eviction_frees_a_batch_of_a_large_pool() -> None:
    """RequestKV.alloc: with the pool full of cached leaves, one page wanted evicts at least
    1/EVICT_BATCH_DIVISOR of the pool (the coldest leaves), so a decode batch does not rebuild
    the eviction heap at every page it allocates; a small pool evicts what it needs."""
    from engine.sched.scheduler import SchedConfig
    from engine.sched.state import EVICT_BATCH_DIVISOR, RequestKV, SchedState

    for num_pages, batch in ((4 * EVICT_BATCH_DIVISOR + 1, 4), (65, 1)):
        state = SchedState(SchedConfig(num_pages=num_pages, page_size=4, max_running=4, max_prefill_tokens=64,
                                       max_context=400, eos_token_ids=(1,), vocab_size=1000))
        kv = RequestKV(state)
        assert kv.evict_batch == batch
        leaves = 0
        while (pages := state.alloc.alloc(1)) is not None:  # one-page leaves, distinct keys
            state.cache.insert([leaves // 1000 + 2, leaves % 1000 + 2, 5, 6], pages)
            leaves += 1
        assert kv.alloc(1) is not None
        assert state.alloc.num_free == batch - 1  # freed `batch`, took one
