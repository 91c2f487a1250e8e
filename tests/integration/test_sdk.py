"""The ZMQ client SDK against the real server."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from engine.bench.sdk_client import SdkBatchClient
from msgs.channels import SDK_IN, SDK_OUT
from msgs.client import KeepAlive
from msgs.params import SamplingParams
from msgs.sdk import AsyncClient, Client, GenerateRequest, StrataError
from tests.integration.conftest import Server


def test_sdk_generate_and_stream(server: Server) -> None:
    with Client(server.sdk) as c:
        full = c.generate("The capital of France is", max_new_tokens=8, temperature=0)
        assert full.finish_reason in ("stop", "length") and full.text
        assert len(full.token_ids) == full.completion_tokens
        parts = list(c.stream("The capital of France is", max_new_tokens=8, temperature=0))
        assert "".join(p.text for p in parts) == full.text
        assert parts[-1].finish_reason == full.finish_reason


def test_sdk_token_ids_and_errors(server: Server) -> None:
    with Client(server.sdk) as c:
        out = c.generate([504, 3575, 282, 4649, 314], max_new_tokens=4, temperature=0)
        assert len(out.token_ids) == 4 and out.prompt_logprobs is None
        scored = c.generate([504, 3575, 282, 4649, 314], max_new_tokens=4, temperature=0, prompt_logprobs=0)
        assert scored.token_ids == out.token_ids and len(scored.prompt_logprobs) == 4
        assert all(x <= 0 for x in scored.prompt_logprobs)
        tops = c.generate([504, 3575, 282, 4649, 314], max_new_tokens=4, temperature=0, logprobs=True,
                          top_logprobs=3, prompt_logprobs=2)
        assert len(tops.top_logprobs) == 4 and all(len(t) == 3 for t in tops.top_logprobs)
        assert [t[0][0] for t in tops.top_logprobs] == out.token_ids  # greedy: the best is the one taken
        assert [t[0][1] for t in tops.top_logprobs] == tops.logprobs
        assert len(tops.prompt_top_logprobs) == 4 and all(len(t) == 2 for t in tops.prompt_top_logprobs)
        first = next(iter(c.stream([504, 3575, 282, 4649, 314], max_new_tokens=2, prompt_logprobs=0)))
        assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == 4
        with pytest.raises(StrataError) as err:
            c.generate("hi", max_new_tokens=4, temperature=-1)
        assert 400 <= err.value.status < 500


def test_sdk_abort_mid_stream_frees_pages(server: Server) -> None:
    with Client(server.sdk) as c:
        it = c.stream("Write a long essay.", max_new_tokens=300, ignore_eos=True)
        for _ in range(3):
            next(it)
        it.close()  # aborts on the server
    m = server.wait_idle()
    assert m["strata_kv_leak_free"] == 1 and m["strata_kv_pages_used"] == m["strata_kv_cache_pages"]


def test_a_closed_sdk_connection_aborts_its_streams(server: Server) -> None:
    """A client that goes away mid-stream (its socket closed, as when its process dies) without
    an abort: the server's next send to it fails, and its requests end there."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 60_000)
    sock.connect(server.sdk)
    params = SamplingParams(max_new_tokens=3000, ignore_eos=True)
    for rid in ("gone-1", "gone-2"):
        sock.send(SDK_IN.codec.encode(GenerateRequest(rid=rid, params=params, text="Count:", stream=True)))
    sock.send(SDK_IN.codec.encode(GenerateRequest(rid="gone-3", params=params, text="Count:")))  # not streamed
    for _ in range(3000):  # the streams' chunks, until the non-streamed request's first keep-alive (~1 s)
        m = SDK_OUT.codec.decode(sock.recv())
        if isinstance(m, KeepAlive) and m.rid == "gone-3":
            break
    else:
        raise AssertionError("no keep-alive for the non-streamed request")
    sock.close(0)
    before = server.metrics()["strata_generation_tokens_total"]
    m = server.wait_idle(timeout=120)  # 3 x 3000 tokens take minutes on 2 cores: aborted long before
    assert m["strata_generation_tokens_total"] - before < 2000
    assert m["strata_kv_leak_free"] == 1


