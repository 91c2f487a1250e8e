"""The cache controller driver over in-memory channel ends: commits need every rank AND
the Step that prepared the object (whichever arrives first), once; digests at checks;
a rank reporting twice is fatal; the follower end of the Step stream has its own address."""

from __future__ import annotations

import pytest

from engine.cache.controller import CacheController
from engine.replica import ReplicaError, rank_replica
from msgs.channels import BACKUPS, COMMITS, STEPS, pipe
from msgs.codec import pack_ids
from msgs.done import BackupDone, Committed, ControllerDigest
from msgs.steps import ApplyCommit, BackupPrepare, DigestCheck, HostInit, Shutdown, Step


def _controller(ranks: int = 2):
    steps_out, steps_in = pipe(STEPS)
    backups_out, backups_in = pipe(BACKUPS)
    commits_out, commits_in = pipe(COMMITS)
    return CacheController(ranks, steps_in, backups_in, commits_out), steps_out, backups_out, commits_in


def test_commit_waits_for_every_rank_and_for_the_step() -> None:
    ctrl, steps, backups, commits = _controller()
    backups.send(BackupDone(obj=7, rank=1))  # before the Step that prepares object 7
    backups.send(BackupDone(obj=7, rank=0))
    ctrl.pump()
    assert list(commits.drain()) == []
    steps.send(Step(seq=1, ops=[HostInit(8), BackupPrepare(7, pack_ids([1, 2]), 0)]))
    ctrl.pump()
    assert list(commits.drain()) == [Committed(obj=7)]
    ctrl.pump()
    assert list(commits.drain()) == []  # once
    steps.send(Step(seq=2, ops=[ApplyCommit(7), DigestCheck()]))
    ctrl.pump()
    mirror = rank_replica()
    mirror.apply_step(Step(seq=1, ops=[HostInit(8), BackupPrepare(7, pack_ids([1, 2]), 0)]))
    mirror.apply_step(Step(seq=2, ops=[ApplyCommit(7), DigestCheck()]))
    assert list(commits.drain()) == [ControllerDigest(seq=2, digest=mirror.digest())]
    steps.send(Shutdown())
    ctrl.pump()
    assert ctrl.stopped


def test_a_rank_reporting_twice_is_fatal() -> None:
    ctrl, _, backups, _ = _controller()
    backups.send(BackupDone(obj=1, rank=0))
    backups.send(BackupDone(obj=1, rank=0))
    with pytest.raises(ReplicaError, match="twice"):
        ctrl.pump()
    backups.send(BackupDone(obj=2, rank=5))
    with pytest.raises(ReplicaError, match="rank 5"):
        ctrl.pump()


def test_the_controller_follows_the_step_stream_at_its_own_address() -> None:
    assert STEPS.address("/run", follower="cache") == "ipc:///run/steps-cache"
    with pytest.raises(ValueError):
        STEPS.address("/run", follower="tokenizer")


def test_the_controller_maps_the_slab_after_its_name_is_gone() -> None:
    """The supervisor unlinks the slab's name once every process is ready; the cache controller may
    read HostInit off the Step stream only after that. It opened the file at start, so it still maps
    the slab the workers write (the same pages, not a new file)."""
    import mmap as _mmap

    from engine.cache.controller import SlabMapping
    from engine.cache.slab import create_slab, map_slab, remove_slab
    from msgs.steps import HostInit

    path = create_slab("test-unlinked")
    try:
        worker = map_slab(path, 4 * 4096)
        slab = SlabMapping(path)
    finally:
        remove_slab(path)  # the name goes, as at ready
    slab.apply(HostInit(num_pages=4, page_bytes=4096))
    assert isinstance(slab.map, _mmap.mmap)
    worker[:5] = b"hello"
    assert slab.map[:5] == b"hello"  # the worker's slab, shared
    slab.map.close()
    worker.close()
