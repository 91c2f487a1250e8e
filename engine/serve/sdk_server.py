"""The ZMQ SDK front: a ROUTER socket speaking msgs.sdk.

Each GenerateRequest runs as a task that answers its client (by ROUTER identity) with
GenerateChunk deltas (stream) or one final chunk, or a GenerateError with the same status
the HTTP API would give. AbortGenerate cancels the task, which aborts the scheduler
request through Generation.close(). A request belongs to the connection (ROUTER identity)
that sent it: only that connection can abort it. A connection that closes takes its requests
with it: the ROUTER refuses a send to it (ROUTER_MANDATORY), and every request it owns is aborted
(a streamed one at its next chunk, a non-streamed one at its next KeepAlive, about a second).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import Awaitable
from typing import TypeVar

import msgspec
import structlog
import zmq

from engine.serve.errors import ApiError
from engine.serve.generate import Choice, Delta, Generation, GenerationFailed, collect
from engine.serve.native import prepare
from engine.serve.state import ServeState
from engine.serve.validate import SubRequest, check_rid, check_unset
from msgs.channels import SDK_IN, SDK_OUT
from msgs.client import AbortGenerate, GenerateChunk, GenerateError, GenerateRequest, KeepAlive

log = structlog.get_logger()
T = TypeVar("T")
QUEUE_FULL_S = 5.0  # a client's send queue full this long: it stopped reading, its requests are aborted
KEEPALIVE_S = 1.0  # a request's keep-alive period (while nothing else is sent): how soon a dead client is noticed


class ClientGone(Exception):
    """The connection a request came from is closed: nothing can reach its client any more."""


class SdkServer:
    def __init__(self, state: ServeState, sock) -> None:  # noqa: ANN001 - zmq.asyncio ROUTER
        self._state = state
        self._sock = sock
        self._tasks: dict[str, tuple[bytes, asyncio.Task[None]]] = {}  # rid -> (owner, task)

    async def run(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) < 2:
                continue
            ident, msg = frames[0], SDK_IN.codec.decode(frames[-1])
            try:
                if msg is None:  # dropped (counted, logged): a request's sender still gets its answer
                    await self._malformed(ident, frames[-1])
                    continue
                await self._handle(ident, msg)
            except Exception:  # one bad message must not stop the SDK front
                log.exception("sdk message failed", kind=type(msg).__name__)

    async def _malformed(self, ident: bytes, frame: bytes) -> None:
        """A frame that does not decode as an SDK message: if it is a GenerateRequest whose rid can
        be read, a 400 naming what is wrong (a client of another language, or one that skipped the
        Python client's typing), instead of a silence the client reads as a dead server."""
        try:
            loose = msgspec.msgpack.decode(frame)
        except (msgspec.DecodeError, RecursionError):
            return
        rid = loose.get("rid") if isinstance(loose, dict) and loose.get("type") == "GenerateRequest" else None
        if not isinstance(rid, str):
            return
        if not self._authorized(loose.get("api_key")):
            return  # an unauthenticated sender learns nothing of the schema
        try:
            check_rid(rid)
            msgspec.msgpack.decode(frame, type=GenerateRequest)
        except ApiError:  # no rid to answer by
            return
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            await self._error(ident, GenerateError(rid, 400, f"malformed GenerateRequest: {str(exc)[:300]}"),
                              patient=False)

    def _authorized(self, given: object) -> bool:
        """The server has no --api-key, or `given` is it (compared in constant time)."""
        key = self._state.cfg.api_key
        return not key or (isinstance(given, str) and hmac.compare_digest(given.encode(), key.encode()))

    async def _handle(self, ident: bytes, msg: GenerateRequest | AbortGenerate | None) -> None:
        if isinstance(msg, GenerateRequest):
            await self._start(ident, msg)
        elif isinstance(msg, AbortGenerate):
            owner, task = self._tasks.get(msg.rid, (None, None))
            if task is None:
                return
            if owner != ident:  # someone else's request: ignored, as if unknown
                log.info("sdk abort from another connection ignored", rid=msg.rid)
                return
            log.info("sdk abort", rid=msg.rid)
            task.cancel()

    async def _start(self, ident: bytes, req: GenerateRequest) -> None:
        if not self._authorized(req.api_key):
            await self._error(ident, GenerateError(req.rid, 401, "a valid API key is required: Client(api_key=...)"),
                              patient=False)
            return
        owner, earlier = self._tasks.get(req.rid, (None, None))
        if earlier is not None and (owner != ident or not earlier.cancelling()):
            await self._error(ident, GenerateError(req.rid, 400, f"request id {req.rid!r} is already in flight"),
                              patient=False)
            return
        # its own request of that rid, aborted and still winding down: the new one starts once it
        # has (as HTTP waits for an aborted rid), not a 400 to a client that reuses rids
        work = self._serve(ident, req) if earlier is None else self._serve_after(earlier, ident, req)
        task = asyncio.create_task(work)
        self._tasks[req.rid] = (ident, task)
        task.add_done_callback(lambda t, rid=req.rid: self._tasks.get(rid, (None, None))[1] is t
                               and self._tasks.pop(rid))

    async def _serve_after(self, earlier: asyncio.Task[None], ident: bytes, req: GenerateRequest) -> None:
        await asyncio.wait({earlier})  # its end, however it ended (this task's own abort goes through)
        await self._serve(ident, req)

    async def _send(self, ident: bytes, msg: GenerateChunk | GenerateError | KeepAlive, patient: bool = True) -> None:
        """Queue msg for the client; ClientGone when its connection is closed, or when its queue
        (SNDHWM frames) stays full for QUEUE_FULL_S: a client that stopped reading. (An asyncio
        send retries once any peer can take a frame, so a full queue beside other clients is an
        EAGAIN: waited out here in short sleeps.) patient=False: not waited out, for the answers the
        receiving loop sends itself (a wait there would hold up every client's messages)."""
        frames = [ident, SDK_OUT.codec.encode(msg)]
        deadline = None
        while True:
            try:
                await self._sock.send_multipart(frames, flags=zmq.DONTWAIT)
                return
            except zmq.Again:
                if not patient:
                    raise ClientGone from None
                now = time.monotonic()
                deadline = deadline or now + QUEUE_FULL_S
                if now > deadline:
                    log.warning("sdk client's queue full: its requests aborted", full_s=QUEUE_FULL_S)
                    raise ClientGone from None
                await asyncio.sleep(0.01)
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                raise ClientGone from None

    async def _error(self, ident: bytes, msg: GenerateError, patient: bool = True) -> None:
        """Answer an error; to a client that is gone, nothing (there is no one to tell)."""
        with contextlib.suppress(ClientGone):
            await self._send(ident, msg, patient)

    def _client_gone(self, ident: bytes, rid: str) -> None:
        """Abort every other request of a connection that closed (this one's task is ending)."""
        others = [task for r, (owner, task) in self._tasks.items() if owner == ident and r != rid]
        log.info("sdk client gone: its requests aborted", rid=rid, requests=1 + len(others))
        for task in others:
            task.cancel()

    async def _serve(self, ident: bytes, req: GenerateRequest) -> None:
        rid = req.rid
        try:
            check_rid(rid)
            check_unset(req.unset, req.params)
            defaults = self._state.sampling_defaults
            params = req.params
            if req.unset and defaults:  # the fields the caller left unset: the model's defaults
                params = msgspec.structs.replace(params, **{k: defaults[k] for k in req.unset if k in defaults})

            async def begin() -> Generation:  # (nothing reaches the scheduler before Generation.start returns)
                ids, checked = await prepare(self._state, req.text, req.input_ids, params, max_given=req.max_given)
                log.info("sdk request", rid=rid, prompt_tokens=len(ids), max_tokens=checked.max_new_tokens)
                return await Generation.start(self._state.frontend, self._state.tok, rid,
                                              [SubRequest(rid, 0, 0, ids, checked)], stream=req.stream)

            # kept alive from the start: readiness, tokenizing and a grammar's compile may take more than
            # the client's SILENCE_S, which it would read as a dead server (an audit)
            gen = await self._keeping_alive(ident, rid, begin())
            try:
                if req.stream:
                    await self._stream(ident, rid, gen)
                else:
                    await self._whole(ident, rid, gen)
            finally:
                gen.close()
        except ClientGone:
            self._client_gone(ident, rid)
            return
        except GenerationFailed as exc:  # the scheduler failed it (500), or a server process died (503)
            log.warning("sdk request failed", rid=rid, status=exc.status, message=exc.message)
            await self._error(ident, GenerateError(rid, exc.status, exc.message))
        except ApiError as exc:
            log.info("sdk request rejected", rid=rid[:300], status=exc.status, message=exc.message)
            self._state.frontend.metrics.rejected.labels(str(exc.status)).inc()
            await self._error(ident, GenerateError(rid, exc.status, exc.message))
        except Exception:  # noqa: BLE001 - a bug must not take the SDK loop down
            log.exception("sdk request failed", rid=rid)
            await self._error(ident, GenerateError(rid, 500, "internal server error"))

    async def _stream(self, ident: bytes, rid: str, gen: Generation) -> None:
        """The deltas as chunks, sent by one task for the whole stream; a KeepAlive where a
        KEEPALIVE_S passed without a chunk (a long prefill)."""
        deltas = gen.deltas()  # raises GenerationFailed
        last_sent = [time.monotonic()]

        async def send_all() -> None:
            async with contextlib.aclosing(deltas):  # closed at once when a send fails or the task is cancelled
                async for d in deltas:
                    if d.text or d.token_ids or d.finish_reason:
                        await self._send(ident, _chunk(rid, d))
                        last_sent[0] = time.monotonic()

        await self._keeping_alive(ident, rid, send_all(), last_sent)

    async def _whole(self, ident: bytes, rid: str, gen: Generation) -> None:
        """The whole result in one chunk; a KeepAlive every KEEPALIVE_S meanwhile."""
        (c,) = await self._keeping_alive(ident, rid, collect(gen))
        await self._send(ident, _chunk(rid, c))

    async def _keeping_alive(self, ident: bytes, rid: str, work: Awaitable[T],
                             last_sent: list[float] | None = None) -> T:
        """work's result, with a KeepAlive to the client each KEEPALIVE_S it takes (where `work`
        sends frames itself: each KEEPALIVE_S after its last, `last_sent`): the client knows the
        server is alive, and a send fails (ClientGone) once its connection is closed."""
        task = asyncio.ensure_future(work)
        try:
            while not (await asyncio.wait({task}, timeout=KEEPALIVE_S))[0]:
                if last_sent is None or time.monotonic() - last_sent[0] >= KEEPALIVE_S:
                    await self._send(ident, KeepAlive(rid))
        finally:
            if not task.done():  # the client is gone, or this request was cancelled: end the work now
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            elif not task.cancelled():  # retrieved even when a keep-alive's failure ends this first
                task.exception()  # (else asyncio logs "Task exception was never retrieved" at error level)
        return task.result()


def _chunk(rid: str, d: Delta | Choice) -> GenerateChunk:
    """A streamed delta, or the whole result (a Choice) as one chunk."""
    return GenerateChunk(
        rid=rid,
        text=d.text,
        token_ids=d.token_ids,
        finish_reason=d.finish_reason,
        prompt_tokens=d.prompt_tokens,
        completion_tokens=d.completion_tokens,
        cached_tokens=d.cached_tokens,
        logprobs=d.logprobs,
        prompt_logprobs=d.prompt_logprobs,
        top_logprobs=d.top_logprobs,
        prompt_top_logprobs=d.prompt_top_logprobs,
    )
