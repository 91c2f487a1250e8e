"""A supervisor killed with -9 never runs its teardown: its run dir (ipc sockets, config.json) and,
before ready, its host-tier slab stay behind. The next supervisor removes them (engine/supervise.py:
remove_stale_runs): only its own names (`strata-run-<pid>-`, `strata-slab-<pid>-`), of this user, of
pids that no longer run here, whose lock (`hold_lock`) nobody holds: a server in another pid namespace
sharing /dev/shm holds its lock, so its files stay."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from engine.supervise import RUN_LOCK, SLAB_TAG, hold_lock, remove_stale_runs, run_prefix


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _run_dir(base: Path, pid: int, suffix: str) -> Path:
    d = base / f"strata-run-{pid}-{suffix}"
    d.mkdir()
    (d / RUN_LOCK).touch()
    (d / "config.json").write_text("{}")
    return d


def test_stale_run_dirs_and_slabs_of_dead_supervisors_are_removed(tmp_path: Path) -> None:
    dead = _dead_pid()
    stale_dir = _run_dir(tmp_path, dead, "k2j4x9")
    stale_slab = tmp_path / f"{SLAB_TAG}-{dead}-0a1b2c3d-l2"
    stale_slab.write_bytes(b"\0" * 4096)
    # in use: a dead pid here (another pid namespace) but its lock held; a live pid; not ours by name
    held_dir = _run_dir(tmp_path, dead, "held")
    held_slab = tmp_path / f"{SLAB_TAG}-{dead}-held-l2"
    held_slab.write_bytes(b"")
    locks = [hold_lock(held_dir / RUN_LOCK), hold_lock(held_slab)]
    live = tmp_path / f"{run_prefix()}abc"
    live.mkdir()
    kept = [held_dir, held_slab, live, _run_dir(tmp_path, 2**40, "x").rename(tmp_path / f"strata-{dead}-notes"),
            tmp_path / "strata-k2j4x9", tmp_path / f"strata-{dead}-0a1b2c3d-l2", tmp_path / f"strata-run-{dead}-nolock"]
    kept[4].mkdir()
    kept[5].write_bytes(b"")
    kept[6].mkdir()  # a run dir without its lock file: not one of ours (or not yet locked)
    huge = _run_dir(tmp_path, 2**40, "huge")  # a pid no kernel has: stale, not a crash
    try:
        removed = remove_stale_runs(tmp_path, tmp_path / "missing")
        assert sorted(removed) == sorted([stale_dir, stale_slab, huge])
        assert all(p.exists() for p in kept), [p for p in kept if not p.exists()]
        assert remove_stale_runs(tmp_path) == []  # nothing left to remove
    finally:
        for fd in locks:
            os.close(fd)
    assert sorted(remove_stale_runs(tmp_path)) == sorted([held_dir, held_slab])  # their locks released
    assert run_prefix() == f"strata-run-{os.getpid()}-"
