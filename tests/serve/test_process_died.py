"""A dead server process, seen by the tokenizer's core (no sockets): in-flight requests
fail with a 503 naming the process (SSE: error event then [DONE]), new ones are refused,
readiness drops; a request the scheduler fails is a 500 in the same shapes."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import pytest

from engine.config import ServerConfig
from engine.serve.errors import ApiError
from engine.serve.frontend import Frontend, GenerationFailed
from engine.serve.generate import Generation, collect
from engine.serve.native import generate_http
from engine.serve.state import Call, Reply, ServeState
from engine.serve.validate import SubRequest
from msgs.outputs import ReqOutput, SchedulerStats, TokenBatch
from msgs.params import SamplingParams
from msgs.requests import AbortRequest

STATS = SchedulerStats(
    ready=True,
    max_context=100,
    vocab_size=1000,
    kv_pages_total=10,
    kv_pages_used=0,
    cache_pages=0,
    running=0,
    waiting=0,
    cache_hit_tokens=0,
    step_seconds=[],
)


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


def ready_state() -> ServeState:
    fe = Frontend()
    fe.dispatch(STATS)
    return ServeState(cfg=ServerConfig(), tok=None, frontend=fe, ready_timeout_s=5)


def body(stream: bool) -> bytes:
    return json.dumps({"input_ids": [1, 2, 3], "stream": stream, "sampling_params": {"max_new_tokens": 50}}).encode()


def tokens(rid: str, ids: list[int], finish: str | None = None, error: str | None = None) -> TokenBatch:
    return TokenBatch(outs=[ReqOutput(rid=rid, new_ids=ids, finish_reason=finish, error=error)])


async def events(stream: AsyncIterator[bytes]) -> list[Any]:
    out = []
    async for raw in stream:
        data = raw.decode().removeprefix("data: ").strip()
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def started_stream(state: ServeState, rid: str) -> Reply:
    """A streaming /generate that has produced its first token."""
    task = asyncio.create_task(generate_http(state, body(True), Call(rid, time.monotonic())))
    await asyncio.sleep(0)
    state.frontend.dispatch(tokens(rid, [7]))
    reply = await task
    assert reply.stream is not None
    return reply


def test_stream_in_flight_gets_error_event_then_done() -> None:
    async def main() -> None:
        state = ready_state()
        reply = await started_stream(state, "s")
        assert reply.stream is not None
        first = await anext(reply.stream)
        assert json.loads(first.decode().removeprefix("data: "))["output_ids"] == [7]
        assert state.frontend.process_died("worker-0", "killed by SIGKILL") == 1
        rest = await events(reply.stream)
        assert rest[-1] == "[DONE]" and len(rest) == 2
        err = rest[0]["error"]
        assert err["type"] == "server_error" and err["code"] == "process_died"
        assert "worker-0" in err["message"] and "SIGKILL" in err["message"]
        assert await state.frontend.drained(1.0)

    run(main())


def test_non_streaming_in_flight_gets_503() -> None:
    async def main() -> None:
        state = ready_state()
        task = asyncio.create_task(generate_http(state, body(False), Call("w", time.monotonic())))
        await asyncio.sleep(0)
        state.frontend.dispatch(tokens("w", [7, 8]))
        state.frontend.process_died("scheduler", "exit status 1")
        with pytest.raises(ApiError) as info:
            await task
        assert info.value.status == 503 and info.value.code == "process_died"
        assert "scheduler" in info.value.message
        assert state.frontend.num_in_flight == 0

    run(main())


def test_outputs_before_the_death_are_delivered_first() -> None:
    async def main() -> None:
        fe = Frontend()
        handle = fe.submit("a", [1], SamplingParams())
        fe.dispatch(tokens("a", [5]))
        fe.dispatch(tokens("a", [6]))
        fe.process_died("worker-0", "killed by SIGKILL")
        out = await anext(handle)
        assert out.new_ids == [5, 6] and out.finish_reason is None
        with pytest.raises(GenerationFailed):
            await anext(handle)
        assert handle.finished and not fe.in_flight("a")

    run(main())


def test_after_the_death_new_requests_and_health_get_503() -> None:
    async def main() -> None:
        state = ready_state()
        assert state.frontend.ready
        state.frontend.process_died("worker-0", "killed by SIGKILL")
        assert not state.frontend.ready  # /health answers 503
        state.frontend.dispatch(STATS)  # a live scheduler's stats do not make it ready again
        assert not state.frontend.ready
        with pytest.raises(ApiError) as info:
            await generate_http(state, body(True), Call("late", time.monotonic()))
        assert info.value.status == 503 and "worker-0" in info.value.message
        with pytest.raises(GenerationFailed):
            state.frontend.submit("late2", [1], SamplingParams())

    run(main())


def test_a_request_waiting_for_readiness_is_woken_by_the_death() -> None:
    async def main() -> None:
        state = ServeState(cfg=ServerConfig(), tok=None, frontend=Frontend(), ready_timeout_s=30)
        task = asyncio.create_task(state.limits())
        await asyncio.sleep(0.01)
        t0 = time.monotonic()
        state.frontend.process_died("scheduler", "killed by SIGKILL")
        with pytest.raises(ApiError) as info:
            await task
        assert info.value.status == 503 and time.monotonic() - t0 < 1

    run(main())


def test_scheduler_error_is_a_500_before_and_after_the_stream_starts() -> None:
    async def main() -> None:
        state = ready_state()
        task = asyncio.create_task(generate_http(state, body(True), Call("e1", time.monotonic())))
        await asyncio.sleep(0)
        state.frontend.dispatch(tokens("e1", [], "error", "the prompt is too long"))
        with pytest.raises(ApiError) as info:
            await task
        assert info.value.status == 500 and info.value.code == "generation_failed"
        reply = await started_stream(state, "e2")
        assert reply.stream is not None
        await anext(reply.stream)
        state.frontend.dispatch(tokens("e2", [], "error", "digest mismatch"))
        rest = await events(reply.stream)
        assert rest[-1] == "[DONE]"
        err = rest[0]["error"]
        assert err["type"] == "server_error" and err["code"] == "generation_failed" and "digest" in err["message"]

    run(main())


def test_collect_raises_503_for_every_choice() -> None:
    async def main() -> None:
        fe = Frontend()
        subs = [SubRequest(f"n-{i}", i, 0, [1], SamplingParams()) for i in range(2)]
        gen = Generation(fe, None, "n", subs, stream=False)
        task = asyncio.create_task(collect(gen))
        await asyncio.sleep(0)
        assert fe.process_died("worker-0", "killed by SIGKILL") == 2
        with pytest.raises(GenerationFailed) as info:
            await task
        gen.close()
        assert info.value.status == 503
        assert await fe.drained(1.0)

    run(main())


def test_health_names_the_dead_process() -> None:
    from starlette.testclient import TestClient

    from engine.serve.http import build_app

    state = ready_state()
    with TestClient(build_app(state)) as client:
        assert client.get("/health").status_code == 200
        state.frontend.process_died("worker-0", "killed by SIGKILL")
        r = client.get("/health")
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == "process_died" and "worker-0" in err["message"] and "SIGKILL" in err["message"]


def test_health_generate_answers_503_when_no_token_comes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ready server whose scheduler never answers (a stuck process): the probe is a 503 after
    its time limit, not a wait for the watchdog, and its request is closed."""
    from engine.serve import native

    monkeypatch.setattr(native, "HEALTH_GENERATE_TIMEOUT_S", 0.3)

    async def main() -> None:
        state = ready_state()
        t0 = time.monotonic()
        with pytest.raises(ApiError) as err:
            await native.health_generate(state, b"", Call("probe", t0))
        assert err.value.status == 503 and "no output within 0.3 s" in err.value.message
        assert 0.3 <= time.monotonic() - t0 < 3
        sent = []
        while not state.frontend._outbox.empty():
            sent.append(state.frontend._outbox.get_nowait())
        assert any(isinstance(m, AbortRequest) and m.rid == "probe" for m in sent), "the probe's request is aborted"

    run(main())


