"""bin/analyze on real logs (one real server: two requests sharing a long prefix, one not) and
on a hand-written log with a digest mismatch."""

from __future__ import annotations

import io
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.analyze import analyze, main, percentile, print_text
from tests.integration.conftest import ROOT, start_server, stop_server

PREFIX = list(range(100, 400))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _generate(http: str, ids: list[int]) -> int:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    r = httpx.post(f"{http}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]["cached_tokens"]


@pytest.fixture(scope="module")
def logdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    d = tmp_path_factory.mktemp("logs")
    srv = start_server(d, "--max-total-tokens", "4096")
    try:
        cached = [_generate(srv.http, ids) for ids in (PREFIX + [5, 6], PREFIX + [7, 8], list(range(600, 640)))]
        srv.wait_idle()
    finally:
        assert stop_server(srv) == 0
    assert cached[0] == 0 and cached[1] > 0
    yield d


def test_real_logs(logdir: Path) -> None:
    rep = analyze(logdir)
    assert rep.summary["count"] == 3
    assert all(r.ttft is not None and r.ttft > 0 for r in rep.requests)
    assert all(r.e2e is not None and r.e2e >= (r.ttft or 0) for r in rep.requests)
    assert all(r.queued is not None and r.received is not None for r in rep.requests)
    assert [r.tier for r in rep.requests] == ["none", "device", "none"]
    assert rep.requests[1].cached_tokens and rep.requests[1].cached_tokens > 0
    assert set(rep.ttft_by_tier) == {"none", "device"}
    assert rep.hit_rates["request_hit_rate"] == pytest.approx(1 / 3)
    assert rep.summary["ttft"]["p50"] > 0 and rep.errors == []


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
    assert [p.name for p in pngs] == ["ttft_by_tier.png", "ttft_over_time.png"]
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in pngs)


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
    assert rep.summary["count"] == 0  # queued, never finished
    buf = io.StringIO()
    print_text(rep, out=buf)
    assert "errors: 2 (first seq mentioned: 17)" in buf.getvalue() and "seq=17" in buf.getvalue()
    assert main([str(tmp_path), "--json"]) == 0


def test_percentile() -> None:
    assert percentile([], 50) is None
    vals = [float(v) for v in range(1, 101)]
    assert (percentile(vals, 50), percentile(vals, 90), percentile(vals, 99)) == (50.0, 90.0, 99.0)
    assert percentile([3.0], 99) == 3.0
