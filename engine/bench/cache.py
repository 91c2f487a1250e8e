"""bin/bench cache: time to first token of one long prompt served by recompute, L1 (the
device prefix cache), L2 (the host tier) and L3 (the disk tier), side by side, on one
`bin/serve` (issue 10).

    bin/bench cache                                  # CPU: the default model, 1024-token prompt
    bin/bench cache --model configs/llama-3.1-8b --load-format dummy --prompt-len 32768 \\
        --l3-dir /tmp/strata-l3

The server runs with --enable-hierarchical-cache and a device pool just larger than the
prompt (--max-total-tokens = prompt + --slack-tokens), so one filler prompt that needs
almost the whole pool pushes the prompt out of L1, while L2 (--hicache-ratio x L1) keeps
it. Each repetition takes a fresh random prompt (so recompute is real) and, on an empty
cache (POST /flush_cache):

  recompute  the prompt, never seen (max_new_tokens 1, streamed: TTFT = first token);
  L1         the same prompt again;
  L2         after the prompt's backup committed (strata_l2_backups_total{result=committed}
             grew) and a filler prompt evicted it from L1 (and its own backup committed
             too, so the prompt's load-back waits for no commit), the same prompt again;
  L3         with --l3-dir: after its L3 files were written (strata_l3_writes_total grew and
             settled) and POST /flush_cache emptied L1 and L2, the same prompt again.

After each phase the server is let go idle and `strata_cache_hit_tokens_total{tier}` is read:
the phase's hit tokens per tier are recorded, and a phase served by another tier than the
intended one (or recompute with any hit) is an error of the run, listed in the output and
the JSON, never silently averaged (its TTFT is left out of the median). tier="device" is
read as l1 (servers before the l1/l2/l3 labels).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

PHASES = ("recompute", "l1", "l2", "l3")
TIERS = ("l1", "l2", "l3")
HIT = "strata_cache_hit_tokens_total"
COMMITTED = 'strata_l2_backups_total{result="committed"}'
L3_WRITES = "strata_l3_writes_total"
MAJORITY = 0.9  # the intended tier must serve at least this share of a phase's hit tokens
TIMEOUT_S = 3600.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The mode's own flags (bin/bench adds --model, --load-format, --seed, --server-args, --out)."""
    p.add_argument("--prompt-len", type=int, default=1024, help="tokens of the long prompt (GPU: 32768)")
    p.add_argument("--repeat", type=int, default=3, help="repetitions, each with a fresh prompt; medians reported")
    p.add_argument("--warmup", type=int, default=1, help="untimed recompute + L1 rounds first (fresh prompts)")
    p.add_argument(
        "--slack-tokens",
        type=int,
        default=64,
        help="device pool = prompt + this many tokens (a few pages: the prompt fits, a filler evicts it)",
    )
    p.add_argument("--hicache-ratio", type=float, default=2.0, help="L2 size as a multiple of the device pool")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page of the server")
    p.add_argument("--l3-dir", default=None, help="also measure L3: the server's --l3-dir (default: no L3 phase)")
    p.add_argument("--l3-size", type=float, default=None, help="the server's --l3-size in GB (default: its own)")
    p.add_argument(
        "--phase-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for a commit, the L3 files or an idle server",
    )


def check(args: argparse.Namespace) -> str | None:
    if args.repeat < 1 or args.warmup < 0:
        return "--repeat must be >= 1 and --warmup >= 0"
    if args.page_size < 1 or args.slack_tokens < 2 * args.page_size:
        return "--slack-tokens must be at least two pages"
    if args.prompt_len < 4 * args.page_size:
        return "--prompt-len must be at least four pages"
    return None


def cp_size(args: argparse.Namespace) -> int:
    """The server's --cp-size (its pages round robin over that many ranks, each a pool of its own)."""
    flags = shlex.split(args.server_args)
    return int(flags[flags.index("--cp-size") + 1]) if "--cp-size" in flags else 1


