"""Worker process: `python -m procs.worker --config PATH --rank R`."""

from __future__ import annotations

import sys
from typing import Any

import msgspec
import zmq

from engine.config import ServerConfig
from msgs.channels import BACKUPS, CONTROL, DONE, STEPS, open_receiver, open_sender
from msgs.control import Fatal, Ready
from msgs.done import WorkerFailed, WorkerReady
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
        ready_out = WithL3Identity(done, l3_ready_fields(cfg, runner))
        pipeline = WorkerPipeline(runner, steps, _with_backups(cfg, ctx, ready_out, runner, rank))
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

def l3_ready_fields(cfg: ServerConfig, runner: Any) -> dict[str, Any]:
    """What the scheduler needs of this rank for the disk tier: the page layout's layers and,
    with --l3-dir, the model fingerprint (the worker knows the weights)."""
    fields: dict[str, Any] = {"num_layers": runner.mcfg.num_layers}
    if cfg.l3_dir and cfg.enable_hierarchical_cache:
        from engine.run.fingerprint import worker_fingerprint

        fields["l3_fingerprint"] = worker_fingerprint(
            cfg, runner.dtype, runner.kv_dtype, runner.host_tier.page_bytes, runner.mcfg.num_layers
        )
    return fields


class WithL3Identity:
    """The worker's `done` outbox, with the L3 fields filled into its WorkerReady."""

    def __init__(self, done: Any, fields: dict[str, Any]) -> None:
        self.done, self.fields = done, fields

    def send(self, msg: Any) -> None:
        if isinstance(msg, WorkerReady):
            msg = msgspec.structs.replace(msg, **self.fields)
        self.done.send(msg)


def _with_backups(cfg: ServerConfig, ctx: zmq.Context, done: Any, runner: Any, rank: int) -> Any:
    """With the host tier on, every backup this rank copies is reported to the cache controller."""
    if not cfg.enable_hierarchical_cache:
        return done
    from engine.run.host_tier import WithBackups

    backups = open_sender(ctx, BACKUPS, "worker", cfg.run_dir, linger_ms=1000)
    return WithBackups(done, backups, runner.host_tier, rank)


if __name__ == "__main__":
    sys.exit(main())
