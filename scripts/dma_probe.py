"""The host tier's DMA calls on a GPU (engine/run/dma.py; issue 10, docs/PERF.md):

1. does a 2D copy (`copy_rows`, the load-backs' straight stretches) return at once, whatever
   its row pitches? Their pitches are the KV pool's layer stride and the slab's, GBs on large
   ones. A call the runtime cannot run asynchronously blocks the calling thread until done.
   The side stream is held by a sleeping kernel: an asynchronous call returns in
   microseconds, a blocking one after the sleep. Both directions, small and large (> 2 GiB)
   pitches on either side;
2. a decoded tail of scattered pages as one batch (`copy_batch`, the backups), as a 2D copy
   per page, and as a gather per layer: call time, GB/s, bytes equal.

    python scripts/dma_probe.py            # on a CUDA machine
"""

from __future__ import annotations

import json
import mmap
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.run.dma import copy_batch, copy_rows  # noqa: E402
from engine.run.pinning import register_host  # noqa: E402

ROWS, WIDTH = 4, 1 << 20
SMALL, BIG = 64 << 20, (5 << 30) // 2  # row pitches: 64 MiB and 2.5 GiB


class _Host:
    """A registered anonymous mapping, as the slab is (mmap + cudaHostRegister)."""

    def __init__(self, pitch: int) -> None:
        self.map = mmap.mmap(-1, ROWS * pitch)
        flat = torch.frombuffer(self.map, dtype=torch.uint8)
        self.rows = flat.view(ROWS, pitch)[:, :WIDTH]
        self.rows.fill_(1)  # first touch
        self.fin = register_host(self, flat, self.map, "probe")


def main() -> None:
    side = torch.cuda.Stream()
    out = []
    dev = {p: torch.zeros(ROWS, p, dtype=torch.uint8, device="cuda")[:, :WIDTH] for p in (SMALL, BIG)}
    host = {p: _Host(p) for p in (SMALL, BIG)}
    for hp in (SMALL, BIG):
        for dp in (SMALL, BIG):
            for direction in ("d2h", "h2d"):
                dst, src = (host[hp].rows, dev[dp]) if direction == "d2h" else (dev[dp], host[hp].rows)
                with torch.cuda.stream(side):
                    copy_rows(dst, src, side)  # warm
                    torch.cuda.synchronize()
                    torch.cuda._sleep(100_000_000)  # ~50 ms on the side stream
                    t0 = time.perf_counter()
                    copy_rows(dst, src, side)
                    call_ms = (time.perf_counter() - t0) * 1e3
                    torch.cuda.synchronize()
                    total_ms = (time.perf_counter() - t0) * 1e3
                    if direction == "d2h":
                        dev[dp].fill_(7)
                        torch.cuda.synchronize()
                        copy_rows(host[hp].rows, dev[dp], side)
                        torch.cuda.synchronize()
                        ok = bool((host[hp].rows == 7).all())
                    else:
                        host[hp].rows.fill_(9)
                        copy_rows(dev[dp], host[hp].rows, side)
                        torch.cuda.synchronize()
                        ok = bool((dev[dp] == 9).all())
                r = {"host_pitch_mib": hp >> 20, "dev_pitch_mib": dp >> 20, "dir": direction,
                     "call_ms": round(call_ms, 3), "until_done_ms": round(total_ms, 1), "bytes_ok": ok}
                print(json.dumps(r), flush=True)
                out.append(r)
    for h in host.values():
        h.fin()
    scattered_tail()


def scattered_tail() -> None:
    """Qwen3-0.6B KV shapes (28 layers, 32 KiB per page and layer), a decode tail of 36
    scattered pages: one batch of 28 * 36 copies per K/V vs one 2D copy per page vs a gather
    per layer. Call time, GB/s, bytes equal. (How much each slows a concurrent forward is
    measured served: gpu_bench.sh l2decode, docs/PERF.md.)"""
    layers, lb, pages = 28, 32 << 10, 70000
    pool = torch.randint(0, 255, (layers, pages, lb), dtype=torch.uint8, device="cuda")  # K only: 63 GB
    host_pages = 4096
    h = _Host.__new__(_Host)
    h.map = mmap.mmap(-1, layers * host_pages * lb)
    flat = torch.frombuffer(h.map, dtype=torch.uint8)
    slab = flat.view(layers, host_pages, lb)
    slab.fill_(0)
    h.fin = register_host(h, flat, h.map, "probe slab")
    gen = torch.Generator().manual_seed(0)
    tail = (torch.randperm(pages - 1, generator=gen)[:36] + 1).tolist()
    side = torch.cuda.Stream()
    start = 100

    lay = torch.arange(layers, dtype=torch.int64)[:, None]
    tail_t = torch.tensor(tail, dtype=torch.int64)[None, :]

    def batch() -> None:
        d = slab.data_ptr() + lay * slab.stride(0) + (start + torch.arange(len(tail)))[None, :] * lb
        s = pool.data_ptr() + lay * pool.stride(0) + tail_t * lb
        copy_batch(d.view(-1), s.view(-1), torch.full((d.numel(),), lb, dtype=torch.int64), side)

    def rows2d() -> None:
        for i, p in enumerate(tail):
            copy_rows(slab[:, start + i], pool[:, p], side)

    idx = torch.tensor(tail, device="cuda")

    def gather() -> None:
        for layer in range(layers):
            slab[layer, start : start + len(tail)].copy_(pool[layer, idx], non_blocking=True)

    for name, fn in (("batch", batch), ("rows2d", rows2d), ("gather", gather)):
        slab.zero_()
        with torch.cuda.stream(side):
            fn()
            torch.cuda.synchronize()
            ok = all(torch.equal(slab[:, start + i].cuda(), pool[:, p]) for i, p in enumerate(tail[:5]))
            torch.cuda._sleep(100_000_000)
            t0 = time.perf_counter()
            fn()
            call_ms = (time.perf_counter() - t0) * 1e3
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            gbps = 20 * layers * len(tail) * lb / (time.perf_counter() - t0) / 1e9
        r = {"tail": name, "call_ms": round(call_ms, 3), "gbps": round(gbps, 1), "bytes_ok": ok}
        print(json.dumps(r), flush=True)
    h.fin()


if __name__ == "__main__":
    main()
