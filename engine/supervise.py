"""Child processes of the supervisor: spawn, liveness, crash notice, orderly teardown.

Children get PR_SET_PDEATHSIG(SIGKILL) so a supervisor killed with -9 leaves no orphans.
When a child dies (or reports Fatal) while serving, `announce_death` tells the tokenizer
first, so every in-flight client gets an explicit error before the teardown cuts its
connection.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import structlog
import zmq

from engine.config import ServerConfig
from engine.env import DIST_ENV
from msgs.channels import Receiver, Sender
from msgs.control import Flushed, ProcessDied, ToSupervisor, ToTokenizerControl

log = structlog.get_logger()

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: teardown still happens on clean exits
        pass


# a supervisor's run dir and host-tier slab: named by its pid, each holding a lock for its life
_STALE_NAMES = (re.compile(r"strata-run-(\d+)-[^/]+$"), re.compile(r"strata-slab-(\d+)-[^/]+$"))
RUN_LOCK = "lock"  # in the run dir


def run_prefix() -> str:
    """The name prefix of this supervisor's run dir (`remove_stale_runs`)."""
    return f"strata-run-{os.getpid()}-"


SLAB_TAG = "strata-slab"  # create_slab(SLAB_TAG): the supervisor's slab, strata-slab-<pid>-...


def hold_lock(path: Path) -> int:
    """An exclusive flock on `path` (created if missing), held until this process exits: the mark
    `remove_stale_runs` reads as "in use", across pid namespaces (containers sharing /dev/shm) too."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def remove_stale_runs(*bases: Path) -> list[Path]:
    """Remove what a supervisor killed by SIGKILL left in these dirs (its children die with it, its
    `finally` never runs): run dirs `strata-run-<pid>-*` and slabs `strata-slab-<pid>-*` of this user
    whose pid no longer runs here and whose lock nobody holds (`hold_lock`: a run dir's `lock` file, a
    slab itself). A slab of a supervisor killed before ready is RAM under /dev/shm. Returns what was
    removed."""
    removed = []
    for base in bases:
        try:
            entries = list(base.iterdir())
        except OSError:
            continue
        for path in entries:
            m = next((m for p in _STALE_NAMES if (m := p.match(path.name))), None)
            try:
                if m is None or path.lstat().st_uid != os.getuid() or _alive(int(m.group(1))):
                    continue
                is_dir = path.is_dir() and not path.is_symlink()
                if not _unlocked(path / RUN_LOCK if is_dir else path):
                    continue
                if is_dir:
                    shutil.rmtree(path)
                else:
                    path.unlink()
            except OSError as exc:  # gone meanwhile, or not ours to remove
                log.debug("stale run not removed", path=str(path), error=str(exc))
                continue
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, ValueError):  # gone, or no pid at all
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _unlocked(path: Path) -> bool:
    """Whether `path` is a regular file (not a link) on which nobody holds a `hold_lock`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:  # missing (a run dir without its lock is not one of ours, or not yet)
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def describe_exit(returncode: int) -> str:
    """'killed by SIGKILL' or 'exit status 1': what a person needs to tell a crash apart."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    if returncode == 128 + signal.SIGTERM:  # procs/child.py's SIGTERM handler (an audit read "exit status 0")
        return f"stopped by SIGTERM (exit status {returncode})"
    return f"exit status {returncode}"


def child_name(proc: str, rank: int | None) -> str:
    return proc if rank is None else f"{proc}-{rank}"


def announce_death(
    notices: Sender[ToTokenizerControl], control: Receiver[ToSupervisor], proc: str, reason: str, timeout_s: float
) -> int | None:
    """Send ProcessDied to the tokenizer and wait up to timeout_s for its Flushed; the
    number of requests it failed, or None if it did not answer in time."""
    try:
        notices.send(ProcessDied(proc=proc, reason=reason), block=False)
    except zmq.Again:  # the tokenizer is not connected (it is gone too): nobody to tell
        return None
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if control.poll(int(left * 1000) + 1):
            msg = control.recv()
            if isinstance(msg, Flushed):
                return msg.requests
    return None


def free_port(host: str = "127.0.0.1", avoid: tuple[int, ...] = ()) -> int:
    """A port free now and not in `avoid` (ports promised to others but not bound yet)."""
    for _ in range(100):
        port = free_ports(1, host)[0]
        if port not in avoid:
            return port
    raise RuntimeError(f"no free port on {host} outside {avoid}")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct ports free now: the sockets are held open together while the OS picks them
    (two calls of a one-socket helper can return the same port twice: a server started with
    --port equal to --sdk-port hung a benchmark's client once)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def dist_master(cfg: ServerConfig) -> tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT): --dist-init-addr, else this host and a port free now."""
    if cfg.dist_init_addr:
        host, _, port = cfg.dist_init_addr.rpartition(":")
        return host.strip("[]"), int(port)
    # not the http or sdk port: the tokenizer binds those after this pick (a test's ephemeral --port was taken once)
    return "127.0.0.1", free_port(avoid=(cfg.port, cfg.sdk_port))


