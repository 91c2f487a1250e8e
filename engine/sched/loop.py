"""The scheduler's driver: messages in, messages out, around SchedulerCore.

`SchedulerLoop` owns no socket. It reads from `Inbox`es and writes to `Outbox`es (see
msgs/channels.py): procs/scheduler.py hands it zmq ends, tests hand it in-memory pipes and
call `pump()` themselves, with no sleep and no private method.

Overlap (docs/architecture.md, Scheduling): with overlap on, step N+1 is planned and sent before the
result of step N is processed, so the worker always has the next step queued while the
scheduler works; at most one step runs ahead.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog

from engine.config import ServerConfig
from engine.env import env
from engine.sched.scheduler import SchedConfig, SchedulerCore
from msgs.channels import Inbox, Outbox
from msgs.codec import DROPPED, id_count
from msgs.control import Heartbeat, Ready, ToSupervisor
from msgs.done import (
    ControllerDigest,
    ControllerFailed,
    FromController,
    FromWorker,
    GrammarReady,
    L3Loaded,
    StepDone,
    WorkerFailed,
    WorkerReady,
)
from msgs.outputs import FlushDone, ReqOutput, SchedulerStats, TokenBatch, ToTokenizer
from msgs.requests import AbortRequest, FlushCache, TokenizedRequest, ToScheduler
from msgs.steps import ToWorker

log = structlog.get_logger()
STATS_INTERVAL_S = 0.1
FLUSH_SETTLE_S = 10.0  # how long a flush waits for in-flight steps and backups before a 409
OCCUPANCY_LOG_S = 1.0  # at most one `cache occupancy` line a second, and only after a change
# the page counts of SchedulerStats that the `cache occupancy` line carries (bin/analyze reads them)
OCCUPANCY_FIELDS = ("kv_pages_used", "kv_pages_total", "cache_pages", "running", "waiting")
TIER_OCCUPANCY_FIELDS = ("l2_pages_used", "l2_pages_total", "l3_files", "l3_bytes")
STALL_LOG_S = 10.0  # running requests with no step in flight or plannable this long: an error line, one per period
BURST_WAIT_CAP = 10  # an idle engine's first step waits at most this many --batch-wait-ms in all


class WorkerFailure(RuntimeError):
    """A worker reported failure (or never became ready): fatal for the engine. `rank`: the one
    rank known to be at fault (the watchdog's, where only it has not answered), so the supervisor
    names that worker, not the scheduler."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


@dataclass
class SchedulerPorts:
    requests: Inbox[ToScheduler]  # from the tokenizer
    done: Inbox[FromWorker]  # from every rank
    outputs: Outbox[ToTokenizer]
    steps: list[Outbox[ToWorker]]  # one per rank, the same Step to each
    control: Outbox[ToSupervisor]
    cache_steps: Outbox[ToWorker] | None = None  # the cache controller's copy of the Step stream
    commits: Inbox[FromController] | None = None  # from the cache controller


class SchedulerLoop:
    def __init__(self, cfg: ServerConfig, ports: SchedulerPorts, stats_interval_s: float = STATS_INTERVAL_S) -> None:
        self.cfg = cfg
        self.clock: Callable[[], float] = time.monotonic  # the burst wait's (tests step it by hand)
        self.heartbeat: Heartbeat | None = None  # Alive to the supervisor, from ready on
        self.batch_wait_s = 0.0  # --batch-wait-ms, resolved for the workers' device at start
        self.burst: tuple[float, float] | None = None  # first and last arrival at an idle engine, until a step
        self.held_s = 0.0  # how much longer this pass's burst wait lasts (0: none)
        self.ports = ports
        self.num_ranks = len(ports.steps)
        self.max_ahead = 1 if cfg.disable_overlap else 2
        self.stats_interval_s = stats_interval_s
        self.core: SchedulerCore | None = None
        self.ready: WorkerReady | None = None
        self.readies: dict[int, WorkerReady] = {}
        self.inflight: deque[int] = deque()
        self.flushes: deque[tuple[int, float]] = deque()  # flush ids waiting for steps to settle, deadline
        self.done_ranks: dict[int, set[int]] = {}  # per step in flight: the ranks whose StepDone came
        self.progress_at = 0.0  # when a StepDone last came in, or a step went out to idle workers
        self.step_seconds: list[float] = []
        self.expert_tokens: dict[int, list[int]] | None = None  # rank 0's latest, until the next stats
        self.last_stats = -stats_interval_s
        self.stats_dirty = True
        self.leak_free = True
        self.occupancy: dict[str, int] = {}  # the figures of the last stats sent
        self.occupancy_logged: dict[str, int] = {}
        self.occupancy_logged_at = -OCCUPANCY_LOG_S
        self.setup_seq: int | None = None  # the set-up Step (host tier) that ready waits for
        self.spec_logged: tuple[int, float] = (0, -OCCUPANCY_LOG_S)  # verify rows answered at the last line, when
        self.stalled_at: float | None = None  # since when running requests got no step (None: they do)
        self.stall_logged_at = 0.0

    # ---- start-up ----------------------------------------------------------------------

    def on_worker_ready(self, msg: FromWorker) -> bool:
        """Collect WorkerReady from every rank; True once all are in and the core exists."""
        if isinstance(msg, WorkerFailed):
            raise WorkerFailure(f"worker {msg.rank}: {msg.reason}", msg.rank)
        if isinstance(msg, WorkerReady):
            self.readies[msg.rank] = msg
        if len(self.readies) < self.num_ranks:
            return False
        if self.cfg.enable_hierarchical_cache and len({r.page_bytes for r in self.readies.values()}) > 1:
            # one slab, one region per rank, one page size in HostInit: ranks must agree
            sizes = {rank: r.page_bytes for rank, r in sorted(self.readies.items())}
            raise WorkerFailure(f"the host tier needs KV pages of one size on every rank; bytes a page: {sizes}")
        self._start(agree(self.readies))
        return True

    def _start(self, first: WorkerReady) -> None:
        self.ready = first
        self.batch_wait_s = self.cfg.batch_wait_s(first.device_type)
        self.core = SchedulerCore(SchedConfig.build(self.cfg, first, self.num_ranks, env().digest_every))
        log.info("workers ready", num_pages=first.num_pages, max_context=first.max_context, ranks=self.num_ranks)
        if self.core.state.cache.changes and self._send_next():
            # set-up ops (HostInit: every worker maps and pins the host slab, which takes
            # seconds per 10 GB) run in a Step of their own now, and ready waits for it: the
            # first request must not pay for them (ready means warm)
            self.setup_seq = self.inflight[-1]
            return
        self._announce()

    def _announce(self) -> None:
        assert self.ready is not None
        self.heartbeat = Heartbeat("scheduler", self.ports.control.send, self.clock())  # Ready: the first sign
        self.ports.control.send(Ready(proc="scheduler", info={"pages": str(self.ready.num_pages),
                                                              "max_context": str(self.ready.max_context)}))
        self._send_stats(force=True)

    # ---- one pass ----------------------------------------------------------------------

    def pump(self) -> None:
        """One non-blocking pass: requests in, steps out, results in, outputs and stats out."""
        if self.core is None:
            for msg in _drain(self.ports.done):
                if self.on_worker_ready(msg):
                    break
            return
        # results first, then plan: a StepDone that frees an in-flight slot is answered by
        # the next Step in this same pass, not after the next wait (which would sleep until
        # the following StepDone and leave the worker one step ahead instead of two)
        self._drain_requests()
        self._drain_done()
        self._watchdog()
        self._drain_commits()
        if self.flushes:
            self._flush()
        self.held_s = self._burst_wait_left()
        while not self.held_s and len(self.inflight) < self.max_ahead and self._send_next():
            pass
        self._maybe_check_leaks()
        self._check_stall()
        self._beat()
        self._send_stats()
        self._maybe_log_occupancy()
        self._maybe_log_spec()

    def run(self, wait: Callable[[int], None]) -> None:
        """The process loop: pump, then `wait(timeout_ms)` for input (a zmq poll)."""
        while True:
            self.pump()
            if self.held_s:
                wait(max(1, math.ceil(self.held_s * 1e3)))
            else:
                wait(5 if self.inflight or self.core is None else 50)

    def _burst_wait_left(self) -> float:
        """Seconds the first step of an idle engine still waits for more of a burst (0: plan now).

        Requests sent together reach the scheduler spread over milliseconds (the tokenizer takes
        them one by one). Planned at the first arrival, the first step would prefill what had come
        and the next step the rest beside their decodes: on a CPU, where a prefill step takes
        100s of ms, that is one more long step than one batch of all (docs/architecture.md,
        Scheduling). So the step waits until no request has come for --batch-wait-ms, at most
        BURST_WAIT_CAP times it from the first."""
        if self.burst is None or not self.batch_wait_s:
            return 0.0
        first, last = self.burst
        left = min(last + self.batch_wait_s, first + BURST_WAIT_CAP * self.batch_wait_s) - self.clock()
        return max(left, 0.0)

    def _send_next(self) -> bool:
        assert self.core is not None
        step = self.core.plan()
        if step is None:
            return False
        if not self.inflight:  # the workers were idle: the watchdog counts from here
            self.progress_at = self.clock()
        for out in self.ports.steps:
            out.send(step)
        if self.ports.cache_steps is not None:
            self.ports.cache_steps.send(step)
        self.inflight.append(step.seq)
        self.done_ranks[step.seq] = set()
        self.burst = None
        return True

    def _drain_requests(self) -> None:
        assert self.core is not None
        outs: list[ReqOutput] = []
        while self.ports.requests.poll(0):
            msg = self.ports.requests.recv()
            self.stats_dirty = True  # running / waiting change (a request that gets no step shows in /metrics)
            if isinstance(msg, TokenizedRequest):
                err = self._submit(msg)
                if err is None and self.batch_wait_s and not self.inflight and not self.core.state.running:
                    now = self.clock()  # a burst at an idle engine: its first step waits for the rest
                    self.burst = (self.burst[0] if self.burst else now, now)
                log.info("request", rid=msg.rid, prompt_tokens=id_count(msg.input_ids), rejected=err is not None)
            elif isinstance(msg, AbortRequest):
                err = self.core.abort(msg.rid)
                log.info("abort", rid=msg.rid, found=err is not None)
            elif isinstance(msg, FlushCache):
                self.flushes.append((msg.id, time.monotonic() + FLUSH_SETTLE_S))
                self._flush()
                continue
            else:  # a dropped frame: the count goes out with the stats
                continue
            if err is not None:
                outs.append(err)
        self._emit(outs)

    def _flush(self) -> None:
        """Answer the flushes asked for. One asked right after the last answer finds that
        request's overlap step (or its backups) still in flight: it waits for them, up to
        FLUSH_SETTLE_S, rather than answering 409 to a client whose requests all returned."""
        assert self.core is not None
        while self.flushes:
            fid, deadline = self.flushes[0]
            problem = self.core.flush()
            if problem is not None and not self.core.busy and time.monotonic() < deadline:
                return
            self.flushes.popleft()
            log.info("flush cache", done=problem is None, problem=problem)
            if problem is None:  # the emptied pool's gauges before the answer (same socket, in order)
                self._send_stats(force=True)
            self.ports.outputs.send(FlushDone(id=fid, ok=problem is None, message=problem or ""))
            self.stats_dirty = True

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
        for msg in _drain(self.ports.done):
            if isinstance(msg, WorkerFailed):
                raise WorkerFailure(f"worker {msg.rank} failed at step {msg.seq}: {msg.reason}", msg.rank)
            if isinstance(msg, GrammarReady):
                outs.extend(self.core.on_grammar_ready(msg))
                continue
            if not isinstance(msg, StepDone):
                continue
            self.progress_at = self.clock()
            outs.extend(self.core.on_done(msg))
            if msg.rank == 0:
                self.step_seconds.append(msg.forward_s)
                if msg.expert_tokens is not None:
                    self.expert_tokens, self.stats_dirty = msg.expert_tokens, True
            self.done_ranks[msg.seq].add(msg.rank)
            while self.inflight and len(self.done_ranks[self.inflight[0]]) == self.num_ranks:
                seq = self.inflight.popleft()
                del self.done_ranks[seq]
                if seq == self.setup_seq:
                    self.setup_seq = None
                    self._announce()
        self._emit(outs)

    def _beat(self) -> None:
        """Alive to the supervisor from this loop: a scheduler stuck between passes is found by its
        silence (procs/supervisor.py), and its clients are told."""
        if self.heartbeat is not None:
            self.heartbeat.tick(self.clock())

    def _watchdog(self) -> None:
        """--watchdog-timeout: a step in flight with no StepDone from any rank for that long (a worker
        stuck in a kernel or a collective, stopped, swapping) stops the server with the stuck ranks
        named: its clients get a 503 (the supervisor's ProcessDied) instead of waiting forever. Where
        some ranks answered, the others are the stuck ones (one alone is blamed as that worker);
        where none of several did, a stuck rank may be holding the rest in a collective; a lone
        rank that did not answer is the one at fault (the supervisor names worker-0, not the
        scheduler)."""
        if not self.inflight or self.clock() - self.progress_at <= self.cfg.watchdog_timeout:
            return
        seq = self.inflight[0]
        missing = sorted(set(range(self.num_ranks)) - self.done_ranks[seq])
        waits = (f"ranks {missing} have not answered (the others have)" if len(missing) < self.num_ranks
                 else f"no rank of {self.num_ranks} has answered")
        raise WorkerFailure(f"no step finished for {self.cfg.watchdog_timeout:g} s (--watchdog-timeout): step {seq}: "
                            f"{waits}", rank=missing[0] if len(missing) == 1 else None)

    def _check_stall(self) -> None:
        """A running request always has a row to plan (a prefill chunk or a decode), so running
        requests with no step in flight and none plannable are a scheduling bug that would
        otherwise hang every client in silence: an error line names it, every STALL_LOG_S."""
        assert self.core is not None
        if self.inflight or self.held_s or not self.core.state.running:
            self.stalled_at = None
            return
        now = self.clock()
        if self.stalled_at is None:
            self.stalled_at = now
        elif now - self.stalled_at >= STALL_LOG_S and now - self.stall_logged_at >= STALL_LOG_S:
            self.stall_logged_at = now
            s = self.core.state
            log.error("scheduler stalled: running requests but no step can be planned",
                      seconds=round(now - self.stalled_at, 1), running=[r.rid for r in s.running][:8],
                      waiting=len(s.waiting), free_pages=s.alloc.num_free, evictable_pages=s.cache.evictable_pages)

    def _drain_commits(self) -> None:
        """The cache controller's messages: commits become ApplyCommit ops in the next Step."""
        assert self.core is not None
        if self.ports.commits is None:
            return
        for msg in _drain(self.ports.commits):
            if isinstance(msg, ControllerFailed):
                raise WorkerFailure(f"cache controller failed: {msg.reason}")
            self.core.on_controller(msg)
            if isinstance(msg, L3Loaded):
                log.info("l3 load", obj=msg.obj, ok=msg.ok)
            self.stats_dirty |= not isinstance(msg, ControllerDigest)

    def _emit(self, outs: list[ReqOutput]) -> None:
        if outs:
            self.ports.outputs.send(TokenBatch(outs=outs))
            self.stats_dirty = True

    def _maybe_check_leaks(self) -> None:
        assert self.core is not None
        # not while FreeReq ops are unpublished: leak_free() would pass vacuously
        # nor while an L3 load holds its lock on the tree (it ends with an L3Loaded: checked then)
        tiers = self.core.state.tiers
        loading = tiers is not None and tiers.loading > 0
        if self.core.idle and not self.inflight and not self.core.pending_ops and self.stats_dirty and not loading:
            ok = self.core.leak_free()
            if not ok:
                log.error("page leak detected while idle", free=self.core.alloc.num_free)
            self.leak_free = ok

    def _send_stats(self, force: bool = False) -> None:
        if self.setup_seq is not None:  # not ready yet: no stats (they say ready)
            return
        now = time.monotonic()
        if not force and (not self.stats_dirty or now - self.last_stats < self.stats_interval_s):
            return
        core, ready = self.core, self.ready
        assert core is not None and ready is not None
        stats = SchedulerStats(
            ready=True,
            max_context=ready.max_context,
            vocab_size=ready.vocab_size,
            eos_token_ids=list(core.state.cfg.eos_token_ids),
            kv_pages_total=core.alloc.capacity,
            kv_pages_used=core.alloc.num_used,
            kv_pages_used_by_cp_rank=core.alloc.used_per_owner() if core.state.cfg.cp_size > 1 else None,
            cache_pages=core.cache.total_pages,
            evictable_pages=core.cache.total_pages - core.cache.locked_pages,  # O(1), not the host tier's walk
            running=len(core.running),
            waiting=len(core.waiting) + len(core.grammars),
            cache_hit_tokens=core.cache_hit_tokens,
            step_seconds=self.step_seconds,
            expert_tokens=self.expert_tokens,
            leak_free=self.leak_free,
            deterministic=ready.deterministic,
            dropped_frames=dict(DROPPED),
            spec_accept_hist=list(core.state.spec_stats.hist),
            spec_empty_rows=core.state.spec_stats.empty,
            spec_drafted=core.state.spec_stats.drafted,
            retractions=core.retractions,
            **(core.state.tiers.stats() if core.state.tiers is not None else {}),
        )
        self.ports.outputs.send(stats)
        fields = OCCUPANCY_FIELDS + (TIER_OCCUPANCY_FIELDS if core.state.tiers is not None else ())
        self.occupancy = {k: getattr(stats, k) for k in fields}
        self.step_seconds = []
        self.expert_tokens = None
        self.last_stats = now
        self.stats_dirty = bool(self.inflight or not core.idle or core.pending_ops)

    def _maybe_log_occupancy(self, now: float | None = None) -> bool:
        """One `cache occupancy` line (the page counts of the last stats sent) at most every
        OCCUPANCY_LOG_S, only when they changed since the last line: a change within the
        interval is logged once it has passed (pump runs at least every 50 ms)."""
        now = time.monotonic() if now is None else now
        if self.occupancy == self.occupancy_logged or now - self.occupancy_logged_at < OCCUPANCY_LOG_S:
            return False
        log.info("cache occupancy", **self.occupancy)
        self.occupancy_logged, self.occupancy_logged_at = dict(self.occupancy), now
        return True

    def _maybe_log_spec(self) -> None:
        """Speculative decoding: one `speculative decoding` line (cumulative verify rows,
        drafts proposed and accepted, the accept length, rows by drafts accepted, rows with none)
        at most every OCCUPANCY_LOG_S, when rows answered since the last one."""
        assert self.core is not None
        st, now = self.core.state.spec_stats, time.monotonic()
        answered = st.rows + st.empty
        if answered == self.spec_logged[0] or now - self.spec_logged[1] < OCCUPANCY_LOG_S:
            return
        log.info("speculative decoding", rows=st.rows, drafted=st.drafted, accepted=st.accepted,
                 accept_length=round(st.accept_length, 3), accept_hist=list(st.hist), chained=st.chained,
                 void=st.void, empty=st.empty, plain=st.plain, capped=st.capped)  # (the last two: batch-size rules)
        self.spec_logged = (answered, now)


def agree(readies: dict[int, WorkerReady]) -> WorkerReady:
    """What every rank can do: the smallest KV pool; everything else must be identical
    (ranks of one model and one config), else the engine cannot start."""
    first = readies[min(readies)]
    for rank, r in sorted(readies.items()):
        same = (r.page_size, r.max_context, r.vocab_size, r.eos_token_ids, r.l3_fingerprint, r.deterministic)
        if same != (first.page_size, first.max_context, first.vocab_size, first.eos_token_ids, first.l3_fingerprint,
                    first.deterministic):
            raise WorkerFailure(f"worker {rank} disagrees with worker {first.rank} on the model: {r} vs {first}")
    pages = min(r.num_pages for r in readies.values())
    return msgspec.structs.replace(first, num_pages=pages)


def _drain(inbox: Inbox[Any]) -> list[Any]:
    out = []
    while inbox.poll(0):
        msg = inbox.recv()
        if msg is not None:
            out.append(msg)
    return out
