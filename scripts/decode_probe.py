"""Where does a batch-1 decode step's host time go? (device diagnostic, not in CI)

Runs LocalEngine's pipelined loop (launch N+1 before finishing N) on a dummy model and
reports per-phase host times, GPU busy time per step (CUDA events) and a cProfile of launch().
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from collections import deque

import torch

from engine.config import ServerConfig
from engine.local import LocalEngine
from msgs.codec import pack_ids
from msgs.params import SamplingParams
from msgs.requests import TokenizedRequest


def main(model: str, batch: int, steps: int = 200) -> None:
    eng = LocalEngine(
        ServerConfig(
            model=model,
            load_format="dummy",
            device="cuda",
            max_running_requests=64,
            max_total_tokens=200_000,
            max_prefill_tokens=65536,
        )
    )
    core, runner = eng.core, eng.runner
    for i in range(batch):
        core.submit(
            TokenizedRequest(
                rid=f"p{i}",
                input_ids=pack_ids([(7 * i + j) % 1000 + 1 for j in range(1024)]),
                params=SamplingParams(max_new_tokens=3 * steps + 50, temperature=0, ignore_eos=True),
            )
        )
    for _ in range(20):  # prefill and warm up serially
        core.on_done(runner.run_step(core.plan()))
    t = dict(plan=0.0, launch=0.0, finish=0.0, on_done=0.0)
    prof = cProfile.Profile()
    launched: deque = deque()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for k in range(steps):
        while len(launched) < 2:
            a = time.perf_counter()
            step = core.plan()
            b = time.perf_counter()
            if k >= steps // 2:
                prof.enable()
            launched.append(runner.launch(step))
            prof.disable()
            c = time.perf_counter()
            t["plan"] += b - a
            t["launch"] += c - b
        a = time.perf_counter()
        done = runner.finish(launched.popleft())
        b = time.perf_counter()
        core.on_done(done)
        t["finish"] += b - a
        t["on_done"] += time.perf_counter() - b
    wall = (time.perf_counter() - t0) / steps
    print(
        f"batch {batch}: {wall * 1e3:.3f} ms/step pipelined; per step: "
        + ", ".join(f"{k} {v / steps * 1e3:.3f} ms" for k, v in t.items())
    )
    # GPU busy per step, serial, with events
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    busy = []
    for _ in range(30):
        step = core.plan()
        torch.cuda.synchronize()
        s.record()
        la = runner.launch(step)
        e.record()
        core.on_done(runner.finish(la))
        busy.append(s.elapsed_time(e))
    print(f"batch {batch}: launch-to-end GPU span {sorted(busy)[15]:.3f} ms (median)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)
