"""Worker process: `python -m procs.worker --config PATH --rank R`.

With --nnodes > 1 its Step stream and `done` are tcp connections to node 0's scheduler
(msgs/channels.TcpPlan), and the Step stream is watched (`WatchedSteps`): a connection to the
scheduler that stays down LOST_STREAM_S (node 0's scheduler exited, or its host vanished and
the zmq heartbeat timed out) is fatal, so a worker on another node never waits for Steps
forever."""

from __future__ import annotations

import signal
import sys
import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from engine.config import ServerConfig
from msgs.channels import BACKUPS, CONTROL, DONE, STEPS, Receiver, open_receiver, open_sender
from msgs.control import Fatal, Ready
from msgs.done import WorkerFailed
from procs.child import start_child


def main() -> int:
    cfg, log, rank = start_child("worker", with_rank=True)
    assert rank is not None
    ctx = zmq.Context()
    # bounded linger: Fatal / WorkerFailed get out, but a dead peer never holds up the exit
    control = open_sender(ctx, CONTROL, "worker", cfg.run_dir, linger_ms=1000)
    net = cfg.net  # None on one node: ipc in the run dir
    steps_in = open_receiver(ctx, STEPS, "worker", cfg.run_dir, rank=rank, net=net)
    steps: Any = steps_in if net is None else WatchedSteps(steps_in, STEPS.address(cfg.run_dir, rank, net=net))
    done = open_sender(ctx, DONE, "worker", cfg.run_dir, linger_ms=1000, net=net)
    pipeline = None
    try:
        from engine.run.fingerprint import WithL3Identity, l3_ready_fields
        from engine.run.pipeline import WorkerPipeline  # heavy imports after sockets: fail fast on bad config
        from engine.run.runner import ModelRunner

        runner = ModelRunner(cfg, rank, served=True)
        ready_out = WithL3Identity(done, l3_ready_fields(cfg, runner))
        pipeline = WorkerPipeline(runner, steps, _with_backups(cfg, ctx, ready_out, runner, rank))
        pipeline.start()
        info = {k: f"{v:.1f}" for k, v in runner.startup.items()}
        info["deterministic"] = "on" if runner.deterministic else "off"
        info["dtype"] = str(runner.dtype).removeprefix("torch.")  # --dtype auto depends on the machine
        control.send(Ready(proc="worker", rank=rank, info=info))
        pipeline.run()
        code = 0
    except Exception as exc:  # fatal by design: report, exit non-zero
        log.exception("worker failed", error=str(exc))
        seq = pipeline.last_seq if pipeline is not None else -1
        # the supervisor hears it first: the scheduler exits on WorkerFailed, and an exit seen
        # before this report would be taken for its cause (ChildSet.cause)
        control.send(Fatal(proc="worker", rank=rank, reason=str(exc)))
        done.send(WorkerFailed(rank=rank, seq=seq, reason=str(exc)))
        code = 1
    finally:
        # exiting now: the supervisor's SIGTERM (sent on a failed start) must not raise SystemExit
        # inside zmq's Context.__del__ while its bounded linger runs ("Exception ignored ...")
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if "engine.run.dist" in sys.modules:  # tp > 1: leave the group, never waiting on it forever
            sys.modules["engine.run.dist"].shutdown_distributed(1)
    return code


LOST_STREAM_S = 5.0  # the scheduler's connection down this long: node 0 is gone
CHECK_EVERY_S = 0.1  # how often a busy worker looks at the connection's events
WAIT_SLICE_MS = 200  # an idle worker's blocking wait, in slices, between looks


class StreamLost(RuntimeError):
    pass


class WatchedSteps:
    """The Step stream's receiving end over tcp (an `Inbox`), watched through a zmq socket
    monitor: a disconnect not followed by a reconnect within lost_s raises StreamLost from
    poll(). Frames already received are delivered first (a Shutdown sent just before the
    scheduler exited still arrives). poll(-1) waits in slices, looking in between."""

    def __init__(self, inner: Receiver[Any], address: str, lost_s: float = LOST_STREAM_S) -> None:
        self.inner = inner
        self.address = address
        self.lost_s = lost_s
        self.monitor = inner.sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        )
        self.down_since: float | None = None
        self.next_check = 0.0

    def _check(self, now: float) -> None:
        self.next_check = now + CHECK_EVERY_S
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self.down_since = self.down_since or now
            else:
                self.down_since = None
        if self.down_since is not None and now - self.down_since >= self.lost_s:
            raise StreamLost(f"lost the Step stream from node 0's scheduler ({self.address}): "
                             f"disconnected for {now - self.down_since:.1f} s")

    def poll(self, timeout_ms: int = 0) -> bool:
        deadline = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000
        while True:
            if self.inner.poll(0):
                return True
            now = time.monotonic()
            if now >= self.next_check:
                self._check(now)
            if deadline is not None and now >= deadline:
                return False
            wait = WAIT_SLICE_MS if deadline is None else min(WAIT_SLICE_MS, int((deadline - now) * 1000) + 1)
            if self.inner.poll(wait):
                return True

    def recv(self) -> Any:
        return self.inner.recv()


def _with_backups(cfg: ServerConfig, ctx: zmq.Context, done: Any, runner: Any, rank: int) -> Any:
    """With the host tier on, every backup this rank copies is reported to the cache controller."""
    if not cfg.enable_hierarchical_cache:
        return done
    from engine.run.host_tier import WithBackups

    backups = open_sender(ctx, BACKUPS, "worker", cfg.run_dir, linger_ms=1000)
    return WithBackups(done, backups, runner.host_tier, rank)


if __name__ == "__main__":
    sys.exit(main())
