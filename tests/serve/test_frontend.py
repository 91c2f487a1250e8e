"""The async core without sockets: routing, coalescing, aborts, stop strings, n > 1."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import pytest

from engine.serve import formats as fmt
from engine.serve.errors import ApiError
from engine.serve.frontend import Frontend, merge_outputs
from engine.serve.generate import Generation, GenerationFailed, collect
from engine.serve.metrics import Metrics
from engine.serve.validate import SubRequest, fan_out
from msgs.codec import unpack_ids
from msgs.outputs import ReqOutput, SchedulerStats, TokenBatch
from msgs.params import SamplingParams
from msgs.requests import AbortRequest, TokenizedRequest


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


def sent(fe: Frontend) -> list[Any]:
    out = []
    while not fe._outbox.empty():
        out.append(fe._outbox.get_nowait())
    return out


def out(rid: str, ids: list[int], finish: str | None = None, **kw: Any) -> TokenBatch:
    return TokenBatch(outs=[ReqOutput(rid=rid, new_ids=ids, finish_reason=finish, **kw)])


def stats(**kw: Any) -> SchedulerStats:
    base = dict(
        ready=True,
        max_context=100,
        vocab_size=1000,
        kv_pages_total=10,
        kv_pages_used=2,
        cache_pages=1,
        running=1,
        waiting=0,
        cache_hit_tokens=0,
        step_seconds=[],
    )
    return SchedulerStats(**{**base, **kw})


def test_submit_routes_outputs_and_finishes() -> None:
    async def main() -> None:
        fe = Frontend()
        handle = fe.submit("a", [1, 2, 3], SamplingParams(max_new_tokens=2))
        (req,) = sent(fe)
        assert isinstance(req, TokenizedRequest) and unpack_ids(req.input_ids) == [1, 2, 3]
        fe.dispatch(out("a", [7]))
        fe.dispatch(out("other", [9]))  # unknown rids are dropped
        fe.dispatch(out("a", [8], "length"))
        got = [o async for o in handle]
        # Both outputs queued before the consumer ran: merged into one.
        assert [(o.new_ids, o.finish_reason) for o in got] == [([7, 8], "length")]
        assert not fe.in_flight("a")
        handle.close()
        assert sent(fe) == []  # finished requests are not aborted

    run(main())


def test_close_before_finish_aborts_and_frees_the_rid() -> None:
    async def main() -> None:
        fe = Frontend()
        handle = fe.submit("a", [1], SamplingParams())
        with pytest.raises(ApiError) as info:
            fe.submit("a", [1], SamplingParams())
        assert info.value.status == 400 and info.value.code == "duplicate_request_id"
        sent(fe)
        handle.close()
        assert sent(fe) == [AbortRequest(rid="a")]
        assert fe.in_flight("a")  # until the scheduler's answer to the abort comes
        fe.dispatch(out("a", [], "abort"))
        assert not fe.in_flight("a")
        fe.submit("a", [1], SamplingParams())  # reusable once gone

    run(main())


def test_a_fan_out_id_in_flight_is_named() -> None:
    """n = 2 under rid "abc" makes abc-0 and abc-1: where abc-0 is another request's, the 400 says
    so, not that "abc" is in flight."""
    async def main() -> None:
        fe = Frontend()
        fe.submit("abc-0", [1], SamplingParams())
        with pytest.raises(ApiError) as info:
            fe.submit_many("abc", [("abc-0", [1], SamplingParams()), ("abc-1", [1], SamplingParams())])
        assert info.value.code == "duplicate_request_id" and "sub-request id 'abc-0'" in info.value.message
        with pytest.raises(ApiError) as info:
            fe.submit("abc-0", [1], SamplingParams())
        assert info.value.message == "request id 'abc-0' is already in flight"

    run(main())


def test_a_reused_rid_waits_for_the_abort_and_gets_only_its_own_outputs() -> None:
    """A client closes a request (a stop string, a disconnect) and at once sends another with the
    same id: the new one starts once the old one's final output is in, and never receives it."""

    async def main() -> None:
        fe = Frontend()
        fe.submit("a", [1], SamplingParams()).close()
        sent(fe)
        task = asyncio.create_task(Generation.start(fe, None, "a", [SubRequest("a", 0, 0, [2], SamplingParams())]))
        await asyncio.sleep(0.02)
        assert not task.done() and sent(fe) == []  # held: the old request's abort is unanswered
        fe.dispatch(out("a", [5], "abort"))  # the old request's last output
        gen = await task
        (req,) = sent(fe)
        assert unpack_ids(req.input_ids) == [2]
        fe.dispatch(out("a", [7, 8], "length"))
        (choice,) = await collect(gen)
        assert choice.token_ids == [7, 8] and choice.finish_reason == "length"

    run(main())


