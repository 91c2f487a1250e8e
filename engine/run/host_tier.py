"""A worker's side of the host tier (L2): copies between its KV pool and the host slab.

`HostCopies` is an effect of the replica (not digested: the HostTier component holds the
allocator state it follows):

* HostInit: map this rank's region of the slab (engine/cache/slab.py), laid out
  [layer][K, V][host page][page_size * kv_heads * head_dim bytes]: an object's pages are one
  contiguous span per layer and K/V, so each is one copy (and, on a GPU, the region is
  registered with cudaHostRegister so those copies are DMA);
* LoadBack: copy host -> device at once, on the compute stream, i.e. before this step's
  forward reads the pages;
* BackupPrepare: queued; `after_forward()` copies device -> host once the step's forward
  has written the KV, and the object is reported done (`take_done`), which the worker
  sends to the cache controller as BackupDone (`WithBackups`).

The copies go through byte views (any KV dtype), per K/V, in pieces of the run
(`_segments`): a stretch of consecutive device pages (a prefill's pages mostly are: the
allocator hands out the lowest free pages) is copied straight from the pool, every layer at
once: on a GPU one 2D DMA (engine/run/dma.py; the stretch is one row per layer at a fixed
pitch on both sides), which takes no SM time from the forward and costs the worker's thread
one call per piece and K/V (it launches them between steps, on the critical path when the
host is the bottleneck). Other pages are gathered into one contiguous block per layer and
K/V and copied to their span (and back, then scattered). Why a step's backups are mostly
straight: its objects are merged into runs (`_runs`), and each prompt's pages are followed by
its partly filled last page (not part of the object), so a run of 30 prompts is ~30 stretches;
MAX_SEGMENTS bounds that before the whole run is gathered instead. On CPU the slab is
ordinary shared memory and everything is synchronous: a backup is done when
`after_forward` returns.

**On a GPU the backups run on a side stream**, off the critical path. `after_forward`
records an event on the compute stream after the step's forward (and its sampling, which the
runner launches first) was enqueued; the side stream waits on it (so the gather reads the KV
the forward wrote, and any LoadBack of this or an earlier step that read the same host
range, since those are earlier on the compute stream), then gathers and copies, then records
a "copied" event. The next step's forward is enqueued on the compute stream meanwhile and
overlaps the copy. The index tensors are kept referenced until the copied event completed;
the gather buffers are allocated on the side stream itself (see `_backup`). `take_done`
polls `event.query()` (never waits); `WithBackups` calls it after every StepDone, and its
reporter thread waits on the oldest outstanding event (a blocking-sync event: it sleeps,
without the GIL) so that a finished copy is reported even when no further step comes. Only
then does the worker send BackupDone, so the cache controller commits an object only once
every rank's bytes are in the slab.

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
* memory: tensors the side stream uses are allocated on it (the caching allocator reuses
  their blocks only for later side-stream work) or are the KV pool's (never freed).

Every second with activity at most, each worker logs one `host copies` line: backups and
load-backs since the last line, their bytes and copy seconds (bin/analyze sums them into
counts and GB/s). On a GPU the seconds come from timing events around each batch of copies
(a backup's time includes contention with the overlapping forward).
"""

from __future__ import annotations

import contextvars
import mmap
import os
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
from engine.run.dma import copy_rows, load_runtime
from engine.run.pinning import register_host
from msgs.codec import unpack_ids
from msgs.done import BackupDone
from msgs.steps import BackupPrepare, HostInit, LoadBack

log = structlog.get_logger()
LOG_INTERVAL_S = 1.0
POPULATE_CHUNK = 1 << 30  # bytes of the slab one thread first-touches at a time
STAT_KEYS = ("backups", "load_backs", "bytes_out", "bytes_in", "backup_s", "load_back_s")
MIN_DIRECT_PAGES = 8  # consecutive device pages copied straight (DMA) rather than gathered
MAX_SEGMENTS = 64  # more pieces than this: the whole run is gathered (bounds the copies a run issues)