def rank_env(cfg: ServerConfig, rank: int, master: tuple[str, int]) -> dict[str, str]:
    """torch.distributed's usual environment for the worker of global rank `rank`."""
    return {
        "MASTER_ADDR": master[0],
        "MASTER_PORT": str(master[1]),
        "RANK": str(rank),
        "WORLD_SIZE": str(cfg.world_size),
        "LOCAL_RANK": str(rank - cfg.node_rank * cfg.ranks_per_node),
        "LOCAL_WORLD_SIZE": str(cfg.ranks_per_node),
    }


class ChildSet:
    def __init__(self, cfg: ServerConfig, run_dir: Path) -> None:
        self.cfg = cfg
        self.config_path = run_dir / "config.json"
        self.config_path.write_text(cfg.to_json())
        self.procs: dict[str, subprocess.Popen] = {}

    def names(self) -> list[str]:
        workers = [f"worker-{r}" for r in self.cfg.local_ranks()]
        return workers + (["scheduler", "tokenizer"] if self.cfg.node_rank == 0 else [])

    def start_all(self) -> None:
        master = dist_master(self.cfg)
        for rank in self.cfg.local_ranks():
            self._spawn(f"worker-{rank}", "procs.worker", "--rank", str(rank), env=rank_env(self.cfg, rank, master))
        if self.cfg.node_rank == 0:  # other nodes run workers only (they follow node 0's scheduler)
            self._spawn("scheduler", "procs.scheduler")
            self._spawn("tokenizer", "procs.tokenizer")

    def _spawn(self, name: str, module: str, *extra: str, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", module, "--config", str(self.config_path), *extra]
        full_env = {**os.environ, **DIST_ENV, **(env or {})}
        self.procs[name] = subprocess.Popen(cmd, preexec_fn=_die_with_parent, env=full_env)  # noqa: PLW1509

    def start_cache(self) -> None:
        """The cache controller (with --enable-hierarchical-cache); watched like the others."""
        self._spawn("cache", "procs.cache")

    def first_dead(self) -> tuple[str, str] | None:
        """(name, how it ended) of a child that is no longer running, if any."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                return name, describe_exit(proc.returncode)
        return None

    def cause(self, reporter: str, grace_s: float, sender: str = "") -> tuple[str, str] | None:
        """The child other than `reporter` (and `sender`, who reported for it and exits next) that
        ended before the report, a signal's victim first, or that a signal ends within grace_s: when
        one rank is killed, a survivor (its collective broken) or the scheduler often reports a
        failure before the dead child's exit is seen, and the dead one is the cause to name. A child
        that exits by itself after the report is its consequence (the scheduler leaving on a
        worker's failure), not its cause: each reports its own failure (Fatal) before it exits."""
        def ended(signalled: bool) -> list[tuple[str, str]]:
            return [(name, describe_exit(proc.returncode)) for name, proc in self.procs.items()
                    if name not in (reporter, sender) and proc.poll() is not None
                    and (proc.returncode < 0 or not signalled)]

        dead = ended(signalled=False)
        deadline = time.monotonic() + grace_s
        while not dead and time.monotonic() < deadline:
            time.sleep(0.02)
            dead = ended(signalled=True)
        return min(dead, key=lambda d: "killed by" not in d[1]) if dead else None

    def stopped(self, *besides: str) -> str | None:
        """A child other than `besides` that is held stopped (SIGSTOP, a debugger): it neither ends
        nor answers, so what the others report (the scheduler's watchdog, a rank waiting in a
        collective) names only their wait, not it."""
        for name, proc in self.procs.items():
            if name in besides or proc.poll() is not None:
                continue
            try:
                if psutil.Process(proc.pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
                    return name
            except psutil.Error:  # ended meanwhile: first_dead's to report
                continue
        return None

    def stop_all(self, grace_s: float = 5.0) -> None:
        """SIGTERM everyone, wait up to grace_s, then SIGKILL what is left."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a stopped child (SIGSTOP) handles the SIGTERM now, not at the kill
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for name, proc in self.procs.items():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("child did not stop on SIGTERM: killed", child=name, grace_s=grace_s)
                proc.kill()
                proc.wait()
