"""A worker's side of the host tier (L2): copies between its KV pool and the host slab.

`HostCopies` is an effect of the replica (not digested: the HostTier component holds the
allocator state it follows):

* HostInit: map the slab (engine/cache/slab.py), one row of `page_bytes` per host page,
  laid out [layer][K, V][page_size * kv_heads * head_dim] in the pool's raw bytes;
* LoadBack: copy host -> device at once, i.e. before this step's forward reads the pages;
* BackupPrepare: queued; `after_forward()` copies device -> host once the step's forward
  has written the KV, and the object is reported done (`take_done`), which the worker
  sends to the cache controller as BackupDone after the StepDone.

The copies are plain indexed copies through byte views (any KV dtype); on CPU the slab is
ordinary shared memory. On a GPU they are correct but synchronous (no side stream, no
per-layer overlap, no cudaHostRegister yet).
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
        self.slab: torch.Tensor | None = None  # uint8 [host pages, layers, 2, layer_bytes]
        self._map: mmap.mmap | None = None
        self.queued: list[tuple[int, list[int], int]] = []  # (obj, device pages, host start)
        self.done: list[int] = []
        self.stats = {"backups": 0, "load_backs": 0, "bytes_out": 0, "bytes_in": 0}

    def apply(self, op: HostInit | BackupPrepare | LoadBack) -> None:
        match op:
            case HostInit(num_pages=n, page_bytes=want):
                if want and want != self.page_bytes:  # another layout than the scheduler's: fatal
                    raise RuntimeError(f"host tier pages of {want} bytes; this rank's are {self.page_bytes}")
                region = n * self.page_bytes
                self._map = map_slab(self.path, region * self.world)
                raw = torch.frombuffer(self._map, dtype=torch.uint8)[self.rank * region : (self.rank + 1) * region]
                self.slab = raw.view(n, self.kv.num_layers, 2, self.layer_bytes)
            case BackupPrepare(obj=obj, device_pages=pages, host_start=start):
                self.queued.append((obj, unpack_ids(pages), start))
            case LoadBack(device_pages=pages, host_start=start):
                self._load(unpack_ids(pages), start)

    def _pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as raw bytes, one row per device page."""
        n = self.kv.num_pages
        return (self.kv.k[layer].view(torch.uint8).view(n, self.layer_bytes),
                self.kv.v[layer].view(torch.uint8).view(n, self.layer_bytes))

    def _load(self, pages: list[int], start: int) -> None:
        assert self.slab is not None
        host = self.slab[start : start + len(pages)]
        idx = torch.tensor(pages, dtype=torch.int64, device=self.kv.device)
        for layer in range(self.kv.num_layers):
            k, v = self._pages(layer)
            k.index_copy_(0, idx, host[:, layer, 0].to(self.kv.device))
            v.index_copy_(0, idx, host[:, layer, 1].to(self.kv.device))
        self.stats["load_backs"] += 1
        self.stats["bytes_in"] += len(pages) * self.page_bytes

    def after_forward(self) -> None:
        """Copy the queued backups (their KV is written once this step's forward ran)."""
        if not self.queued:
            return
        assert self.slab is not None
        for obj, pages, start in self.queued:
            host = self.slab[start : start + len(pages)]
            idx = torch.tensor(pages, dtype=torch.int64, device=self.kv.device)
            for layer in range(self.kv.num_layers):
                k, v = self._pages(layer)
                host[:, layer, 0].copy_(k[idx])
                host[:, layer, 1].copy_(v[idx])
            self.done.append(obj)
            self.stats["backups"] += 1
            self.stats["bytes_out"] += len(pages) * self.page_bytes
        self.queued = []

    def take_done(self) -> list[int]:
        done, self.done = self.done, []
        return done


class WithBackups:
    """The worker's `done` outbox, followed by a BackupDone per object this rank copied
    (to the cache controller), sent after the StepDone of the step that copied them."""

    def __init__(self, done: Any, backups: Any, copies: HostCopies, rank: int) -> None:
        self.done, self.backups, self.copies, self.rank = done, backups, copies, rank

    def send(self, msg: Any) -> None:
        self.done.send(msg)
        for obj in self.copies.take_done():
            self.backups.send(BackupDone(obj=obj, rank=self.rank))