def test_a_closed_request_whose_final_output_was_in_frees_its_rid_at_once() -> None:
    async def main() -> None:
        fe = Frontend()
        handle = fe.submit("a", [1], SamplingParams())
        fe.dispatch(out("a", [7], "stop"))  # arrived, not yet consumed
        handle.close()
        assert not fe.in_flight("a")

    run(main())


def test_parent_and_sub_rids_are_all_taken() -> None:
    async def main() -> None:
        fe = Frontend()
        subs = fan_out("p", [[1]], [SamplingParams()], 2)
        gen = Generation(fe, None, "p", subs)
        for rid in ("p", "p-0", "p-1"):
            with pytest.raises(ApiError):
                fe.submit(rid, [1], SamplingParams())
        gen.close()
        assert {m.rid for m in sent(fe) if isinstance(m, AbortRequest)} == {"p-0", "p-1"}
        assert not fe.in_flight("p")

    run(main())


def test_merge_outputs_keeps_logprobs_aligned() -> None:
    merged = merge_outputs(
        [
            ReqOutput("a", [1], logprobs=[-0.1], top_logprobs=[[(1, -0.1)]], cached_tokens=4,
                      prompt_logprobs=[-1.5], prompt_top_logprobs=[[(7, -0.5)]]),
            ReqOutput("a", [2, 3], "stop", logprobs=[-0.2, -0.3], top_logprobs=[[(2, -0.2)], [(3, -0.3)]]),
        ]
    )
    assert merged.new_ids == [1, 2, 3] and merged.finish_reason == "stop"
    assert merged.logprobs == [-0.1, -0.2, -0.3] and len(merged.top_logprobs or []) == 3
    assert merged.cached_tokens == 4
    assert merged.prompt_logprobs == [-1.5] and merged.prompt_top_logprobs == [[(7, -0.5)]]  # the first output's


def test_stop_string_finishes_and_aborts(text_tok) -> None:
    async def main() -> None:
        fe = Frontend()
        ids = text_tok.encode("one two STOP three four")
        params = SamplingParams(stop=["STOP"], max_new_tokens=50)
        gen = Generation(fe, text_tok, "s", [SubRequest("s", 0, 0, [1], params)])
        sent(fe)

        async def feed() -> None:
            for t in ids:
                fe.dispatch(out("s", [t]))
                await asyncio.sleep(0)

        feeder = asyncio.create_task(feed())
        try:
            deltas = [d async for d in gen.deltas()]
        finally:
            gen.close()
        await feeder
        assert "".join(d.text for d in deltas) == "one two "
        assert deltas[-1].finish_reason == "stop"
        assert AbortRequest(rid="s") in sent(fe)  # the scheduler frees the pages

    run(main())


def test_a_stop_string_inside_a_multi_token_output_ends_the_answer_at_its_token(text_tok) -> None:
    """A speculative step answers several ids at once (outputs merged while the consumer was busy
    do too): a stop string completed by one of them ends the answer there, its ids, logprobs, top
    logprobs and usage, as one id a step would (the audit saw 2-4 ids past the stop)."""
    ids = text_tok.encode("one two STOP three four five")
    done = next(i for i in range(len(ids)) if "STOP" in text_tok.decode(ids[: i + 1])) + 1
    assert done < len(ids) - 1

    async def answer(chunks: list[list[int]]) -> Any:
        fe = Frontend()
        params = SamplingParams(stop=["STOP"], max_new_tokens=50, logprobs=True, top_logprobs=1)
        gen = Generation(fe, text_tok, "m", [SubRequest("m", 0, 0, [1], params)])
        at = 0
        for chunk in chunks:
            lps = [-float(at + j) for j in range(len(chunk))]
            tops = [[(t, lp)] for t, lp in zip(chunk, lps, strict=True)]
            fe.dispatch(out("m", chunk, logprobs=lps, top_logprobs=tops))
            at += len(chunk)
        (choice,) = await collect(gen)
        return choice

    one_a_step = run(answer([[t] for t in ids]))
    at_once = run(answer([ids[:2], ids[2:]]))
    for c in (one_a_step, at_once):
        assert c.text == "one two " and c.finish_reason == "stop"
        assert c.token_ids == ids[:done] and c.completion_tokens == done
        assert c.logprobs == [-float(j) for j in range(done)] and len(c.top_logprobs) == done


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("stop", ["user", "eos"])
def test_the_stop_token_is_not_in_the_text_unless_asked(text_tok, stop: str, keep: bool) -> None:
    """A user stop token, and EOS where special tokens are kept in the text, end the text without
    being part of it (vLLM); include_stop_str_in_output keeps them. Either way token_ids hold them."""
    async def main() -> None:
        fe = Frontend()
        if stop == "user":
            stop_id, shown = text_tok.encode("!")[0], "!"
            params = SamplingParams(stop_token_ids=[stop_id], include_stop_str_in_output=keep)
        else:
            stop_id, shown = text_tok.encode("<|im_end|>")[0], "<|im_end|>"
            params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=keep)
        assert text_tok.decode([stop_id], skip_special_tokens=False) == shown
        gen = Generation(fe, text_tok, "t", [SubRequest("t", 0, 0, [1], params)])
        fe.dispatch(out("t", [*text_tok.encode("hello"), stop_id], "stop"))
        (choice,) = await collect(gen)
        assert choice.text == ("hello" + shown if keep else "hello") and choice.finish_reason == "stop"
        assert choice.token_ids[-1] == stop_id

    run(main())


