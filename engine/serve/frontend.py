"""The async core of the tokenizer process: request registry and output routing.

    handle = frontend.submit(rid, ids, params)     # sends TokenizedRequest
    try:
        async for out in handle: ...               # ReqOutput, in order, until finished
    finally:
        handle.close()                             # aborts in the scheduler if unfinished

Everything here runs on one asyncio loop and never awaits between checking and changing
the registry, so the checks are race-free without locks. Messages to the scheduler go
through an outbox drained by `run_sender`, which lets `close()` be synchronous: it is
called from `finally` blocks of cancelled tasks, where awaiting is not an option.

When a server process dies, `process_died` fails every in-flight handle (its consumer gets
a `GenerationFailed` with status 503 naming the process) and every later submission, so
no client mistakes a crash for a finished answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import structlog

from engine.serve.errors import ApiError
from engine.serve.metrics import Metrics
from engine.serve.validate import Limits
from msgs import outputs, requests
from msgs.channels import AsyncReceiver, AsyncSender
from msgs.codec import pack_ids
from msgs.outputs import FlushDone, ReqOutput, SchedulerStats, TokenBatch
from msgs.params import SamplingParams
from msgs.requests import AbortRequest, FlushCache, TokenizedRequest

log = structlog.get_logger()


class GenerationFailed(ApiError):
    """A request the server could not finish: the scheduler failed it (500), or a server
    process died (503). An ApiError, so every front maps it like any other error."""

    def __init__(self, message: str, status: int = 500, code: str = "generation_failed") -> None:
        super().__init__(status, message, code=code)


class _Group:
    """The sub-requests of one API request; the parent rid stays taken until all end."""

    __slots__ = ("parent", "left")

    def __init__(self, parent: str, size: int) -> None:
        self.parent = parent
        self.left = size


class ReqHandle:
    """The output stream of one scheduler request. Outputs that arrived while the consumer
    was busy are merged into one (fewer, larger deltas under load).

    With `wake_each=False` the consumer is only woken by the final output: a
    non-streaming request without stop strings has nothing to do before then, and
    skipping a task switch per token is most of the per-token cost here."""

    def __init__(self, frontend: Frontend, rid: str, group: _Group, t0: float, wake_each: bool = True,
                 prompt_tokens: int = 0) -> None:
        self.rid = rid
        self.finished = False  # the scheduler sent the final output, or we closed it
        self._frontend = frontend
        self._group = group
        self._wake_each = wake_each
        self._pending: list[ReqOutput] = []
        self._waiter: asyncio.Future[None] | None = None
        self._t0: float | None = t0
        self._arrival = t0
        self._prompt_tokens = prompt_tokens
        self._generated = 0
        self.ttft: float | None = None  # seconds from arrival to the first token (logged when it finishes)
        self._failure: GenerationFailed | None = None  # raised once _pending is delivered

    def __aiter__(self) -> ReqHandle:
        return self

    async def __anext__(self) -> ReqOutput:
        if self.finished:
            raise StopAsyncIteration
        while not self._has_news():
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if not self._pending:  # failed, and every output that came before is delivered
            assert self._failure is not None
            self.finished = True
            self._frontend._release(self)
            raise self._failure
        outs, self._pending = self._pending, []
        out = outs[0] if len(outs) == 1 else merge_outputs(outs)
        if out.finish_reason is not None:
            self.finished = True
            self._frontend._release(self)
        return out

    def undelivered_tokens(self) -> int:
        """Tokens that came but the consumer never took: a non-streamed request is woken only by its
        final output, so one cancelled before it still generated these."""
        return sum(len(o.new_ids) for o in self._pending)

    def ended(self, reason: str) -> None:
        """Count how the request ended (strata_requests_finished_total)."""
        self._frontend.metrics.finished.labels(reason).inc()

    def close(self) -> None:
        """Stop this request; tells the scheduler to free it unless it already finished. Its rid
        stays taken until the scheduler's final output for it comes (Frontend._closing)."""
        if self.finished:
            return
        self.finished = True
        self._frontend._release(self)
        if not any(o.finish_reason is not None for o in self._pending):
            self._frontend._closing.add(self.rid)
        self._frontend.send(AbortRequest(rid=self.rid))

    def _has_news(self) -> bool:
        if self._failure is not None:
            return True
        return bool(self._pending) and (self._wake_each or self._pending[-1].finish_reason is not None)

    def _fail(self, exc: GenerationFailed) -> None:
        self._failure = exc
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _put(self, out: ReqOutput, now: float) -> None:
        if self._t0 is not None and out.new_ids:
            self.ttft = now - self._t0
            self._frontend.metrics.ttft.observe(self.ttft)
            self._t0 = None
        self._generated += len(out.new_ids)
        if out.finish_reason is not None and self.ttft is not None:
            e2e = now - self._arrival
            self._frontend.metrics.on_finish(e2e, e2e - self.ttft, self._prompt_tokens, self._generated)
        self._pending.append(out)
        waiter = self._waiter
        if waiter is not None and not waiter.done() and (self._wake_each or out.finish_reason is not None):
            waiter.set_result(None)