def test_keep_alives_are_skipped_by_every_client(server: Server) -> None:
    """A non-streamed request of more than a second gets keep-alives before its answer: the clients
    (the SDK's two and bin/bench's batch client) return the answer."""
    with Client(server.sdk) as c:
        assert len(c.generate("Count:", max_new_tokens=120, ignore_eos=True).token_ids) == 120

    async def main() -> int:
        async with AsyncClient(server.sdk) as c:  # closed on the way out, as Client in a with
            return len((await c.generate("Count:", max_new_tokens=120, ignore_eos=True)).token_ids)

    assert asyncio.run(main()) == 120

    async def bench_client() -> int:
        async with SdkBatchClient(server.sdk) as c:
            return len((await c.generate([504, 3575, 282], max_new_tokens=120, ignore_eos=True)).token_ids)

    assert asyncio.run(bench_client()) == 120


def test_a_requests_timeout_is_a_504_and_aborts_it(server: Server) -> None:
    """timeout_s bounds a whole request, keep-alives or not: a StrataError 504 once it passes (not
    zmq's raw Again), and the server aborts the request (its pages come back)."""
    for stream in (False, True):
        with Client(server.sdk, timeout_s=1.5) as c:
            t0 = time.monotonic()
            with pytest.raises(StrataError) as err:
                if stream:
                    list(c.stream("Count:", max_new_tokens=3000, ignore_eos=True))
                else:
                    c.generate("Count:", max_new_tokens=3000, ignore_eos=True)
            assert err.value.status == 504 and "timeout_s" in err.value.message
            assert time.monotonic() - t0 < 5
    m = server.wait_idle(timeout=60)
    assert m["strata_kv_leak_free"] == 1

    async def main() -> int:
        c = AsyncClient(server.sdk, timeout_s=1.5)
        try:
            with pytest.raises(StrataError) as err:
                await c.generate("Count:", max_new_tokens=3000, ignore_eos=True)
            return err.value.status
        finally:
            c.close()

    assert asyncio.run(main()) == 504
    assert server.wait_idle(timeout=60)["strata_kv_leak_free"] == 1


def test_async_sdk_concurrent(server: Server) -> None:
    async def main() -> list[str]:
        c = AsyncClient(server.sdk)
        try:
            outs = await asyncio.gather(*(c.generate(f"Number {i}:", max_new_tokens=5, seed=i) for i in range(8)))
            chunks = [ch async for ch in c.stream("Hello", max_new_tokens=4, temperature=0)]
            assert chunks[-1].finish_reason is not None
            return [o.finish_reason for o in outs]
        finally:
            c.close()

    assert all(r in ("stop", "length") for r in asyncio.run(main()))


def test_malformed_frames_do_not_hurt_the_server(server: Server) -> None:
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.sdk)
    for frame in (b"", b"\x00\xff garbage", b'{"type": "GenerateRequest"}'):
        sock.send(frame)
    sock.close(0)
    with Client(server.sdk) as c:
        assert c.generate("Hello", max_new_tokens=2, temperature=0).completion_tokens == 2


def test_a_frame_past_the_body_limit_is_refused_before_it_is_read(server: Server) -> None:
    """An audit: frames of any size were read and decoded on the tokenizer's event loop, before
    the API key was checked (95 MB stalled every client 2-6 s; 57 MB took the process to ~1 GB).
    zmq now drops a frame past HTTP's body limit (MAXMSGSIZE) and the sender's connection: the
    server never reads it (no malformed frame counted), and serves the others."""
    import httpx

    from engine.serve.http import MAX_BODY

    def dropped() -> float:
        text = httpx.get(f"{server.http}/metrics", timeout=10).text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("strata_dropped_frames_total"))

    before, settled = dropped(), time.monotonic() + 10
    while time.monotonic() < settled:  # earlier tests' malformed frames may still be on their way
        time.sleep(0.5)
        if (now := dropped()) == before:
            break
        before = now
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(server.sdk)
    sock.send(b"\x00" * (MAX_BODY + 1))  # (nothing after it: a DEALER resends its queue on reconnect)
    sock.close()
    with Client(server.sdk) as c:
        assert c.generate("Hello", max_new_tokens=2, temperature=0).completion_tokens == 2
    garbage = ctx.socket(zmq.DEALER)  # a small malformed frame on another connection is read and counted
    garbage.setsockopt(zmq.LINGER, 1000)
    garbage.connect(server.sdk)
    garbage.send(b"\x00 garbage")
    garbage.close()
    deadline = time.monotonic() + 10
    while dropped() < before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert dropped() == before + 1


