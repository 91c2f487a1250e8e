"""The host tier (L2) in real processes: bin/serve --enable-hierarchical-cache starts the
cache controller and the shared-memory slab; a conversation's greedy output is the same
when its prefix is computed, hit in L1, or loaded back from L2 (a small L1 forces the
latter); the tier's metrics move; nothing leaks; and killing any child with -9 leaves no
/dev/shm segment behind."""

from __future__ import annotations

import random
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.integration.conftest import Server, start_server, start_servers, stop_server

# a pool of 16 pages (L1: 15), L2 twice that
POOL_ARGS = ("--enable-hierarchical-cache", "--max-total-tokens", "256", "--hicache-ratio", "2",
             "--max-prefill-tokens", "256", "--max-running-requests", "4")
# bfloat16 with deterministic inference: computed, L1 and L2 answers equal bit for bit
TIER_ARGS = (*POOL_ARGS, "--dtype", "bfloat16", "--enable-deterministic-inference")


def _children(srv: Server) -> dict[str, psutil.Process]:
    out = {}
    for child in psutil.Process(srv.proc.pid).children(recursive=True):
        cmd = child.cmdline()
        for role in ("worker", "scheduler", "tokenizer", "cache"):
            if f"procs.{role}" in cmd:
                out[f"{role}-{cmd[cmd.index('--rank') + 1]}" if role == "worker" else role] = child
    return out


def _slabs(srv: Server) -> set[Path]:
    """The host slabs the server's processes map (engine/cache/slab.py names them; the supervisor
    unlinks the name once every process is ready, so the maps say "(deleted)")."""
    maps = {m.path.removesuffix(" (deleted)") for c in _children(srv).values() for m in c.memory_maps()}
    return {Path(p) for p in maps if p.startswith("/dev/shm/strata-") and p.endswith("-l2")}


@pytest.fixture(scope="module")
def tier_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("logs"), *TIER_ARGS)
    yield srv
    slabs = _slabs(srv)
    assert stop_server(srv) == 0
    assert slabs and not any(p.exists() for p in slabs), f"slab left behind: {slabs}"


def _generate(srv: Server, ids: list[int]) -> tuple[list, int]:
    """(output ids with their logprobs, cached prompt tokens)."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0, "logprobs": True}}
    r = httpx.post(f"{srv.http}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["meta_info"]["output_token_logprobs"], out["meta_info"]["cached_tokens"]


def test_every_process_maps_the_slab(tier_server: Server) -> None:
    tier_server.wait_idle()
    _generate(tier_server, list(range(300, 340)))  # the first Step creates the tier
    tier_server.wait_idle()
    kids = _children(tier_server)
    assert {"worker-0", "scheduler", "tokenizer", "cache"} <= set(kids)
    (slab,) = _slabs(tier_server)
    for role in ("worker-0", "cache"):
        assert slab in {Path(m.path.removesuffix(" (deleted)")) for m in kids[role].memory_maps()}, role
    assert not slab.exists()  # its name went once all were ready: a SIGKILLed supervisor leaves nothing behind


def test_fresh_l1_and_l2_give_the_same_tokens(tier_server: Server) -> None:
    rng = random.Random(1)
    convs = [[rng.randrange(200, 20000) for _ in range(65)] for _ in range(5)]  # 5 x ~5 pages > L1's 15
    first = {c: _generate(tier_server, convs[c]) for c in range(5)}  # computed (or partly L1)
    again = _generate(tier_server, convs[4])  # just ran: an L1 hit
    assert again[0] == first[4][0] and again[1] >= 64  # its 4 full pages
    for c in range(4):  # evicted from L1 by the later ones: loaded back from L2
        out, cached = _generate(tier_server, convs[c])
        assert out == first[c][0], f"conversation {c}: {out} != {first[c][0]}"
        assert cached >= 64
    m = tier_server.wait_idle()
    assert m['strata_cache_hit_tokens_total{tier="l2"}'] > 0
    assert m['strata_l2_backups_total{result="committed"}'] > 0 and m["strata_l2_load_backs_total"] > 0
    assert 0 < m["strata_l2_pages_used"] <= m["strata_l2_pages_total"]
    assert m["strata_kv_leak_free"] == 1


@pytest.fixture(scope="module")
def victims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    """One server with the tier for each kill test, started side by side (the tier in float32:
    no answers are compared)."""
    names = ("cache", "worker-0")
    servers = dict(zip(names, start_servers(*((tmp_path_factory.mktemp(f"logs-{v}"), POOL_ARGS) for v in names)),
                       strict=True))
    yield servers
    for srv in servers.values():  # (each test kills its own; one left by a failure is killed here)
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait(timeout=30)


@pytest.mark.parametrize("victim", ["cache", "worker-0"])
def test_kill_9_of_a_child_leaves_no_shared_memory(victims: dict[str, Server], victim: str) -> None:
    srv = victims[victim]
    try:
        _generate(srv, list(range(300, 380)))
        slabs = _slabs(srv)
        assert slabs
        _children(srv)[victim].send_signal(signal.SIGKILL)
        assert srv.proc.wait(timeout=30) == 1
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    assert not any(p.exists() for p in slabs), f"shared memory left behind: {slabs}"