def pool_tokens(args: argparse.Namespace) -> int:
    """A rank's device pool (--max-total-tokens): over the cp ranks the prompt and its output token
    fit, with a few pages to spare."""
    n = -(-(args.prompt_len + args.slack_tokens) // cp_size(args))
    return -(-n // args.page_size) * args.page_size


def filler_len(args: argparse.Namespace) -> int:
    """A prompt that needs all but one page of every rank's pool: nothing else stays in L1."""
    cp = cp_size(args)
    return cp * (pool_tokens(args) - args.page_size) - 1


def server_args(args: argparse.Namespace) -> list[str]:
    out = [
        "--enable-hierarchical-cache",
        "--max-total-tokens", str(pool_tokens(args)),
        "--hicache-ratio", str(args.hicache_ratio),
        "--page-size", str(args.page_size),
        "--max-running-requests", "4",
    ]  # fmt: skip
    if args.l3_dir:
        out += ["--l3-dir", args.l3_dir]
        if args.l3_size is not None:
            out += ["--l3-size", str(args.l3_size)]
    return out + shlex.split(args.server_args)  # the user's flags last: they win


# ---------------------------------------------------------------- talking to the server


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


def hits(m: dict[str, float]) -> dict[str, float]:
    """Hit tokens per tier; tier="device" counts as l1."""
    out = {t: m.get(f'{HIT}{{tier="{t}"}}', 0.0) for t in TIERS}
    out["l1"] += m.get(f'{HIT}{{tier="device"}}', 0.0)
    return out


def wait_idle(url: str, timeout: float, every_s: float = 0.3) -> dict[str, float]:
    """The metrics once nothing runs or waits and two reads every_s apart agree on every strata_
    metric: the scheduler's last stats (sent at most every 0.1 s) and the idle leak check have
    arrived (one fixed sleep after idle could read them early on a busy core)."""
    deadline = time.monotonic() + timeout
    last: dict[str, float] | None = None
    while True:
        m = metrics(url)
        now = {k: v for k, v in m.items() if k.startswith("strata_")}
        idle = m.get("strata_running_requests") == 0 and m.get("strata_waiting_requests") == 0
        if idle and now == last:
            return m
        last = now if idle else None
        if time.monotonic() > deadline:
            raise TimeoutError(f"server not idle and settled after {timeout:.0f} s")
        time.sleep(every_s if idle else 0.05)


def wait_metric(url: str, name: str, above: float, timeout: float, settle_s: float = 0.0) -> float:
    """Poll /metrics until `name` exceeds `above` (and, with settle_s, stopped growing for that
    long); returns its value."""
    deadline = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        value = metrics(url).get(name, 0.0)
        if value != last:
            last, since = value, time.monotonic()
        if value > above and time.monotonic() - since >= settle_s:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"{name} did not grow past {above} in {timeout:.0f} s (last {last})")


def flush(url: str, timeout: float) -> None:
    """POST /flush_cache until it is accepted (409 while something runs or is backed up)."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.post(f"{url}/flush_cache", timeout=60)
        if r.status_code == 200:
            return
        if r.status_code != 409 or time.monotonic() > deadline:
            raise RuntimeError(f"POST /flush_cache: HTTP {r.status_code} {r.text[:200]}")
        time.sleep(0.1)


def stream_events(url: str, ids: list[int], new: int, ignore_eos: bool = False) -> Iterator[tuple[float, dict]]:
    """(seconds since the send, event) for each event of one streamed greedy /generate request."""
    params = {"max_new_tokens": new, "temperature": 0.0} | ({"ignore_eos": True} if ignore_eos else {})
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/generate", json={"input_ids": ids, "sampling_params": params, "stream": True},
                      timeout=TIMEOUT_S) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"/generate: HTTP {resp.status_code} {resp.read()[:200]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            data = json.loads(line[5:])
            if "error" in data:
                raise RuntimeError(f"/generate stream error: {str(data)[:300]}")
            yield time.perf_counter() - t0, data


def ttft(url: str, ids: list[int]) -> tuple[float, int | None, int | None]:
    """Time to the first streamed token of one request (max_new_tokens 1), the cached_tokens its
    response reports, and the token."""
    first, cached, token = None, None, None
    for t, data in stream_events(url, ids, 1):
        meta = data.get("meta_info", {})
        if first is None and meta.get("completion_tokens", 0) >= 1:
            first = t
        cached = meta.get("cached_tokens", cached)
        token = (data.get("output_ids") or [token])[-1]
    if first is None:
        raise RuntimeError("/generate streamed no token")
    return first, cached, token


# ---------------------------------------------------------------- the measurement


class Run:
    def __init__(self, url: str, args: argparse.Namespace, vocab: int) -> None:
        self.url, self.args = url, args
        self.rng = random.Random(args.seed)
        self.hi = max(min(vocab, 32000) - 1, 200)
        self.timeout = args.phase_timeout

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(100, self.hi) for _ in range(n)]

    def phase(self, name: str, ids: list[int]) -> dict[str, Any]:
        before = hits(wait_idle(self.url, self.timeout))
        seconds, cached, token = ttft(self.url, ids)
        after = hits(wait_idle(self.url, self.timeout))
        got = {t: int(after[t] - before[t]) for t in TIERS}
        return {"phase": name, "ttft_s": seconds, "cached_tokens": cached, "hit_tokens": got, "token": token,
                "error": verdict(name, got)}  # fmt: skip

    def wait_l3(self, writes: float, files: int) -> None:
        """Until the prompt's page files are on disk: strata_l3_writes_total grew (the metric
        can lag: the controller sends its L3 stats rate-limited) or the directory holds at
        least the prompt's pages more than before, then nothing changed for a second."""
        need = self.args.prompt_len // self.args.page_size - 1
        deadline = time.monotonic() + self.timeout
        last, since = None, time.monotonic()
        while time.monotonic() < deadline:
            now = (metrics(self.url).get(L3_WRITES, 0.0), l3_files(self.args.l3_dir))
            if now != last:
                last, since = now, time.monotonic()
            if (now[0] > writes or now[1] >= files + need) and time.monotonic() - since >= 1.0:
                return
            time.sleep(0.1)
        raise TimeoutError(f"no L3 writes in {self.timeout:.0f} s (writes, files: {last}; before {writes}, {files})")

    def repetition(self, timed: bool = True) -> list[dict[str, Any]]:
        a, url = self.args, self.url
        flush(url, self.timeout)
        ids = self.prompt(a.prompt_len)
        m = metrics(url)
        committed, writes, files = m.get(COMMITTED, 0.0), m.get(L3_WRITES, 0.0), l3_files(a.l3_dir)
        out = [self.phase("recompute", ids), self.phase("l1", ids)]
        if not timed:
            return out
        wait_metric(url, COMMITTED, committed, self.timeout)  # the prompt is in L2
        committed = metrics(url).get(COMMITTED, 0.0)
        self.phase("filler", self.prompt(filler_len(a)))  # evicts it from L1
        wait_metric(url, COMMITTED, committed, self.timeout)  # its backup too: no commit is awaited below
        out.append(self.phase("l2", ids))
        if a.l3_dir:
            try:
                self.wait_l3(writes, files)
            except TimeoutError as exc:
                out.append({"phase": "l3", "ttft_s": None, "cached_tokens": None,
                            "hit_tokens": dict.fromkeys(TIERS, 0), "error": f"l3: {exc}"})  # fmt: skip
                return out
            wait_idle(url, self.timeout)
            flush(url, self.timeout)  # L1 and L2 emptied; the L3 files stay
            out.append(self.phase("l3", ids))
        return out


