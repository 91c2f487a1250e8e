"""The host tier's copy bandwidth through the worker's real `HostCopies` effect (issue 10,
docs/PERF.md), and the byte-exact round trip the tests and the bandwidth run check.

    python -m engine.bench.hostcopy [cuda|cpu]      # Llama-3.1-8B KV shapes, bf16
"""

from __future__ import annotations

import sys
import time

import torch

from engine.cache.slab import create_slab, remove_slab
from engine.layers.kv_pool import KVPool
from engine.run.host_tier import HostCopies
from msgs.steps import BackupPrepare, HostInit, LoadBack


def measure(kv: KVPool, path: str, host_pages: int, object_pages: int, repeat: int = 5) -> dict[str, float]:
    """GB/s of backups (device -> host) and load-backs (host -> device) of objects of
    `object_pages` device pages, scattered and consecutive, through the real effect
    (docs/PERF.md)."""
    copies = HostCopies(kv, path)
    copies.apply(HostInit(host_pages, copies.page_bytes))
    gen = torch.Generator().manual_seed(0)
    scattered = (torch.randperm(kv.num_pages - 1, generator=gen)[:object_pages] + 1).tolist()
    out: dict[str, float] = {}
    for layout, pages in (("scattered", scattered), ("straight", list(range(1, object_pages + 1)))):
        packed = b"".join(int(p).to_bytes(4, "little", signed=True) for p in pages)
        for name, run in (
            ("backup_gbps", lambda packed=packed: backup_now(copies, BackupPrepare(0, packed, 0))),
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
    out["round_trip_equal"] = float(round_trip(copies, scattered[:half], scattered[half:]))
    return out


def round_trip(copies: HostCopies, src: list[int], dst: list[int]) -> bool:
    """Back `src` up, load it into `dst`: the bytes must be equal, every layer, K and V."""
    kv = copies.kv
    for t in (*kv.k, *kv.v):
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, device=t.device))
    backup_now(copies, BackupPrepare(1, b"".join(p.to_bytes(4, "little") for p in src), 0))
    _sync(kv.device)  # a LoadBack reads only committed objects: their copies have finished
    copies.apply(LoadBack(1, b"".join(p.to_bytes(4, "little") for p in dst), 0))
    _sync(kv.device)
    idx_s, idx_d = torch.tensor(src, device=kv.device), torch.tensor(dst, device=kv.device)
    return all(torch.equal(a[:, idx_s], a[:, idx_d]) for a in copies.dev)


def backup_now(copies: HostCopies, op: BackupPrepare) -> None:
    """Queue a backup and launch it as a step would, then wait until its copies are enqueued."""
    copies.apply(op)
    copies.after_forward()
    copies.drain()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu"))
    # Llama-3.1-8B's KV shapes in bf16: 32 layers, 8 KV heads of 128, pages of 16 tokens (2 MiB a page)
    n = 1024 if dev.type == "cuda" else 64  # pages per object (2 GiB on a GPU)
    pool = KVPool(32, 2 * n + 1, 16, 8, 128, torch.bfloat16, dev)
    slab = create_slab("strata-bw")
    try:
        print({"device": str(dev), "object_mib": n * 2, **measure(pool, slab, host_pages=n, object_pages=n)})
    finally:
        remove_slab(slab)
