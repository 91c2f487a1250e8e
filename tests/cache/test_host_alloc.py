"""The host tier's allocator and its replica component: first fit, coalescing, splits,
commits, digests that prove placement, and the same op stream giving the same state on
every replica."""

from __future__ import annotations

import random

import pytest

from engine.replica import ReplicaError, rank_replica
from engine.replica.host_alloc import HostAllocator, HostAllocError
from msgs.codec import pack_ids
from msgs.steps import ApplyCommit, BackupPrepare, Flush, HostEvict, HostInit, HostSplit, LoadBack, Op, Step


def test_first_fit_and_coalescing() -> None:
    a = HostAllocator(10)
    assert [a.reserve(o, 2) for o in range(5)] == [0, 2, 4, 6, 8]
    assert a.reserve(9, 1) is None
    a.release(1)
    a.release(3)
    assert a.free == [(2, 2), (6, 2)]
    assert a.reserve(7, 3) is None  # 4 pages free but no run of 3: first fit needs a run
    a.release(2)  # joins both neighbours into one run
    assert a.free == [(2, 6)]
    assert a.reserve(7, 3) == 2  # the lowest run that fits
    a.check()


def test_release_order_does_not_change_the_digest() -> None:
    def fill() -> HostAllocator:
        a = HostAllocator(12)
        for o in range(6):
            a.reserve(o, 2)
        return a

    one, two = fill(), fill()
    for o in (1, 3, 2, 5):
        one.release(o)
    for o in (5, 2, 3, 1):
        two.release(o)
    assert one.free == two.free == [(2, 6), (10, 2)]
    assert one.digest() == two.digest()


def test_split_commit_and_errors() -> None:
    a = HostAllocator(8)
    a.reserve(5, 4)
    a.commit(5)
    a.split(5, 1, 9)
    assert a.ranges == {9: (0, 1), 5: (1, 3)} and a.committed == {5, 9}
    with pytest.raises(HostAllocError):
        a.commit(5)  # twice
    with pytest.raises(HostAllocError):
        a.release(42)  # unknown: never a silent no-op
    with pytest.raises(HostAllocError):
        a.split(5, 3, 10)  # the cut must leave both parts non-empty
    a.release(9)
    a.release(5)
    assert a.free == [(0, 8)] and not a.committed
    a.check()


def test_flush_restores_the_initial_digest() -> None:
    a = HostAllocator(16)
    fresh = a.digest()
    a.reserve(1, 3)
    a.commit(1)
    assert a.digest() != fresh
    a.reset()
    assert a.digest() == fresh


def _stream(seed: int, capacity: int = 64, n: int = 300) -> list[Op]:
    """A random but valid host-op stream, as the scheduler would publish it."""
    rng, a, ops, next_obj = random.Random(seed), HostAllocator(capacity), [HostInit(capacity)], 0
    pending: set[int] = set()
    for _ in range(n):
        roll = rng.random()
        if roll < 0.4:
            size = rng.randint(1, 6)
            start = a.find(size)
            if start is None:
                continue
            assert a.reserve(next_obj, size) == start
            ops.append(BackupPrepare(next_obj, pack_ids(range(1, size + 1)), start))
            pending.add(next_obj)
            next_obj += 1
        elif roll < 0.6 and pending:
            obj = min(pending)
            pending.discard(obj)
            a.commit(obj)
            ops.append(ApplyCommit(obj))
        elif roll < 0.7 and a.ranges:
            obj = rng.choice(sorted(a.ranges))
            if a.ranges[obj][1] > 1:
                a.split(obj, 1, next_obj)
                if obj in pending:
                    pending.add(next_obj)
                ops.append(HostSplit(obj, 1, next_obj))
                next_obj += 1
        elif roll < 0.8 and a.committed:
            obj = rng.choice(sorted(a.committed))
            ops.append(LoadBack(obj, pack_ids(range(1, a.ranges[obj][1] + 1)), a.ranges[obj][0]))
        elif a.ranges:
            obj = rng.choice(sorted(a.ranges))
            pending.discard(obj)
            a.release(obj)
            ops.append(HostEvict(obj))
    return ops


def _replay(ops: list[Op]) -> str:
    r = rank_replica()
    for i in range(0, len(ops), 7):  # ops arrive in steps of a few each
        r.apply_step(Step(seq=r.seq + 1, ops=ops[i : i + 7]))
    r["host_tier"].alloc.check()
    return r.digest()


def test_eight_replicas_agree_and_one_divergent_op_shows() -> None:
    ops = _stream(seed=7)
    digests = {_replay(ops) for _ in range(8)}
    assert len(digests) == 1
    # drop the last commit that nothing later depends on: only the committed set differs
    i = max(
        i for i, op in enumerate(ops)
        if isinstance(op, ApplyCommit) and not any(getattr(o, "obj", None) == op.obj for o in ops[i + 1 :])
    )
    assert _replay(ops[:i] + ops[i + 1 :]) not in digests


def test_a_replica_that_would_place_elsewhere_stops() -> None:
    r = rank_replica()
    r.apply_step(Step(seq=1, ops=[HostInit(8), BackupPrepare(1, pack_ids([3, 4]), 0)]))
    with pytest.raises(ReplicaError, match="placed at 2"):
        r.apply_step(Step(seq=2, ops=[BackupPrepare(2, pack_ids([5]), 4)]))


def test_host_ops_are_refused_without_a_tier_and_loadback_needs_a_commit() -> None:
    r = rank_replica()
    with pytest.raises(ReplicaError, match="no HostInit"):
        r.apply(HostEvict(1))
    r.apply(HostInit(4))
    r.apply(BackupPrepare(1, pack_ids([7, 8]), 0))
    with pytest.raises(ReplicaError, match="not a committed"):
        r.apply(LoadBack(1, pack_ids([9, 10]), 0))
    r.apply(ApplyCommit(1))
    with pytest.raises(ReplicaError, match="not a committed object there"):
        r.apply(LoadBack(1, pack_ids([9, 10]), 1))
    r.apply(LoadBack(1, pack_ids([9, 10]), 0))
    fresh = rank_replica()
    fresh.apply(HostInit(4))
    r.apply(Flush())
    assert r.digest() == fresh.digest()
