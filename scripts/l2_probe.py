"""How much the host tier's backups slow a prefill-heavy step on the GPU (issue 10).

A stand-in for a prefill step (bf16 GEMMs on a high-priority stream, as the worker's
forward runs) is timed alone and then with one write-through backup per step through the
real `HostCopies` effect (Qwen3-0.6B KV shapes: 28 layers, 8 KV heads of 128, 16-token
pages; PAGES pages a step, about what a 16k-token prefill step backs up), with consecutive
device pages (copied straight: DMA) and with scattered ones (gathered first). Reports per
variant: the median GPU time of a step's compute, the worker thread's time in
`after_forward`, the backup's GB/s alone, and how long a step's 2 KB result copy (device to
host), the same bytes stored by a kernel, and a 64 KB input copy (host to device) take
with backups in flight.

    python scripts/l2_probe.py            # on a CUDA machine
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.cache.slab import create_slab, remove_slab  # noqa: E402
from engine.layers.kv_pool import KVPool  # noqa: E402
from engine.run import host_tier  # noqa: E402
from msgs.steps import BackupPrepare, HostInit  # noqa: E402

PAGES = 1024  # device pages backed up per step
STEPS = 30


def _store_kernel():  # noqa: ANN202 - a triton kernel: the step's tokens stored by the SMs into pinned host memory
    import triton
    import triton.language as tl

    @triton.jit
    def store(src, dst, n, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        tl.store(dst + o, tl.load(src + o, mask=o < n), mask=o < n)

    return store


def _pack(pages: list[int]) -> bytes:
    return b"".join(int(p).to_bytes(4, "little", signed=True) for p in pages)


def run(variant: str, pool: KVPool, slab: str) -> dict[str, float]:
    """variant: none (no backup), direct (consecutive device pages), gather (scattered ones)."""
    copies = host_tier.HostCopies(pool, slab)
    copies.apply(HostInit(2 * PAGES, copies.page_bytes))
    compute = torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1])
    a = torch.randn(16384, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 3072, device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    out: dict[str, list[float]] = {"step_ms": [], "after_forward_ms": [], "result_copy_ms": [], "result_store_ms": [],
                                   "input_copy_ms": [], "pageable_input_ms": [], "pageable_host_ms": []}
    inputs = torch.zeros(16384, dtype=torch.int32).pin_memory()  # a step's ids/positions/tables: H2D
    tokens = torch.arange(256, device="cuda")
    pinned = torch.zeros(256, dtype=torch.int64).pin_memory()
    from engine.layers.triton_ops import HostPointer

    store, dst = _store_kernel(), HostPointer(pinned)
    events = []
    torch.cuda.synchronize()
    for i in range(STEPS):  # no sync between steps: a step's backup overlaps the next step's compute
        if variant == "direct":
            first = 1 + (i % 3) * PAGES
            pages = list(range(first, first + PAGES))
        else:
            pages = (torch.randperm(pool.num_pages - 1, generator=gen)[:PAGES] + 1).tolist()
        with torch.cuda.stream(compute):
            t0 = torch.cuda.Event(enable_timing=True)
            t1 = torch.cuda.Event(enable_timing=True)
            t0.record()
            for _ in range(28):  # ~a layer's GEMMs each
                torch.mm(a, w)
            t1.record()
            tokens.to("cpu", non_blocking=True)  # the step's result copy (a copy engine)
            t2 = torch.cuda.Event(enable_timing=True)
            t2.record()
            store[(1,)](tokens, dst, 256, BLOCK=256)  # the same bytes stored by a kernel
            t3 = torch.cuda.Event(enable_timing=True)
            t3.record()
            inputs.to("cuda", non_blocking=True)  # the next step's inputs (the other direction)
            t4 = torch.cuda.Event(enable_timing=True)
            t4.record()
            h0 = time.perf_counter()
            torch.zeros(16384, dtype=torch.int32).to("cuda", non_blocking=True)  # as forward._to: pageable
            out["pageable_host_ms"].append((time.perf_counter() - h0) * 1e3)
            t5 = torch.cuda.Event(enable_timing=True)
            t5.record()
            if variant != "none":
                copies.apply(BackupPrepare(i, _pack(pages), (i % 2) * PAGES))
                c0 = time.perf_counter()
                copies.after_forward()
                out["after_forward_ms"].append((time.perf_counter() - c0) * 1e3)
        events.append((t0, t1, t2, t3, t4, t5))
        copies.take_done()
    copies.drain()
    torch.cuda.synchronize()
    out["step_ms"] = [e[0].elapsed_time(e[1]) for e in events]
    out["result_copy_ms"] = [e[1].elapsed_time(e[2]) for e in events]
    out["result_store_ms"] = [e[2].elapsed_time(e[3]) for e in events]
    out["input_copy_ms"] = [e[3].elapsed_time(e[4]) for e in events]
    out["pageable_input_ms"] = [e[4].elapsed_time(e[5]) for e in events]
    copies.take_done()
    res = {k: statistics.median(v[5:]) for k, v in out.items() if v}
    res["copy_all"], res["store_all"] = out["result_copy_ms"][5:], out["result_store_ms"][5:]
    if variant != "none":  # the backup alone
        pages = list(range(1, PAGES + 1)) if variant == "direct" else pages
        torch.cuda.synchronize()
        c0 = time.perf_counter()
        for i in range(5):
            copies.apply(BackupPrepare(100 + i, _pack(pages), 0))
            copies.after_forward()
        copies.drain()
        torch.cuda.synchronize()
        res["backup_gbps_alone"] = 5 * PAGES * copies.page_bytes / (time.perf_counter() - c0) / 1e9
        copies.take_done()
    copies.close()
    return res


def main() -> None:
    pool = KVPool(28, 4 * PAGES + 1, 16, 8, 128, torch.bfloat16, torch.device("cuda"))
    slab = create_slab("strata-l2probe")
    results = {}
    try:
        for name in ("none", "direct", "gather"):
            results[name] = run(name, pool, slab)
            print(name, {k: round(v, 3) for k, v in results[name].items() if not isinstance(v, list)}, flush=True)
    finally:
        remove_slab(slab)
    base = results["none"]["step_ms"]
    for name, r in results.items():
        print(f"{name:14s} step {r['step_ms']:.3f} ms ({r['step_ms'] / base - 1:+.1%})"
              f" after_forward {r.get('after_forward_ms', 0):.3f} ms  alone {r.get('backup_gbps_alone', 0):.1f} GB/s"
              f"  result copy {r['result_copy_ms']:.3f} ms, stored by a kernel {r['result_store_ms']:.3f} ms"
              f" (max {max(r['copy_all']):.3f} / {max(r['store_all']):.3f}),"
              f" 64 KB input copy {r['input_copy_ms']:.3f} ms, pageable {r['pageable_input_ms']:.3f} ms"
              f" (host {r['pageable_host_ms']:.3f} ms)")
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(exist_ok=True)
    (out / "l2_probe.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
