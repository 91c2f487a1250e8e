"""A torch profiler over a range of a worker's forward steps, for diagnosing the served path
(STRATA_PROFILE_STEPS=FIRST:COUNT): the steps FIRST .. FIRST+COUNT-1 with a forward are
profiled (CPU and device activity), then a table of kernels and ops by self device time is
written to LOG_DIR/profile-rank{R}.txt (or the working directory) and the timeline, for
chrome://tracing or Perfetto, to profile-rank{R}.json.gz. Off by default: nothing is
done per step but one comparison."""

from __future__ import annotations

import time
from pathlib import Path

import structlog
import torch

log = structlog.get_logger()


class StepProfiler:
    def __init__(self, window: tuple[int, int], out_dir: str, rank: int) -> None:
        self.first, self.count = window  # (engine/env.py checked them)
        self.path = Path(out_dir or ".") / f"profile-rank{rank}.txt"
        self.steps = 0
        self.prof: torch.profiler.profile | None = None
        self.t0 = 0.0

    def tick(self) -> None:
        """Called once per forward step, before it is launched."""
        self.steps += 1
        if self.steps == self.first:
            torch.cuda.synchronize()
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.start()
            self.t0 = time.perf_counter()
        elif self.steps == self.first + self.count and self.prof is not None:
            torch.cuda.synchronize()
            wall = time.perf_counter() - self.t0
            self.prof.stop()
            table = self.prof.key_averages().table(sort_by="self_device_time_total", row_limit=50)
            self.path.write_text(f"steps {self.first}..{self.steps - 1}, wall {wall * 1e3:.1f} ms\n{table}")
            self.prof.export_chrome_trace(str(self.path.with_suffix(".json.gz")))
            log.info("step profile written", path=str(self.path), steps=self.count, wall_ms=round(wall * 1e3, 1))
            self.prof = None
