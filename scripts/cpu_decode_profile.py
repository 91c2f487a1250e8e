"""Where does a CPU decode step go? (diagnostic, not in CI)

    .venv/bin/python scripts/cpu_decode_profile.py [--dtype bfloat16] [--batch 16] [--input-len 128]
        [--steps 8] [--no-profile] [--prefill] [--deterministic] [--temperature 1]

In one process (LocalEngine: the served Step stream, no sockets), the default model on CPU:
prefills `batch` seeded random prompts, then times decode steps (median of `steps`, and of a
second round) and prints torch.profiler's CPU operators by self time per step. --prefill
times the prefill step(s) instead of decode. Medians and relative breakdowns, not one wall
clock: the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

if "GOMP_SPINCOUNT" not in os.environ:  # else: a bounded spin, for an A/B of the wait policy
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the served worker (engine/run/__init__.py)

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from engine.config import ServerConfig
from engine.local import LocalEngine
from models.default_model import ensure_default_model
from msgs.codec import pack_ids
from msgs.params import SamplingParams
from msgs.requests import TokenizedRequest


def _step(core, runner) -> float:  # noqa: ANN001
    t = time.perf_counter()
    core.on_done(runner.run_step(core.plan()))
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--prefill", action="store_true", help="time and profile the prefill instead")
    p.add_argument("--deterministic", action="store_true",
                   help="with deterministic inference (else --disable-deterministic-inference)")
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: every step samples (the race's noise)")
    p.add_argument("--rows", type=int, default=28, help="operators to print")
    p.add_argument("--shapes", action="store_true", help="group operators by input shapes too")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    cfg = ServerConfig(model=str(ensure_default_model()), device="cpu", dtype=a.dtype, max_running_requests=a.batch,
                       max_prefill_tokens=a.batch * a.input_len, max_total_tokens=a.batch * (a.input_len + 256),
                       disable_overlap=True, enable_deterministic_inference=a.deterministic,
                       disable_deterministic_inference=not a.deterministic)
    eng = LocalEngine(cfg)
    core, runner = eng.core, eng.runner
    rng = np.random.default_rng(0)
    vocab = 49152
    params = SamplingParams(max_new_tokens=1 if a.prefill else 200, temperature=a.temperature, ignore_eos=True)

    def submit(tag: str) -> None:
        for i in range(a.batch):
            ids = rng.integers(0, vocab, size=a.input_len).tolist()
            core.submit(TokenizedRequest(rid=f"{tag}{i}", input_ids=pack_ids(ids), params=params))

    def prefill() -> list[float]:
        times = []
        while core.waiting or any(r.in_prefill for r in core.running):
            times.append(_step(core, runner))
        if a.prefill:  # one output token: drain what is left (nothing to run)
            while (step := core.plan()) is not None:
                core.on_done(runner.run_step(step))
        return times

    submit("w")
    prefill()
    if a.prefill:
        rounds = []
        for r in range(3):
            submit(f"p{r}")
            rounds.append(sum(prefill()))
        print(f"prefill {a.batch}x{a.input_len} {a.dtype}: {[f'{x * 1e3:.0f}' for x in rounds]} ms")
        if not a.no_profile:
            submit("pp")
            with profile(activities=[ProfilerActivity.CPU], record_shapes=a.shapes) as prof:
                prefill()
            _print(prof, 1, a.rows, a.shapes)
        return
    for _ in range(3):
        _step(core, runner)
    t1 = [_step(core, runner) for _ in range(a.steps)]
    t2 = [_step(core, runner) for _ in range(a.steps)]
    m1, m2 = statistics.median(t1) * 1e3, statistics.median(t2) * 1e3
    print(f"decode {a.batch} rows {a.dtype}: median step {m1:.1f} / {m2:.1f} ms (min {min(t1 + t2) * 1e3:.1f})")
    if a.no_profile:
        return
    with profile(activities=[ProfilerActivity.CPU], record_shapes=a.shapes) as prof:
        for _ in range(a.steps):
            _step(core, runner)
    _print(prof, a.steps, a.rows, a.shapes)


def _print(prof, steps: int, rows: int, shapes: bool = False) -> None:  # noqa: ANN001
    ev = sorted(prof.key_averages(group_by_input_shape=shapes), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ev) / steps / 1e3
    print(f"profiled: {total:.1f} ms of operator self time per step")
    def shape_of(e) -> str:  # noqa: ANN001
        return str(e.input_shapes)[:90] if shapes else ""

    for e in ev[:rows]:
        ms = e.self_cpu_time_total / steps / 1e3
        print(f"  {ms:7.2f} ms {100 * ms / total:5.1f}%  x{e.count // steps:<5} {e.key[:40]} {shape_of(e)}")


if __name__ == "__main__":
    main()