def test_a_request_past_the_frame_limit_is_a_413_and_spares_the_connection(server: Server) -> None:
    """An audit: the client sent it, the server's zmq dropped the frame and the connection, and
    every request on that client waited 10 s for a false "server down" 503. Now the client knows
    the limit (msgs.client.MAX_FRAME_BYTES) and refuses the request before sending it."""
    from msgs.client import MAX_FRAME_BYTES


    huge = "a" * (MAX_FRAME_BYTES + 1)
    with Client(server.sdk) as c:
        t0 = time.monotonic()
        with pytest.raises(StrataError) as err:
            c.generate(huge, max_new_tokens=2)
        assert err.value.status == 413 and "limit" in err.value.message and time.monotonic() - t0 < 5
        assert c.generate("Hello", max_new_tokens=2, temperature=0).completion_tokens == 2

    async def both() -> tuple[int, int]:
        async with AsyncClient(server.sdk) as c:
            async def streamed() -> int:
                ids = [t async for chunk in c.stream("Hello", max_new_tokens=6, temperature=0, ignore_eos=True)
                       for t in chunk.token_ids]
                return len(ids)
            task = asyncio.create_task(streamed())
            await asyncio.sleep(0.05)
            try:
                await c.generate(huge, max_new_tokens=2)
            except StrataError as exc:
                status = exc.status
            return status, await task

    assert asyncio.run(both()) == (413, 6)


def test_a_rid_reused_right_after_its_abort_is_served(server: Server) -> None:
    """An audit: breaking out of a stream (its abort) then asking again with the same rid was a
    400 "already in flight" while the aborted request wound down; HTTP waits for it, so does the
    SDK now. Another connection's request with a rid in flight is still a 400."""
    with Client(server.sdk) as c:
        for i, _ in enumerate(c.stream("Tell me a long story.", rid="reused", max_new_tokens=64, ignore_eos=True)):
            if i == 3:
                break
        out = c.generate("Hello", rid="reused", max_new_tokens=3, temperature=0)
        assert out.completion_tokens == 3
        with Client(server.sdk) as other:
            chunks = iter(c.stream("Tell me a long story.", rid="busy", max_new_tokens=64, ignore_eos=True))
            next(chunks)
            with pytest.raises(StrataError) as err:
                other.generate("Hello", rid="busy", max_new_tokens=2)
            assert err.value.status == 400 and "already in flight" in str(err.value)
            chunks.close()


