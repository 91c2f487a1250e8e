"""A lean asyncio client for the ZMQ SDK wire protocol (msgs.sdk), built for many requests.

msgs.sdk.AsyncClient is meant for a handful of concurrent calls: tasks waiting for a
reply poll every millisecond, which for hundreds of in-flight requests would burn the
benchmark's CPU. Here one reader task routes each reply to its request's future.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import zmq
import zmq.asyncio

from msgs.channels import SDK_IN, SDK_OUT
from msgs.params import SamplingParams
from msgs.sdk import SILENCE_S, GenerateChunk, GenerateError, GenerateRequest, StrataError


class SdkBatchClient:
    """Non-streaming generate calls over one DEALER socket; use as `async with`."""

    def __init__(self, addr: str, api_key: str = "") -> None:
        self._api_key = api_key
        self._heard = time.monotonic()  # the last frame from the server (keep-alives come every second)
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(addr)
        self._waiting: dict[str, asyncio.Future[GenerateChunk | GenerateError]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def __aenter__(self) -> SdkBatchClient:
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._sock.close(0)
        self._ctx.term()

    async def _read(self) -> None:
        while True:
            msg = SDK_OUT.codec.decode(await self._sock.recv())
            self._heard = time.monotonic()
            if not isinstance(msg, GenerateChunk | GenerateError):  # a KeepAlive (a long request) or malformed
                continue
            fut = self._waiting.pop(msg.rid, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    async def generate(self, input_ids: list[int], **params: Any) -> GenerateChunk:
        """One request to completion (params are SamplingParams fields); StrataError on failure."""
        rid = uuid.uuid4().hex
        fut: asyncio.Future[GenerateChunk | GenerateError] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        req = GenerateRequest(rid=rid, params=SamplingParams(**params), input_ids=input_ids, api_key=self._api_key)
        try:
            await self._sock.send(SDK_IN.codec.encode(req))
            sent = time.monotonic()
            # a server that is gone (or never was) says nothing: a 503 as the SDK's, not a wait forever
            while not (await asyncio.wait({fut}, timeout=1.0))[0]:
                if time.monotonic() - max(self._heard, sent) > SILENCE_S:
                    raise StrataError(503, f"no word from the server in {SILENCE_S:g} s: it is down or unreachable")
            msg = fut.result()
        finally:
            self._waiting.pop(rid, None)
        if isinstance(msg, GenerateError):
            raise StrataError(msg.status, msg.message)
        return msg
