"""One API request end to end: its scheduler sub-requests -> text deltas.

`Generation` submits every sub-request at once (so the scheduler can share their cached
prompt prefix), detokenizes each output stream, and merges them into one stream of
`Delta`s tagged with the choice index. `collect` folds that stream into final choices
for non-streaming responses. Always `close()` a Generation (in a finally): it aborts
whatever is still running, which is how client disconnects reach the scheduler.

A request the server cannot finish raises `GenerationFailed` (an ApiError) from the delta
stream: 500 when the scheduler ended it with finish_reason "error", 503 when a server
process died. The fronts answer it like any ApiError (a JSON error before the response
starts; an SSE error event then [DONE] once a stream has started).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import structlog

from engine.serve.detokenizer import Detokenizer
from engine.serve.frontend import Frontend, GenerationFailed, ReqHandle  # fronts import it from here
from engine.serve.validate import SubRequest
from engine.tokenizer import TextTokenizer
from msgs.outputs import ReqOutput

log = structlog.get_logger()


@dataclass
class Delta:
    """New output of one choice. Counters are cumulative for that choice."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    matched: int | str | None = None  # what a "stop" matched: the token id, or the stop string
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    spec: tuple[int, int, int] | None = None  # speculative decoding: verify rows, drafts, accepted
    prompt_logprobs: list[float] | None = None  # prompt tokens 1.. (with the first output)
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class Choice:
    """A finished choice (non-streaming)."""

    index: int
    prompt_index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    matched: int | str | None = None  # what a "stop" matched: the token id, or the stop string
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    spec: tuple[int, int, int] | None = None  # speculative decoding: verify rows, drafts, accepted
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None


_DONE = object()


class Generation:
    """The scheduler requests behind one API request, and their merged output."""

    def __init__(
        self,
        frontend: Frontend,
        tok: TextTokenizer | None,
        parent: str,
        subs: list[SubRequest],
        t0: float | None = None,
        stream: bool = True,
    ) -> None:
        """Submits now: raises ApiError (400) if a rid is already in flight. stream=False
        when only the final result matters (`collect`): fewer wake-ups per token."""
        self.subs = subs
        self._tok = tok
        self._handles = frontend.submit_many(parent, [(s.rid, s.ids, s.params) for s in subs], t0, stream)
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    async def start(cls, frontend: Frontend, tok: TextTokenizer | None, parent: str, subs: list[SubRequest],
                    t0: float | None = None, stream: bool = True) -> Generation:
        """A Generation, once the rids it reuses are settled (Frontend.settled): the way to start one."""
        await frontend.settled([parent, *(s.rid for s in subs)])
        return cls(frontend, tok, parent, subs, t0, stream)

    async def deltas(self) -> AsyncIterator[Delta]:
        """Deltas of every choice, interleaved in arrival order."""
        if len(self.subs) == 1:
            async for delta in _sub_deltas(self._tok, self.subs[0], self._handles[0]):
                yield delta
            return
        queue: asyncio.Queue[object] = asyncio.Queue()
        for sub, handle in zip(self.subs, self._handles, strict=True):
            self._tasks.append(asyncio.create_task(_pump(_sub_deltas(self._tok, sub, handle), queue)))
        left = len(self._tasks)
        while left:
            item = await queue.get()
            if item is _DONE:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                assert isinstance(item, Delta)
                yield item

    def close(self) -> None:
        """Abort every unfinished sub-request (idempotent; safe in finally blocks)."""
        for task in self._tasks:
            task.cancel()
        for handle in self._handles:
            handle.close()


async def first_then_rest(gen: Generation) -> AsyncIterator[Delta]:
    """The deltas of a streaming request, after waiting for the first one.

    Waiting before the response starts lets a request the server fails at once get a
    real error status (GenerationFailed propagates) instead of a 200 and an error event."""
    deltas = gen.deltas()
    try:
        first = await anext(deltas, None)
    except BaseException:  # failed, or cancelled (client gone), before the response started
        gen.close()
        raise
    return _chain(first, deltas)


