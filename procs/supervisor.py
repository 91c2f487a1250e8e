"""bin/serve: start every process, wait for each to be Ready, watch them, tear down.

Exit status: 0 after a clean SIGINT/SIGTERM shutdown, 1 when a child fails to start or
dies (the message names it), 2 for bad arguments. A child that dies while serving is first
announced to the tokenizer (ProcessDied), which answers every in-flight request with an
error (503) before the teardown.

With --nnodes > 1, node 0's supervisor runs the tokenizer, the scheduler and its own workers;
the supervisor of node R > 0 runs only its workers (ranks R*local ..), which follow node 0's
scheduler over tcp. It watches them like any child: one that dies or reports Fatal (a failed
collective, or the Step stream lost when node 0 went away: procs/worker.py) stops the node's
other ranks and exits 1 naming it.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import zmq

from engine.args import parse_args
from engine.cache.slab import create_slab, remove_slab, slab_dir
from engine.config import ServerConfig, check_before_start
from engine.env import env
from engine.logs import setup_logging
from engine.supervise import (
    RUN_LOCK,
    SLAB_TAG,
    ChildSet,
    announce_death,
    child_name,
    hold_lock,
    remove_stale_runs,
    run_prefix,
)
from models.config import ModelConfig
from msgs.channels import CONTROL, NOTICES, Receiver, Sender, open_receiver, open_sender
from msgs.control import Alive, Fatal, Ready, ToSupervisor, ToTokenizerControl

START_TIMEOUT_S = 900.0
POLL_MS = 100  # how often children are checked: a crash reaches clients within ~this
FLUSH_TIMEOUT_S = 1.0  # how long the tokenizer may take to fail in-flight requests
SMALL_CONTEXT = 512  # a longest request below this many tokens is worth a warning at ready


def prepare_model(cfg: ServerConfig) -> ServerConfig:
    if cfg.model:
        if not Path(cfg.model, "config.json").is_file():
            raise ValueError(f"--model {cfg.model}: no config.json there")
    else:
        from models.default_model import ensure_default_model

        cfg = replace(cfg, model=str(ensure_default_model()))
    check_before_start(cfg)
    # its keys, sizes and features, and what --ep-size asks of them: a ValueError here, not a worker's failure
    ModelConfig.from_dir(cfg.model).check_ep_size(cfg.ep_size)
    return cfg


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    try:
        log = setup_logging("supervisor", cfg.log_dir)
    except OSError as exc:  # ("File exists" alone, for a file in the way, read as nonsense)
        why = "a file is in the way of the directory" if isinstance(exc, FileExistsError) else exc.strerror or exc
        print(f"strata: --log-dir {cfg.log_dir}: {why}", file=sys.stderr)
        return 2
    try:  # the default model's checks (its config.json) run here: a bad flag is exit 2, not a traceback
        cfg = prepare_model(cfg)
    except ValueError as exc:
        print(f"strata: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the default model's conversion under STRATA_CACHE_DIR
        print(f"strata: the default model cannot be prepared under STRATA_CACHE_DIR ({env().cache_dir}): {exc}",
              file=sys.stderr)
        return 2
    stale = remove_stale_runs(Path(tempfile.gettempdir()), slab_dir())  # what a kill -9 left
    if stale:
        log.info("removed the run dirs and slabs of killed servers", paths=[str(p) for p in stale])
    run_dir = tempfile.mkdtemp(prefix=run_prefix())  # mode 0700: ipc sockets stay private
    locks = [hold_lock(Path(run_dir, RUN_LOCK))]  # "in use" to another supervisor's remove_stale_runs
    # the host tier's slab: created here, removed below whatever happens to the children
    cfg = replace(cfg, run_dir=run_dir, hicache_path=create_slab(SLAB_TAG) if cfg.enable_hierarchical_cache else "")
    if cfg.hicache_path:
        locks.append(hold_lock(Path(cfg.hicache_path)))
    stop = {"signal": 0}

    def on_signal(signum: int, _frame: object) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    ctx = zmq.Context()
    control = open_receiver(ctx, CONTROL, "supervisor", run_dir)
    notices = open_sender(ctx, NOTICES, "supervisor", run_dir)  # -> tokenizer: ProcessDied
    children = ChildSet(cfg, Path(run_dir))
    code = 1  # what an exception out of the loop below leaves
    try:
        children.start_all()
        if cfg.enable_hierarchical_cache:
            children.start_cache()
        code = _run(cfg, children, control, notices, stop, log)
    finally:
        children.stop_all()
        control.sock.close(0)
        notices.sock.close(0)
        ctx.term()
        shutil.rmtree(run_dir, ignore_errors=True)
        remove_slab(cfg.hicache_path)
        for fd in locks:
            os.close(fd)
        log.info("supervisor exiting", code=code)
    return code


def _run(
    cfg: ServerConfig,
    children: ChildSet,
    control: Receiver[ToSupervisor],
    notices: Sender[ToTokenizerControl],
    stop: dict,
    log,  # noqa: ANN001
) -> int:
    expected = children.names() + (["cache"] if cfg.enable_hierarchical_cache else [])
    ready: dict[str, Ready] = {}
    t_start = time.monotonic()
    if cfg.node_rank > 0:  # its workers wait in torch.distributed's rendezvous until node 0 is up
        print(f"strata: node {cfg.node_rank}/{cfg.nnodes}: waiting for node 0 at {cfg.dist_init_addr} "
              "(--dist-init-addr)", flush=True)
    deadline = t_start + START_TIMEOUT_S

    def crashed(name: str, message: str, reason: str) -> int:
        print(f"strata: {message}; shutting down", file=sys.stderr, flush=True)
        log.error("child died", child=name, reason=reason)
        if "tokenizer" in ready and name != "tokenizer":  # clients are connected: tell them
            failed = announce_death(notices, control, name, reason, FLUSH_TIMEOUT_S)
            log.info("tokenizer flushed" if failed is not None else "tokenizer did not flush", requests=failed)
        return 1

    alive: dict[str, float] = {}  # the loops that beat (Alive): when each was last heard from
    while not stop["signal"]:
        # Messages first: a child that sent Fatal and exited is reported with its reason.
        if control.poll(POLL_MS):
            msg = control.recv()
            if isinstance(msg, Alive):
                alive[msg.proc] = time.monotonic()
                continue
            if isinstance(msg, Fatal):
                name = child_name(msg.proc, msg.rank)
                cause = children.cause(name, CAUSE_GRACE_S, msg.by)
                if cause is not None:  # a rank was killed and a survivor or the scheduler reported it first
                    dead, how = cause
                    log.info("failure reported after a child ended", reporter=name, reason=msg.reason)
                    return crashed(dead, f"process {dead} ({how}) exited unexpectedly; {name} then failed: "
                                   f"{msg.reason[:300]}", how)
                # a stopped rank: the others can only say they wait, and the scheduler's watchdog may
                # blame it (a worker's Fatal sent `by` the scheduler) or the rank waiting on it
                held = children.stopped(msg.by or name)
                if held is not None:
                    then = f"{msg.by} reported" if held == name else f"{name} then failed"
                    return crashed(held, f"process {held} is stopped (SIGSTOP); {then}: {msg.reason[:300]}",
                                   "stopped (SIGSTOP)")
                return crashed(name, f"{name} failed: {msg.reason}", msg.reason)
            if isinstance(msg, Ready):
                name = child_name(msg.proc, msg.rank)
                ready[name] = msg
                if name in BEATING:
                    alive[name] = time.monotonic()
                log.info("child ready", child=name, **msg.info)
                if set(ready) == set(expected):
                    # every process that maps the host slab has mapped it (workers at the set-up step
                    # ready waits for, the controller at start): its name goes now, so that nothing is
                    # left in /dev/shm even if this process is SIGKILLed
                    remove_slab(cfg.hicache_path)
                    print(ready_line(cfg, ready), flush=True)
                    print(f"strata: {time_to_ready(time.monotonic() - t_start, ready)}", flush=True)
        if stop["signal"]:  # a Ctrl-C reaches the children too: their exit is the shutdown, not a crash
            break
        dead = children.first_dead()
        if dead:
            name, how = dead
            return crashed(name, f"process {name} ({how}) exited unexpectedly", how)
        stuck = silent(alive, time.monotonic(), cfg.watchdog_timeout)
        if stuck:
            how = f"stuck: no sign of life for {cfg.watchdog_timeout:g} s (--watchdog-timeout)"
            return crashed(stuck, f"process {stuck} is {how}", how)
        if len(ready) < len(expected) and time.monotonic() > deadline:
            print(f"strata: start timed out; not ready: {sorted(set(expected) - set(ready))}", file=sys.stderr)
            return 1
    how = signal.Signals(stop["signal"]).name
    log.info("shutting down", signal=how)
    if "tokenizer" in ready:  # clients in flight get a 503 (an error event on a stream), not a cut connection
        failed = announce_death(notices, control, "", f"stopped by {how}", FLUSH_TIMEOUT_S)
        log.info("tokenizer flushed" if failed is not None else "tokenizer did not flush", requests=failed)
    return 0


CAUSE_GRACE_S = 0.5  # after a Fatal: how long another child's exit may take to be seen (it is the cause)
BEATING = ("scheduler", "tokenizer", "cache")  # the loops that send Alive (workers: the scheduler's watchdog)


def silent(alive: dict[str, float], now: float, timeout_s: float) -> str | None:
    """The first process (of those that beat and were ready) not heard from for timeout_s, or None."""
    return next((name for name, at in sorted(alive.items()) if now - at > timeout_s), None)


def ready_line(cfg: ServerConfig, ready: dict[str, Ready]) -> str:
    if cfg.node_rank > 0:
        net = cfg.net
        where = net.address(0).rsplit(":", 1)[0] if net is not None else "?"
        return (f"strata: node {cfg.node_rank}/{cfg.nnodes} ready: {', '.join(sorted(ready))} "
                f"following node 0's scheduler at {where}")
    info = ready["tokenizer"].info
    worker = ready.get("worker-0")
    det = (f"; {worker.info.get('dtype', '?')}, deterministic inference {worker.info['deterministic']}"
           if worker and "deterministic" in worker.info else "")
    line = f"strata: ready. model {cfg.model_name}; HTTP {info.get('http')}; SDK {info.get('sdk')}{det}"
    context = int(ready["scheduler"].info.get("max_context", 0)) if "scheduler" in ready else 0
    if context:
        line += f"; context {context} tokens"
        if context < SMALL_CONTEXT:  # (a prompt and its answer longer than this get a 400)
            line += (f"\nstrata: warning: requests are limited to {context} tokens "
                     "(--max-total-tokens / --context-length)")
    return line


def time_to_ready(total_s: float, ready: dict[str, Ready]) -> str:
    """'ready in 12.3 s (worker-0: load 3.1 s, warm-up 5.2 s, capture 2.0 s)': where start-up went."""
    phases = {"load_s": "load", "warmup_s": "warm-up", "capture_s": "capture"}
    parts = []
    for name, msg in sorted(ready.items()):
        got = [f"{label} {msg.info[key]} s" for key, label in phases.items() if key in msg.info]
        if got:
            parts.append(f"{name}: {', '.join(got)}")
    return f"ready in {total_s:.1f} s" + (f" ({'; '.join(parts)})" if parts else "")


if __name__ == "__main__":
    sys.exit(main())
