"""Worker process: `python -m procs.worker --config PATH --rank R`."""

from __future__ import annotations

import argparse
import signal
import sys
from collections import deque

import zmq

from engine.config import ServerConfig
from engine.logs import setup_logging
from msgs import done as done_ch
from msgs import steps as step_ch
from msgs.control import Fatal, Ready
from msgs.control import codec as control_codec
from msgs.done import WorkerFailed
from msgs.steps import Shutdown, Step


def serve_steps(runner, steps: zmq.Socket, done: zmq.Socket) -> None:  # noqa: ANN001
    """Launch each Step as it arrives; while one runs on the device, launch the next before
    waiting for the first's results (at most two in flight), so the device never idles on
    the host between steps."""
    pending: deque = deque()
    while True:
        if pending and (len(pending) == 2 or runner.ready(pending[0])):
            done.send(done_ch.codec.encode(runner.finish(pending.popleft())))
            continue
        if pending and not steps.poll(0, zmq.POLLIN):
            continue  # spin: the running step may be ready now (a GPU worker owns its core)
        msg = step_ch.codec.decode(steps.recv())
        if isinstance(msg, Shutdown):
            return
        if isinstance(msg, Step):
            pending.append(runner.launch(msg))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--rank", type=int, default=0)
    args = ap.parse_args()
    cfg = ServerConfig.from_json(open(args.config).read())
    log = setup_logging("worker", cfg.log_dir, rank=args.rank)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ctx = zmq.Context()
    control = ctx.socket(zmq.PUSH)
    control.connect(cfg.ipc("control"))
    steps = ctx.socket(zmq.PULL)
    steps.bind(cfg.ipc(f"step-{args.rank}"))
    done = ctx.socket(zmq.PUSH)
    done.setsockopt(zmq.SNDHWM, 0)
    done.connect(cfg.ipc("done"))
    try:
        from engine.run.runner import ModelRunner  # heavy import after sockets: fail fast on bad config

        runner = ModelRunner(cfg, args.rank)
        done.send(done_ch.codec.encode(runner.ready_msg()))
        control.send(control_codec.encode(Ready(proc="worker", rank=args.rank)))
        serve_steps(runner, steps, done)
        return 0
    except Exception as exc:  # fatal by design: report, exit non-zero
        log.exception("worker failed", error=str(exc))
        done.send(done_ch.codec.encode(WorkerFailed(rank=args.rank, seq=-1, reason=str(exc))))
        control.send(control_codec.encode(Fatal(proc="worker", rank=args.rank, reason=str(exc))))
        return 1


if __name__ == "__main__":
    sys.exit(main())
