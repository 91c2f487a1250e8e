"""A worker's side of the host tier (L2): copies between its KV pool and the host slab.

`HostCopies` is an effect of the replica (not digested: the HostTier component holds the
allocator state it follows):

* HostInit: map this rank's region of the slab (engine/cache/slab.py), laid out
  [layer][K, V][host page][page_size * kv_heads * head_dim bytes]: an object's pages are one
  contiguous span per layer and K/V, so each is one copy (and, on a GPU, the region is
  registered with cudaHostRegister so those copies are DMA, async on a side stream later);
* LoadBack: copy host -> device at once, i.e. before this step's forward reads the pages;
* BackupPrepare: queued; `after_forward()` copies device -> host once the step's forward
  has written the KV, and the object is reported done (`take_done`), which the worker
  sends to the cache controller as BackupDone after the StepDone.

The copies go through byte views (any KV dtype): device pages are gathered per layer into
one contiguous block and copied to the object's span (and back, then scattered). On CPU
the slab is ordinary shared memory. On a GPU the copies are issued on the compute stream
(no side stream or per-layer overlap with the forward yet).
"""

from __future__ import annotations

import mmap
from typing import Any

import torch

from engine.cache.slab import map_slab
from engine.layers.kv_pool import KVPool
from engine.replica import Effect
from msgs.codec import unpack_ids
from msgs.done import BackupDone
from msgs.steps import BackupPrepare, HostInit, LoadBack


