"""Tests for the deterministic device page allocator."""

from __future__ import annotations

import random

import pytest

from engine.cache.allocator import PageAllocator


def test_capacity_excludes_padding_page() -> None:
    a = PageAllocator(8)
    assert a.capacity == 7
    assert a.num_free == 7 and a.num_used == 0
    assert not a.is_free(0)
    assert a.alloc(7) == [1, 2, 3, 4, 5, 6, 7]
    assert a.num_free == 0 and a.num_used == 7


def test_alloc_is_lowest_first_ascending() -> None:
    a = PageAllocator(16)
    assert a.alloc(3) == [1, 2, 3]
    assert a.alloc(2) == [4, 5]
    a.free([5, 2])
    assert a.alloc(1) == [2]
    a.free([4, 1])
    assert a.alloc(4) == [1, 4, 5, 6]
    assert a.alloc(0) == []


def test_large_alloc_path_is_lowest_first() -> None:
    a = PageAllocator(100)
    a.free(a.alloc(60)[::2])  # free 1, 3, 5, ... 59
    got = a.alloc(40)  # large enough to take the sort path
    assert got == list(range(1, 60, 2)) + list(range(61, 71))
    assert a.alloc(a.num_free) == list(range(71, 100))


def test_exhaustion_returns_none_without_change() -> None:
    a = PageAllocator(5)
    assert a.alloc(3) == [1, 2, 3]
    before = a.digest()
    assert a.alloc(2) is None
    assert a.num_free == 1 and a.digest() == before
    assert a.alloc(1) == [4]
    assert a.alloc(1) is None


def test_double_free_and_bad_pages_raise_atomically() -> None:
    a = PageAllocator(8)
    pages = a.alloc(4)
    assert pages == [1, 2, 3, 4]
    a.free([2])
    before = (a.digest(), a.num_free)
    with pytest.raises(ValueError, match="double free"):
        a.free([1, 2])
    with pytest.raises(ValueError, match="out-of-range"):
        a.free([0])
    with pytest.raises(ValueError, match="out-of-range"):
        a.free([8])
    with pytest.raises(ValueError, match="duplicate"):
        a.free([3, 3])
    with pytest.raises(ValueError):
        a.alloc(-1)
    assert (a.digest(), a.num_free) == before  # nothing changed, page 1 still used
    a.free([1, 3, 4])
    assert a.num_free == 7


def test_digest_tracks_free_set_not_history() -> None:
    a, b = PageAllocator(32), PageAllocator(32)
    assert a.digest() == b.digest()
    pa = a.alloc(5)
    assert a.digest() != b.digest()
    pb = b.alloc(5)
    assert pa == pb and a.digest() == b.digest()
    a.free([pa[0], pa[3]])
    b.free([pb[3], pb[0]])
    assert a.digest() == b.digest()
    a.free([pa[1]])
    assert a.digest() != b.digest()
    assert PageAllocator(32).digest() != PageAllocator(33).digest()
    assert len(a.digest()) == 64


def test_million_pages_speed_sanity() -> None:
    """1e6 pages: init, many small alloc/free cycles, one full drain; fast (no timing asserted)."""
    n = 1_000_000
    a = PageAllocator(n)
    rng = random.Random(0)
    held: list[list[int]] = []
    for _ in range(20_000):
        if held and rng.random() < 0.45:
            a.free(held.pop(rng.randrange(len(held))))
        else:
            got = a.alloc(rng.randint(1, 4))
            assert got is not None
            held.append(got)
    used = sum(len(h) for h in held)
    assert a.num_used == used
    rest = a.alloc(a.num_free)
    assert rest is not None and rest == sorted(rest)
    assert a.num_free == 0 and a.alloc(1) is None
    a.free(rest)
    for h in held:
        a.free(h)
    assert a.num_free == n - 1
    assert a.digest() == PageAllocator(n).digest()


def test_owned_allocator_gives_page_i_from_owner_i_mod_cp() -> None:
    """Context parallelism: one pool per owner; a global id is local * owners + owner."""
    from engine.cache.allocator import OwnedPageAllocator, make_allocator

    assert isinstance(make_allocator(9, 1), PageAllocator)
    a = make_allocator(5, 3)  # 4 usable pages per owner
    assert isinstance(a, OwnedPageAllocator) and a.capacity == 12 and a.num_free == 12
    pages = a.alloc(5, first=2)  # request pages 2..6: owners 2, 0, 1, 2, 0
    assert pages is not None and [p % 3 for p in pages] == [2, 0, 1, 2, 0]
    assert pages == [1 * 3 + 2, 1 * 3 + 0, 1 * 3 + 1, 2 * 3 + 2, 2 * 3 + 0]  # lowest first per owner
    assert a.used_per_owner() == [2, 1, 2] and all(a.is_used(p) for p in pages)
    # free per owner now 2, 3, 2: pages 0..5 need 2 each; 0..8 three each (owners 0 and 2 one short)
    assert a.shortfall(6, first=0) == 0 and a.shortfall(9, first=0) == 2 and a.shortfall(12, first=0) == 5
    assert a.alloc(12, first=0) is None and a.num_free == 7  # one owner short: nothing taken
    before = a.digest()
    with pytest.raises(ValueError):
        a.free([pages[0], 0])  # a padding page: refused whole
    with pytest.raises(ValueError):
        a.free([pages[0], pages[0]])
    assert a.digest() == before
    a.free(pages)
    assert a.num_free == 12 and a.digest() == make_allocator(5, 3).digest()
