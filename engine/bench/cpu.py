"""`bin/bench cpu`: the served CPU path against transformers, same weights, same batch, same run.

1. transformers (engine/bench/hf_baseline.py, a child process): greedy `generate` of the batch
   and one forward pass of the long prompt.
2. bin/serve, started here: the same batch over the SDK, all requests at once (greedy, no EOS
   stop), then the long prompt alone with one output token (its time to first token), then the
   worker's resident memory.

Both sides get one untimed warm-up first. Throughput counts output tokens over the wall time
of the whole batch, prefill included, on both sides. The machine's load average is recorded
at start and end: on a shared machine it says how much the figures can be trusted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import tempfile
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
    ]
    for flag, default, what in flags:
        p.add_argument(flag, type=int, default=default, help=f"{what} (default: {default})")
    p.add_argument("--hf-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="transformers' dtype: float32 (its default for this checkpoint) or bfloat16, the same "
                   "precision as --server-args '--dtype bfloat16' (default: float32)")


def check(args: argparse.Namespace) -> str | None:
    """A problem with the cpu mode's arguments, or None."""
    checks = [
        (args.batch >= 1 and args.input_len >= 1 and args.output_len >= 1, "--batch/--input-len/--output-len >= 1"),
        (args.long_prompt_len >= 0, "--long-prompt-len must be >= 0"),
        (args.load_format != "dummy", "cpu mode compares with transformers, which needs the weights (no dummy)"),
    ]
    return next((problem for ok, problem in checks if not ok), None)


def workload_of(args: argparse.Namespace, vocab: int) -> tuple[list[BenchRequest], list[int]]:
    """The seeded batch and long prompt (random ids: no shared prefix, no cache hits)."""
    reqs = workload.random_requests(
        args.batch, (args.input_len, args.input_len), (args.output_len, args.output_len), vocab, args.seed
    )
    rng = np.random.default_rng(args.seed + 1)
    return reqs, rng.integers(0, vocab, size=args.long_prompt_len).tolist()


def baseline(
    model_dir: Path, reqs: list[BenchRequest], long_prompt: list[int], output_len: int, dtype: str = "float32"
) -> dict[str, Any]:
    """Run engine/bench/hf_baseline.py in a child process; its progress bars show on stderr."""
    with tempfile.TemporaryDirectory(prefix="strata-bench-hf-") as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({
            "model_dir": str(model_dir), "prompts": [r.prompt for r in reqs], "output_len": output_len,
            "long_prompt": long_prompt, "dtype": dtype,
        }))
        subprocess.run([sys.executable, "-m", "engine.bench.hf_baseline", str(spec), str(out)], cwd=ROOT, check=True)
        return json.loads(out.read_text())


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


def served(args: argparse.Namespace, reqs: list[BenchRequest], long_prompt: list[int]) -> dict[str, Any]:
    """Our side: bin/serve started here, the batch, the long prompt, the worker's memory."""
    out: dict[str, Any] = {}
    with launch.endpoints(None, None, args.model, args.load_format, shlex.split(args.server_args)) as ep:
        timed_batch(ep.sdk, [BenchRequest(r.prompt[:8], 2) for r in reqs[:2]], "strata warm-up")
        out["served_s"], out["served_ids"] = timed_batch(ep.sdk, reqs, f"strata {len(reqs)}x{args.output_len}")
        if long_prompt:
            desc = f"strata {len(long_prompt)}-token prompt"
            out["ttft_s"], ids = timed_batch(ep.sdk, [BenchRequest(long_prompt, 1)], desc)
            out["ttft_next_id"] = ids[0][0] if ids[0] else None
        out.update(worker_memory(ep.pid))
    return out


def figures(args: argparse.Namespace, hf: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    tokens = args.batch * args.output_len
    hf_tps, our_tps = tokens / hf["generate_s"], tokens / ours["served_s"]
    same = sum(a == b for a, b in zip(hf["generate_ids"], ours["served_ids"], strict=True))
    f: dict[str, Any] = {
        "completed": len(ours["served_ids"]),
        "output_tokens": tokens,
        "hf_threads": hf["threads"],
        "hf_generate_s": hf["generate_s"],
        "hf_output_tok_s": hf_tps,
        "served_s": ours["served_s"],
        "served_output_tok_s": our_tps,
        "throughput_ratio": our_tps / hf_tps,
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
    """Both sides, in this order (transformers first, so the server is not running meanwhile)."""
    model_dir = workload.resolve_model_dir(args.model)
    reqs, long_prompt = workload_of(args, workload.vocab_size(model_dir))
    load_start = os.getloadavg()
    hf = baseline(model_dir, reqs, long_prompt, args.output_len, args.hf_dtype)
    ours = served(args, reqs, long_prompt)
    return {**figures(args, hf, ours), "loadavg_start": list(load_start), "loadavg_end": list(os.getloadavg())}


def table_rows(f: dict[str, Any]) -> list[tuple[str, Any]]:
    rows = [
        ("transformers threads", f["hf_threads"]),
        ("transformers generate (s)", f["hf_generate_s"]),
        ("transformers output tok/s", f["hf_output_tok_s"]),
        ("Strata served (s)", f["served_s"]),
        ("Strata output tok/s", f["served_output_tok_s"]),
        ("Throughput ratio (Strata / transformers)", f["throughput_ratio"]),
        ("Rows with tokens equal to transformers", f["rows_equal_to_hf"]),
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
