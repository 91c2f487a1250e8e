"""The host tier on a GPU (marker gpu; skipped without CUDA): random-weight Qwen3-0.6B in
bf16, the real runner, the cache controller driver and a cudaHostRegister'ed slab. A
prefix loaded back from L2 must give the same greedy tokens as the same prefix hit in L1
(the KV bytes round-trip exactly), with every step digest-checked. The backups run on a
side stream (engine/run/host_tier.py): a round trip through it is byte-identical, it reads
the KV the forward before it wrote, a forward issued right after it does not corrupt it,
and WithBackups reports a finished copy even when no further step comes.

    python3 -m pytest -m gpu tests/cache/test_tier_gpu.py
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch
from test_tier_differential import Engine  # tests/cache is on sys.path (no __init__)

from engine.cache.slab import create_slab, remove_slab
from engine.config import ServerConfig
from engine.layers.kv_pool import KVPool
from engine.run.host_tier import HostCopies, WithBackups, _segments
from msgs.codec import pack_ids
from msgs.done import BackupDone
from msgs.steps import BackupPrepare, HostInit, LoadBack

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_l2_load_back_gives_the_l1_tokens_on_gpu() -> None:
    slab = create_slab("strata-gpu-test")
    try:
        cfg = ServerConfig(
            model=str(ROOT / "configs" / "qwen3-0.6b"),
            load_format="dummy",
            device="cuda",
            max_total_tokens=12 * 16,
            max_running_requests=4,
            max_prefill_tokens=256,
            enable_hierarchical_cache=True,
            hicache_path=slab,
            **_backend(),
        )
        eng = SettledEngine(cfg)
        rng = random.Random(2)
        convs = [[rng.randrange(200, 20000) for _ in range(80)] for _ in range(3)]
        eng.run([convs[0]])
        l1 = eng.run([convs[0] + [7, 8]])[0]  # its history is an L1 hit
        eng.run([convs[1]])
        eng.run([convs[2]])  # the pool holds about two conversations: 0 went to L2
        before = eng.core.state.tiers.stats()["load_backs"]
        l2 = eng.run([convs[0] + [7, 8]])[0]
        assert eng.core.state.tiers.stats()["load_backs"] > before
        assert l2 == l1
    finally:
        remove_slab(slab)


def _backend() -> dict:
    """The torch reference backend without graphs: this checks the copies, not the kernels."""
    return {"attention_backend": "torch", "disable_cuda_graph": True}


class SettledEngine(Engine):
    """Engine whose controller pump first waits for the side stream's copies: the served
    worker's reporter thread sends BackupDone as soon as they finish; here the commits
    must land before the next run so that eviction can move a conversation to L2."""

    def _controller(self) -> None:
        torch.cuda.synchronize()
        super()._controller()


def _pool(pages: int = 64) -> KVPool:
    """Llama-like KV pages in bf16 (4 layers, 8 KV heads of 128, 16-token pages: 128 KiB a page)."""
    return KVPool(4, pages, 16, 8, 128, torch.bfloat16, "cuda")


def _fill(kv: KVPool, pages: list[int], value: int | None = None) -> None:
    """Random (or constant) bytes into `pages` of every layer's K and V, on the current stream."""
    for t in (*kv.k, *kv.v):
        rows = t.view(kv.num_pages, -1).view(torch.uint8)[torch.tensor(pages, device="cuda")]
        new = (
            torch.randint(0, 256, rows.shape, dtype=torch.uint8, device="cuda")
            if value is None
            else (torch.full_like(rows, value))
        )
        t.view(kv.num_pages, -1).view(torch.uint8)[torch.tensor(pages, device="cuda")] = new


def _snapshot(kv: KVPool, pages: list[int]) -> list[torch.Tensor]:
    idx = torch.tensor(pages, device="cuda")
    return [t.view(kv.num_pages, -1).view(torch.uint8)[idx].clone() for t in (*kv.k, *kv.v)]


def _wait_done(copies: HostCopies, timeout: float = 30.0) -> list[int]:
    """Poll take_done (never blocking) until something is reported."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := copies.take_done():
            return got
        time.sleep(0.001)
    raise TimeoutError("no backup reported done")


def _busy(n: int = 6) -> None:
    """Keep the compute stream busy for a while (big matmuls)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(n):
        a = (a @ a).clamp_(-1, 1)


