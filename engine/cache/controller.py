"""The cache controller's logic: a replica of the Step stream that turns every rank's
BackupDone into one Committed (DESIGN.md 6). Messages in, messages out, no socket:
procs/cache.py hands it zmq ends, tests hand it in-memory pipes and call `pump()`.

* It applies every Step to its own replica (the same `rank_replica()` as the workers and
  the scheduler's mirror: the host tier's allocator is covered by its digest), and at a
  DigestCheck reports its digest to the scheduler, which compares it with the mirror's.
* A BackupDone may arrive before the Step that prepared the object (different sockets):
  it waits. An object is Committed once every rank reported it AND this replica holds it
  pending, and only once; a second report from one rank is a protocol bug (fatal).
* It maps the host slab on HostInit (for the coming L3 writer; it never writes to it).
"""

from __future__ import annotations

import mmap
from typing import Any

from engine.cache.slab import map_slab
from engine.replica import Effect, ReplicaError, rank_replica
from msgs.channels import Inbox, Outbox
from msgs.done import BackupDone, Committed, ControllerDigest, FromController, ToController
from msgs.steps import HostInit, Shutdown, Step, ToWorker


class SlabMapping(Effect):
    """Maps the slab (every rank's region) when the tier is created; read-only use so far."""

    ops = (HostInit,)

    def __init__(self, path: str, world: int = 1) -> None:
        self.path, self.world = path, world
        self.map: mmap.mmap | None = None

    def apply(self, op: HostInit) -> None:
        if self.path and op.page_bytes:
            self.map = map_slab(self.path, op.num_pages * op.page_bytes * self.world)


class CacheController:
    def __init__(
        self,
        num_ranks: int,
        steps: Inbox[ToWorker],
        backups: Inbox[ToController],
        out: Outbox[FromController],
        effects: list[Effect] | None = None,
    ) -> None:
        self.num_ranks = num_ranks
        self.steps, self.backups, self.out = steps, backups, out
        self.replica = rank_replica(effects or [])
        self.reports: dict[int, set[int]] = {}  # object -> ranks that copied it
        self.stopped = False
        self.committed = 0

    def pump(self) -> bool:
        """Every queued Step, then every queued BackupDone; False when nothing moved."""
        moved = False
        while not self.stopped and self.steps.poll(0):
            moved = True
            msg = self.steps.recv()
            if isinstance(msg, Shutdown):
                self.stopped = True
            elif isinstance(msg, Step):
                self.on_step(msg)
        while self.backups.poll(0):
            moved = True
            msg = self.backups.recv()
            if isinstance(msg, BackupDone):
                self.on_backup(msg)
        return moved

    def on_step(self, step: Step) -> None:
        if self.replica.apply_step(step):
            self.out.send(ControllerDigest(seq=step.seq, digest=self.replica.digest()))
        self._commit_ready()

    def on_backup(self, msg: BackupDone) -> None:
        if not 0 <= msg.rank < self.num_ranks:
            raise ReplicaError(f"BackupDone from rank {msg.rank} of {self.num_ranks}")
        ranks = self.reports.setdefault(msg.obj, set())
        if msg.rank in ranks:
            raise ReplicaError(f"rank {msg.rank} reported object {msg.obj} twice")
        ranks.add(msg.rank)
        self._commit_ready()

    def _commit_ready(self) -> None:
        alloc = self.replica["host_tier"].alloc
        for obj in sorted(self.reports):  # one order, whatever the arrival order
            if len(self.reports[obj]) == self.num_ranks and obj in alloc.ranges and obj not in alloc.committed:
                del self.reports[obj]
                self.out.send(Committed(obj=obj))
                self.committed += 1

    def run(self, wait: Any) -> None:
        """The process loop: pump, then `wait(timeout_ms)` (a zmq poll) for input."""
        while not self.stopped:
            if not self.pump():
                wait(50)