def merge_outputs(outs: list[ReqOutput]) -> ReqOutput:
    """Concatenate consecutive outputs of one request (the last one's counters win)."""
    last = outs[-1]
    ids = [t for o in outs for t in o.new_ids]
    lps = [x for o in outs for x in (o.logprobs or [])] if any(o.logprobs is not None for o in outs) else None
    tops = [x for o in outs for x in (o.top_logprobs or [])] if any(o.top_logprobs is not None for o in outs) else None
    return ReqOutput(
        rid=last.rid,
        new_ids=ids,
        finish_reason=last.finish_reason,
        error=last.error,
        prompt_tokens=last.prompt_tokens,
        cached_tokens=max(o.cached_tokens for o in outs),
        completion_tokens=last.completion_tokens,
        logprobs=lps,
        top_logprobs=tops,
        spec=next((o.spec for o in reversed(outs) if o.spec is not None), None),  # cumulative: the latest
        prompt_logprobs=next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None),  # (the first's)
        prompt_top_logprobs=next((o.prompt_top_logprobs for o in outs if o.prompt_top_logprobs is not None), None),
    )


class Frontend:
    """Registry of in-flight requests, the scheduler's latest stats, and the socket loops."""

    def __init__(self, metrics: Metrics | None = None) -> None:
        self.metrics = metrics or Metrics()
        self.stats: SchedulerStats | None = None
        self._reqs: dict[str, ReqHandle] = {}
        self._parents: set[str] = set()
        # rids closed before their final output came: the scheduler's answer to the abort (or the
        # final output already on its way) is still to come, and must not reach a new request
        # that reuses the rid, so the rid stays in flight until it does
        self._closing: set[str] = set()
        self._outbox: asyncio.Queue[requests.ToScheduler] = asyncio.Queue()
        self._ready = asyncio.Event()
        self.died: tuple[str, str] | None = None  # (process, reason) once one has died
        self._flushes: dict[int, asyncio.Future[FlushDone]] = {}  # FlushCache id -> its answer
        self._next_flush = 0
        self.last_output = 0.0  # monotonic time of the last TokenBatch: the engine makes progress

    # -- requests ---------------------------------------------------------------------

    def submit(self, rid: str, ids: list[int], params: SamplingParams, t0: float | None = None) -> ReqHandle:
        return self.submit_many(rid, [(rid, ids, params)], t0)[0]

    def submit_many(
        self,
        parent: str,
        subs: Sequence[tuple[str, list[int], SamplingParams]],
        t0: float | None = None,
        stream: bool = True,
    ) -> list[ReqHandle]:
        """Send the sub-requests of one API request; 400 if any of its rids is in flight.

        stream=False: the consumer only needs the final result, so it is woken per
        output only when stop strings must be checked as the text grows."""
        if self.died is not None:
            raise self.unavailable()
        rids = [rid for rid, _, _ in subs]
        # the parent's id, or one of its fan-out ids (rid-k), may be another request's
        taken = next((r for r in (parent, *rids) if self.in_flight(r)), None)
        if taken is not None or len(set(rids)) < len(rids):
            what = f"request id {parent!r}" if taken in (None, parent) else \
                f"request id {parent!r}: its sub-request id {taken!r}"
            raise ApiError(400, f"{what} is already in flight", "x-request-id", "duplicate_request_id")
        t0 = time.monotonic() if t0 is None else t0
        group = _Group(parent, len(subs))
        self._parents.add(parent)
        handles = []
        for rid, ids, params in subs:
            handle = ReqHandle(self, rid, group, t0, wake_each=stream or bool(params.stop), prompt_tokens=len(ids))
            self._reqs[rid] = handle
            handles.append(handle)
            self.metrics.on_submit(len(ids))
            self.send(TokenizedRequest(rid=rid, input_ids=pack_ids(ids), params=params))
        return handles

    def in_flight(self, rid: str) -> bool:
        return rid in self._reqs or rid in self._parents or rid in self._closing

    async def settled(self, rids: Sequence[str], timeout_s: float = 5.0, grace_s: float = 0.5) -> None:
        """Wait until none of rids is being aborted (at most timeout_s), nor still running (at most
        grace_s): a client that reuses a request id right after closing its request waits for the
        scheduler's answer (a step or two), and for its own disconnect to be noticed (a stream's
        handler sees it a moment after the client is gone), rather than getting a 400."""
        t0 = time.monotonic()
        while self.died is None:
            waited = time.monotonic() - t0
            closing = waited < timeout_s and any(r in self._closing for r in rids)
            running = waited < grace_s and any(r in self._reqs or r in self._parents for r in rids)
            if not (closing or running):
                return
            await asyncio.sleep(0.002)

    def abort(self, rid: str, everything: bool = False) -> int:
        """SGLang's /abort_request: ask the scheduler to end the request `rid` (an n > 1 or batch
        request's own rid: all its sub-requests), or every request in flight. Their consumers are
        left running, so each gets the scheduler's final output (finish_reason "abort", with what
        was generated) as from any other end; how many were asked."""
        hits = [h for h in self._reqs.values() if everything or rid in (h.rid, h._group.parent)]
        for handle in hits:
            self.send(AbortRequest(rid=handle.rid))
        return len(hits)

    @property
    def num_in_flight(self) -> int:
        return len(self._reqs)

    def send(self, msg: requests.ToScheduler) -> None:
        self._outbox.put_nowait(msg)

    def _release(self, handle: ReqHandle) -> None:
        if self._reqs.get(handle.rid) is handle:
            del self._reqs[handle.rid]
        group = handle._group
        group.left -= 1
        if group.left == 0:
            self._parents.discard(group.parent)

    # -- a dead server process --------------------------------------------------------

    def process_died(self, proc: str, reason: str) -> int:
        """Fail every in-flight request and refuse new ones; how many were failed. proc "": no
        process died, the server is being stopped (a signal to the supervisor)."""
        if self.died is None:
            self.died = (proc, reason)
            if proc:
                log.error("server process died: failing every request", proc=proc, reason=reason,
                          requests=len(self._reqs))
            else:  # an ordered shutdown, not an error
                log.info("server shutting down: failing every request", reason=reason, requests=len(self._reqs))
        self._ready.set()  # wakes requests waiting for readiness: they find the server dead
        self._closing.clear()  # no answer will come
        handles = list(self._reqs.values())
        for handle in handles:
            handle._fail(self.unavailable())
        return len(handles)

    def unavailable(self) -> GenerationFailed:
        """A fresh 503 naming the dead process (one per request: tracebacks are per raise)."""
        message, code = self.down_reason()
        return GenerationFailed(message, 503, code)

    def down_reason(self) -> tuple[str, str]:
        """(message, error code) of a server that a process death or a shutdown took down."""
        assert self.died is not None
        proc, reason = self.died
        if not proc:
            return f"the server is shutting down ({reason})", "server_shutdown"
        return f"server process {proc} died ({reason}); the server is shutting down", "process_died"

    async def drained(self, timeout: float) -> bool:
        """Wait until every in-flight request has been released (its consumer saw the
        failure); False on timeout."""
        deadline = time.monotonic() + timeout
        while self._reqs:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    # -- scheduler state --------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.died is None

    async def wait_ready(self, timeout: float) -> bool:
        """True once the scheduler is ready, False on timeout; 503 if a process died."""
        if not self._ready.is_set():
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except TimeoutError:
                return False
        if self.died is not None:
            raise self.unavailable()
        return True

    def limits(self) -> Limits | None:
        if self.stats is None:
            return None
        return Limits(max_context=self.stats.max_context, vocab_size=self.stats.vocab_size,
                      eos_ids=tuple(self.stats.eos_token_ids))

    def dispatch(self, msg: outputs.ToTokenizer) -> None:
        """Route one message from the scheduler."""
        if isinstance(msg, TokenBatch):
            now = self.last_output = time.monotonic()
            tokens = 0
            for out in msg.outs:
                tokens += len(out.new_ids)
                handle = self._reqs.get(out.rid)
                if handle is not None:
                    handle._put(out, now)
                elif out.finish_reason is not None:
                    self._closing.discard(out.rid)
            self.metrics.generation_tokens.inc(tokens)
        elif isinstance(msg, FlushDone):
            fut = self._flushes.get(msg.id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, SchedulerStats):
            self.stats = msg
            self.metrics.on_stats(msg)
            if msg.ready and not self._ready.is_set():
                log.info("scheduler ready", max_context=msg.max_context, vocab_size=msg.vocab_size)
                self._ready.set()
            elif not msg.ready:
                self._ready.clear()

    async def flush_cache(self, timeout_s: float = 30.0) -> FlushDone:
        """Ask the scheduler to empty every cache tier; its answer (refused while requests
        run). Raises ApiError 503 when the server is not serving, 504 on no answer."""
        if self.died is not None or not self.ready:
            raise ApiError(503, "the server is not ready", code="not_ready")
        self._next_flush += 1
        fid = self._next_flush
        fut: asyncio.Future[FlushDone] = asyncio.get_running_loop().create_future()
        self._flushes[fid] = fut
        self.send(FlushCache(id=fid))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            raise ApiError(504, "the scheduler did not answer the flush in time") from None
        finally:
            del self._flushes[fid]

    # -- socket loops -----------------------------------------------------------------

    async def run_sender(self, out: AsyncSender[requests.ToScheduler]) -> None:
        while True:
            msg = await self._outbox.get()
            await out.send(msg)

    async def run_receiver(self, inbox: AsyncReceiver[outputs.ToTokenizer]) -> None:
        while True:
            msg = await inbox.recv()
            if msg is None:
                continue
            try:
                self.dispatch(msg)
            except Exception:  # a bug here must not stop every other request's output
                log.exception("failed to dispatch scheduler output", kind=type(msg).__name__)
