"""Cache controller process: `python -m procs.cache --config PATH`.

Owns the controller's sockets (its copy of the Step stream, every worker's BackupDone,
Committed/digests to the scheduler) and runs engine.cache.controller.CacheController.
"""

from __future__ import annotations

import sys
import time

import zmq

from engine.cache.controller import CacheController, L3Tier, SlabMapping
from msgs.channels import BACKUPS, COMMITS, CONTROL, STEPS, open_receiver, open_sender
from msgs.control import Fatal, Heartbeat, Ready
from msgs.done import ControllerFailed
from procs.child import start_child

ROLE = "cache"


def main() -> int:
    cfg, log, _ = start_child(ROLE)
    ctx = zmq.Context()
    control = open_sender(ctx, CONTROL, ROLE, cfg.run_dir, linger_ms=1000)
    steps = open_receiver(ctx, STEPS, ROLE, cfg.run_dir, follower=ROLE)
    backups = open_receiver(ctx, BACKUPS, ROLE, cfg.run_dir)
    commits = open_sender(ctx, COMMITS, ROLE, cfg.run_dir, linger_ms=1000)
    poller = zmq.Poller()
    poller.register(steps.sock, zmq.POLLIN)
    poller.register(backups.sock, zmq.POLLIN)
    slab = SlabMapping(cfg.hicache_path, cfg.tp_size)  # one region per tp rank; cp ranks share it
    l3 = L3Tier(slab, cfg.l3_dir, int(cfg.l3_size * 2**30)) if cfg.l3_dir else None
    controller = CacheController(cfg.world_size, steps, backups, commits, [slab], l3=l3)
    control.send(Ready(proc=ROLE))
    heartbeat = Heartbeat(ROLE, control.send, time.monotonic())  # a stuck controller is found by its silence
    try:
        controller.run(wait=poller.poll, beat=lambda: heartbeat.tick(time.monotonic()))
    except Exception as exc:  # fatal by design: tell the scheduler and the supervisor, exit non-zero
        log.exception("cache controller failed", error=str(exc))
        commits.send(ControllerFailed(reason=str(exc)))
        control.send(Fatal(proc=ROLE, reason=str(exc)))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