def test_side_stream_backup_round_trip_is_exact() -> None:
    """The backup waits for the forward that wrote its pages (a slow compute stream, then the
    write), runs on the side stream, and a forward issued right after it (writing other
    pages, allocating and filling fresh memory) does not corrupt it; loading it back into
    other pages gives the same bytes."""
    slab = create_slab("strata-gpu-side")
    try:
        kv = _pool()
        copies = HostCopies(kv, slab)
        assert copies.stream is not None and copies.stream != torch.cuda.current_stream()
        copies.apply(HostInit(32, copies.page_bytes))
        src, dst, other = list(range(1, 17)), list(range(40, 56)), list(range(20, 36))
        _fill(kv, list(range(1, kv.num_pages)))
        torch.cuda.synchronize()
        _busy()  # "the forward": slow, then it writes the KV of src
        _fill(kv, src)
        expected = _snapshot(kv, src)  # enqueued on the compute stream, before the backup
        copies.apply(BackupPrepare(7, pack_ids(src), 4))
        copies.after_forward()
        # "the next forward", enqueued at once: overwrites other pages and churns the allocator
        _fill(kv, other, 0)
        junk = [torch.full((64 << 20,), 0xAB, dtype=torch.uint8, device="cuda") for _ in range(8)]
        del junk
        assert _wait_done(copies) == [7]
        copies.apply(LoadBack(7, pack_ids(dst), 4))
        torch.cuda.synchronize()
        got = _snapshot(kv, dst)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        assert copies.stats["backups"] == 1 and copies.stats["load_backs"] == 1
        logged = copies.maybe_log(now=time.monotonic() + 10)
        assert logged is not None and logged["bytes_out"] == 16 * copies.page_bytes and logged["backup_s"] > 0
        copies.close()
    finally:
        remove_slab(slab)


def test_many_stretches_and_scattered_pages_round_trip_is_exact() -> None:
    """A run like a prefill step's backups: a dozen stretches (each prompt's pages, then its
    partly filled last page left out) plus scattered pages, backed up by the copier thread's
    batch of DMAs; loaded back into another such layout (straight 2D copies and a gathered
    piece), every byte is equal."""
    slab = create_slab("strata-gpu-mixed")
    try:
        kv = _pool(400)
        copies = HostCopies(kv, slab)
        copies.apply(HostInit(300, copies.page_bytes))
        src = [p for base in range(1, 130, 11) for p in range(base, base + 10)] + [300, 250, 333, 290]
        dst = [p for base in range(140, 270, 22) for p in range(base, base + 20)] + [390, 391, 5, 380]
        pieces = _segments(dst)
        assert sum(first is not None for _, _, first in pieces) == 6 and pieces[-1][2] is None
        _fill(kv, list(range(1, kv.num_pages)))
        expected = _snapshot(kv, src)
        copies.apply(BackupPrepare(1, pack_ids(src), 17))
        copies.after_forward()
        assert _wait_done(copies) == [1]
        copies.apply(LoadBack(1, pack_ids(dst), 17))
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(_snapshot(kv, dst), expected, strict=True))
        copies.close()
    finally:
        remove_slab(slab)


class _Outbox:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg: object) -> None:
        self.sent.append(msg)


def test_done_copy_reported_without_another_step() -> None:
    """A copy still running when its step's StepDone goes out is reported by WithBackups'
    thread once it finished, with no further send."""
    slab = create_slab("strata-gpu-report")
    try:
        kv = _pool(256)
        copies = HostCopies(kv, slab)
        copies.apply(HostInit(200, copies.page_bytes))
        done, backups = _Outbox(), _Outbox()
        outbox = WithBackups(done, backups, copies, rank=0)
        _busy(12)  # the copy waits behind this
        copies.apply(BackupPrepare(3, pack_ids(list(range(1, 201))), 0))
        copies.after_forward()
        outbox.send("step done")  # the copy is most likely still waiting: nothing or BackupDone(3)
        deadline = time.monotonic() + 30
        while not backups.sent and time.monotonic() < deadline:
            time.sleep(0.01)
        assert done.sent == ["step done"]
        assert backups.sent == [BackupDone(obj=3, rank=0)]
        copies.close()
    finally:
        remove_slab(slab)
