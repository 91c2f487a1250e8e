"""A supervisor killed with -9 never runs its teardown: its run dir (ipc sockets, config.json) and,
before ready, its host-tier slab stay behind. The next supervisor removes them (engine/supervise.py:
remove_stale_runs): only names of its own pattern, of pids that no longer run, owned by this user."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from engine.supervise import remove_stale_runs, run_prefix


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_run_dirs_and_slabs_of_dead_supervisors_are_removed(tmp_path: Path) -> None:
    dead = _dead_pid()
    run_dir = tmp_path / f"strata-{dead}-k2j4x9"
    run_dir.mkdir()
    (run_dir / "config.json").write_text("{}")
    slab = tmp_path / f"strata-{dead}-0a1b2c3d-l2"
    slab.write_bytes(b"\0" * 4096)
    live = tmp_path / f"{run_prefix()}abc"  # this process: a running server's
    live.mkdir()
    kept = [live, tmp_path / "strata-k2j4x9", tmp_path / "strata-l2-notes", tmp_path / f"other-{dead}-x"]
    for path in kept[1:]:
        path.mkdir()
    removed = remove_stale_runs(tmp_path, tmp_path / "missing")
    assert sorted(removed) == sorted([run_dir, slab])
    assert not run_dir.exists() and not slab.exists()
    assert all(p.exists() for p in kept)
    assert remove_stale_runs(tmp_path) == []  # nothing left to remove
    assert run_prefix() == f"strata-{os.getpid()}-"