def test_health_generate_of_a_busy_server_answers_on_any_output() -> None:
    """An audit: a healthy server whose queue held the probe for 20 s answered 503. As SGLang's, any
    request's output after the probe started answers 200 (the probe's own token not needed)."""
    from engine.serve import native

    async def main() -> None:
        state = ready_state()
        t0 = time.monotonic()
        probe = asyncio.ensure_future(native.health_generate(state, b"", Call("probe", t0)))
        await asyncio.sleep(0.2)
        assert not probe.done()  # no output yet: it waits
        state.frontend.dispatch(tokens("someone-else", [5]))
        reply = await asyncio.wait_for(probe, 2)
        assert reply.body == {"status": "ok", "output_ids": []}
        sent = []
        while not state.frontend._outbox.empty():
            sent.append(state.frontend._outbox.get_nowait())
        assert any(isinstance(m, AbortRequest) and m.rid == "probe" for m in sent), "the probe is dropped"

    run(main())


def test_health_generate_answers_503_at_once_before_ready() -> None:
    """The probe never waits for readiness (a request does): before the scheduler is ready it is a
    503 right away, and once a process died the dead process's 503."""
    from engine.serve.native import health_generate

    async def main() -> None:
        state = ServeState(cfg=ServerConfig(), tok=None, frontend=Frontend(), ready_timeout_s=30)
        t0 = time.monotonic()
        with pytest.raises(ApiError) as err:
            await health_generate(state, b"", Call("probe", t0))
        assert err.value.status == 503 and "not ready" in err.value.message
        assert time.monotonic() - t0 < 1
        state.frontend.process_died("worker-0", "killed by SIGKILL")
        with pytest.raises(ApiError) as err:
            await health_generate(state, b"", Call("probe2", time.monotonic()))
        assert err.value.status == 503 and "worker-0" in err.value.message

    run(main())


def test_a_request_that_ran_and_failed_is_not_counted_rejected() -> None:
    """An audit: the 503 of a request a process death ended counted in strata_requests_rejected
    ("refused before they ran"), beside its "error" end; only refusals count now."""
    import httpx

    from engine.serve.http import build_app

    async def main() -> None:
        state = ready_state()
        rejected = state.frontend.metrics.rejected
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            running = asyncio.create_task(client.post("/generate", content=body(False),
                                                      headers={"content-type": "application/json"}))
            while not state.frontend.num_in_flight:
                await asyncio.sleep(0.01)
            state.frontend.process_died("worker-0", "killed by SIGKILL")
            assert (await running).status_code == 503
            assert rejected.labels("503")._value.get() == 0
            bad = await client.post("/generate", content=b"{", headers={"content-type": "application/json"})
            assert bad.status_code == 400 and rejected.labels("400")._value.get() == 1

    run(main())
