"""Scheduler process: `python -m procs.scheduler --config PATH`.

Owns the scheduler's sockets (one end of each channel in msgs/channels.py) and runs
engine.sched.loop.SchedulerLoop over them.
"""

from __future__ import annotations

import sys

import zmq

from engine.sched.loop import SchedulerLoop, SchedulerPorts
from msgs.channels import COMMITS, CONTROL, DONE, OUTPUTS, REQUESTS, STEPS, open_receiver, open_sender
from msgs.control import Fatal
from procs.child import start_child

ROLE = "scheduler"


def main() -> int:
    cfg, log, _ = start_child(ROLE)
    ctx = zmq.Context()
    run_dir = cfg.run_dir
    net = cfg.net  # --nnodes > 1: done and the Step streams over tcp, bound here (workers connect)
    ports = SchedulerPorts(
        requests=open_receiver(ctx, REQUESTS, ROLE, run_dir),
        done=open_receiver(ctx, DONE, ROLE, run_dir, net=net),
        outputs=open_sender(ctx, OUTPUTS, ROLE, run_dir),
        steps=[open_sender(ctx, STEPS, ROLE, run_dir, rank=r, net=net) for r in range(cfg.world_size)],
        control=open_sender(ctx, CONTROL, ROLE, run_dir, linger_ms=1000),
    )
    poller = zmq.Poller()
    if cfg.enable_hierarchical_cache:  # the cache controller follows the Step stream and commits
        ports.cache_steps = open_sender(ctx, STEPS, ROLE, run_dir, follower="cache")
        ports.commits = open_receiver(ctx, COMMITS, ROLE, run_dir)
        poller.register(ports.commits.sock, zmq.POLLIN)  # type: ignore[attr-defined]
    poller.register(ports.requests.sock, zmq.POLLIN)  # type: ignore[attr-defined]
    poller.register(ports.done.sock, zmq.POLLIN)  # type: ignore[attr-defined]
    loop = SchedulerLoop(cfg, ports)
    try:
        loop.run(wait=poller.poll)
    except Exception as exc:  # fatal by design: report it, then exit non-zero
        log.exception("scheduler failed", error=str(exc))
        rank = getattr(exc, "rank", None)  # a WorkerFailure that knows the one rank at fault: name that worker
        proc = ROLE if rank is None else "worker"
        ports.control.send(Fatal(proc=proc, rank=rank, reason=str(exc), by=ROLE if proc != ROLE else ""))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
