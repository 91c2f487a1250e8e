"""The disk tier (L3) in real processes: two bin/serve engines on one --l3-dir at once.
What one writes the other serves: a long-ish prompt computed by engine A is answered by
engine B from A's files (tier l3 hits, identical greedy output); a file corrupted on disk
is detected (counted, removed) and the answer is still identical (recomputed)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import Server, start_server, start_servers, stop_server

ARGS = ("--enable-hierarchical-cache", "--max-total-tokens", "512", "--hicache-ratio", "2",
        "--max-prefill-tokens", "256", "--max-running-requests", "4", "--dtype", "bfloat16",
        "--enable-deterministic-inference")
PAGES = 3  # a prompt's full pages (of 16 tokens): files written, tokens served from them
FULL = 16 * PAGES
PROMPT = FULL + 4  # (of its tokens, all but the last are matched)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server, Path]]:
    l3_dir = tmp_path_factory.mktemp("l3")
    a, b = start_servers(*((tmp_path_factory.mktemp(f"logs-{n}"), (*ARGS, "--l3-dir", str(l3_dir))) for n in "ab"))
    yield a, b, l3_dir
    with ThreadPoolExecutor(2) as pool:  # stopped side by side
        assert list(pool.map(stop_server, (a, b))) == [0, 0]


def _generate(srv: Server, ids: list[int], max_new: int = 2) -> tuple[list, int, float]:
    """(output ids with their logprobs: equal bit for bit from any tier in bf16 with deterministic
    inference; cached prompt tokens; seconds)."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "logprobs": True}}
    t0 = time.perf_counter()
    r = httpx.post(f"{srv.http}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["meta_info"]["output_token_logprobs"], out["meta_info"]["cached_tokens"], time.perf_counter() - t0


def _files(l3_dir: Path) -> set[Path]:
    return set(l3_dir.glob("*/*.kv"))


def _eventually(srv: Server, name: str, at_least: float) -> dict[str, float]:
    """The metrics once `name` reached at_least (the controller's L3 counters reach /metrics
    at most once a second)."""
    deadline = time.monotonic() + 30
    while (m := srv.wait_idle())[name] < at_least:
        assert time.monotonic() < deadline, f"{name} = {m[name]} < {at_least}"
        time.sleep(0.2)
    return m


def _writes(srv: Server) -> float:
    return srv.metrics()["strata_l3_writes_total"]


def _written(srv: Server, at_least: float) -> None:
    """Wait until the engine's controller has written that many files (asynchronously; its
    counters reach /metrics at most once a second)."""
    deadline = time.monotonic() + 30
    while (n := _writes(srv)) < at_least:
        assert time.monotonic() < deadline, f"{n} of {at_least} L3 files written"
        time.sleep(0.1)


def test_what_one_engine_writes_the_other_serves(engines: tuple[Server, Server, Path]) -> None:
    a, b, l3_dir = engines
    rng = random.Random(7)
    prompt = [rng.randrange(200, 20000) for _ in range(PROMPT)]
    want, cached, t_compute = _generate(a, prompt)
    assert cached == 0
    _written(a, PAGES)
    got, cached, t_l3 = _generate(b, prompt)
    assert got == want and cached == FULL
    m = _eventually(b, "strata_l3_reads_total", PAGES)
    assert m['strata_cache_hit_tokens_total{tier="l3"}'] == FULL and m["strata_l3_read_bytes_total"] > 0
    assert m["strata_kv_leak_free"] == 1
    # TTFT (max_new_tokens=1) on engine B of a prompt it computes vs one engine A wrote to L3
    _, _, recompute = _generate(b, [rng.randrange(200, 20000) for _ in range(PROMPT)], max_new=1)
    _written(b, PAGES)  # B wrote that one: settled before the next test looks for A's new files
    other = [rng.randrange(200, 20000) for _ in range(PROMPT)]
    _generate(a, other, max_new=1)
    _written(a, 2 * PAGES)
    _, cached, from_l3 = _generate(b, other, max_new=1)
    assert cached == FULL
    # /flush_cache empties L1 and L2, not L3: the prompt comes from the files again
    files = _files(l3_dir)
    deadline = time.monotonic() + 30
    while (r := httpx.post(f"{b.http}/flush_cache", timeout=30)).status_code == 409:  # commits in flight
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)
    assert r.status_code == 200 and _files(l3_dir) == files
    again, cached, _ = _generate(b, prompt)
    assert again == want and cached == FULL
    assert _eventually(b, 'strata_cache_hit_tokens_total{tier="l3"}', 2 * FULL + FULL)[
        'strata_cache_hit_tokens_total{tier="l3"}'] == 3 * FULL
    print(f"\nTTFT of a {PROMPT}-token prompt on CPU: recomputed {recompute * 1e3:.0f} ms, {FULL} tokens from L3 "
          f"{from_l3 * 1e3:.0f} ms (2 new tokens: computed {t_compute * 1e3:.0f} ms, from L3 {t_l3 * 1e3:.0f} ms)")


def test_a_corrupt_file_is_detected_and_the_answer_is_unchanged(engines: tuple[Server, Server, Path]) -> None:
    a, b, l3_dir = engines
    rng = random.Random(8)
    prompt = [rng.randrange(200, 20000) for _ in range(PROMPT)]
    before, writes = _files(l3_dir), _writes(a)
    want, _, _ = _generate(a, prompt)
    _written(a, writes + PAGES)
    new = _files(l3_dir) - before
    assert len(new) == PAGES
    victim = sorted(new)[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x40  # a flipped bit in the payload
    victim.write_bytes(bytes(data))
    corrupt_before = b.metrics()["strata_l3_corrupt_files_total"]
    got, cached, _ = _generate(b, prompt)
    assert got == want and cached < FULL  # not served from the damaged files: recomputed
    m = _eventually(b, "strata_l3_corrupt_files_total", corrupt_before + 1)
    assert not victim.exists() or victim.read_bytes() != bytes(data)  # removed (then written anew, whole)
    assert m["strata_kv_leak_free"] == 1


def test_a_deterministic_engine_does_not_serve_another_arithmetics_pages(engines: tuple[Server, Server, Path],
                                                                          tmp_path: Path) -> None:
    """A non-deterministic engine on the same directory writes its pages under another fingerprint:
    the deterministic engines neither serve them nor lose their own (an audit found a deterministic
    engine answering from a non-deterministic one's pages, its logprobs off its own recompute's)."""
    a, _, l3_dir = engines
    other = start_server(tmp_path, *ARGS[:-1], "--disable-deterministic-inference", "--l3-dir", str(l3_dir))
    try:
        prompt = [random.Random(9).randrange(200, 20000) for _ in range(PROMPT)]
        hits = a.wait_idle()['strata_cache_hit_tokens_total{tier="l3"}']
        before = _writes(other)
        _generate(other, prompt)
        _written(other, before + PAGES)
        _, cached, _ = _generate(a, prompt)
        assert cached == 0  # not from the other engine's files: computed
        assert a.wait_idle()['strata_cache_hit_tokens_total{tier="l3"}'] == hits
    finally:
        assert stop_server(other) == 0
