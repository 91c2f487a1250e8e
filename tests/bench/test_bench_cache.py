"""bin/bench cache on CPU (the default model, a 256-token prompt, one repetition, L3 in a
temp dir): every phase is served by its tier, the numbers are sane, the JSON record holds them. No timing
assertions (a shared 2-core machine)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine.bench import cache
from engine.bench.cli import main


def test_bench_cache_cpu(tmp_path: Path) -> None:
    out = tmp_path / "cache.json"
    l3 = tmp_path / "l3"
    flags = ["--prompt-len", "256", "--repeat", "1", "--warmup", "0", "--l3-dir", str(l3), "--out", str(out)]
    code = main(["cache", *flags])
    record = json.loads(out.read_text())
    f = record["figures"]
    assert code == 0, f["tier_errors"]
    assert record["mode"] == "cache" and f["tier_errors"] == [] and f["prompt_len"] == 256
    phases = f["phases"]
    assert set(phases) == {"recompute", "l1", "l2", "l3"}
    assert phases["recompute"]["hit_tokens"] == [{"l1": 0, "l2": 0, "l3": 0}]
    assert cache.l3_files(str(l3)) >= 256 // 16 - 1
    for tier in ("l1", "l2", "l3"):
        (hit,) = phases[tier]["hit_tokens"]
        assert hit[tier] >= 256 - 2 * 16 and sum(hit.values()) == hit[tier], (tier, hit)
        assert phases[tier]["cached_tokens"][0] == hit[tier]
    for p in phases.values():
        assert p["valid"] == 1 and 0 < p["median_ttft_s"] < 60 and p["speedup"] > 0


def test_verdict_and_sizes() -> None:
    assert cache.verdict("recompute", {"l1": 0, "l2": 0, "l3": 0}) is None
    assert cache.verdict("recompute", {"l1": 16, "l2": 0, "l3": 0})
    assert cache.verdict("l1", {"l1": 240, "l2": 0, "l3": 0}) is None
    assert "another tier" in cache.verdict("l2", {"l1": 240, "l2": 0, "l3": 0})
    assert cache.verdict("l2", {"l1": 16, "l2": 224, "l3": 0}) is None  # a first page left in L1
    assert "no cache hit" in cache.verdict("l2", {"l1": 0, "l2": 0, "l3": 0})
    assert cache.verdict("l3", {"l1": 0, "l2": 240, "l3": 240}) is None  # an L3 read goes through L2
    assert cache.verdict("l3", {"l1": 0, "l2": 240, "l3": 0})
    args = argparse.Namespace(prompt_len=1000, slack_tokens=64, page_size=16, l3_dir="/x", l3_size=2.0,
                              hicache_ratio=2.0, server_args="--log-dir /tmp/l")  # fmt: skip
    assert cache.pool_tokens(args) == 1072 and cache.filler_len(args) == 1072 - 17
    flags = cache.server_args(args)
    assert flags[-2:] == ["--log-dir", "/tmp/l"] and "--l3-dir" in flags and "--l3-size" in flags
