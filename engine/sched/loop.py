"""The scheduler process's event loop: sockets around SchedulerCore.

Overlap (DESIGN.md section 5): with overlap on, step N+1 is planned and sent before the
result of step N is processed, so the worker always has the next step queued while the
scheduler works; at most one step runs ahead.
"""

from __future__ import annotations

import time
from collections import deque

import structlog
import zmq

from engine.config import ServerConfig
from engine.env import env
from engine.sched.scheduler import SchedConfig, SchedulerCore
from msgs import done as done_ch
from msgs import outputs as out_ch
from msgs import requests as req_ch
from msgs import steps as step_ch
from msgs.codec import DROPPED
from msgs.control import Ready
from msgs.control import codec as control_codec
from msgs.done import StepDone, WorkerFailed, WorkerReady
from msgs.outputs import ReqOutput, SchedulerStats, TokenBatch
from msgs.requests import AbortRequest, TokenizedRequest

log = structlog.get_logger()
STATS_INTERVAL_S = 0.1


class WorkerFailure(RuntimeError):
    pass


class SchedulerLoop:
    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.ctx = zmq.Context()
        self.req_in = self._sock(zmq.PULL, bind="scheduler")
        self.done_in = self._sock(zmq.PULL, bind="done")
        self.out = self._sock(zmq.PUSH, connect="tokenizer")
        self.control = self._sock(zmq.PUSH, connect="control")
        self.steps = [self._sock(zmq.PUSH, connect=f"step-{r}") for r in range(cfg.tp_size)]
        self.core: SchedulerCore | None = None
        self.max_context = 0
        self.vocab_size = 0
        self.inflight: deque[int] = deque()
        self.done_ranks: dict[int, int] = {}
        self.step_seconds: list[float] = []
        self.last_stats = 0.0
        self.stats_dirty = True
        self.leak_free = True

    def _sock(self, kind: int, bind: str = "", connect: str = "") -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.PUSH:
            sock.setsockopt(zmq.SNDHWM, 0)  # never drop a Step or an output
        if bind:
            sock.bind(self.cfg.ipc(bind))
        else:
            sock.connect(self.cfg.ipc(connect))
        return sock

    # ---- start-up ----------------------------------------------------------------------

    def wait_for_workers(self) -> None:
        readies: dict[int, WorkerReady] = {}
        while len(readies) < self.cfg.tp_size:
            msg = done_ch.codec.decode(self.done_in.recv())
            if isinstance(msg, WorkerReady):
                readies[msg.rank] = msg
            elif isinstance(msg, WorkerFailed):
                raise WorkerFailure(f"worker {msg.rank}: {msg.reason}")
        first = readies[0]
        self.max_context = first.max_context
        self.vocab_size = first.vocab_size
        self.core = SchedulerCore(
            SchedConfig(
                num_pages=first.num_pages,
                page_size=first.page_size,
                max_running=self.cfg.max_running_requests,
                max_prefill_tokens=self.cfg.max_prefill_tokens,
                max_context=first.max_context,
                eos_token_ids=tuple(first.eos_token_ids),
                vocab_size=first.vocab_size,
                enable_radix=not self.cfg.disable_radix_cache,
                seed=self.cfg.seed,
                digest_every=env().digest_every,
                num_ranks=self.cfg.tp_size,
            )
        )
        log.info("workers ready", num_pages=first.num_pages, max_context=first.max_context)
        self.control.send(control_codec.encode(Ready(proc="scheduler", info={"pages": str(first.num_pages)})))
        self._send_stats(force=True)

    # ---- main loop ---------------------------------------------------------------------

    def run(self) -> None:
        self.wait_for_workers()
        max_ahead = 1 if self.cfg.disable_overlap else 2
        poller = zmq.Poller()
        poller.register(self.req_in, zmq.POLLIN)
        poller.register(self.done_in, zmq.POLLIN)
        while True:
            self._drain_requests()
            while len(self.inflight) < max_ahead and self._send_next():
                pass
            events = dict(poller.poll(5 if self.inflight else 50))
            if self.done_in in events:
                self._drain_done()
            self._maybe_check_leaks()
            self._send_stats()

    def _send_next(self) -> bool:
        assert self.core is not None
        step = self.core.plan()
        if step is None:
            return False
        frame = step_ch.codec.encode(step)
        for sock in self.steps:
            sock.send(frame)
        self.inflight.append(step.seq)
        self.done_ranks[step.seq] = 0
        return True

    def _drain_requests(self) -> None:
        assert self.core is not None
        outs: list[ReqOutput] = []
        while self.req_in.poll(0):
            msg = req_ch.codec.decode(self.req_in.recv())
            if isinstance(msg, TokenizedRequest):
                err = self._submit(msg)
                log.info("request", rid=msg.rid, prompt_tokens=len(msg.input_ids) // 4, rejected=err is not None)
            elif isinstance(msg, AbortRequest):
                err = self.core.abort(msg.rid)
                log.info("abort", rid=msg.rid, found=err is not None)
            else:
                self.stats_dirty = True  # a dropped frame: the count goes out with the stats
                continue
            if err is not None:
                outs.append(err)
        self._emit(outs)

    def _submit(self, msg: TokenizedRequest) -> ReqOutput | None:
        """Queue a request; a bug that concerns one request fails that request only."""
        assert self.core is not None
        try:
            return self.core.submit(msg)
        except Exception as exc:  # noqa: BLE001 - defence in depth (submit checks before it queues)
            log.exception("request rejected by an internal error", rid=msg.rid)
            return ReqOutput(rid=msg.rid, new_ids=[], finish_reason="error", error=f"internal error: {exc}")

    def _drain_done(self) -> None:
        assert self.core is not None
        outs: list[ReqOutput] = []
        while self.done_in.poll(0):
            msg = done_ch.codec.decode(self.done_in.recv())
            if isinstance(msg, WorkerFailed):
                raise WorkerFailure(f"worker {msg.rank} failed at step {msg.seq}: {msg.reason}")
            if not isinstance(msg, StepDone):
                continue
            if msg.rank == 0:
                outs.extend(self.core.on_done(msg))
                self.step_seconds.append(msg.forward_s)
            elif msg.digest is not None:
                self.core.check_digest(msg.seq, msg.digest, msg.rank)
            self.done_ranks[msg.seq] += 1
            while self.inflight and self.done_ranks[self.inflight[0]] == self.cfg.tp_size:
                del self.done_ranks[self.inflight.popleft()]
        self._emit(outs)

    def _emit(self, outs: list[ReqOutput]) -> None:
        if outs:
            self.out.send(out_ch.codec.encode(TokenBatch(outs=outs)))
            self.stats_dirty = True

    def _maybe_check_leaks(self) -> None:
        assert self.core is not None
        # not while FreeReq ops are unpublished: leak_free() would pass vacuously
        if self.core.idle and not self.inflight and not self.core.pending_ops and self.stats_dirty:
            ok = self.core.leak_free()
            if not ok:
                log.error("page leak detected while idle", free=self.core.alloc.num_free)
            self.leak_free = ok

    def _send_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and (not self.stats_dirty or now - self.last_stats < STATS_INTERVAL_S):
            return
        core = self.core
        assert core is not None
        stats = SchedulerStats(
            ready=True,
            max_context=self.max_context,
            vocab_size=self.vocab_size,
            kv_pages_total=core.alloc.capacity,
            kv_pages_used=core.alloc.num_used,
            cache_pages=core.cache.total_pages,
            running=len(core.running),
            waiting=len(core.waiting),
            cache_hit_tokens=core.cache_hit_tokens,
            step_seconds=self.step_seconds,
            leak_free=self.leak_free,
            dropped_frames=dict(DROPPED),
        )
        self.out.send(out_ch.codec.encode(stats))
        self.step_seconds = []
        self.last_stats = now
        self.stats_dirty = bool(self.inflight or not core.idle or core.pending_ops)
