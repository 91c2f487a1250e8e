"""SdkServer._keeping_alive (engine/serve/sdk_server.py) when a client stops reading: the work's
own send and a keep-alive both give up (ClientGone). An audit saw one error-level "Task exception
was never retrieved ... ClientGone()" per request when the keep-alive's failure ended the wait
after the work had failed: the work's exception must be retrieved whichever fails first."""

from __future__ import annotations

import asyncio
import gc

import pytest
import zmq

from engine.serve import sdk_server
from engine.serve.sdk_server import ClientGone, SdkServer
from msgs.client import KeepAlive


class FullQueue:
    """A ROUTER whose client never reads: every send would block."""

    async def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        raise zmq.Again()


def test_a_stuck_send_and_a_stuck_keep_alive_leave_no_unretrieved_exception(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(sdk_server, "QUEUE_FULL_S", 0.3)
    monkeypatch.setattr(sdk_server, "KEEPALIVE_S", 0.1)
    server = SdkServer(None, FullQueue())  # type: ignore[arg-type]
    unhandled: list[dict] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: unhandled.append(ctx))
        work = server._send(b"client", KeepAlive("r"))  # gives up after 0.3 s; a keep-alive starts at 0.1 s
        with pytest.raises(ClientGone):
            await server._keeping_alive(b"client", "r", work)
        gc.collect()  # an unretrieved exception is reported when its task is collected
        await asyncio.sleep(0)

    asyncio.run(main())
    gc.collect()
    assert not [c for c in unhandled if "never retrieved" in str(c.get("message"))], unhandled
