"""What a result was measured on: CPU, GPU, library versions, git commit.

`python -m engine.bench.hardware` prints the same record as JSON: server-driving modes
call it in a subprocess so the bench process itself never creates a CUDA context (that
would take GPU memory the server sizes its KV pool from).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from engine.env import env

ROOT = Path(__file__).resolve().parents[2]


def cpu_model() -> str:
    """The CPU's marketing name (from /proc/cpuinfo on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_info() -> dict[str, Any]:
    """GPU name and count from torch (None/0 without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return {"gpu": None, "gpu_count": 0, "cuda": torch.version.cuda}
    return {
        "gpu": torch.cuda.get_device_name(0),
        "gpu_count": torch.cuda.device_count(),
        "cuda": torch.version.cuda,
    }


def hardware_info() -> dict[str, Any]:
    """Hardware and software of this machine, in this process (imports torch)."""
    import psutil
    import torch

    return {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        **gpu_info(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "probed_at": time.time(),  # when it finished: a record shows that no timed load overlapped it
    }


class HardwareProbe:
    """hardware_info() computed in a child process (no CUDA context here), started at once so
    that it overlaps the server's start-up; `result()` waits for it.

    PROBE_BEFORE_LOAD: callers await `result()` before the timed load, never after it. The probe
    imports torch (~2 s of CPU): on a 2-core CPU, with a server that was already up (`--sdk`,
    `--url`) or started in 2 s, it ran inside the timed window and took `bin/bench offline`'s
    16 x 128/64 from 4.3 to 5.1-5.7 s (the worker's threads waited 0.8-1.0 s on the run queue)."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "engine.bench.hardware"], cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True,
        )

    def result(self, timeout_s: float = 120.0) -> dict[str, Any]:
        try:
            out, _ = self._proc.communicate(timeout=timeout_s)
            return json.loads(out)
        except (subprocess.SubprocessError, json.JSONDecodeError) as exc:
            self._proc.kill()
            return {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "error": str(exc)}


def git_commit() -> str | None:
    """`git rev-parse HEAD` of the repository; outside a checkout (the GPU machine gets a copy
    of the tree without .git) STRATA_GIT_COMMIT, set by whoever copied the tree; else None.
    STRATA_GIT_COMMIT wins when set: a copied tree may carry a stale .git."""
    if env().git_commit:
        return env().git_commit
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return env().git_commit
    return out.stdout.strip() or env().git_commit


if __name__ == "__main__":
    print(json.dumps(hardware_info()))
