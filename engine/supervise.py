"""Child processes of the supervisor: spawn, liveness, orderly teardown.

Children get PR_SET_PDEATHSIG(SIGKILL) so a supervisor killed with -9 leaves no orphans.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import time
from pathlib import Path

from engine.config import ServerConfig

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: teardown still happens on clean exits
        pass


class ChildSet:
    def __init__(self, cfg: ServerConfig, run_dir: Path) -> None:
        self.cfg = cfg
        self.config_path = run_dir / "config.json"
        self.config_path.write_text(cfg.to_json())
        self.procs: dict[str, subprocess.Popen] = {}

    def names(self) -> list[str]:
        return [f"worker-{r}" for r in range(self.cfg.tp_size)] + ["scheduler", "tokenizer"]

    def start_all(self) -> None:
        for rank in range(self.cfg.tp_size):
            self._spawn(f"worker-{rank}", "procs.worker", "--rank", str(rank))
        self._spawn("scheduler", "procs.scheduler")
        self._spawn("tokenizer", "procs.tokenizer")

    def _spawn(self, name: str, module: str, *extra: str) -> None:
        cmd = [sys.executable, "-m", module, "--config", str(self.config_path), *extra]
        self.procs[name] = subprocess.Popen(cmd, preexec_fn=_die_with_parent)  # noqa: PLW1509

    def first_dead(self) -> str | None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                return f"{name} (exit status {proc.returncode})"
        return None

    def stop_all(self, grace_s: float = 5.0) -> None:
        """SIGTERM everyone, wait up to grace_s, then SIGKILL what is left."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
