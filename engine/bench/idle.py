"""GPU idle time between decode steps, from a torch.profiler (CUPTI) trace.

Over a window of decode steps: busy = union of GPU activity intervals (kernels, memcpy,
memset), span = first activity start -> last activity end, idle fraction = 1 - busy/span.
In process the scheduler (plan / on_done) runs between two worker steps while the GPU
waits; in the served engine it runs in its own process, off the worker's critical path.
`worker_idle_fraction` therefore also removes the measured scheduler time from both the
idle time and the span: it estimates what a worker fed by a separate scheduler sees.
The profiler adds some host overhead per launch, so both slightly overstate idle time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def union_length(intervals: list[tuple[int, int]]) -> int:
    """Total length covered by [start, end) intervals (overlaps counted once)."""
    total, cur_start, cur_end = 0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def idle_stats(intervals: list[tuple[int, int]], steps: int, host_s: float, sched_s: float) -> dict[str, Any]:
    """Idle figures from GPU activity intervals (ns) over `steps` steps that took `host_s` seconds,
    `sched_s` of them in the scheduler."""
    if not intervals:
        return {"skipped": "the profiler recorded no GPU activity"}
    span = max(e for _, e in intervals) - min(s for s, _ in intervals)
    busy = union_length(intervals)
    idle_ns = span - busy
    sched_ns = min(int(sched_s * 1e9), idle_ns)
    return {
        "steps": steps,
        "gpu_span_ms": span / 1e6,
        "gpu_busy_ms": busy / 1e6,
        "idle_fraction": idle_ns / span if span else 0.0,
        "idle_ms_per_step": idle_ns / 1e6 / steps,
        "sched_ms_per_step": sched_s * 1e3 / steps,
        "worker_idle_fraction": (idle_ns - sched_ns) / (span - sched_ns) if span > sched_ns else 0.0,
        "host_ms_per_step": host_s * 1e3 / steps,
    }


def gpu_intervals(prof: torch.profiler.profile) -> list[tuple[int, int]]:
    """[start, end) in ns of every GPU-side event of a finished profile."""
    out = []
    for ev in prof.profiler.kineto_results.events():
        if ev.device_type() == torch.autograd.DeviceType.CUDA and ev.duration_ns() > 0:
            out.append((ev.start_ns(), ev.start_ns() + ev.duration_ns()))
    return out


def profile_idle(device: torch.device, run_steps: Callable[[int], float], steps: int) -> dict[str, Any]:
    """Run `run_steps(steps)` (it returns the seconds spent in the scheduler) under the profiler
    and return idle figures; skipped off-GPU."""
    if device.type != "cuda":
        return {"skipped": "no GPU: idle profiling needs CUDA"}
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # no CPU op recording: less overhead
        t0 = time.perf_counter()
        sched_s = run_steps(steps)
        torch.cuda.synchronize()
        host_s = time.perf_counter() - t0
    return idle_stats(gpu_intervals(prof), steps, host_s, sched_s)
