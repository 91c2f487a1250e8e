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


def test_a_request_waiting_for_readiness_is_kept_alive(monkeypatch) -> None:  # noqa: ANN001
    """An audit: keep-alives began only once the request reached the scheduler, so a request that
    waited longer than the client's SILENCE_S before that (the scheduler not ready yet, a long
    tokenization, a grammar's compile) was read as a dead server. Over a real ROUTER / DEALER
    pair, a request waiting on a scheduler that never gets ready hears keep-alives, then the 503."""
    import zmq.asyncio

    from engine.config import ServerConfig
    from engine.serve.frontend import Frontend
    from engine.serve.state import ServeState
    from msgs.channels import SDK_IN, SDK_OUT
    from msgs.client import GenerateError, GenerateRequest
    from msgs.params import SamplingParams

    monkeypatch.setattr(sdk_server, "KEEPALIVE_S", 0.2)
    state = ServeState(cfg=ServerConfig(), tok=None, frontend=Frontend(), ready_timeout_s=1.5)

    async def main() -> list[object]:
        ctx = zmq.asyncio.Context()
        router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.bind("inproc://sdk-ready")
        dealer.connect("inproc://sdk-ready")
        serving = asyncio.create_task(SdkServer(state, router).run())
        req = GenerateRequest(rid="r", params=SamplingParams(max_new_tokens=2), input_ids=[1, 2, 3])
        await dealer.send(SDK_IN.codec.encode(req))
        got: list[object] = []
        while not got or not isinstance(got[-1], GenerateError):
            got.append(SDK_OUT.codec.decode(await asyncio.wait_for(dealer.recv(), 5)))
        serving.cancel()
        router.close(0)
        dealer.close(0)
        ctx.term()
        return got

    got = asyncio.run(main())
    error = got[-1]
    assert isinstance(error, GenerateError) and error.status == 503 and "not ready" in error.message
    assert sum(isinstance(m, KeepAlive) for m in got[:-1]) >= 4, got  # 1.5 s at one a 0.2 s