def test_n_choices_are_merged_with_their_index(text_tok) -> None:
    async def main() -> None:
        fe = Frontend()
        subs = fan_out("n", [text_tok.encode("x")], [SamplingParams(seed=1)], 3)
        gen = Generation(fe, text_tok, "n", subs)
        for i, word in enumerate(["one", "two", "three"]):
            fe.dispatch(out(f"n-{i}", text_tok.encode(word), "length", cached_tokens=i))
        choices = await collect(gen)
        gen.close()
        assert [(c.index, c.text) for c in choices] == [(0, "one"), (1, "two"), (2, "three")]
        use = fmt.usage_of((c.prompt_index, c.prompt_tokens, c.completion_tokens, c.cached_tokens) for c in choices)
        assert use["prompt_tokens"] == 1  # one prompt, counted once
        assert use["completion_tokens"] == sum(len(text_tok.encode(w)) for w in ["one", "two", "three"])

    run(main())


def test_scheduler_error_raises() -> None:
    async def main() -> None:
        fe = Frontend()
        gen = Generation(fe, None, "e", [SubRequest("e", 0, 0, [1], SamplingParams())])
        fe.dispatch(out("e", [], "error", error="worker died"))
        with pytest.raises(GenerationFailed, match="worker died"):
            await collect(gen)
        gen.close()

    run(main())


async def _cancel_a_consumer(fe: Frontend, gen: Generation, outputs: tuple[TokenBatch, ...] = ()) -> None:
    """Collect gen in a task (closing it at the end, as the HTTP handlers do), let `outputs` come, cancel it."""
    async def consume() -> None:
        try:
            await collect(gen)
        finally:
            gen.close()

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.01)
    for o in outputs:
        fe.dispatch(o)
    await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_cancelled_consumer_aborts() -> None:
    async def main() -> None:
        fe = Frontend()
        gen = Generation(fe, None, "c", fan_out("c", [[1]], [SamplingParams()], 2))
        sent(fe)
        await _cancel_a_consumer(fe, gen)
        assert {m.rid for m in sent(fe)} == {"c-0", "c-1"}
        assert fe.num_in_flight == 0

    run(main())


def test_a_cancelled_non_streamed_request_counts_what_it_generated() -> None:
    """An audit: a non-streamed request (woken only by its final output) cancelled mid-way was
    logged with completion_tokens 0, though it had generated tokens; bin/analyze undercounted."""
    from structlog.testing import capture_logs

    async def main() -> list[dict]:
        fe = Frontend()
        gen = Generation(fe, None, "q", fan_out("q", [[1]], [SamplingParams()], 1), stream=False)
        sent(fe)
        with capture_logs() as logs:
            await _cancel_a_consumer(fe, gen, (out("q", [5, 6]), out("q", [7])))
        return logs

    done = [e for e in run(main()) if e["event"] == "request finished"]
    assert [(e["finish_reason"], e["completion_tokens"]) for e in done] == [("cancelled", 3)]


def test_readiness_and_limits() -> None:
    async def main() -> None:
        fe = Frontend()
        assert not fe.ready and fe.limits() is None
        assert not await fe.wait_ready(0.01)
        fe.dispatch(stats(ready=False))
        assert not fe.ready
        fe.dispatch(stats(max_context=4096))
        assert fe.ready and await fe.wait_ready(0.01)
        assert fe.limits() is not None and fe.limits().max_context == 4096

    run(main())


