"""Worker process: `python -m procs.worker --config PATH --rank R`."""

from __future__ import annotations

import sys
from typing import Any

import zmq

from engine.config import ServerConfig
from msgs.channels import BACKUPS, CONTROL, DONE, STEPS, open_receiver, open_sender
from msgs.control import Fatal, Ready
from msgs.done import WorkerFailed
from procs.child import start_child


def main() -> int:
    cfg, log, rank = start_child("worker", with_rank=True)
    assert rank is not None
    ctx = zmq.Context()
    # bounded linger: Fatal / WorkerFailed get out, but a dead peer never holds up the exit
    control = open_sender(ctx, CONTROL, "worker", cfg.run_dir, linger_ms=1000)
    steps = open_receiver(ctx, STEPS, "worker", cfg.run_dir, rank=rank)
    done = open_sender(ctx, DONE, "worker", cfg.run_dir, linger_ms=1000)
    pipeline = None
    try:
        from engine.run.pipeline import WorkerPipeline  # heavy imports after sockets: fail fast on bad config
        from engine.run.runner import ModelRunner

        runner = ModelRunner(cfg, rank)
        pipeline = WorkerPipeline(runner, steps, _with_backups(cfg, ctx, done, runner, rank))
        pipeline.start()
        control.send(Ready(proc="worker", rank=rank, info={k: f"{v:.1f}" for k, v in runner.startup.items()}))
        pipeline.run()
        code = 0
    except Exception as exc:  # fatal by design: report, exit non-zero
        log.exception("worker failed", error=str(exc))
        seq = pipeline.last_seq if pipeline is not None else -1
        done.send(WorkerFailed(rank=rank, seq=seq, reason=str(exc)))
        control.send(Fatal(proc="worker", rank=rank, reason=str(exc)))
        code = 1
    finally:
        if "engine.run.dist" in sys.modules:  # tp > 1: leave the group, never waiting on it forever
            sys.modules["engine.run.dist"].shutdown_distributed(1)
    return code

def _with_backups(cfg: ServerConfig, ctx: zmq.Context, done: Any, runner: Any, rank: int) -> Any:
    """With the host tier on, every backup this rank copies is reported to the cache controller."""
    if not cfg.enable_hierarchical_cache:
        return done
    from engine.run.host_tier import WithBackups

    backups = open_sender(ctx, BACKUPS, "worker", cfg.run_dir, linger_ms=1000)
    return WithBackups(done, backups, runner.host_tier, rank)


if __name__ == "__main__":
    sys.exit(main())