def l3_files(d: str | None) -> int:
    """Page files (*.kv) in a local L3 directory (0 without one)."""
    return sum(1 for _ in Path(d).rglob("*.kv")) if d and Path(d).is_dir() else 0


def verdict(phase: str, got: dict[str, int]) -> str | None:
    """None when the phase was served by its tier; else what went wrong. The intended tier
    must have served the prompt's hits, any other at most (1 - MAJORITY) of that (an L3 read
    goes through L2: in the L3 phase the L2 count may match it)."""
    total = sum(got.values())
    if phase in ("recompute", "filler"):
        return None if total == 0 else f"{phase}: {total} prompt tokens were cache hits ({got})"
    if total == 0:
        return f"{phase}: no cache hit at all (recomputed)"
    others = [t for t in TIERS if t != phase and not (phase == "l3" and t == "l2")]
    if got[phase] == 0 or any(got[t] > (1 - MAJORITY) * got[phase] for t in others):
        return f"{phase}: served by another tier: hit tokens {got}"
    return None


def measure(url: str, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    run = Run(url, args, vocab)
    for _ in range(args.warmup):
        run.repetition(timed=False)
    reps = []
    for i in range(args.repeat):
        phases = run.repetition()
        reps.append(phases)
        print(
            f"repetition {i + 1}/{args.repeat}: "
            + ", ".join(f"{p['phase']} {_ms(p['ttft_s'])} ms{' (ERROR)' if p['error'] else ''}" for p in phases),
            flush=True,
        )
    return figures(reps, args)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def figures(reps: list[list[dict[str, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    phases = [p for p in PHASES if p != "l3" or args.l3_dir]
    per: dict[str, dict[str, Any]] = {}
    errors: list[str] = []
    for name in phases:
        runs = [p for rep in reps for p in rep if p["phase"] == name]
        ok = [p["ttft_s"] for p in runs if p["error"] is None]
        errors += [f"repetition {i + 1}: {p['error']}" for i, p in enumerate(runs) if p["error"]]
        per[name] = {
            "ttft_s": [p["ttft_s"] for p in runs],
            "median_ttft_s": statistics.median(ok) if ok else None,
            "valid": len(ok),
            "hit_tokens": [p["hit_tokens"] for p in runs],
            "cached_tokens": [p["cached_tokens"] for p in runs],
            "tokens": [p.get("token") for p in runs],
        }
    base = per["recompute"]["median_ttft_s"]
    for name in phases:
        med = per[name]["median_ttft_s"]
        per[name]["speedup"] = base / med if base and med else None
    return {
        "prompt_len": args.prompt_len,
        "pool_tokens": pool_tokens(args),
        "filler_len": filler_len(args),
        "repeat": args.repeat,
        "cp_size": cp_size(args),
        "phases": per,
        # each phase's token is the fresh prompt's (recompute): bits equal only where the arithmetic
        # allows (float32 or deterministic inference); in bf16 a near tie may legitimately flip
        "tokens_equal_fresh": all(per[n]["tokens"] == per["recompute"]["tokens"] for n in phases),
        "tier_errors": errors,
        "completed": sum(per[n]["valid"] for n in phases),
    }


def table(f: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    header = ["served by", "median TTFT ms", "speedup", "valid", "hit tokens l1/l2/l3 (per repetition)"]
    rows = []
    for name, p in f["phases"].items():
        med = p["median_ttft_s"]
        hit = "; ".join(f"{h['l1']}/{h['l2']}/{h['l3']}" for h in p["hit_tokens"])
        rows.append([name, None if med is None else med * 1000, p["speedup"], f"{p['valid']}/{len(p['ttft_s'])}", hit])
    return header, rows