async def _chain(first: Delta | None, rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    if first is not None:
        yield first
    async for delta in rest:
        yield delta


async def _pump(gen: AsyncIterator[Delta], queue: asyncio.Queue[object]) -> None:
    try:
        async for delta in gen:
            queue.put_nowait(delta)
    except Exception as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
        queue.put_nowait(exc)
    finally:
        queue.put_nowait(_DONE)


async def _sub_deltas(tok: TextTokenizer | None, sub: SubRequest, handle: ReqHandle) -> AsyncIterator[Delta]:
    params = sub.params
    detok = Detokenizer(tok, params.stop, params.skip_special_tokens, sub.ids, params.min_new_tokens,
                        params.include_stop_str_in_output)
    produced = cached = 0
    spec: tuple[int, int, int] | None = None
    finish: str | None = None
    try:
        async for out in handle:
            cached = max(cached, out.cached_tokens)
            spec = out.spec or spec
            text, finish, kept = _text_and_finish(detok, out, params.include_stop_str_in_output,
                                                  by_token=bool(params.stop))
            if finish == "error":
                raise GenerationFailed(f"generation failed: {out.error or 'the scheduler failed this request'}")
            ids, logprobs, tops = out.new_ids, out.logprobs, out.top_logprobs
            if kept < len(ids):  # a stop string ended the output before these ids' last
                ids = ids[:kept]
                logprobs = None if logprobs is None else logprobs[:kept]
                tops = None if tops is None else tops[:kept]
            produced += kept
            if text or ids or finish:
                yield Delta(
                    index=sub.index,
                    text=text,
                    token_ids=ids,
                    logprobs=logprobs,
                    top_logprobs=tops,
                    finish_reason=finish,
                    matched=_matched(detok, out) if finish == "stop" else None,
                    prompt_tokens=len(sub.ids),
                    completion_tokens=produced,
                    cached_tokens=cached,
                    spec=spec,
                    prompt_logprobs=out.prompt_logprobs,
                    prompt_top_logprobs=out.prompt_top_logprobs,
                )
            if finish:
                return
    except GenerationFailed:
        finish = "error"
        raise
    finally:
        if finish is None:  # cancelled: what it generated counts, taken or not (an audit logged 0)
            produced += handle.undelivered_tokens()
        handle.close()  # after a stop string this aborts the request in the scheduler
        handle.ended(finish or "cancelled")
        log.info(
            "request finished",
            rid=sub.rid,
            finish_reason=finish or "cancelled",
            prompt_tokens=len(sub.ids),
            completion_tokens=produced,
            cached_tokens=cached,
            ttft=None if handle.ttft is None else round(handle.ttft, 6),
        )


def _text_and_finish(detok: Detokenizer, out: ReqOutput, keep_stop_token: bool,
                     by_token: bool) -> tuple[str, str | None, int]:
    """Text for one output, the finish reason (a stop string overrides the scheduler's) and how
    many of its ids the answer keeps. An output may carry several ids (a speculative step's
    accepted drafts, outputs merged while the consumer was busy); with stop strings (`by_token`)
    they are read one by one, so that a stop string ends the answer at the id that completed it,
    ids, logprobs and usage alike, as one id a step would."""
    ids = out.new_ids
    # The scheduler's "stop" is always a token's (EOS, a user stop token, a grammar's end): it ends
    # the text but is not part of it, unless include_stop_str_in_output (vLLM's rule; the token
    # stays in token_ids, logprobs and usage)
    if out.finish_reason == "stop" and ids and not keep_stop_token:
        ids = ids[:-1]
    if by_token and len(ids) > 1:
        parts = []
        for i in range(len(ids)):
            parts.append(detok.push(ids[i : i + 1]))
            if detok.stopped:
                return "".join(parts), "stop", i + 1
        text = "".join(parts)
    else:
        text = detok.push(ids)
        if detok.stopped:
            return text, "stop", len(ids)
    if out.finish_reason is None:
        return text, None, len(out.new_ids)
    text += detok.finish()
    return text, "stop" if detok.stopped else out.finish_reason, len(out.new_ids)


def _matched(detok: Detokenizer, out: ReqOutput) -> int | str | None:
    """What ended a "stop": the stop string, else the token the scheduler stopped on."""
    if detok.matched is not None:
        return detok.matched
    return out.new_ids[-1] if out.finish_reason == "stop" and out.new_ids else None


async def collect(gen: Generation) -> list[Choice]:
    """Run to completion; the choices in index order. Raises GenerationFailed."""
    choices = {s.index: Choice(index=s.index, prompt_index=s.prompt_index) for s in gen.subs}
    texts: dict[int, list[str]] = {i: [] for i in choices}  # joined once: `+=` on a str is quadratic
    async for delta in gen.deltas():
        c = choices[delta.index]
        texts[delta.index].append(delta.text)
        c.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            c.logprobs = c.logprobs or []
            c.logprobs.extend(delta.logprobs)
        if delta.top_logprobs is not None:
            c.top_logprobs = c.top_logprobs or []
            c.top_logprobs.extend(delta.top_logprobs)
        c.finish_reason = delta.finish_reason or c.finish_reason
        c.matched = delta.matched if delta.finish_reason else c.matched
        c.prompt_tokens, c.completion_tokens = delta.prompt_tokens, delta.completion_tokens
        c.cached_tokens = delta.cached_tokens
        c.spec = delta.spec or c.spec
        if delta.prompt_logprobs is not None:
            c.prompt_logprobs, c.prompt_top_logprobs = delta.prompt_logprobs, delta.prompt_top_logprobs
    for i, c in choices.items():
        c.text = "".join(texts[i])
    return [choices[i] for i in sorted(choices)]
