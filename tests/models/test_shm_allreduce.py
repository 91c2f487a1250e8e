"""The CPU ranks' shared-memory all-reduce (engine/layers/shm_allreduce.py), two real ranks in
spawned processes over gloo: sums in rank order, the same bytes on both ranks, an all-gather in rank
order, messages over its size left to gloo, the file gone once mapped, and a rank whose peer died
raises instead of spinning."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
import torch

from engine.layers import shm_allreduce
from tests.ports import reserve_ports

pytestmark = pytest.mark.skipif(not shm_allreduce.available(torch.device("cpu")), reason="x86-64 only")


def _rank(rank: int, port: int, out: mp.Queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        shm = shm_allreduce.setup(dist.group.WORLD, rank, 2, timeout_s=30)
        assert shm is not None
        got = []
        for i, dtype in enumerate((torch.float32, torch.bfloat16, torch.float32)):
            g = torch.Generator().manual_seed(10 * i + rank)
            x = torch.randn(3 + i, 576, generator=g).to(dtype)
            assert shm.takes(x)
            y = shm.all_reduce(x.clone())
            got.append((dtype, _bytes(x), _bytes(y)))  # raw bytes: no tensor travels through the queue
        x = torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * rank
        g = shm.all_gather(x)  # every rank's, in rank order
        got.append((torch.float32, _bytes(x), _bytes(g)))
        assert not shm.takes(torch.zeros(shm_allreduce.MAX_BYTES // 4 + 1))  # gloo's
        left = sorted(p.name for p in Path("/dev/shm").glob(f"strata-allreduce-{os.getpid()}-*"))  # rank 0 made it
        out.put((rank, (got, left)))
        dist.barrier()
        if rank == 1:
            _flush(out)
            os._exit(0)  # gone without a word: rank 0's next all-reduce must notice
        t0 = time.monotonic()
        try:
            shm.all_reduce(torch.ones(4))
            out.put(("late", "no error"))
        except RuntimeError as exc:
            out.put(("late", f"{exc} after {time.monotonic() - t0:.1f} s"))
    finally:
        _flush(out)
        os._exit(0)


def _bytes(x: torch.Tensor) -> bytes:
    return x.contiguous().view(torch.uint8).numpy().tobytes()


def _tensor(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)


def _flush(out: mp.Queue) -> None:
    out.close()
    out.join_thread()


def test_two_ranks_sum_in_rank_order_and_a_dead_peer_raises() -> None:
    port = reserve_ports(1)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        reports = dict(out.get(timeout=120) for _ in range(3))
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    *sums, gather = zip(reports[0][0], reports[1][0], strict=True)
    for (dtype, a, ya), (_, b, yb) in sums:
        assert ya == yb  # the same bytes on both ranks
        assert torch.equal(_tensor(ya, dtype), _tensor(a, dtype) + _tensor(b, dtype))  # rank 0's then rank 1's
    (_, a, ga), (_, b, gb) = gather  # the all-gather: rank 0's x, then rank 1's, on both ranks
    assert ga == gb and ga == a + b
    assert reports[0][1] == [] and reports[1][1] == []  # unlinked once both mapped it
    assert "is gone" in reports["late"], reports["late"]
