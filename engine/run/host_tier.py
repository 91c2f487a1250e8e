"""A worker's side of the host tier (L2): copies between its KV pool and the host slab.

`HostCopies` is an effect of the replica (not digested: the HostTier component holds the
allocator state it follows):

* HostInit: map this rank's region of the slab (engine/cache/slab.py), laid out
  [layer][component][host page][page bytes of a component] (the components of the model's
  declared KV layout, engine/layers/kv_layout.py: K and V, or MLA's latent): an object's pages
  are one contiguous span per layer and component, so each is one copy (and, on a GPU, the region is
  registered with cudaHostRegister so those copies are DMA);
* LoadBack: copy host -> device at once, on the compute stream, i.e. before this step's
  forward reads the pages;
* BackupPrepare: queued; `after_forward()` copies device -> host once the step's forward
  has written the KV, and the object is reported done (`take_done`), which the worker
  sends to the cache controller as BackupDone (`WithBackups`).

Backups (device -> host) are a list of 1D copies (`batch_copies`), one per layer, K/V and
stretch: pages consecutive both on the device and in the slab (a step's objects are placed
one after another in the slab, and a prefill's device pages are mostly ascending, so a
stretch is usually a prompt's cached pages; a decoded tail, interleaved with other requests'
pages, is a stretch per page). On a GPU the list is one cudaMemcpyBatchAsync
(engine/run/dma.py): DMA by the copy engines, no kernel, so no SM time taken from the
forward. (Issue 10, docs/PERF.md: gather kernels on the side stream, and launching copies
from the worker's thread, each cost L2-on throughput a few percent on the H200.) On CPU each
copy is a memmove, done when `after_forward` returns.

Load-backs (host -> device) are on the critical path anyway (the forward waits for them): per
K/V, in pieces (`_segments`), a stretch of consecutive device pages is one copy of every
layer (a 2D DMA on a GPU, `_straight`), other pages one copy to the device then a scatter
per layer.

**On a GPU the backups run on a side stream, launched by a copier thread**, both off the
critical path. `after_forward` records an event on the compute stream after the step's
forward (and its sampling, which the runner launches first) was enqueued and hands the step's
backups to the copier thread (`_copier`), which makes the side stream wait on that event (so
the copies read the KV the forward wrote, and come after any LoadBack of this or an earlier
step that read the same host range, since those are earlier on the compute stream), enqueues
the batch and records a "copied" event. The next step's forward is enqueued on the compute
stream meanwhile and overlaps the copy. The address lists are kept referenced until the
copied event completed. `take_done` polls `event.query()` (never waits) and raises what the
copier thread failed with; `WithBackups` calls it after every StepDone, and its reporter
thread waits on the oldest outstanding event (a blocking-sync event: it sleeps, without the
GIL) so that a finished copy is reported even when no further step comes. Only then does the
worker send BackupDone, so the cache controller commits an object only once every rank's
bytes are in the slab.

Why nothing else can race with a copy still in flight on the side stream:

* device pages: a pending node (backed up, not committed) keeps its device pages
  (engine/cache/hiradix.py's invariant: `_device_leaf` never picks a pending node,
  `evictable_pages` counts none at or above one, a flush is refused while any is pending),
  and the KV of a tree node is never rewritten. Its pages can only be freed after
  ApplyCommit, which needs this rank's BackupDone, which needs this copy's event: so a
  LoadBack or a forward can never write pages a pending backup still reads;
* host ranges: a pending object's host range is never freed (evict-to-fit only drops
  committed objects) and only a committed object is loaded back; copies on the one side
  stream run in order, so a range freed by HostEvict and reused is written after the
  previous writer finished, and after every LoadBack enqueued before it read it;
* memory: the side stream allocates nothing; it reads the KV pool (never freed) and writes
  the slab (unmapped only after close(), which drains the copier thread first).

Every second with activity at most, each worker logs one `host copies` line: backups and
load-backs since the last line, their bytes and copy seconds (bin/analyze sums them into
counts and GB/s). On a GPU the seconds come from timing events around each batch of copies
(a backup's time includes contention with the overlapping forward).
"""

from __future__ import annotations

import contextvars
import ctypes
import mmap
import os
import queue
import threading
import time
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog
import torch