def test_a_wrongly_typed_request_is_a_400_not_a_silence(server: Server) -> None:
    """The client types its parameters before sending (a wrong type is its StrataError 400 at once),
    and a frame that skipped that (another language's client) is answered 400 by its rid: before,
    the server dropped it and the client waited 10 s to be told the server was down."""
    with Client(server.sdk) as c:
        t0 = time.monotonic()
        for bad in ({"max_new_tokens": "4"}, {"seed": 1.5}, {"min_new_tokens": None}, {"no_such": 1}):
            with pytest.raises(StrataError) as err:
                c.generate("Hello", **bad)
            assert err.value.status == 400, err.value
        assert c.generate("Hello", max_new_tokens=2, temperature=0, stop=".").completion_tokens <= 2  # stop: str
        # a null model-default field (temperature, top_p, ...) is unset, as over HTTP: not an error
        assert c.generate("Hello", max_new_tokens=2, temperature=None, seed=1).completion_tokens <= 2
        assert time.monotonic() - t0 < 5
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.sdk)
    try:
        frame = SDK_IN.codec.encode(GenerateRequest(rid="typed-wrong", params=SamplingParams(max_new_tokens=2),
                                                    text="Hello"))
        sock.send(frame.replace(b"\xaemax_new_tokens\x02", b"\xaemax_new_tokens\xa14"))  # the int 2 as "4"
        assert sock.poll(5000), "no answer to a malformed request"
        reply = SDK_OUT.codec.decode(sock.recv())
        assert (reply.rid, reply.status) == ("typed-wrong", 400) and "max_new_tokens" in reply.message, reply
        # `unset` names only model-default fields the params left at their default: else a 400, not an override
        for rid, unset, params in (("unset-unknown", ["no_such"], SamplingParams(max_new_tokens=2)),
                                   ("unset-set", ["temperature"], SamplingParams(max_new_tokens=2, temperature=0.0))):
            sock.send(SDK_IN.codec.encode(GenerateRequest(rid=rid, params=params, text="Hello", unset=unset)))
            assert sock.poll(5000), f"no answer to {rid}"
            reply = SDK_OUT.codec.decode(sock.recv())
            assert (reply.rid, reply.status) == (rid, 400) and "unset" in reply.message, reply
    finally:
        sock.close(0)


def test_async_client_same_rid_twice_and_abort_answer_at_once(server: Server) -> None:
    """Replies are routed by rid: a second request with a rid in flight on this client is a 400 at
    once and the first still gets its answer (the second's cleanup dropped the first's route, and
    the first waited 10 s for a 503); abort() ends the waiting call with a 499 at once (the server
    sends nothing more for an aborted request: it waited 10 s for a 503 too)."""

    async def main() -> None:
        async with AsyncClient(server.sdk) as ac:
            first = asyncio.ensure_future(ac.generate("Hello", rid="twice", max_new_tokens=12, temperature=0,
                                                      ignore_eos=True))
            await asyncio.sleep(0.05)
            with pytest.raises(StrataError) as err:
                await ac.generate("Hello", rid="twice", max_new_tokens=2)
            assert err.value.status == 400
            assert (await first).completion_tokens == 12
            waiting = asyncio.ensure_future(ac.generate("Hello", rid="cut", max_new_tokens=64, ignore_eos=True))
            await asyncio.sleep(0.2)
            t0 = time.monotonic()
            await ac.abort("cut")
            with pytest.raises(StrataError) as err:
                await waiting
            assert err.value.status == 499 and time.monotonic() - t0 < 5

    asyncio.run(main())
    assert server.wait_idle()["strata_kv_leak_free"] == 1


def test_closing_an_async_client_mid_stream_ends_the_stream_quietly(server: Server) -> None:
    """An audit: closing the AsyncClient while iterating its stream raised ZMQError ENOTSOCK from
    the stream's abort (sent on the closed socket); the server aborts what the connection owned."""

    async def main() -> None:
        ac = AsyncClient(server.sdk)
        stream = ac.stream("Tell me a long story.", max_new_tokens=64, ignore_eos=True)
        first = await stream.__anext__()
        assert first.token_ids
        ac.close()
        await stream.aclose()  # its abort: nothing to send it on, no error

    asyncio.run(main())
    assert server.wait_idle()["strata_kv_leak_free"] == 1


def test_a_second_request_on_a_busy_sync_client_is_refused(server: Server) -> None:
    """An audit: two interleaved streams on one Client lost each other's chunks with no error (7 and 5
    tokens of 10); the second request is a 409 now, and the client serves again once the first ends."""
    with Client(server.sdk) as c:
        a = c.stream("Count:", max_new_tokens=10, ignore_eos=True, temperature=0)
        first = next(a)
        with pytest.raises(StrataError) as err:
            next(c.stream("Other:", max_new_tokens=10))
        assert err.value.status == 409
        with pytest.raises(StrataError):
            c.generate("Other:", max_new_tokens=2)
        chunks = [first, *a]
        assert sum(len(ch.token_ids) for ch in chunks) == 10 and chunks[-1].finish_reason == "length"
        assert len(c.generate("Other:", max_new_tokens=3, ignore_eos=True).token_ids) == 3
