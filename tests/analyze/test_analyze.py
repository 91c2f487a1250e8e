"""bin/analyze on real logs (one real server: two requests sharing a long prefix, one not; one
with the host and disk tiers: a prompt computed, hit in L1, loaded back from L2, read from L3)
and on hand-written logs (a digest mismatch; cache occupancy lines). The real logs carry the
scheduler's `cache occupancy` lines and, with L3, the cache controller's `l3 writes` lines."""

from __future__ import annotations

import io
import json
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from engine.analyze import analyze, load, main, percentile, plot, print_text
from engine.bench import cache as bench_cache
from tests.integration.conftest import ROOT, start_server, stop_server

PREFIX = list(range(100, 400))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _generate(http: str, ids: list[int]) -> int:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    r = httpx.post(f"{http}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]["cached_tokens"]


@pytest.fixture(scope="module")
def real_logs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both servers' logs: the two servers run side by side (each mostly waits on its own steps)."""
    dirs = {"plain": tmp_path_factory.mktemp("logs"), "tiers": tmp_path_factory.mktemp("tier-logs")}
    with ThreadPoolExecutor(2) as pool:
        done = [pool.submit(_plain_logs, dirs["plain"]), pool.submit(_tier_logs, dirs["tiers"])]
    for f in done:
        f.result()  # raises what the server's run raised
    return dirs


@pytest.fixture(scope="module")
def logdir(real_logs: dict[str, Path]) -> Iterator[Path]:
    yield real_logs["plain"]


def _plain_logs(d: Path) -> None:
    srv = start_server(d, "--max-total-tokens", "4096")
    try:
        cached = [_generate(srv.http, ids) for ids in (PREFIX + [5, 6], PREFIX + [7, 8], list(range(600, 640)))]
        srv.wait_idle()
    finally:
        assert stop_server(srv) == 0
    assert cached[0] == 0 and cached[1] > 0


def test_real_logs(logdir: Path) -> None:
    rep = analyze(logdir)
    assert rep.summary["count"] == 3
    assert all(r.ttft is not None and r.ttft > 0 for r in rep.requests)
    assert all(r.e2e is not None and r.e2e >= (r.ttft or 0) for r in rep.requests)
    assert all(r.queued is not None and r.received is not None for r in rep.requests)
    assert [r.tier for r in rep.requests] == ["none", "l1", "none"]
    assert rep.requests[1].cached_tokens and rep.requests[1].cached_tokens > 0
    assert set(rep.ttft_by_tier) == {"none", "l1"}
    assert rep.copies == {} and rep.l3 == {}  # tiers off
    # the scheduler's `cache occupancy` lines: L1 only (a change within a second of the last
    # line may be logged after the server stopped, so only the first line is certain)
    lines = [r for r in load(logdir) if r["event"] == "cache occupancy"]
    assert lines and all(r["proc"] == "scheduler" and r["kv_pages_total"] > 0 for r in lines)
    assert len(rep.occupancy) == len(lines) and not any("l2_pages_used" in p for p in rep.occupancy)
    assert set(rep.occupancy_summary) == {"kv_pages_used", "cache_pages"}
    assert rep.occupancy_summary["kv_pages_used"]["total"] == lines[0]["kv_pages_total"]
    assert rep.hit_rates["request_hit_rate"] == pytest.approx(1 / 3)
    assert rep.summary["ttft"]["p50"] > 0 and rep.errors == []
    tokens = rep.summary["tokens"]  # the totals of the three requests' usage
    assert tokens["prompt"] == sum(r.prompt_tokens or 0 for r in rep.requests) == 2 * (len(PREFIX) + 2) + 40
    assert tokens["completion"] == sum(r.completion_tokens or 0 for r in rep.requests) > 0
    assert tokens["cached"] == rep.requests[1].cached_tokens
    buf = io.StringIO()
    print_text(rep, out=buf)
    assert f"tokens: prompt {tokens['prompt']} ({tokens['cached']} cached)" in buf.getvalue()
    assert all(len(r.rid) > 12 and r.rid in buf.getvalue() for r in rep.requests)  # whole ids (were cut to 12)
    assert any(n.startswith("the server was stopped by SIGTERM at ") for n in rep.notes), rep.notes


def test_cli_json_and_plots(logdir: Path, tmp_path: Path) -> None:
    out = subprocess.run(
        [str(ROOT / "bin" / "analyze"), str(logdir), "--json", "--plot", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    data = json.loads(out.stdout)
    assert data["summary"]["count"] == 3 and data["summary"]["ttft"]["count"] == 3
    pngs = sorted(tmp_path.glob("*.png"))
    assert [p.name for p in pngs] == ["cache_occupancy.png", "ttft_by_tier.png", "ttft_over_time.png"]
    assert data["occupancy"] and data["occupancy_summary"]["kv_pages_used"]["total"] > 0
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in pngs)


def test_cli_paths_are_the_callers_and_plot_errors_are_one_line(logdir: Path, tmp_path: Path) -> None:
    """bin/analyze resolves relative paths in the caller's directory (it used to change into the
    repository); a --plot that cannot be written is one line and exit 1, a file is a usage error."""
    tool = str(ROOT / "bin" / "analyze")
    (tmp_path / "logs").symlink_to(logdir)
    ok = subprocess.run([tool, "logs", "--json", "--plot", "plots"], cwd=tmp_path, capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["summary"]["count"] == 3 and sorted((tmp_path / "plots").glob("*.png"))
    (tmp_path / "afile").write_text("")
    for where, code, said in (("afile", 2, "a file, not a directory"), ("afile/sub", 1, "--plot afile/sub: ")):
        bad = subprocess.run([tool, "logs", "--plot", where], cwd=tmp_path, capture_output=True, text=True,
                             timeout=120)
        assert bad.returncode == code and said in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


@pytest.fixture(scope="module")
def tier_logdir(real_logs: dict[str, Path]) -> Iterator[Path]:
    yield real_logs["tiers"]


def _tier_logs(d: Path) -> None:
    """A server with L2 and L3 and a pool just larger than one 128-token prompt: the prompt
    computed, hit in L1, loaded back from L2 after a filler evicted it, read from L3 after
    a flush (bin/bench cache's phases)."""
    pool = 128 + 64
    srv = start_server(d, "--enable-hierarchical-cache", "--max-total-tokens", str(pool), "--l3-dir", str(d / "l3"))
    try:
        prompt = list(range(1000, 1128))
        cached = [_generate(srv.http, prompt), _generate(srv.http, prompt)]
        bench_cache.wait_metric(srv.http, bench_cache.COMMITTED, 0.0, 60)
        _generate(srv.http, list(range(3000, 3000 + pool - 17)))  # evicts the prompt from L1
        cached.append(_generate(srv.http, prompt))
        bench_cache.wait_metric(srv.http, bench_cache.L3_WRITES, 0.0, 60, settle_s=1.0)
        srv.wait_idle()
        bench_cache.flush(srv.http, 60)
        cached.append(_generate(srv.http, prompt))
        srv.wait_idle()
        deadline = time.monotonic() + 30  # the workers' 'host copies' line: at most one a second
        while analyze(d).copies.get("total", {}).get("load_backs", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        assert stop_server(srv) == 0
    assert cached[0] == 0 and all(c >= 112 for c in cached[1:]), cached


def test_real_logs_with_tiers(tier_logdir: Path, tmp_path: Path) -> None:
    rep = analyze(tier_logdir)
    assert rep.summary["count"] == 5 and rep.errors == []
    # the scheduler's `admitted` lines: each cached request's tokens by the tier they came from
    assert [r.tier for r in rep.requests] == ["none", "l1", "none", "l2", "l3"]
    assert set(rep.ttft_by_tier) == {"none", "l1", "l2", "l3"}
    total = rep.copies["total"]
    assert total["backups"] >= 2 and total["load_backs"] >= 2  # from L2, and from L3 through L2
    assert total["bytes_out"] > 0 and total["backup_gbps"] > 0 and total["load_back_gbps"] > 0
    assert list(rep.copies["workers"]) == ["worker-0"]
    assert rep.l3["loads_ok"] >= 1 and rep.l3["loads_failed"] == 0
    buf = io.StringIO()
    print_text(rep, timelines=False, out=buf)
    text = buf.getvalue()
    assert "backups" in text and "load-backs" in text and "disk tier (L3)" in text
    # L3 writes: the cache controller's `l3 writes` lines, summed; every page file written once
    writes = rep.l3["writes"]
    assert writes["pages"] >= 7 and writes["bytes"] > writes["pages"] * 1000 and writes["write_s"] > 0
    assert writes["gbps"] > 0 and writes["skips"] == 0 and writes["corrupt"] == 0
    assert "disk tier (L3) writes:" in text and f"{writes['pages']} pages" in text
    # occupancy from the scheduler's `cache occupancy` lines, with L2 and L3 figures
    occ = rep.occupancy_summary
    assert {"kv_pages_used", "cache_pages", "l2_pages_used", "l3_files", "l3_bytes"} <= set(occ)
    assert 0 < occ["kv_pages_used"]["peak"] <= occ["kv_pages_used"]["total"]
    assert 0 < occ["l2_pages_used"]["peak"] <= occ["l2_pages_used"]["total"]
    assert occ["l3_files"]["last"] == writes["pages"] and occ["l3_bytes"]["last"] == writes["dir_bytes"] > 0
    assert "cache occupancy" in text and "L2 pages used" in text and "L3 bytes" in text
    assert not [n for n in rep.notes if "occupancy" in n or "l3 writes" in n]
    paths = plot(rep, tmp_path)
    assert paths[-1].name == "cache_occupancy.png" and paths[-1].read_bytes()[:8] == PNG_MAGIC


def _line(**kw: object) -> str:
    return json.dumps({"level": "info", **kw})


def test_digest_mismatch_reported_with_its_seq(tmp_path: Path) -> None:
    msg = "rank 1 diverged at or before step 17: replica 3f2a != 9c1b"
    (tmp_path / "scheduler.log").write_text(
        "\n".join(
            [
                _line(event="workers ready", proc="scheduler", timestamp="2026-01-01T00:00:00.000000Z"),
                _line(
                    event="request",
                    rid="r1",
                    prompt_tokens=8,
                    proc="scheduler",
                    timestamp="2026-01-01T00:00:00.100000Z",
                ),
                json.dumps(
                    {
                        "event": "scheduler failed",
                        "error": msg,
                        "proc": "scheduler",
                        "level": "error",
                        "exception": [{"exc_type": "DigestMismatch", "exc_value": msg}],
                        "timestamp": "2026-01-01T00:00:01.000000Z",
                    }
                ),
                "not json at all",
            ]
        )
        + "\n"
    )
    (tmp_path / "supervisor.log").write_text(
        json.dumps(
            {
                "event": "child died",
                "child": "scheduler",
                "reason": "exit code 1",
                "proc": "supervisor",
                "level": "error",
                "timestamp": "2026-01-01T00:00:01.500000Z",
            }
        )
        + "\n"
    )
    rep = analyze(tmp_path)
    assert [e["event"] for e in rep.errors] == ["scheduler failed", "child died"]
    assert rep.errors[0]["seq"] == 17 and rep.first_error_seq == 17
    assert "DigestMismatch" in rep.errors[0]["detail"]
    assert rep.errors[1]["detail"] == "child died | process scheduler | exit code 1"  # which process died
    assert rep.summary["count"] == 0  # queued, never finished: listed as unfinished, not hidden
    assert rep.unfinished == [{"rid": "r1", "first_seen": 0.1, "last_seen": 0.1, "last_event": "request",
                               "last_proc": "scheduler"}]
    buf = io.StringIO()
    print_text(rep, out=buf)
    assert "errors: 2 (first seq mentioned: 17)" in buf.getvalue() and "seq=17" in buf.getvalue()
    assert "unfinished requests: 1" in buf.getvalue() and "r1: first seen 0.100 s" in buf.getvalue()
    assert main([str(tmp_path), "--json"]) == 0


def test_an_empty_log_dir_says_so(tmp_path: Path) -> None:
    rep = analyze(tmp_path)
    assert rep.notes == ["no log lines here: is this a --log-dir of bin/serve?"] and rep.unfinished == []
    with pytest.raises(SystemExit) as exit_:  # the command line: a usage error, not an empty summary and 0
        main([str(tmp_path)])
    assert exit_.value.code == 2


def test_cache_occupancy_plot(tmp_path: Path) -> None:
    """The scheduler's `cache occupancy` lines give a summary and a third PNG; the cache
    controller's `l3 writes` lines are summed."""
    logs = tmp_path / "logs"
    logs.mkdir()
    lines = [
        _line(event="cache occupancy", proc="scheduler", kv_pages_used=u, kv_pages_total=20, cache_pages=u // 2,
              l2_pages_used=2 * u, l2_pages_total=40, l3_files=u, l3_bytes=u * 1000,
              timestamp=f"2026-01-01T00:00:0{i}.000000Z")  # fmt: skip
        for i, u in enumerate((0, 5, 20, 12))
    ]
    (logs / "scheduler.log").write_text("\n".join(lines) + "\n")
    writes = [
        _line(event="l3 writes", proc="cache", pages=n, bytes=n * 10**6, write_s=n / 1000, existed=0, skips=1,
              corrupt=0, files=f, dir_bytes=f * 10**6, timestamp=f"2026-01-01T00:00:0{i}.500000Z")  # fmt: skip
        for i, (n, f) in enumerate(((3, 3), (5, 8)))
    ]
    (logs / "cache.log").write_text("\n".join(writes) + "\n")
    rep = analyze(logs)
    assert [p["kv_pages_used"] for p in rep.occupancy] == [0, 5, 20, 12]
    assert rep.occupancy[-1]["t"] == pytest.approx(3.0) and rep.occupancy[-1]["l2_pages_used"] == 24
    occ = rep.occupancy_summary
    assert occ["kv_pages_used"] == {"peak": 20, "last": 12, "total": 20}
    assert occ["l2_pages_used"] == {"peak": 40, "last": 24, "total": 40}
    assert occ["l3_bytes"] == {"peak": 20000, "last": 12000}
    w = rep.l3["writes"]
    assert (w["pages"], w["bytes"], w["skips"], w["lines"], w["files"]) == (8, 8 * 10**6, 2, 2, 8)
    assert w["gbps"] == pytest.approx(1.0) and rep.l3["loads"] == 0 and "l3 writes" not in rep.host_tier
    buf = io.StringIO()
    print_text(rep, out=buf)
    text = buf.getvalue()
    assert "disk tier (L3) writes: 8 pages, 0.008 GB in 0.008 s (1.00 GB/s)" in text
    assert "cache occupancy (4 samples)" in text
    paths = plot(rep, tmp_path / "png")
    assert [p.name for p in paths][-1] == "cache_occupancy.png"
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in paths)


def test_percentile() -> None:
    assert percentile([], 50) is None
    vals = [float(v) for v in range(1, 101)]
    assert (percentile(vals, 50), percentile(vals, 90), percentile(vals, 99)) == (50.0, 90.0, 99.0)
    assert percentile([3.0], 99) == 3.0


def test_a_reused_rid_is_two_requests_and_rejections_are_not_in_flight(tmp_path: Path) -> None:
    """An audit: requests were keyed by rid, so a rid reused after its abort (as HTTP and the SDK
    allow) merged two requests into one row; and requests rejected with a 4xx, a batch's own rid
    and a request failed by a server's death were listed as in flight when the logs ended."""
    def at(ms: int) -> str:
        return f"2026-01-01T00:00:{ms // 1000:02d}.{ms % 1000:03d}000Z"

    tok = [
        _line(event="sdk request", rid="a", prompt_tokens=8, proc="tokenizer", timestamp=at(0)),
        _line(event="request finished", rid="a", finish_reason="cancelled", prompt_tokens=8, completion_tokens=3,
              cached_tokens=0, ttft=0.05, proc="tokenizer", timestamp=at(100)),
        _line(event="sdk request", rid="a", prompt_tokens=2, proc="tokenizer", timestamp=at(200)),
        _line(event="request finished", rid="a", finish_reason="stop", prompt_tokens=2, completion_tokens=2,
              cached_tokens=0, ttft=0.02, proc="tokenizer", timestamp=at(300)),
        _line(event="request rejected", rid="b", status=400, proc="tokenizer", timestamp=at(400)),
        _line(event="sdk request rejected", rid="c", status=413, proc="tokenizer", timestamp=at(410)),
        _line(event="generate batch", rid="d", prompts=1, proc="tokenizer", timestamp=at(500)),
        _line(event="generate request", rid="d-0", prompt_tokens=4, proc="tokenizer", timestamp=at(501)),
        _line(event="request finished", rid="d-0", finish_reason="length", prompt_tokens=4, completion_tokens=1,
              cached_tokens=0, ttft=0.01, proc="tokenizer", timestamp=at(600)),
        _line(event="sdk request failed", rid="e", status=503, proc="tokenizer", timestamp=at(700)),
        _line(event="chat request", rid="g", n=2, proc="tokenizer", timestamp=at(710)),  # n = 2: g-0 and g-1 run
        *[_line(event="request finished", rid=f"g-{i}", finish_reason="length", prompt_tokens=4, completion_tokens=1,
                cached_tokens=0, ttft=0.01, proc="tokenizer", timestamp=at(720 + i)) for i in range(2)],
        _line(event="chat request", rid="f", prompt_tokens=5, proc="tokenizer", timestamp=at(800)),
        # an audit: an /abort_request call's own line listed it as an unfinished request
        _line(event="abort asked", rid="h", target="f", abort_all=False, aborted=1, proc="tokenizer",
              timestamp=at(810)),
    ]
    sched = [_line(event="request", rid="a", prompt_tokens=2, proc="scheduler", timestamp=at(210)),
             _line(event="request", rid="a", prompt_tokens=2, proc="scheduler", timestamp=at(310))]  # a late line
    (tmp_path / "tokenizer.log").write_text("\n".join(tok) + "\n")
    (tmp_path / "scheduler.log").write_text("\n".join(sched) + "\n")
    rep = analyze(tmp_path)
    assert [(r.rid, r.prompt_tokens, r.completion_tokens) for r in rep.requests] == [
        ("a", 8, 3), ("a", 2, 2), ("d-0", 4, 1), ("g-0", 4, 1), ("g-1", 4, 1)]
    assert [r.queued for r in rep.requests][:2] == [None, pytest.approx(0.21)]
    assert rep.rejected == {"400": 1, "413": 1}
    assert [u["rid"] for u in rep.unfinished] == ["f"]  # the one request in flight
    buf = io.StringIO()
    print_text(rep, out=buf)
    assert "rejected requests: 2 (by HTTP status: 400: 1, 413: 1)" in buf.getvalue()
