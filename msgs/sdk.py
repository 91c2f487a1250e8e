"""ZMQ client SDK for Strata (depends on msgspec and pyzmq only; no torch).

    from msgs.sdk import Client
    with Client("tcp://127.0.0.1:8001") as c:
        print(c.generate("The capital of France is", max_new_tokens=8).text)
        for chunk in c.stream("Count: 1, 2,", max_new_tokens=8):
            print(chunk.text, end="")

`AsyncClient` offers the same calls as coroutines / async iterators. A request that is
abandoned (an iterator closed early, a cancelled task) is aborted on the server.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import zmq
import zmq.asyncio

from msgs.channels import SDK_IN, SDK_OUT
from msgs.client import AbortGenerate, FromServer, GenerateChunk, GenerateError, GenerateRequest
from msgs.params import SamplingParams

__all__ = ["AbortGenerate", "AsyncClient", "Client", "GenerateChunk", "GenerateError", "GenerateRequest", "StrataError"]


class StrataError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


_TO_SERVER = SDK_IN.codec  # what the server decodes
_FROM_SERVER = SDK_OUT.codec  # what the client decodes


def _request(prompt: str | list[int], stream: bool, rid: str | None, kw: dict[str, Any], api_key: str
             ) -> GenerateRequest:
    params = SamplingParams(**kw)
    rid = rid or uuid.uuid4().hex
    if isinstance(prompt, str):
        return GenerateRequest(rid=rid, params=params, text=prompt, stream=stream, api_key=api_key)
    return GenerateRequest(rid=rid, params=params, input_ids=list(prompt), stream=stream, api_key=api_key)


def _check(msg: FromServer | None) -> GenerateChunk | None:
    """The chunk; None for a KeepAlive or a malformed frame (skipped); raises a GenerateError."""
    if isinstance(msg, GenerateError):
        raise StrataError(msg.status, msg.message)
    return msg if isinstance(msg, GenerateChunk) else None


class Client:
    """Blocking client. One request at a time per client object (use AsyncClient for many)."""

    def __init__(self, addr: str, timeout_s: float = 300.0, api_key: str = "") -> None:
        self._api_key = api_key  # the server's --api-key, where it has one
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        self._sock.connect(addr)

    def generate(self, prompt: str | list[int], rid: str | None = None, **params: Any) -> GenerateChunk:
        """Run one request to completion; params are SamplingParams fields."""
        req = _request(prompt, False, rid, params, self._api_key)
        self._sock.send(_TO_SERVER.encode(req))
        while True:
            chunk = _check(_FROM_SERVER.decode(self._sock.recv()))
            if chunk is not None and chunk.rid == req.rid:
                return chunk

    def stream(self, prompt: str | list[int], rid: str | None = None, **params: Any) -> Iterator[GenerateChunk]:
        """Yield deltas until the request finishes. Closing the iterator early aborts it."""
        req = _request(prompt, True, rid, params, self._api_key)
        self._sock.send(_TO_SERVER.encode(req))
        finished = False
        try:
            while not finished:
                chunk = _check(_FROM_SERVER.decode(self._sock.recv()))
                if chunk is None or chunk.rid != req.rid:
                    continue
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            if not finished:
                self.abort(req.rid)

    def abort(self, rid: str) -> None:
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

    def __init__(self, addr: str, api_key: str = "") -> None:
        self._api_key = api_key  # the server's --api-key, where it has one
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
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_forever())
        queue: asyncio.Queue[FromServer] = asyncio.Queue()
        self._queues[req.rid] = queue
        await self._sock.send(_TO_SERVER.encode(req))
        return queue

    async def generate(self, prompt: str | list[int], rid: str | None = None, **params: Any) -> GenerateChunk:
        req = _request(prompt, False, rid, params, self._api_key)
        try:
            queue = await self._open(req)
            while (chunk := _check(await queue.get())) is None:  # keep-alives
                pass
            return chunk
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
        try:
            queue = await self._open(req)
            while not finished:
                chunk = _check(await queue.get())
                if chunk is None:
                    continue
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            self._queues.pop(req.rid, None)
            if not finished:
                await self.abort(req.rid)

    async def abort(self, rid: str) -> None:
        await self._sock.send(_TO_SERVER.encode(AbortGenerate(rid=rid)))

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._sock.close(0)