class HostCopies(Effect):
    ops = (HostInit, BackupPrepare, LoadBack)

    def __init__(self, kv: KVPool, path: str, rank: int = 0, world: int = 1) -> None:
        self.kv = kv
        self.path = path
        self.rank, self.world = rank, world  # each rank owns one region of the slab: its KV heads
        self.layer_bytes = kv.page_size * kv.num_kv_heads * kv.head_dim * kv.dtype.itemsize
        self.page_bytes = 2 * kv.num_layers * self.layer_bytes
        # the pool's K and V as raw bytes: [layers, device pages, layer bytes], and per layer
        self.dev = kv.page_bytes()
        self.dev_layers = tuple(list(t.unbind(0)) for t in self.dev)
        self.slab: torch.Tensor | None = None  # uint8 [layers, 2, host pages, layer_bytes]
        self._map: mmap.mmap | None = None
        self.cuda = kv.device.type == "cuda"
        # the backups' side stream, at the default (lowest) priority: the forward's is higher (runner.py)
        self.stream = torch.cuda.Stream(kv.device) if self.cuda else None
        if self.cuda:
            load_runtime()
        self.queued: list[tuple[int, list[int], int]] = []  # (obj, device pages, host start)
        # copied or in flight: (objects, copied event or None on CPU, tensors kept alive until then)
        self.done: list[tuple[list[int], torch.cuda.Event | None, list[Any]]] = []
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
                self.slab = raw.view(self.kv.num_layers, 2, n, self.layer_bytes)
                if self.cuda:
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
                self.queued.append((obj, unpack_ids(pages), start))
            case LoadBack(device_pages=pages, host_start=start):
                self._load(unpack_ids(pages), start)

    def _register(self, slab: torch.Tensor) -> None:
        """Pin the mapping for DMA (every process that maps the slab may register it); undone
        before it is unmapped (when this object goes, or on close(): engine/run/pinning.py)."""
        if self.cuda:
            self._finalizer = register_host(self, slab, self._map, "the host slab")

    def close(self) -> None:
        """Unregister the slab's mapping (GPU) now; the mapping goes with this object."""
        if self._finalizer is not None:
            self._finalizer()

    def _load(self, pages: list[int], start: int) -> None:
        """Host -> device on the compute stream: the forward of this step comes after it.
        Per segment (`_segments`), K and V: consecutive device pages are one copy of every
        layer (`_straight`); other pages one copy to the device then a scatter per layer."""
        assert self.slab is not None
        t0 = time.perf_counter()
        begin = self._timing_event() if self.cuda else None
        for span, dev_pages, _ in self._pieces(pages, start):
            for kv, dev in enumerate(self.dev):
                host = self.slab[:, kv, span]  # [layers, pages, layer bytes]
                if isinstance(dev_pages, slice):
                    self._straight(dev[:, dev_pages], host)
                else:
                    for layer, layer_dev in enumerate(self.dev_layers[kv]):
                        layer_dev.index_copy_(0, dev_pages, host[layer].to(self.kv.device, non_blocking=True))
        with self.lock:
            self.stats["load_backs"] += 1
            self.stats["bytes_in"] += len(pages) * self.page_bytes
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
        nbytes = sum(len(pages) for _, pages, _ in queued) * self.page_bytes
        runs = _runs(queued)
        if self.stream is None:
            t0 = time.perf_counter()
            for pages, start in runs:
                self._backup(pages, start)
            with self.lock:
                self.done.append(([obj for obj, _, _ in queued], None, []))
                self._count_backups(len(queued), nbytes, time.perf_counter() - t0)
            return
        forward_written = torch.cuda.Event()
        forward_written.record()  # on the compute stream, after this step's forward
        keep: list[Any] = []
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(forward_written)
            begin = self._timing_event()
            for pages, start in runs:
                keep += self._backup(pages, start)
            end = self._timing_event()
            copied = torch.cuda.Event(blocking=True)  # WithBackups' thread may sleep on it
            copied.record()
        with self.lock:
            self.done.append(([obj for obj, _, _ in queued], copied, keep))
            self._timings.append(("backup_s", begin, end))
            self._count_backups(len(queued), nbytes, 0.0)

    def _backup(self, pages: list[int], start: int) -> list[torch.Tensor]:
        """Copy the pages of each layer, K and V, to the object's spans, on the current stream,
        per segment (`_segments`): consecutive device pages in one copy straight from the
        pool (`_straight`: no kernel, no SM time taken from the forward), the others gathered first;
        returns the index tensors, kept until the copies finished. (A gather block is
        allocated on the same stream as its copy: the caching allocator gives it to later
        work of that stream only, so it is freed at once and the next layer reuses it;
        holding every block would hold the whole object on the device.)"""
        assert self.slab is not None
        keep: list[torch.Tensor] = []
        for span, dev_pages, held in self._pieces(pages, start):
            keep += held
            for kv, dev in enumerate(self.dev):
                host = self.slab[:, kv, span]  # [layers, pages, layer bytes]
                if isinstance(dev_pages, slice):  # every layer's copy in one call
                    self._straight(host, dev[:, dev_pages])
                else:  # gathered per layer: a block of one layer's pages at a time
                    for layer, layer_dev in enumerate(self.dev_layers[kv]):
                        host[layer].copy_(layer_dev[dev_pages], non_blocking=True)
        return keep

    def _straight(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy a stretch of every layer ([layers, pages, layer bytes] on both sides) on the
        current stream: on a GPU one 2D DMA (engine/run/dma.py), on CPU one strided copy."""
        if self.cuda:
            copy_rows(dst.flatten(1), src.flatten(1), torch.cuda.current_stream(self.kv.device))
        else:
            dst.copy_(src)

    def _pieces(self, pages: list[int], start: int) -> Iterator[tuple[slice, slice | torch.Tensor, list[torch.Tensor]]]:
        """Per `_segments` piece of a run at host page `start`: its host span, its device pages
        (a slice of the pool where consecutive, else an index tensor on the device), and the
        tensors an asynchronous copy must keep alive (the index and its host source)."""
        for at, n, first in _segments(pages):
            span = slice(start + at, start + at + n)
            if first is not None:
                yield span, slice(first, first + n), []
            else:
                host_idx = torch.tensor(pages[at : at + n], dtype=torch.int64)
                if self.cuda:  # pinned: from pageable memory the driver may first wait for the stream
                    host_idx = host_idx.pin_memory()
                idx = host_idx.to(self.kv.device, non_blocking=True)
                yield span, idx, [host_idx, idx]

    def _count_backups(self, n: int, nbytes: int, seconds: float) -> None:
        self.stats["backups"] += n
        self.stats["bytes_out"] += nbytes
        self.stats["backup_s"] += seconds

    def _timing_event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def take_done(self) -> list[int]:
        """Objects whose copy has finished, oldest first (never waits: a copy still running
        is reported by a later call; see WithBackups for who makes that call)."""
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


def _runs(queued: list[tuple[int, list[int], int]]) -> list[tuple[list[int], int]]:
    """The queued backups as (device pages, host start) runs: objects whose host spans are
    adjacent (the usual case: one step's objects are placed one after the other) are merged,
    so a step's backups cost one gather and one copy per layer and K/V per run, not per
    object (a prefill step of ~30 objects launched ~3,400 copies from the worker's thread,
    and its steps took ~26% longer on the H200)."""
    runs: list[tuple[list[int], int]] = []
    for _, pages, start in sorted(queued, key=lambda q: q[2]):
        if runs and runs[-1][1] + len(runs[-1][0]) == start:
            runs[-1][0].extend(pages)
        else:
            runs.append((list(pages), start))
    return runs


def _segments(pages: list[int]) -> list[tuple[int, int, int | None]]:
    """A run's device pages as (offset, count, first device page or None) pieces: a stretch
    of at least MIN_DIRECT_PAGES consecutive device pages is copied straight (first = its
    first page), the pages between such stretches are gathered (None). A prefill's pages
    are mostly consecutive (the allocator hands out the lowest free pages, ascending); a
    decoded tail is interleaved with other requests' pages. Measured on the H200
    (scripts/l2_probe.py): a gather kernel on the side stream took 8-11% off a concurrent
    GEMM step; a DMA takes none."""
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
        self._wake = threading.Event()
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


def measure(kv: KVPool, path: str, host_pages: int, object_pages: int, repeat: int = 5) -> dict[str, float]:
    """GB/s of backups (device -> host) and load-backs (host -> device) of objects of
    `object_pages` device pages, scattered (gathered copies) and consecutive (straight 2D
    copies), through the real effect (docs/PERF.md)."""
    import time

    copies = HostCopies(kv, path)
    copies.apply(HostInit(host_pages, copies.page_bytes))
    gen = torch.Generator().manual_seed(0)
    scattered = (torch.randperm(kv.num_pages - 1, generator=gen)[:object_pages] + 1).tolist()
    out: dict[str, float] = {}
    for layout, pages in (("scattered", scattered), ("straight", list(range(1, object_pages + 1)))):
        packed = b"".join(int(p).to_bytes(4, "little", signed=True) for p in pages)
        for name, run in (
            ("backup_gbps", lambda packed=packed: (copies.apply(BackupPrepare(0, packed, 0)), copies.after_forward())),
            ("load_back_gbps", lambda packed=packed: copies.apply(LoadBack(0, packed, 0))),
        ):
            run()  # warm
            _sync(kv.device)
            t0 = time.perf_counter()
            for _ in range(repeat):
                run()
            _sync(kv.device)
            out[f"{layout}_{name}"] = repeat * object_pages * copies.page_bytes / (time.perf_counter() - t0) / 1e9
    copies.take_done()
    half = object_pages // 2
    out["round_trip_equal"] = float(_round_trip(copies, scattered[:half], scattered[half:]))
    return out


def _round_trip(copies: HostCopies, src: list[int], dst: list[int]) -> bool:
    """Back `src` up, load it into `dst`: the bytes must be equal, every layer, K and V."""
    kv = copies.kv
    for t in (*kv.k, *kv.v):
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, device=t.device))
    copies.apply(BackupPrepare(1, b"".join(p.to_bytes(4, "little") for p in src), 0))
    copies.after_forward()
    _sync(kv.device)  # a LoadBack reads only committed objects: their copies have finished
    copies.apply(LoadBack(1, b"".join(p.to_bytes(4, "little") for p in dst), 0))
    _sync(kv.device)
    idx_s, idx_d = torch.tensor(src, device=kv.device), torch.tensor(dst, device=kv.device)
    return all(torch.equal(a[:, idx_s], a[:, idx_d]) for a in copies.dev)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":  # python -m engine.run.host_tier [cuda|cpu]: the copy bandwidth
    import sys

    from engine.cache.slab import create_slab, remove_slab

    dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu"))
    # Llama-3.1-8B's KV shapes in bf16: 32 layers, 8 KV heads of 128, pages of 16 tokens (2 MiB a page)
    n = 1024 if dev.type == "cuda" else 64  # pages per object (2 GiB on a GPU)
    pool = KVPool(32, 2 * n + 1, 16, 8, 128, torch.bfloat16, dev)
    slab = create_slab("strata-bw")
    try:
        print({"device": str(dev), "object_mib": n * 2, **measure(pool, slab, host_pages=n, object_pages=n)})
    finally:
        remove_slab(slab)