from engine.cache.slab import map_slab
from engine.layers.kv_pool import KVPool
from engine.replica import Effect
from engine.run.dma import copy_batch, copy_rows, load_runtime
from engine.run.pinning import register_host
from msgs.codec import unpack_ids
from msgs.done import BackupDone
from msgs.steps import BackupPrepare, HostInit, LoadBack

log = structlog.get_logger()
LOG_INTERVAL_S = 1.0
POPULATE_CHUNK = 1 << 30  # bytes of the slab one thread first-touches at a time
STAT_KEYS = ("backups", "load_backs", "bytes_out", "bytes_in", "backup_s", "load_back_s")
MIN_DIRECT_PAGES = 8  # consecutive device pages copied straight (DMA) rather than gathered
MAX_SEGMENTS = 8  # more pieces than this: the whole load-back is gathered (bounds the copies it issues)


class HostCopies(Effect):
    ops = (HostInit, BackupPrepare, LoadBack)

    def __init__(self, kv: KVPool, path: str, rank: int = 0, world: int = 1, cp_rank: int = 0,
                 cp_world: int = 1) -> None:
        self.kv = kv
        self.path = path
        self.rank, self.world = rank, world  # each tp rank owns one region of the slab: its KV heads
        # context parallelism: the cp ranks of a tp rank share its region, which holds each page once;
        # a rank copies only the pages it owns (global id % cp_world == cp_rank; engine/cache/allocator.py)
        self.cp_rank, self.cp_world = cp_rank, cp_world
        # the slab's rows are [layer][component] (K, V for GQA; the latent for MLA): one size
        self.layer_bytes = kv.layout.uniform_page_bytes(kv.page_size, kv.dtype)
        self.components = len(kv.layout.components)
        self.page_bytes = self.components * kv.num_layers * self.layer_bytes
        # the pool's components as raw bytes: [layers, device pages, layer bytes], and per layer
        self.dev = kv.page_bytes()
        self.dev_layers = tuple(list(t.unbind(0)) for t in self.dev)
        self.slab: torch.Tensor | None = None  # uint8 [layers, components, host pages, layer_bytes]
        self._map: mmap.mmap | None = None
        self.cuda = kv.device.type == "cuda"
        # the backups' side stream, at the default (lowest) priority: the forward's is higher (runner.py)
        self.stream = torch.cuda.Stream(kv.device) if self.cuda else None
        # GPU backups are launched by a copier thread (`_copier`), not the worker's: the batch
        # call costs the host ~0.7 us a copy (scripts/dma_probe.py), which the next step's
        # launch would wait for
        self._jobs: queue.Queue[tuple[list[tuple[int, list[int], list[int]]], torch.cuda.Event] | None] = queue.Queue()
        self.enqueued = threading.Event()  # set when the copier added in-flight copies (WithBackups waits)
        self._error: BaseException | None = None
        self._copier_started = False
        self.queued: list[tuple[int, list[int], list[int]]] = []  # (obj, device pages, host pages)
        # copied or in flight: (objects, copied event or None on CPU, tensors kept alive until then)
        self.done: list[tuple[list[int], torch.cuda.Event | None, tuple[torch.Tensor, ...]]] = []
        # GPU copy timings not read yet: (key of seconds, start event, end event)
        self._timings: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.lock = threading.Lock()  # self.done and the stats: the worker's loop and WithBackups' thread
        self.stats: dict[str, float] = dict.fromkeys(STAT_KEYS, 0)  # cumulative
        self._logged: dict[str, float] = dict.fromkeys(STAT_KEYS, 0)
        self._last_log = 0.0
        self._finalizer: weakref.finalize | None = None

    def apply(self, op: HostInit | BackupPrepare | LoadBack) -> None:
        match op:
            case HostInit(num_pages=n, page_bytes=want):
                if want and want != self.page_bytes:  # another layout than the scheduler's: fatal
                    raise RuntimeError(f"host tier pages of {want} bytes; this rank's are {self.page_bytes}")
                region = n * self.page_bytes
                self._map = map_slab(self.path, region * self.world)
                raw = torch.frombuffer(self._map, dtype=torch.uint8)[self.rank * region : (self.rank + 1) * region]
                self.slab = raw.view(self.kv.num_layers, self.components, n, self.layer_bytes)
                if self.cuda:
                    if not self._copier_started:
                        self._start_copier()
                    t0 = time.perf_counter()
                    populate(raw)
                    t1 = time.perf_counter()
                    self._register(self.slab)
                    log.info(
                        "host slab pinned",
                        gib=round(region / 2**30, 2),
                        populate_s=round(t1 - t0, 2),
                        register_s=round(time.perf_counter() - t1, 2),
                    )
            case BackupPrepare(obj=obj, device_pages=pages, host_start=start):
                self.queued.append((obj, *self._owned(unpack_ids(pages), start)))  # reported even if none is ours
            case LoadBack(device_pages=pages, host_start=start):
                if self.cp_world == 1:
                    self._load(unpack_ids(pages), start)
                else:
                    self._load_owned(*self._owned(unpack_ids(pages), start))

    def _owned(self, pages: list[int], start: int) -> tuple[list[int], list[int]]:
        """(this rank's device pages, their host pages) of an object at host page `start`: every
        page at cp 1; under cp the pages it owns, at their local ids."""
        if self.cp_world == 1:
            return pages, list(range(start, start + len(pages)))
        w, r = self.cp_world, self.cp_rank
        mine = [(p // w, start + i) for i, p in enumerate(pages) if p % w == r]
        return [d for d, _ in mine], [h for _, h in mine]

    def _start_copier(self) -> None:
        """At HostInit (start-up: only an engine with a host tier has the thread, and a missing
        runtime fails there, not in a request's step)."""
        load_runtime()
        self._copier_started = True
        threading.Thread(
            target=contextvars.copy_context().run,
            args=(_copier, weakref.ref(self), self._jobs, _device_index(self.kv.device)),
            name="host-tier-copier",
            daemon=True,
        ).start()
        weakref.finalize(self, self._jobs.put, None)  # the thread ends with this object

    def _register(self, slab: torch.Tensor) -> None:
        """Pin the mapping for DMA (every process that maps the slab may register it); undone
        before it is unmapped (when this object goes, or on close(): engine/run/pinning.py)."""
        if self.cuda:
            self._finalizer = register_host(self, slab, self._map, "the host slab")

    def close(self) -> None:
        """Stop the copier thread after the backups queued so far, then unregister the slab's
        mapping (GPU); the mapping goes with this object."""
        self.drain()
        if self._copier_started:
            self._copier_started = False
            self._jobs.put(None)
        if self._finalizer is not None:
            self._finalizer()

    def drain(self) -> None:
        """Wait until the copier thread has enqueued every backup handed to it (not until the
        copies ran: their events say that); raises what the thread failed with."""
        self._jobs.join()
        self._raise_copier_error()

    def _raise_copier_error(self) -> None:
        if self._error is not None:
            raise RuntimeError("the host tier's copier thread failed") from self._error

    def _load(self, pages: list[int], start: int) -> None:
        """Host -> device on the compute stream: the forward of this step comes after it.
        Per segment (`_segments`), K and V: consecutive device pages are one copy of every
        layer (`_straight`); other pages one copy to the device then a scatter per layer."""
        assert self.slab is not None
        t0 = time.perf_counter()
        begin = self._timing_event() if self.cuda else None
        for span, dev_pages in self._pieces(pages, start):
            for kv, dev in enumerate(self.dev):
                host = self.slab[:, kv, span]  # [layers, pages, layer bytes]
                if isinstance(dev_pages, slice):
                    self._straight(dev[:, dev_pages], host)
                else:
                    for layer, layer_dev in enumerate(self.dev_layers[kv]):
                        layer_dev.index_copy_(0, dev_pages, host[layer].to(self.kv.device, non_blocking=True))
        self._count_load(len(pages), begin, t0)

    def _load_owned(self, dev_pages: list[int], host_pages: list[int]) -> None:
        """Host -> device of the pages this cp rank owns (every cp-th page of the object, so
        never a straight stretch): a gather per component, one copy to the device, a scatter
        per layer, on the compute stream."""
        assert self.slab is not None
        if not dev_pages:
            return
        t0 = time.perf_counter()
        begin = self._timing_event() if self.cuda else None
        host = torch.tensor(host_pages, dtype=torch.int64)
        dev = torch.tensor(dev_pages, dtype=torch.int64)
        if self.cuda:
            dev = dev.pin_memory().to(self.kv.device, non_blocking=True)
        for kv in range(len(self.dev)):
            rows = self.slab[:, kv].index_select(1, host)  # [layers, pages, layer bytes]
            rows = rows.pin_memory().to(self.kv.device, non_blocking=True) if self.cuda else rows
            for layer, layer_dev in enumerate(self.dev_layers[kv]):
                layer_dev.index_copy_(0, dev, rows[layer])
        self._count_load(len(dev_pages), begin, t0)

    def _count_load(self, pages: int, begin: torch.cuda.Event | None, t0: float) -> None:
        """A load-back's stats: on a GPU its time from events (read later), on CPU now."""
        with self.lock:
            self.stats["load_backs"] += 1
            self.stats["bytes_in"] += pages * self.page_bytes
            if begin is not None:
                self._timings.append(("load_back_s", begin, self._timing_event()))
            else:
                self.stats["load_back_s"] += time.perf_counter() - t0

    def after_forward(self) -> None:
        """Copy the queued backups (their KV is written once this step's forward ran): at
        once on CPU; on a GPU enqueued on the side stream after the forward (module doc)."""
        if not self.queued:
            return
        assert self.slab is not None
        queued, self.queued = self.queued, []
        if self.stream is None:  # CPU: the same copies, each a memmove, done at once
            t0 = time.perf_counter()
            dsts, srcs, sizes = batch_copies(queued, self.dev, self.slab)
            for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
                ctypes.memmove(dst, src, size)
            self._record_backups(queued, None, (), time.perf_counter() - t0)
            return
        forward_written = torch.cuda.Event()
        forward_written.record()  # on the compute stream, after this step's forward
        self._jobs.put((queued, forward_written))

    def _copy_job(self, queued: list[tuple[int, list[int], list[int]]], forward_written: torch.cuda.Event) -> None:
        """The copier thread's part of a step's backups: on the side stream, after the forward
        that wrote them, one batch of DMAs (`batch_copies`); the objects are done once the
        copied event completes."""
        assert self.stream is not None and self.slab is not None
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(forward_written)
            begin = self._timing_event()
            copies = batch_copies(queued, self.dev, self.slab)
            copy_batch(*copies, self.stream)
            end = self._timing_event()
            copied = torch.cuda.Event(blocking=True)  # WithBackups' thread may sleep on it
            copied.record()
        self._record_backups(queued, copied, copies, 0.0, (begin, end))
        self.enqueued.set()

    def _record_backups(
        self,
        queued: list[tuple[int, list[int], list[int]]],
        copied: torch.cuda.Event | None,
        keep: tuple[torch.Tensor, ...],
        seconds: float,
        timing: tuple[torch.cuda.Event, torch.cuda.Event] | None = None,
    ) -> None:
        """The objects of a step's backups are in flight (or, on CPU, done): `take_done` reports
        them once `copied` completed; `keep` lives until then; the stats count them."""
        with self.lock:
            self.done.append(([obj for obj, _, _ in queued], copied, keep))
            if timing is not None:
                self._timings.append(("backup_s", *timing))
            self.stats["backups"] += len(queued)
            self.stats["bytes_out"] += sum(len(pages) for _, pages, _ in queued) * self.page_bytes
            self.stats["backup_s"] += seconds

    def _straight(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy a stretch of every layer ([layers, pages, layer bytes] on both sides) on the
        current stream: on a GPU one 2D DMA (engine/run/dma.py), on CPU one strided copy."""
        if self.cuda:
            copy_rows(dst.flatten(1), src.flatten(1), torch.cuda.current_stream(self.kv.device))
        else:
            dst.copy_(src)

    def _pieces(self, pages: list[int], start: int) -> Iterator[tuple[slice, slice | torch.Tensor]]:
        """Per `_segments` piece of a load-back at host page `start`: its host span and its
        device pages (a slice of the pool where consecutive, else an index tensor on the
        device; the compute stream uses it, so torch's allocators keep it and its pinned
        source alive until then)."""
        for at, n, first in _segments(pages):
            span = slice(start + at, start + at + n)
            if first is not None:
                yield span, slice(first, first + n)
            else:
                host_idx = torch.tensor(pages[at : at + n], dtype=torch.int64)
                if self.cuda:  # pinned: from pageable memory the driver may first wait for the stream
                    host_idx = host_idx.pin_memory()
                yield span, host_idx.to(self.kv.device, non_blocking=True)

    def _timing_event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def take_done(self) -> list[int]:
        """Objects whose copy has finished, oldest first (never waits: a copy still running
        is reported by a later call; see WithBackups for who makes that call)."""
        self._raise_copier_error()
        with self.lock:
            ready: list[int] = []
            while self.done and (self.done[0][1] is None or self.done[0][1].query()):
                ready += self.done.pop(0)[0]  # side-stream copies finish in order
            self._read_timings()
            return ready

    def oldest_in_flight(self) -> torch.cuda.Event | None:
        """The copied event of the oldest backup still running (None: none is)."""
        with self.lock:
            return next((ev for _, ev, _ in self.done if ev is not None), None)

    def _read_timings(self) -> None:
        while self._timings and self._timings[0][2].query():
            key, begin, end = self._timings.pop(0)
            self.stats[key] += begin.elapsed_time(end) / 1000

    def maybe_log(self, now: float | None = None) -> dict[str, float] | None:
        """One `host copies` line with what happened since the last one, at most one per
        LOG_INTERVAL_S and only after activity; returns what it logged."""
        now = time.monotonic() if now is None else now
        with self.lock:
            if now - self._last_log < LOG_INTERVAL_S:
                return None
            self._read_timings()
            delta = {k: self.stats[k] - self._logged[k] for k in STAT_KEYS}
            if not (delta["backups"] or delta["load_backs"] or delta["backup_s"] or delta["load_back_s"]):
                return None
            self._logged = dict(self.stats)
            self._last_log = now
        out = {k: (round(v, 6) if k.endswith("_s") else int(v)) for k, v in delta.items()}
        log.info("host copies", **out, in_flight=len(self.done), device=self.kv.device.type)
        return out


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _copier(ref: weakref.ref[HostCopies], jobs: queue.Queue, device: int) -> None:
    """The copier thread: a step's backups at a time, in order. A failure (also of its set-up)
    is kept in `_error`, raised on the worker's thread by take_done/drain; later jobs are still
    taken off the queue (so drain returns) but not run."""
    error: BaseException | None = None
    try:
        torch.cuda.set_device(device)  # the runtime's current device is per thread
    except BaseException as e:  # noqa: BLE001
        error = e
    while True:
        job = jobs.get()
        if job is None:  # close() or the object went
            jobs.task_done()
            return
        copies = ref()
        try:
            if copies is None:
                return
            if error is not None:
                raise error
            if copies._error is None:
                copies._copy_job(*job)
        except BaseException as e:  # noqa: BLE001 - reported on the worker's thread (take_done, drain)
            log.error("host tier copier failed", error=repr(e))
            if copies is not None:
                copies._error = e
        finally:
            del copies
            jobs.task_done()


def batch_copies(
    queued: list[tuple[int, list[int], list[int]]], dev: tuple[torch.Tensor, ...], slab: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's backups as 1D copies (destination, source, bytes: int64 CPU tensors, the
    arguments of engine/run/dma.copy_batch): one per layer, component (K/V) and stretch, a
    stretch being pages consecutive both on the device and in the slab (objects placed one after
    another merge). `dev` is the pool's components as bytes [layers, device pages, layer bytes],
    `slab` this rank's region [layers, components, host pages, layer bytes]. Vectorized: the copier thread
    holds the GIL only for a few tensor ops, whatever the number of pages."""
    queued = sorted((q for q in queued if q[1]), key=lambda q: q[2][0])  # by host page (an object's are ascending)
    dev_pages = torch.tensor([p for _, pages, _ in queued for p in pages], dtype=torch.int64)
    host_pages = torch.tensor([h for _, _, hosts in queued for h in hosts], dtype=torch.int64)
    n = dev_pages.numel()
    brk = torch.ones(n, dtype=torch.bool)
    brk[1:] = (dev_pages[1:] != dev_pages[:-1] + 1) | (host_pages[1:] != host_pages[:-1] + 1)
    first = brk.nonzero().squeeze(1)
    count = torch.diff(first, append=torch.tensor([n]))
    layers, page = slab.shape[0], slab.shape[-1]
    layer = torch.arange(layers, dtype=torch.int64)[:, None]
    comps = range(len(dev))
    dsts = [slab[:, kv].data_ptr() + layer * slab.stride(0) + host_pages[first] * page for kv in comps]
    srcs = [dev[kv].data_ptr() + layer * dev[kv].stride(0) + dev_pages[first] * page for kv in comps]
    sizes = (count * page).expand(len(dev) * layers, -1)
    return torch.stack(dsts).reshape(-1), torch.stack(srcs).reshape(-1), sizes.reshape(-1).contiguous()


def _segments(pages: list[int]) -> list[tuple[int, int, int | None]]:
    """A load-back's device pages as (offset, count, first device page or None) pieces: a
    stretch of at least MIN_DIRECT_PAGES consecutive device pages is copied straight (first =
    its first page), the pages between such stretches are gathered (None)."""
    stretches: list[tuple[int, int]] = []  # (offset, count) of consecutive device pages
    at = 0
    while at < len(pages):
        end = at + 1
        while end < len(pages) and pages[end] == pages[end - 1] + 1:
            end += 1
        stretches.append((at, end - at))
        at = end
    out: list[tuple[int, int, int | None]] = []
    for at, n in stretches:
        if n >= MIN_DIRECT_PAGES:
            out.append((at, n, pages[at]))
        elif out and out[-1][2] is None:  # extend the gathered piece before it
            out[-1] = (out[-1][0], out[-1][1] + n, None)
        else:
            out.append((at, n, None))
    return out if len(out) <= MAX_SEGMENTS else [(0, len(pages), None)]


def populate(region: torch.Tensor) -> None:
    """First-touch a fresh (all-zero, unwritten) slab region from many threads before
    cudaHostRegister pins it: tmpfs allocates and zeroes each page on its first touch, and
    one thread does that at ~2 GB/s (a 99 GiB slab took 48 s to register); pinning pages
    that are already there is the cheaper part. Writing zeros is safe only because nothing
    was written yet (HostInit is the slab's first op)."""
    flat = region.view(-1)
    chunks = [flat[at : at + POPULATE_CHUNK] for at in range(0, flat.numel(), POPULATE_CHUNK)]
    with ThreadPoolExecutor(min(16, os.cpu_count() or 1, max(1, len(chunks)))) as pool:
        list(pool.map(_zero, chunks))


@torch.inference_mode()  # the slab is an inference tensor (made under the worker's inference mode)
def _zero(chunk: torch.Tensor) -> None:
    chunk.zero_()


class WithBackups:
    """The worker's `done` outbox, followed by a BackupDone per object this rank copied
    (to the cache controller), sent after the StepDone of the step that copied them, or,
    for a copy still running on the GPU's side stream then, as soon as it finished: a
    daemon thread sleeps on the oldest copy's event (or, with none in flight, up to a
    second) and reports what finished; it also writes the rate-limited `host copies` log
    line. The backups socket is only used under the lock."""

    def __init__(self, done: Any, backups: Any, copies: HostCopies, rank: int) -> None:
        self.done, self.backups, self.copies, self.rank = done, backups, copies, rank
        self._send_lock = threading.Lock()
        self._wake = copies.enqueued  # set by the copier thread, or below
        self._thread = threading.Thread(
            target=contextvars.copy_context().run, args=(self._reporter,), name="backup-reporter", daemon=True
        )  # the log context (proc, rank) goes with it
        self._thread.start()

    def send(self, msg: Any) -> None:
        self.done.send(msg)
        self._report()
        if self.copies.oldest_in_flight() is not None:
            self._wake.set()

    def _report(self) -> None:
        with self._send_lock:
            for obj in self.copies.take_done():
                self.backups.send(BackupDone(obj=obj, rank=self.rank))

    def _reporter(self) -> None:
        while True:
            event = self.copies.oldest_in_flight()
            if event is not None:
                event.synchronize()  # a blocking-sync event: sleeps, the GIL released
                self._report()
            else:
                self._wake.wait(LOG_INTERVAL_S)
                self._wake.clear()
            self.copies.maybe_log()
