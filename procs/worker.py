"""Worker process: `python -m procs.worker --config PATH --rank R`."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

import zmq

from engine.config import ServerConfig
from engine.logs import setup_logging
from msgs.channels import BACKUPS, CONTROL, DONE, STEPS, open_receiver, open_sender
from msgs.control import Fatal, Ready
from msgs.done import WorkerFailed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--rank", type=int, default=0)
    args = ap.parse_args()
    cfg = ServerConfig.from_json(open(args.config).read())
    log = setup_logging("worker", cfg.log_dir, rank=args.rank)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ctx = zmq.Context()
    # bounded linger: Fatal / WorkerFailed get out, but a dead peer never holds up the exit
    control = open_sender(ctx, CONTROL, "worker", cfg.run_dir, linger_ms=1000)
    steps = open_receiver(ctx, STEPS, "worker", cfg.run_dir, rank=args.rank)
    done = open_sender(ctx, DONE, "worker", cfg.run_dir, linger_ms=1000)
    pipeline = None
    try:
        from engine.run.pipeline import WorkerPipeline  # heavy imports after sockets: fail fast on bad config
        from engine.run.runner import ModelRunner

        runner = ModelRunner(cfg, args.rank)
        pipeline = WorkerPipeline(runner, steps, _with_backups(cfg, ctx, done, runner, args.rank))
        pipeline.start()
        control.send(Ready(proc="worker", rank=args.rank, info={k: f"{v:.1f}" for k, v in runner.startup.items()}))
        pipeline.run()
        code = 0
    except Exception as exc:  # fatal by design: report, exit non-zero
        log.exception("worker failed", error=str(exc))
        seq = pipeline.last_seq if pipeline is not None else -1
        done.send(WorkerFailed(rank=args.rank, seq=seq, reason=str(exc)))
        control.send(Fatal(proc="worker", rank=args.rank, reason=str(exc)))
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