def test_metrics_from_stats_and_requests() -> None:
    async def main() -> str:
        m = Metrics()
        fe = Frontend(m)
        fe.dispatch(stats(cache_hit_tokens=10, step_seconds=[0.01, 0.02], kv_pages_used=5, running=3))
        fe.dispatch(stats(cache_hit_tokens=25, leak_free=False))
        handle = fe.submit("m", [1, 2, 3, 4], SamplingParams())
        fe.dispatch(out("m", [5, 6], "length"))
        _ = [o async for o in handle]
        return m.render()[0].decode()

    text = run(main())
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(lines['strata_cache_hit_tokens_total{tier="l1"}']) == 25
    assert float(lines["strata_requests_total"]) == 1
    assert float(lines["strata_prompt_tokens_total"]) == 4
    assert float(lines["strata_generation_tokens_total"]) == 2
    assert float(lines["strata_step_seconds_count"]) == 2
    assert float(lines["strata_ttft_seconds_count"]) == 1
    assert float(lines["strata_kv_leak_free"]) == 0
    assert float(lines["strata_running_requests"]) == 1


def test_request_latency_token_and_speculation_metrics() -> None:
    """An audit: no E2E, time-per-output-token or per-request token histograms (vLLM's and SGLang's
    dashboards plot them), and no drafted-token count to make an acceptance rate of."""
    async def main() -> str:
        m = Metrics()
        fe = Frontend(m)
        t0 = time.monotonic() - 1.0  # arrived a second ago
        handle = fe.submit("m", [1, 2, 3, 4, 5], SamplingParams(), t0=t0)
        fe.dispatch(out("m", [6]))
        await asyncio.sleep(0.05)
        fe.dispatch(out("m", [7, 8]))
        fe.dispatch(out("m", [9], "length"))
        _ = [o async for o in handle]
        # cumulative: 3 verify rows accepting 0, 2, 2 drafts of 3 each; then 1 more of 1 accepting 1
        fe.dispatch(stats(spec_accept_hist=[1, 0, 2], spec_drafted=9))
        fe.dispatch(stats(spec_accept_hist=[1, 1, 2], spec_drafted=10))
        return m.render()[0].decode()

    lines = dict(line.rsplit(" ", 1) for line in run(main()).splitlines() if line and not line.startswith("#"))
    assert float(lines["strata_e2e_request_latency_seconds_count"]) == 1
    e2e = float(lines["strata_e2e_request_latency_seconds_sum"])
    assert 1.0 < e2e < 5
    tpot = float(lines["strata_time_per_output_token_seconds_sum"])  # 3 gaps after the first token
    assert 0.05 / 3 <= tpot < e2e and float(lines["strata_time_per_output_token_seconds_count"]) == 1
    assert float(lines["strata_request_prompt_tokens_sum"]) == 5
    assert float(lines["strata_request_generation_tokens_sum"]) == 4
    assert float(lines['strata_request_generation_tokens_bucket{le="5.0"}']) == 1
    assert float(lines["strata_spec_draft_tokens_total"]) == 10
    assert float(lines["strata_spec_accepted_tokens_total"]) == 5


def test_logprob_formats(text_tok) -> None:
    ids = text_tok.encode("hi there")
    lps = [-0.5] * len(ids)
    tops = [[(t, -0.5), (0, float("-inf"))] for t in ids]
    chat = fmt.chat_logprobs(text_tok, ids, lps, tops)
    assert chat is not None
    entry = chat["content"][0]
    assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
    assert entry["top_logprobs"][1]["logprob"] == fmt.LOGPROB_FLOOR  # -inf is not JSON
    legacy, end = fmt.completion_logprobs(text_tok, ids, lps, tops)
    assert legacy is not None and "".join(legacy["tokens"]) == "hi there"
    other = [[(0, -0.25)] for _ in ids]  # the chosen token is not among the alternatives: it comes first
    shown, _ = fmt.completion_logprobs(text_tok, ids, lps, other)
    assert shown is not None and [list(t.items()) for t in shown["top_logprobs"]] == [
        [(fmt.token_text(text_tok, t), -0.5), (fmt.token_text(text_tok, 0), -0.25)] for t in ids]
    assert legacy["text_offset"][0] == 0 and end.chars == len("hi there") and end.pending == b""
    assert fmt.chat_logprobs(text_tok, ids, None, None) is None