class HostCopies(Effect):
    ops = (HostInit, BackupPrepare, LoadBack)

    def __init__(self, kv: KVPool, path: str, rank: int = 0, world: int = 1) -> None:
        self.kv = kv
        self.path = path
        self.rank, self.world = rank, world  # each rank owns one region of the slab: its KV heads
        self.layer_bytes = kv.page_size * kv.num_kv_heads * kv.head_dim * kv.dtype.itemsize
        self.page_bytes = 2 * kv.num_layers * self.layer_bytes
        self.slab: torch.Tensor | None = None  # uint8 [layers, 2, host pages, layer_bytes]
        self._map: mmap.mmap | None = None
        self.queued: list[tuple[int, list[int], int]] = []  # (obj, device pages, host start)
        self.done: list[tuple[int, torch.cuda.Event | None]] = []  # copied (or enqueued: event)
        self.stats = {"backups": 0, "load_backs": 0, "bytes_out": 0, "bytes_in": 0}

    def apply(self, op: HostInit | BackupPrepare | LoadBack) -> None:
        match op:
            case HostInit(num_pages=n, page_bytes=want):
                if want and want != self.page_bytes:  # another layout than the scheduler's: fatal
                    raise RuntimeError(f"host tier pages of {want} bytes; this rank's are {self.page_bytes}")
                region = n * self.page_bytes
                self._map = map_slab(self.path, region * self.world)
                raw = torch.frombuffer(self._map, dtype=torch.uint8)[self.rank * region : (self.rank + 1) * region]
                self.slab = raw.view(self.kv.num_layers, 2, n, self.layer_bytes)
                self._register(self.slab)
            case BackupPrepare(obj=obj, device_pages=pages, host_start=start):
                self.queued.append((obj, unpack_ids(pages), start))
            case LoadBack(device_pages=pages, host_start=start):
                self._load(unpack_ids(pages), start)

    def _register(self, slab: torch.Tensor) -> None:
        """Pin the mapping for DMA (every process that maps the slab may register it)."""
        if self.kv.device.type == "cuda":
            err = torch.cuda.cudart().cudaHostRegister(slab.data_ptr(), slab.numel(), 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of the host slab failed: {err}")

    def _pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as raw bytes, one row per device page."""
        n = self.kv.num_pages
        return (self.kv.k[layer].view(torch.uint8).view(n, self.layer_bytes),
                self.kv.v[layer].view(torch.uint8).view(n, self.layer_bytes))

    def _load(self, pages: list[int], start: int) -> None:
        assert self.slab is not None
        span = slice(start, start + len(pages))
        idx = torch.tensor(pages, dtype=torch.int64).to(self.kv.device, non_blocking=True)
        for layer in range(self.kv.num_layers):
            for kv, dev in zip((0, 1), self._pages(layer), strict=True):
                dev.index_copy_(0, idx, self.slab[layer, kv, span].to(self.kv.device, non_blocking=True))
        self.stats["load_backs"] += 1
        self.stats["bytes_in"] += len(pages) * self.page_bytes

    def after_forward(self) -> None:
        """Copy the queued backups (their KV is written once this step's forward ran)."""
        if not self.queued:
            return
        assert self.slab is not None
        for obj, pages, start in self.queued:
            span = slice(start, start + len(pages))
            idx = torch.tensor(pages, dtype=torch.int64).to(self.kv.device, non_blocking=True)
            for layer in range(self.kv.num_layers):
                for kv, dev in zip((0, 1), self._pages(layer), strict=True):
                    self.slab[layer, kv, span].copy_(dev[idx], non_blocking=True)
            self.done.append((obj, None))
            self.stats["backups"] += 1
            self.stats["bytes_out"] += len(pages) * self.page_bytes
        self.queued = []
        if self.kv.device.type == "cuda":  # BackupDone promises the bytes are in the slab: track them
            event = torch.cuda.Event()
            event.record()
            self.done = [(obj, ev or event) for obj, ev in self.done]

    def take_done(self) -> list[int]:
        """Objects whose copy has finished (never waits: on a GPU a copy still running is
        reported by a later call; the step that enqueued it finishes after it, and its
        StepDone is followed by this call)."""
        ready, waiting = [], []
        for obj, ev in self.done:  # one query per copy: a copy finishing meanwhile is not lost
            (ready if ev is None or ev.query() else waiting).append((obj, ev))
        self.done = waiting
        return [obj for obj, _ in ready]


class WithBackups:
    """The worker's `done` outbox, followed by a BackupDone per object this rank copied
    (to the cache controller), sent after the StepDone of the step that copied them."""

    def __init__(self, done: Any, backups: Any, copies: HostCopies, rank: int) -> None:
        self.done, self.backups, self.copies, self.rank = done, backups, copies, rank

    def send(self, msg: Any) -> None:
        self.done.send(msg)
        for obj in self.copies.take_done():
            self.backups.send(BackupDone(obj=obj, rank=self.rank))


def measure(kv: KVPool, path: str, host_pages: int, object_pages: int, repeat: int = 5) -> dict[str, float]:
    """GB/s of backups (device -> host) and load-backs (host -> device) of objects of
    `object_pages` scattered device pages, through the real effect (docs/PERF.md)."""
    import time

    copies = HostCopies(kv, path)
    copies.apply(HostInit(host_pages, copies.page_bytes))
    gen = torch.Generator().manual_seed(0)
    pages = (torch.randperm(kv.num_pages - 1, generator=gen)[:object_pages] + 1).tolist()
    packed = b"".join(int(p).to_bytes(4, "little", signed=True) for p in pages)
    out: dict[str, float] = {}
    for name, run in (
        ("backup_gbps", lambda: (copies.apply(BackupPrepare(0, packed, 0)), copies.after_forward())),
        ("load_back_gbps", lambda: copies.apply(LoadBack(0, packed, 0))),
    ):
        run()  # warm
        _sync(kv.device)
        t0 = time.perf_counter()
        for _ in range(repeat):
            run()
        _sync(kv.device)
        out[name] = repeat * object_pages * copies.page_bytes / (time.perf_counter() - t0) / 1e9
    copies.take_done()
    out["round_trip_equal"] = float(_round_trip(copies, pages[: object_pages // 2], pages[object_pages // 2 :]))
    return out


def _round_trip(copies: HostCopies, src: list[int], dst: list[int]) -> bool:
    """Back `src` up, load it into `dst`: the bytes must be equal, every layer, K and V."""
    kv = copies.kv
    for t in (*kv.k, *kv.v):
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, device=t.device))
    copies.apply(BackupPrepare(1, b"".join(p.to_bytes(4, "little") for p in src), 0))
    copies.after_forward()
    copies.apply(LoadBack(1, b"".join(p.to_bytes(4, "little") for p in dst), 0))
    _sync(kv.device)
    idx_s, idx_d = torch.tensor(src, device=kv.device), torch.tensor(dst, device=kv.device)
    return all(
        torch.equal(a[idx_s], a[idx_d]) for layer in range(kv.num_layers) for a in copies._pages(layer)
    )


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
