"""`bin/bench cpu`: the served CPU path against transformers, same weights, same batch, same run.

Both sides stay loaded for the whole run: transformers in a child process
(engine/bench/hf_baseline.py: greedy `generate`, one forward pass), bin/serve started here.
The throughput batch runs in `--rounds` rounds that alternate the two sides, each round with
fresh seeded prompts (no prefix-cache hit carries over), and the figures are the medians over
rounds: a shared VM's speed drifts by tens of percent within a minute, which one sequential
run of each side turns into a ratio of anything. Then the long prompt once on each side (time
to first token against one forward pass), then the worker's resident memory.

Both sides get one untimed warm-up first. Throughput counts output tokens over the wall time
of the whole batch, prefill included, on both sides. The machine's load average is recorded
at start and end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from engine.bench import launch, workload
from engine.bench.hardware import ROOT
from engine.bench.workload import BenchRequest

GIB = 2**30


def add_arguments(p: argparse.ArgumentParser) -> None:
    flags = [
        ("--batch", 16, "concurrent requests of the throughput run"),
        ("--input-len", 128, "prompt tokens per request of the throughput run"),
        ("--output-len", 64, "output tokens per request, greedy, no EOS stop"),
        ("--long-prompt-len", 8191, "prompt tokens of the time-to-first-token run; 0 skips it"),
        ("--rounds", 3, "throughput rounds, alternating transformers and Strata; medians reported"),
    ]
    for flag, default, what in flags:
        p.add_argument(flag, type=int, default=default, help=f"{what} (default: {default})")
    p.add_argument("--hf-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="transformers' dtype: float32 (its default for this checkpoint) or bfloat16, the same "
                   "precision as --server-args '--dtype bfloat16' (default: float32)")


def check(args: argparse.Namespace) -> str | None:
    """A problem with the cpu mode's arguments, or None."""
    checks = [
        (min(args.batch, args.input_len, args.output_len, args.rounds) >= 1,
         "--batch/--input-len/--output-len/--rounds >= 1"),
        (args.long_prompt_len >= 0, "--long-prompt-len must be >= 0"),
        (args.load_format != "dummy", "cpu mode compares with transformers, which needs the weights (no dummy)"),
    ]
    return next((problem for ok, problem in checks if not ok), None)


def workload_of(args: argparse.Namespace, vocab: int, round_: int = 0) -> tuple[list[BenchRequest], list[int]]:
    """A round's seeded batch, and the long prompt (random ids: no shared prefix, no cache hits)."""
    reqs = workload.random_requests(
        args.batch, (args.input_len, args.input_len), (args.output_len, args.output_len), vocab,
        args.seed + 1000 * round_,
    )
    rng = np.random.default_rng(args.seed + 1)
    return reqs, rng.integers(0, vocab, size=args.long_prompt_len).tolist()