def test_logprobs_of_a_character_split_over_tokens(text_tok) -> None:
    """An emoji is two tokens here: chat's `bytes` are each token's own (joined, the text's bytes),
    and completions' text_offset counts characters of the text, not one per token's U+FFFD."""
    text = "I love \U0001F600\U0001F600 ok"
    ids = text_tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # the emojis are split
    chat = fmt.chat_logprobs(text_tok, ids, [-0.1] * len(ids), None)
    assert bytes(b for e in chat["content"] for b in e["bytes"]).decode() == text
    half = len(ids) // 2  # streamed: the offset carried over two calls, mid-character or not
    first, off = fmt.completion_logprobs(text_tok, ids[:half], [-0.1] * half, None)
    rest, end = fmt.completion_logprobs(text_tok, ids[half:], [-0.1] * (len(ids) - half), None, off)
    offsets = first["text_offset"] + rest["text_offset"]
    assert end.chars == len(text)
    parts = [text_tok.token_bytes(t) for t in ids]
    # a token starts at the characters completed before it (one inside a character: at that character)
    assert offsets == [len(b"".join(parts[:i]).decode("utf-8", "ignore")) for i in range(len(ids))]
    assert offsets[-1] == len(text) - len(parts[-1].decode())


def test_a_token_after_an_invalid_lead_byte_starts_after_its_replacement(text_tok) -> None:
    """An audit's echo of [10813, 905] gave text_offset [0, 0, ...]: the lone byte is a U+FFFD
    of its own in the text, so the next token starts at 1 (the decoded text shows where)."""
    lead = next(t for t in range(len(text_tok.hf)) if text_tok.token_bytes(t) in (b"\xe0", b"\xf0", b"\xc3"))
    ids = [lead] + text_tok.encode(" world", add_special_tokens=False)
    body, end = fmt.completion_logprobs(text_tok, ids, [-0.1] * len(ids), None)
    text = b"".join(text_tok.token_bytes(t) for t in ids).decode("utf-8", "replace")
    assert text.startswith("\ufffd world") and end.chars == len(text)
    assert body["text_offset"][:2] == [0, 1]
    assert fmt.TextOffset(3, b"\xc3").start_of(b"\xa9 ok") == 3  # a byte that completes it: inside it


class _FakeRequest:
    """Just the ASGI receive channel of a Starlette Request."""

    def __init__(self, disconnect_after: float | None) -> None:
        self._after = disconnect_after

    async def receive(self) -> dict[str, Any]:
        if self._after is None:
            await asyncio.Event().wait()  # the client never leaves
        await asyncio.sleep(self._after or 0)
        return {"type": "http.disconnect"}


def test_disconnect_cancels_a_pending_handler() -> None:
    from engine.serve.http import ClientGone, until_disconnect
    from engine.serve.state import Reply

    async def main() -> list[str]:
        events: list[str] = []

        async def slow() -> Reply:
            try:
                await asyncio.sleep(10)
            finally:
                events.append("cleaned up")
            return Reply(body={})

        async def fast() -> Reply:
            return Reply(body={"ok": True})

        with pytest.raises(ClientGone):
            await until_disconnect(_FakeRequest(0.01), slow())  # type: ignore[arg-type]
        reply = await until_disconnect(_FakeRequest(None), fast())  # type: ignore[arg-type]
        events.append(str(reply.body))
        return events

    assert run(main()) == ["cleaned up", "{'ok': True}"]


def test_a_reused_rid_waits_briefly_for_its_old_request_to_be_closed() -> None:
    """The old request's handler notices its client's disconnect a moment after the new request
    with the same id arrives: the new one waits for that (within grace_s) instead of a 400; a
    request that stays in flight is still a 400 after the grace."""

    async def main() -> None:
        fe = Frontend()
        old = fe.submit("a", [1], SamplingParams())
        task = asyncio.create_task(Generation.start(fe, None, "a", [SubRequest("a", 0, 0, [2], SamplingParams())]))
        await asyncio.sleep(0.02)
        assert not task.done()  # waiting: "a" still runs
        old.close()  # the disconnect, noticed
        fe.dispatch(out("a", [], "abort"))
        await task
        fe.submit("b", [1], SamplingParams())
        t0 = time.monotonic()
        with pytest.raises(ApiError) as info:
            await Generation.start(fe, None, "b", [SubRequest("b", 0, 0, [2], SamplingParams())])
        assert info.value.code == "duplicate_request_id" and 0.4 < time.monotonic() - t0 < 5

    run(main())
