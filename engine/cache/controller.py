"""The cache controller's logic: a replica of the Step stream that turns every rank's
BackupDone into one Committed (docs/architecture.md, Tiers). Messages in, messages out, no socket:
procs/cache.py hands it zmq ends, tests hand it in-memory pipes and call `pump()`.

* It applies every Step to its own replica (the same `rank_replica()` as the workers and
  the scheduler's mirror: the host tier's allocator is covered by its digest), and at a
  DigestCheck reports its digest to the scheduler, which compares it with the mirror's.
* A BackupDone may arrive before the Step that prepared the object (different sockets):
  it waits. An object is Committed once every rank reported it AND this replica holds it
  pending, and only once; a second report from one rank is a protocol bug (fatal).
* It maps the host slab on HostInit (every rank's region).
* The disk tier (L3, `L3Tier`, with --l3-dir): it keeps every pending backup's page keys
  (BackupPrepare carries them; they split with HostSplit). When it decides Committed(obj)
  it first snapshots the bytes of obj and of the pieces split off it (every rank) out of
  the slab and queues them for the writer thread, then sends Committed: a later HostEvict
  and reuse of those host pages can never reach the disk. On L3Load it reads the files
  into the slab on a reader thread and reports L3Loaded(obj, ok). It also keeps every L2
  object's keys and parent object (`L3Tier.chain`): a write or read stamps the files of the
  chain above the object too (l3.py: the cap's order). L3Stats at most once a
  second, when they changed; an `l3 writes` log line likewise (`L3Store.maybe_log`: pages
  written, bytes, writer seconds, skips, corrupt files), and a last one at shutdown.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable
from typing import Any

from engine.cache.l3 import KEY_BYTES, WRITE_QUEUE_BYTES, L3Dir, L3Store, unpack_keys
from engine.cache.slab import available_memory, map_slab, open_slab
from engine.replica import Effect, ReplicaError, rank_replica
from engine.replica.host_alloc import HostAllocator
from msgs.channels import Inbox, Outbox
from msgs.done import BackupDone, Committed, ControllerDigest, FromController, L3Loaded, L3Stats, ToController
from msgs.steps import (
    ApplyCommit,
    BackupPrepare,
    Flush,
    HostEvict,
    HostInit,
    HostSplit,
    L3Load,
    L3Touch,
    Shutdown,
    Step,
    ToWorker,
)

STATS_EVERY_S = 1.0
STAMP_EVERY_S = 10.0  # an object's L3 files are stamped as an ancestor's at most this often (wall time: ages only)
MAX_CHAIN_DEPTH = 4096  # objects walked up a chain at most (a defence: the tree has no cycles)


class SlabMapping(Effect):
    """Maps the slab (every rank's region) when the tier is created."""

    ops = (HostInit,)

    def __init__(self, path: str, world: int = 1) -> None:
        self.path, self.world = path, world
        self.map: mmap.mmap | None = None
        # opened now, mapped at HostInit: the supervisor unlinks the name once every process is
        # ready, which can come before this process has read HostInit off the Step stream
        self.fd = open_slab(path) if path else -1

    def apply(self, op: HostInit) -> None:
        if self.path and op.page_bytes:
            self.map = map_slab(self.path, op.num_pages * op.page_bytes * self.world, fd=self.fd)


class L3Tier(Effect):
    """The controller's side of the disk tier: every L2 object's page keys and place in its key
    chain (`chain`, for the stamps that order the size cap), the writes of pending backups at
    their commit, the reads of L3Load. Created with the tier (HostInit with a fingerprint)."""

    ops = (HostInit, BackupPrepare, HostSplit, HostEvict, ApplyCommit, Flush, L3Load, L3Touch)

    def __init__(self, slab: SlabMapping, root: str, cap_bytes: int, queue_bytes: int = WRITE_QUEUE_BYTES) -> None:
        self.slab, self.root, self.cap, self.queue_bytes = slab, root, cap_bytes, queue_bytes
        self.store: L3Store | None = None
        self.pending: set[int] = set()  # backups with keys, not committed yet (written at their commit)
        self.pieces: dict[int, list[int]] = {}  # pending backup -> pieces split off it since
        self.origin: dict[int, int] = {}  # a piece -> the object whose commit covers it
        # every host object with keys, pending or not: its packed keys (16 bytes a page) and the
        # object above it, so a write or read can stamp the whole chain (L3Store.write_object)
        self.chain: dict[int, tuple[bytes, int]] = {}
        self.stamped: dict[int, float] = {}  # object -> when its files were last stamped as an ancestor's

    def apply(self, op: Any) -> None:
        match op:
            case HostInit(num_pages=n, page_bytes=page_bytes, num_layers=layers, l3_fingerprint=fp,
                          kv_components=comps) if fp:
                rows = layers * comps  # the slab's [layer][component] rows of a page (host_tier.py)
                if self.slab.map is None or rows < 1 or page_bytes % rows:
                    raise ReplicaError(f"L3 without a mapped slab or layout ({page_bytes} bytes, {layers} layers, "
                                       f"{comps} KV components)")
                import numpy as np

                view = np.frombuffer(self.slab.map, dtype=np.uint8)
                view = view.reshape(self.slab.world, rows, n, page_bytes // rows)
                # the writer may hold up to one L2's worth (at least queue_bytes): an object is at
                # most the whole slab, so a long prefix (4 GiB at 32k tokens of Llama-3.1-8B) is written
                # whole; but never more than a fifth of the memory free now (the slab was sized to leave it)
                slab_bytes = n * page_bytes * self.slab.world
                queue = max(self.queue_bytes, min(slab_bytes, available_memory() // 5))
                self.store = L3Store(L3Dir(self.root, fp, self.cap), view, queue)
            case BackupPrepare(obj=obj, keys=keys, parent=parent) if keys:
                self.pending.add(obj)
                self.chain[obj] = (keys, parent)
            case HostSplit(obj=obj, cut=cut, new_obj=new) if obj in self.chain:
                # the prefix piece takes the node's place under its parent
                packed, parent = self.chain[obj]
                at = cut * KEY_BYTES
                self.chain[new], self.chain[obj] = (packed[:at], parent), (packed[at:], new)
                if obj in self.pending:  # the piece is written at the commit of the object it came from
                    self.pending.add(new)
                    root = self.origin.get(obj, obj)
                    self.origin[new] = root
                    self.pieces.setdefault(root, []).append(new)
            case ApplyCommit(obj=obj):  # (a committed object keeps its chain entry until evicted)
                self._settled(obj)
            case HostEvict(obj=obj):
                self._settled(obj)
                self.chain.pop(obj, None)
                self.stamped.pop(obj, None)
            case Flush():
                self.pending.clear()
                self.pieces.clear()
                self.origin.clear()
                self.chain.clear()
                self.stamped.clear()
            case L3Load(obj=obj, host_start=start, keys=keys, parent=parent) if self.store is not None:
                self.chain[obj] = (keys, parent)
                self.store.load_object(obj, start, unpack_keys(keys), self._above(parent))
            case L3Touch(obj=obj) if self.store is not None:
                self.store.stamp_later(self._above(obj))

    def _settled(self, obj: int) -> None:
        """obj is no longer a pending backup (committed, or gone)."""
        self.pending.discard(obj)
        self.pieces.pop(obj, None)
        self.origin.pop(obj, None)

    def write(self, obj: int, alloc: HostAllocator) -> None:
        """obj is about to be Committed: queue its pages and its pieces' for the disk."""
        if self.store is None:
            return
        # in host order, which is token order (splits cut a contiguous range): should the
        # writer's queue fill up, the pages left out are the chain's last ones
        objs = [o for o in [obj, *self.pieces.pop(obj, [])] if o in alloc.ranges and o in self.pending]
        objs.sort(key=lambda o: alloc.ranges[o][0])
        for i, o in enumerate(objs):  # the first piece's chain above it is stamped with it
            packed, parent = self.chain[o]
            self.store.write_object(alloc.ranges[o][0], unpack_keys(packed), self._above(parent) if i == 0 else ())

    def _above(self, parent: int) -> list[bytes]:
        """The keys of the chain above an object whose parent object is `parent`, first page first:
        its ancestors' objects this controller knows (the walk stops at one it does not), less those
        stamped in the last STAMP_EVERY_S (their files are young already)."""
        now, path = time.monotonic(), []
        while parent in self.chain and len(path) < MAX_CHAIN_DEPTH:
            packed, up = self.chain[parent]
            if now - self.stamped.get(parent, -STAMP_EVERY_S) >= STAMP_EVERY_S:
                path.append(packed)
                self.stamped[parent] = now
            parent = up
        return [k for packed in reversed(path) for k in unpack_keys(packed)]


class CacheController:
    def __init__(
        self,
        num_ranks: int,
        steps: Inbox[ToWorker],
        backups: Inbox[ToController],
        out: Outbox[FromController],
        effects: list[Effect] | None = None,
        l3: L3Tier | None = None,
    ) -> None:
        self.num_ranks = num_ranks
        self.steps, self.backups, self.out = steps, backups, out
        self.l3 = l3
        self.replica = rank_replica([*(effects or []), *([l3] if l3 is not None else [])])
        self.reports: dict[int, set[int]] = {}  # object -> ranks that copied it
        self.stopped = False
        self.committed = 0
        self._stats_sent: L3Stats | None = None
        self._stats_at = -STATS_EVERY_S

    def pump(self) -> bool:
        """Every queued Step, then every queued BackupDone; False when nothing moved."""
        moved = False
        while not self.stopped and self.steps.poll(0):
            moved = True
            msg = self.steps.recv()
            if isinstance(msg, Shutdown):
                self.stopped = True
                if self.l3 is not None and self.l3.store is not None:
                    self.l3.store.drain(timeout=5.0)  # queued L3 writes land before the exit
                    self.l3.store.maybe_log(force=True)
            elif isinstance(msg, Step):
                self.on_step(msg)
        while self.backups.poll(0):
            moved = True
            msg = self.backups.recv()
            if isinstance(msg, BackupDone):
                self.on_backup(msg)
        store = self.l3.store if self.l3 is not None else None
        if store is not None:
            for obj, ok in store.take_loaded():
                moved = True
                self.out.send(L3Loaded(obj=obj, ok=ok))
            self._send_stats(store)
            store.maybe_log()  # the writer logs after its batches; this logs what came after
        return moved

    def _send_stats(self, store: L3Store, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._stats_at < STATS_EVERY_S:
            return
        stats = L3Stats(**store.stats())
        if stats != self._stats_sent:
            self.out.send(stats)
            self._stats_sent, self._stats_at = stats, now

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
                if self.l3 is not None:  # the bytes go to disk from a snapshot taken now
                    self.l3.write(obj, alloc)
                self.out.send(Committed(obj=obj))
                self.committed += 1

    def run(self, wait: Any, beat: Callable[[], None] | None = None) -> None:
        """The process loop: pump, then `wait(timeout_ms)` (a zmq poll) for input; `beat()` once a
        pass (the process's heartbeat to the supervisor, which rate-limits itself)."""
        while not self.stopped:
            if beat is not None:
                beat()
            if not self.pump():
                busy = self.l3 is not None and self.l3.store is not None and self.l3.store.busy
                wait(2 if busy else 50)  # L3 reads finish on a thread: look again soon
