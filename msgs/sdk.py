"""ZMQ client SDK for Strata (depends on msgspec and pyzmq only; no torch).

    from msgs.sdk import Client
    with Client("tcp://127.0.0.1:8001") as c:
        print(c.generate("The capital of France is", max_new_tokens=8).text)
        for chunk in c.stream("Count: 1, 2,", max_new_tokens=8):
            print(chunk.text, end="")

`AsyncClient` offers the same calls as coroutines / async iterators. A request that is
abandoned (an iterator closed early, a cancelled task) is aborted on the server.

Time limits: `timeout_s` bounds a whole request (StrataError 504 past it, the request aborted). The
server sends a keep-alive about once a second to every request it is working on, so a client that
hears nothing for SILENCE_S knows the server is gone (StrataError 503) long before that.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from msgs.channels import SDK_IN, SDK_OUT
from msgs.client import MAX_FRAME_BYTES, AbortGenerate, FromServer, GenerateChunk, GenerateError, GenerateRequest
from msgs.params import INT32, MODEL_DEFAULT_FIELDS, SamplingParams

__all__ = ["AbortGenerate", "AsyncClient", "Client", "GenerateChunk", "GenerateError", "GenerateRequest", "StrataError"]


class StrataError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


_TO_SERVER = SDK_IN.codec  # what the server decodes
_FROM_SERVER = SDK_OUT.codec  # what the client decodes
SILENCE_S = 10.0  # no frame at all for this long (keep-alives come every second): the server is gone


def _gone() -> StrataError:
    return StrataError(503, f"no word from the server in {SILENCE_S:.0f} s: it is down or unreachable")


def _frame(req: GenerateRequest) -> bytes:
    """The request's frame, or StrataError 413 where the server would refuse it (and drop the
    connection, every other request on it with it)."""
    try:
        frame = _TO_SERVER.encode(req)
    except (OverflowError, msgspec.EncodeError) as exc:  # e.g. a seed past 64 bits: a 400, as over HTTP
        raise StrataError(400, f"bad request: {exc}") from None
    if len(frame) > MAX_FRAME_BYTES:
        raise StrataError(413, f"request of {len(frame)} bytes is over the server's {MAX_FRAME_BYTES >> 20} MiB limit")
    return frame


def _key(api_key: str | None) -> str:
    """None is no key (`api_key=os.environ.get(...)`): a frame with a null key would not decode, and a
    keyed server answers no undecodable frame, so the client heard nothing for SILENCE_S (an audit)."""
    if api_key is None:
        return ""
    if not isinstance(api_key, str):
        raise TypeError(f"api_key must be a string or None, got {type(api_key).__name__}")
    return api_key


def _closed() -> StrataError:  # (zmq's own error, "Socket operation on non-socket", says nothing useful)
    return StrataError(400, "this client is closed: make a new one")


def _timed_out(timeout_s: float) -> StrataError:
    return StrataError(504, f"the request did not finish within the client's timeout_s ({timeout_s:g} s)")


def _request(prompt: str | list[int], stream: bool, rid: str | None, kw: dict[str, Any], api_key: str
             ) -> GenerateRequest:
    # a null sampling field is unset, as over HTTP: the server's model defaults fill it
    kw = {k: v for k, v in kw.items() if not (v is None and k in MODEL_DEFAULT_FIELDS)}
    # as /generate: max_new_tokens left out is 128 at most, None up to the context's end; both are
    # clipped to the context left on the server (max_given=False), a number given is not
    max_given = kw.get("max_new_tokens") is not None
    if "max_new_tokens" in kw and kw["max_new_tokens"] is None:
        kw = {**kw, "max_new_tokens": INT32 - 1}
    unknown = sorted(set(kw) - set(SamplingParams.__struct_fields__))
    if unknown:
        raise StrataError(400, f"unknown sampling parameter(s): {', '.join(unknown)}")
    if isinstance(kw.get("stop"), str):  # as the HTTP API takes it
        kw = {**kw, "stop": [kw["stop"]]}
    try:  # typed here: a wrong type would otherwise reach the server as a frame it cannot decode
        params = msgspec.convert(kw, SamplingParams, str_keys=True)  # logit_bias={"5": 1.0} too
    except msgspec.ValidationError as exc:
        raise StrataError(400, f"bad sampling parameter: {exc}") from None
    if rid is not None and not isinstance(rid, str):  # the server could not even decode the frame
        raise StrataError(400, f"rid must be a string, got {type(rid).__name__}")
    rid = rid or uuid.uuid4().hex
    unset = [name for name in MODEL_DEFAULT_FIELDS if name not in kw]  # the model's defaults fill these
    if isinstance(prompt, str):
        return GenerateRequest(rid=rid, params=params, text=prompt, stream=stream, api_key=api_key, unset=unset,
                               max_given=max_given)
    # token ids: a list or tuple of ints in int64 (bytes would pass as ids; None or 5 was a TypeError)
    if not isinstance(prompt, (list, tuple)) or not all(type(t) is int and -2**63 <= t < 2**63 for t in prompt):
        raise StrataError(400, "prompt: a string, or a list of token ids (ints)")
    return GenerateRequest(rid=rid, params=params, input_ids=list(prompt), stream=stream, api_key=api_key,
                           unset=unset, max_given=max_given)


def _check(msg: FromServer | None) -> GenerateChunk | None:
    """The chunk; None for a KeepAlive or a malformed frame (skipped); raises a GenerateError."""
    if isinstance(msg, GenerateError):
        raise StrataError(msg.status, msg.message)
    return msg if isinstance(msg, GenerateChunk) else None


class Client:
    """Blocking client. One request at a time per client object (use AsyncClient for many): a
    second one while a stream is open is a StrataError 409, not replies lost between the two."""

    def __init__(self, addr: str, *, timeout_s: float = 300.0, api_key: str | None = "") -> None:
        self._api_key = _key(api_key)  # the server's --api-key, where it has one
        self._timeout_s = timeout_s  # a whole request's limit
        self._active: str | None = None  # the rid of the request in flight
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(addr)

    def _next(self, rid: str, deadline: float) -> GenerateChunk:
        """The next chunk of request rid (keep-alives and other rids' frames skipped); StrataError
        when the server says so, is silent for SILENCE_S, or the deadline passes."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _timed_out(self._timeout_s)
            if not self._sock.poll(int(min(left, SILENCE_S) * 1000) + 1):
                if left > SILENCE_S:
                    raise _gone()
                continue  # (the deadline is checked above)
            chunk = _check(_FROM_SERVER.decode(self._sock.recv()))
            if chunk is not None and chunk.rid == rid:
                return chunk

    def _send(self, req: GenerateRequest) -> None:
        if self._sock.closed:
            raise _closed()
        if self._active is not None:
            raise StrataError(409, f"this Client has request {self._active!r} in flight: one at a time (finish or "
                                   "close its stream first, or use AsyncClient for many)")
        self._sock.send(_frame(req))
        self._active = req.rid

    def generate(self, prompt: str | list[int], rid: str | None = None, **params: Any) -> GenerateChunk:
        """Run one request to completion; params are SamplingParams fields."""
        req = _request(prompt, False, rid, params, self._api_key)
        self._send(req)
        try:
            return self._next(req.rid, time.monotonic() + self._timeout_s)
        except StrataError as exc:
            if exc.status in (503, 504):  # ours, not the server's: it may still be running it
                self.abort(req.rid)
            raise
        finally:
            self._active = None

    def stream(self, prompt: str | list[int], rid: str | None = None, **params: Any) -> Iterator[GenerateChunk]:
        """Yield deltas until the request finishes. Closing the iterator early aborts it."""
        req = _request(prompt, True, rid, params, self._api_key)
        self._send(req)
        deadline = time.monotonic() + self._timeout_s
        finished = False
        try:
            while not finished:
                chunk = self._next(req.rid, deadline)
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            self._active = None
            if not finished:
                self.abort(req.rid)

    def abort(self, rid: str) -> None:
        if not self._sock.closed:  # (closed: the server aborts what the connection owned when it goes)
            self._sock.send(_TO_SERVER.encode(AbortGenerate(rid=rid)))

    def close(self) -> None:
        self._sock.close(0)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """asyncio client; many concurrent requests share one socket. One reader task routes
    replies to per-request queues by rid."""

    def __init__(self, addr: str, *, api_key: str | None = "", timeout_s: float = 300.0) -> None:
        self._api_key = _key(api_key)  # the server's --api-key, where it has one
        self._timeout_s = timeout_s  # a whole request's limit (Client's)
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(addr)
        self._queues: dict[str, asyncio.Queue[FromServer]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def _read_forever(self) -> None:
        while True:
            msg = _FROM_SERVER.decode(await self._sock.recv())
            queue = self._queues.get(msg.rid) if msg is not None else None
            if queue is not None:
                queue.put_nowait(msg)

    async def _open(self, req: GenerateRequest) -> asyncio.Queue[FromServer]:
        if self._sock.closed:
            raise _closed()
        if req.rid in self._queues:  # replies are routed by rid: a second one would take the first's
            raise StrataError(400, f"request id {req.rid!r} is already in flight on this client")
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_forever())
        queue: asyncio.Queue[FromServer] = asyncio.Queue()
        self._queues[req.rid] = queue
        try:
            await self._sock.send(_frame(req))
        except BaseException:
            self._queues.pop(req.rid, None)
            raise
        return queue

    async def _next(self, queue: asyncio.Queue[FromServer], deadline: float) -> GenerateChunk:
        """The next chunk (keep-alives skipped); StrataError as Client._next's."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _timed_out(self._timeout_s)
            try:
                msg = await asyncio.wait_for(queue.get(), min(left, SILENCE_S))
            except TimeoutError:
                if left > SILENCE_S:
                    raise _gone() from None
                continue
            if (chunk := _check(msg)) is not None:
                return chunk

    async def generate(self, prompt: str | list[int], rid: str | None = None, **params: Any) -> GenerateChunk:
        req = _request(prompt, False, rid, params, self._api_key)
        queue = await self._open(req)
        try:
            return await self._next(queue, time.monotonic() + self._timeout_s)
        except StrataError as exc:
            if exc.status in (503, 504):  # ours, not the server's: it may still be running it
                self._sock.send(_TO_SERVER.encode(AbortGenerate(rid=req.rid)))  # fire and forget
            raise
        except asyncio.CancelledError:
            self._sock.send(_TO_SERVER.encode(AbortGenerate(rid=req.rid)))  # fire and forget
            raise
        finally:
            self._queues.pop(req.rid, None)

    async def stream(
        self, prompt: str | list[int], rid: str | None = None, **params: Any
    ) -> AsyncIterator[GenerateChunk]:
        req = _request(prompt, True, rid, params, self._api_key)
        finished = False
        queue = await self._open(req)
        try:
            deadline = time.monotonic() + self._timeout_s
            while not finished:
                chunk = await self._next(queue, deadline)
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            self._queues.pop(req.rid, None)
            if not finished:
                await self.abort(req.rid)

    async def abort(self, rid: str) -> None:
        """Abort request rid; its waiting generate() or stream() raises StrataError(499) at once
        (the server sends nothing more for an aborted request)."""
        queue = self._queues.get(rid)
        if queue is not None:
            queue.put_nowait(GenerateError(rid=rid, status=499, message="aborted by the client (AsyncClient.abort)"))
        if not self._sock.closed:  # (closed: the server aborts what the connection owned when it goes)
            await self._sock.send(_TO_SERVER.encode(AbortGenerate(rid=rid)))

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._sock.close(0)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