class Transformers:
    """The transformers child process (engine/bench/hf_baseline.py), one JSON line per call."""

    def __init__(self, model_dir: Path, dtype: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine.bench.hf_baseline", str(model_dir), dtype],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self.threads = self._reply()["threads"]

    def _reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the transformers baseline exited (status {self.proc.wait()})")
        return json.loads(line)

    def _call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def generate(self, reqs: list[BenchRequest], output_len: int) -> tuple[float, list[list[int]]]:
        out = self._call(op="generate", prompts=[r.prompt for r in reqs], output_len=output_len)
        return out["seconds"], out["ids"]

    def forward(self, prompt: list[int]) -> tuple[float, int]:
        out = self._call(op="forward", prompt=prompt)
        return out["seconds"], out["next_id"]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # its command loop ends
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextmanager
def ticker(desc: str) -> Iterator[None]:
    """A progress line with the elapsed time while a single long call runs."""
    stop = threading.Event()
    with tqdm(desc=desc, bar_format="{desc}: {elapsed}") as bar:

        def tick() -> None:
            while not stop.wait(0.5):
                bar.refresh()

        thread = threading.Thread(target=tick, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


async def _batch(addr: str, reqs: list[BenchRequest]) -> list[list[int]]:
    from engine.bench.sdk_client import SdkBatchClient

    async with SdkBatchClient(addr) as client:
        chunks = await asyncio.gather(*(
            client.generate(r.prompt, max_new_tokens=r.output_len, temperature=0.0, ignore_eos=True) for r in reqs
        ))
    return [list(c.token_ids) for c in chunks]


def timed_batch(addr: str, reqs: list[BenchRequest], desc: str) -> tuple[float, list[list[int]]]:
    """Wall seconds for the whole batch at once over the SDK, and each request's output ids."""
    with ticker(desc):
        t0 = time.perf_counter()
        ids = asyncio.run(_batch(addr, reqs))
        return time.perf_counter() - t0, ids


def worker_memory(supervisor_pid: int | None) -> dict[str, float | None]:
    """The worker process's resident and peak resident memory in GiB (psutil; VmHWM on Linux)."""
    import psutil

    if supervisor_pid is None:
        return {"worker_rss_gib": None, "worker_peak_rss_gib": None}
    kids = psutil.Process(supervisor_pid).children(recursive=True)
    worker = next(p for p in kids if "procs.worker" in " ".join(p.cmdline()))
    peak = None
    status = Path(f"/proc/{worker.pid}/status")
    if status.is_file():
        hwm = next((ln for ln in status.read_text().splitlines() if ln.startswith("VmHWM:")), None)
        peak = int(hwm.split()[1]) * 1024 / GIB if hwm else None
    return {"worker_rss_gib": worker.memory_info().rss / GIB, "worker_peak_rss_gib": peak}


def measure(args: argparse.Namespace, model_dir: Path, vocab: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both sides' timings: `rounds` alternating throughput rounds, then the long prompt."""
    hf_side: dict[str, Any] = {"generate_s": [], "generate_ids": []}
    ours: dict[str, Any] = {"served_s": [], "served_ids": []}
    hf = Transformers(model_dir, args.hf_dtype)
    try:
        hf_side["threads"] = hf.threads
        with launch.endpoints(None, None, args.model, args.load_format, shlex.split(args.server_args)) as ep:
            warm, long_prompt = workload_of(args, vocab, round_=args.rounds)  # a batch no round uses
            timed_batch(ep.sdk, [BenchRequest(r.prompt[:8], 2) for r in warm[:2]], "strata warm-up")
            for i in range(args.rounds):
                reqs, _ = workload_of(args, vocab, round_=i)
                secs, ids = hf.generate(reqs, args.output_len)
                hf_side["generate_s"].append(secs)
                hf_side["generate_ids"].append(ids)
                secs, ids = timed_batch(ep.sdk, reqs, f"strata {len(reqs)}x{args.output_len} ({i + 1}/{args.rounds})")
                ours["served_s"].append(secs)
                ours["served_ids"].append(ids)
            if long_prompt:
                hf_side["forward_s"], hf_side["forward_next_id"] = hf.forward(long_prompt)
                desc = f"strata {len(long_prompt)}-token prompt"
                ours["ttft_s"], ids = timed_batch(ep.sdk, [BenchRequest(long_prompt, 1)], desc)
                ours["ttft_next_id"] = ids[0][0] if ids[0] else None
            ours.update(worker_memory(ep.pid))
    finally:
        hf.close()
    return hf_side, ours


def figures(args: argparse.Namespace, hf: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    """Medians over rounds (each side's seconds per round, in `hf["generate_s"]` and
    `ours["served_s"]`), the throughput ratio of each round and their median, and the rows
    whose tokens equal transformers'."""
    tokens = args.batch * args.output_len
    hf_s, our_s = statistics.median(hf["generate_s"]), statistics.median(ours["served_s"])
    ratios = [h / o for h, o in zip(hf["generate_s"], ours["served_s"], strict=True)]
    same = sum(a == b for hf_ids, our_ids in zip(hf["generate_ids"], ours["served_ids"], strict=True)
               for a, b in zip(hf_ids, our_ids, strict=True))
    f: dict[str, Any] = {
        "rounds": len(ours["served_s"]),
        "completed": sum(len(ids) for ids in ours["served_ids"]),
        "output_tokens": tokens,
        "hf_threads": hf["threads"],
        "hf_generate_s": hf_s,
        "hf_generate_s_rounds": hf["generate_s"],
        "hf_output_tok_s": tokens / hf_s,
        "served_s": our_s,
        "served_s_rounds": ours["served_s"],
        "served_output_tok_s": tokens / our_s,
        # paired: each round's two sides ran back to back, so the median ratio of rounds is what
        # drift disturbs least (a ratio of medians pairs a fast round of one side with a slow one)
        "throughput_ratio": statistics.median(ratios),
        "throughput_ratio_rounds": ratios,
        "rows_equal_to_hf": same,
        "worker_rss_gib": ours["worker_rss_gib"],
        "worker_peak_rss_gib": ours["worker_peak_rss_gib"],
    }
    if "ttft_s" in ours:
        f.update({
            "long_prompt_tokens": args.long_prompt_len,
            "hf_forward_s": hf["forward_s"],
            "served_ttft_s": ours["ttft_s"],
            "ttft_ratio": ours["ttft_s"] / hf["forward_s"],
            "long_next_token_equal": ours["ttft_next_id"] == hf["forward_next_id"],
        })
    return f


def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = workload.resolve_model_dir(args.model)
    load_start = os.getloadavg()
    hf, ours = measure(args, model_dir, workload.vocab_size(model_dir))
    return {**figures(args, hf, ours), "loadavg_start": list(load_start), "loadavg_end": list(os.getloadavg())}


def table_rows(f: dict[str, Any]) -> list[tuple[str, Any]]:
    rows = [
        ("transformers threads", f["hf_threads"]),
        ("Rounds (alternating; medians below)", f["rounds"]),
        ("transformers generate (s)", f["hf_generate_s"]),
        ("transformers output tok/s", f["hf_output_tok_s"]),
        ("Strata served (s)", f["served_s"]),
        ("Strata output tok/s", f["served_output_tok_s"]),
        ("Throughput ratio, median of rounds", f["throughput_ratio"]),
        ("Ratio by round", " ".join(f"{r:.2f}" for r in f["throughput_ratio_rounds"])),
        ("Rows with tokens equal to transformers", f"{f['rows_equal_to_hf']} / {f['completed']}"),
    ]
    if "ttft_ratio" in f:
        rows += [
            (f"transformers forward, {f['long_prompt_tokens']} tokens (s)", f["hf_forward_s"]),
            ("Strata time to first token (s)", f["served_ttft_s"]),
            ("TTFT ratio (Strata / transformers)", f["ttft_ratio"]),
            ("Next token equal", f["long_next_token_equal"]),
        ]
    rows += [
        ("Worker resident memory (GiB)", f["worker_rss_gib"]),
        ("Worker peak resident memory (GiB)", f["worker_peak_rss_gib"]),
        ("Load average at start / end", f"{f['loadavg_start'][0]:.2f} / {f['loadavg_end'][0]:.2f}"),
    ]
    return rows
