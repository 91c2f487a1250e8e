"""SGLang-native /generate, and the request preparation it shares with the ZMQ SDK.

/generate answers {"text", "output_ids", "meta_info": {id, prompt_tokens,
completion_tokens, cached_tokens, finish_reason}}, finish_reason as SGLang's object ({"type": "stop",
"matched": token id or stop string} / {"type": "length", "length": n}). Streamed events follow SGLang: each
carries the text and output ids so far (cumulative), then `data: [DONE]`. A batch (`text` a
list of strings or `input_ids` a list of id lists) answers a list of those, not streamed.
SGLang's top-level `return_logprob`, `top_logprobs_num` and `logprob_start_len` (>= 0: the
prompt's tokens from there, `input_token_logprobs`) set the sampling params' logprobs,
top_logprobs and prompt_logprobs; `return_text_in_logprobs` puts each token's text third.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog

from engine.serve import formats as fmt
from engine.serve.errors import ApiError, api_error_body
from engine.serve.generate import Choice, Delta, Generation, GenerationFailed, collect, first_then_rest
from engine.serve.grammar import constrain, service_of
from engine.serve.protocol import AbortBody, GenerateBody, decode_body
from engine.serve.state import VERSION, Call, Reply, ServeState
from engine.serve.validate import (
    MAX_N,
    MAX_SUBREQUESTS,
    NATIVE_NAMES,
    SubRequest,
    check_policy,
    check_rid,
    check_subrequests,
    fan_out,
    native_params,
    native_prompt,
    native_request,
    off_loop,
    renamed,
    request_rid,
)
from engine.tokenizer import TextTokenizer
from msgs.params import MAX_TOP_LOGPROBS, SamplingParams

log = structlog.get_logger()


async def prepare(
    state: ServeState, text: str | None, input_ids: list[int] | None, params: SamplingParams, max_given: bool
) -> tuple[list[int], SamplingParams]:
    """Prompt ids and final params of a native request (HTTP or SDK); ApiError if bad."""
    limits = await state.limits()
    ids = await off_loop(len(text or ""), native_prompt, text, input_ids, state.tok, limits)
    with renamed(NATIVE_NAMES):
        params = native_request(ids, params, max_given, limits, state.tok)
    check_policy(params, state.cfg)
    return ids, await constrain(service_of(state), params, limits.vocab_size)


@dataclass(frozen=True)
class _Shape:
    """How a /generate body wants its logprobs shaped (SGLang's top-level fields)."""

    start: int = -1  # logprob_start_len: the prompt's logprobs from this token (-1: none)
    tok: TextTokenizer | None = None  # return_text_in_logprobs: each entry's text third
    logprobs: bool = False  # return_logprob: the output's lists always there (empty: no token came)

    def body(self, rid: str, c: Choice, prompt: list[int]) -> dict[str, Any]:
        meta = fmt.native_meta(rid, len(prompt), len(c.token_ids), c.cached_tokens, c.finish_reason, c.spec,
                               c.matched)
        fmt.native_logprobs(meta, c.token_ids, c.logprobs, c.top_logprobs, self.tok)
        if self.logprobs:  # (an audit: an answer aborted before its first token lacked the keys)
            meta.setdefault("output_token_logprobs", [])
            meta.setdefault("output_top_logprobs", [])
        if c.prompt_logprobs is not None:
            fmt.native_input_logprobs(meta, prompt, c.prompt_logprobs, c.prompt_top_logprobs, max(self.start, 0),
                                      self.tok)
        return {"text": c.text, "output_ids": c.token_ids, "meta_info": meta}


def _sglang_fields(req: GenerateBody, params: SamplingParams,
                   tok: TextTokenizer | None) -> tuple[SamplingParams, _Shape]:
    if not req.return_logprob:
        return params, _Shape()
    if req.logprob_start_len < -1:
        raise ApiError(400, "logprob_start_len must be >= -1", param="logprob_start_len")
    k = req.top_logprobs_num
    if not 0 <= k <= MAX_TOP_LOGPROBS:  # (the shared check would name top_logprobs, a field not sent)
        raise ApiError(400, f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs_num")
    extra: dict[str, Any] = {"logprobs": True, "top_logprobs": k}
    if req.logprob_start_len >= 0:
        extra["prompt_logprobs"] = k
    # (replace does not validate: native_request's check_params does, a 400 naming top_logprobs)
    shape = _Shape(req.logprob_start_len, tok if req.return_text_in_logprobs else None, logprobs=True)
    return msgspec.structs.replace(params, **extra), shape


def _batch(req: GenerateBody) -> list[tuple[str | None, list[int] | None]] | None:
    """A batch's (text, ids) items, or None for one prompt."""
    if isinstance(req.text, list):
        if req.input_ids is not None:
            raise ApiError(400, "give exactly one of text and input_ids", param="text")
        items: list[tuple[str | None, list[int] | None]] = [(t, None) for t in req.text]
    elif req.input_ids and isinstance(req.input_ids[0], list):
        if req.text is not None:
            raise ApiError(400, "give exactly one of text and input_ids", param="text")
        items = [(None, ids) for ids in req.input_ids]
    else:
        return None
    if not items or len(items) > MAX_SUBREQUESTS:
        raise ApiError(400, f"a batch holds 1..{MAX_SUBREQUESTS} prompts",
                       param="input_ids" if req.input_ids else "text")
    return items


async def generate_http(state: ServeState, body: bytes, call: Call) -> Reply:
    req = decode_body(body, GenerateBody)
    rid = request_rid(req, call.rid, call.rid_given)  # the x-request-id header wins over the body
    raw, n = _samples(req.sampling_params)
    params, max_given = native_params(raw, state.sampling_defaults)
    params, shape = _sglang_fields(req, params, state.tok)
    batch = _batch(req)
    if batch is None and n > 1:  # one prompt, n samples: a batch of it (prepare checks it as any prompt)
        batch = [(req.text if isinstance(req.text, str) else None, req.input_ids)]
    if batch is not None:
        return await _generate_batch(state, req, call, rid, batch, params, max_given, shape, n)
    ids_in = req.input_ids
    if ids_in is not None and not all(type(t) is int for t in ids_in):
        raise ApiError(400, "input_ids must be token ids, or a list of token id lists (a batch)", param="input_ids")
    ids, params = await prepare(state, req.text if isinstance(req.text, str) else None, ids_in, params, max_given)
    _check_start(shape, ids)
    log.info("generate request", rid=rid, prompt_tokens=len(ids), max_tokens=params.max_new_tokens, stream=req.stream)
    sub = SubRequest(rid, 0, 0, ids, params)
    gen = await Generation.start(state.frontend, state.tok, rid, [sub], call.t0, req.stream)
    if req.stream:
        deltas = await first_then_rest(gen)
        return Reply(stream=_stream(gen, deltas, rid, ids, shape), close=gen.close, rid=rid)
    try:
        (c,) = await collect(gen)  # GenerationFailed is an ApiError: a 5xx JSON error
    finally:
        gen.close()
    return Reply(body=shape.body(rid, c, ids), rid=rid)


def _samples(raw: dict[str, Any] | None) -> tuple[dict[str, Any] | None, int]:
    """SGLang's sampling_params.n: the samples of each prompt (taken out of the params)."""
    if raw is None or "n" not in raw:
        return raw, 1
    raw = dict(raw)
    n = raw.pop("n")
    n = 1 if n is None else n
    if type(n) is not int or not 1 <= n <= MAX_N:
        raise ApiError(400, f"sampling_params.n must be in 1..{MAX_N}, got {n!r}", param="n")
    return raw, n


async def _generate_batch(state: ServeState, req: GenerateBody, call: Call, rid: str,
                          items: list[tuple[str | None, list[int] | None]], params: SamplingParams, max_given: bool,
                          shape: _Shape, n: int = 1) -> Reply:
    """A batch of prompts, or of n samples of each (prompt-major, as SGLang lists them; a seeded
    request's sample j has seed + j, as the OpenAI routes' n)."""
    if req.stream:
        raise ApiError(400, "a batch of prompts (or n > 1) is not streamed", param="stream" if n == 1 else "n")
    check_subrequests(len(items), n)  # (before any prompt is tokenized)
    prompts, prompt_params = [], []
    for text, ids_in in items:
        if ids_in is not None and not (isinstance(ids_in, list) and all(type(t) is int for t in ids_in)):
            raise ApiError(400, "input_ids must be a list of token id lists", param="input_ids")
        ids, p = await prepare(state, text, ids_in, params, max_given)
        _check_start(shape, ids)
        prompts.append(ids)
        prompt_params.append(p)
    subs = fan_out(rid, prompts, prompt_params, n)
    log.info("generate batch", rid=rid, prompts=len(subs), prompt_tokens=sum(len(s.ids) for s in subs))
    gen = await Generation.start(state.frontend, state.tok, rid, subs, call.t0, False)
    try:
        choices = await collect(gen)
    finally:
        gen.close()
    return Reply(body=[shape.body(s.rid, c, s.ids) for s, c in zip(subs, choices, strict=True)], rid=rid)


def _check_start(shape: _Shape, ids: list[int]) -> None:
    if shape.start >= len(ids):
        raise ApiError(400, f"logprob_start_len must be below the prompt's {len(ids)} tokens", "logprob_start_len")


async def _stream(gen: Generation, deltas: AsyncIterator[Delta], rid: str, prompt: list[int],
                  shape: _Shape) -> AsyncIterator[bytes]:
    c = Choice(index=0, prompt_index=0)  # cumulative, as SGLang's events are
    try:
        try:
            async for d in deltas:
                c.text += d.text
                c.token_ids.extend(d.token_ids)
                if d.logprobs is not None:
                    c.logprobs = (c.logprobs or []) + d.logprobs
                if d.top_logprobs is not None:
                    c.top_logprobs = (c.top_logprobs or []) + d.top_logprobs
                if d.prompt_logprobs is not None:
                    c.prompt_logprobs, c.prompt_top_logprobs = d.prompt_logprobs, d.prompt_top_logprobs
                c.cached_tokens, c.finish_reason, c.spec = d.cached_tokens, d.finish_reason, d.spec
                c.matched = d.matched
                yield fmt.sse(shape.body(rid, c, prompt))
        except GenerationFailed as exc:  # the error event, then [DONE] as after any stream
            log.warning("stream failed", status=exc.status, error=exc.message)
            yield fmt.sse(api_error_body(exc))
        yield fmt.SSE_DONE
    finally:
        gen.close()


HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's HEALTH_CHECK_TIMEOUT
HEALTH_POLL_S = 0.05  # how often a waiting probe looks at the engine's last output


async def health_generate(state: ServeState, body: bytes, call: Call) -> Reply:
    """SGLang's GET /health_generate: one greedy token through every process (the probe that
    /health's readiness alone cannot give). As SGLang's, any request's output after the probe
    started proves the engine alive (a busy server's probe waits behind its queue: an audit got a
    503 from a healthy server with a 30-s queue); then `output_ids` is empty and the probe is
    dropped. A failure is the generation's 5xx, and no output at all within
    HEALTH_GENERATE_TIMEOUT_S a 503 (a stuck process: the probe answers, it does not wait for the
    watchdog)."""
    if state.frontend.died is not None:
        raise state.frontend.unavailable()
    if not state.frontend.ready:  # a probe answers at once (requests wait for ready instead)
        raise ApiError(503, "the server is not ready yet (the scheduler has not reported ready)")
    probe = SubRequest(call.rid, 0, 0, [0], SamplingParams(max_new_tokens=1, temperature=0.0))
    started = time.monotonic()
    gen = await Generation.start(state.frontend, state.tok, call.rid, [probe], call.t0, False)
    answer = asyncio.ensure_future(collect(gen))
    try:
        while not answer.done() and state.frontend.last_output <= started:
            if time.monotonic() - started > HEALTH_GENERATE_TIMEOUT_S:
                raise ApiError(503, f"health_generate: no output within {HEALTH_GENERATE_TIMEOUT_S:g} s (a process is "
                                    "stuck)")
            await asyncio.wait({answer}, timeout=HEALTH_POLL_S)
        if not answer.done():  # the output seen may be the probe's own, not taken by its task yet
            await asyncio.wait({answer}, timeout=HEALTH_POLL_S)
        ids = answer.result()[0].token_ids if answer.done() else []
    finally:
        answer.cancel()
        gen.close()
    return Reply(body={"status": "ok", "output_ids": ids})


async def abort_request(state: ServeState, body: bytes, call: Call) -> Reply:
    """SGLang's POST /abort_request {"rid": ..., "abort_all": false}: the request (an n > 1 or batch
    request's rid: all its parts) ends as soon as the scheduler sees the abort, and its client gets
    what was generated with finish_reason "abort" ({"type": "abort"} on /generate). A rid not in
    flight aborts nothing (200, as SGLang)."""
    req = decode_body(body, AbortBody)
    if not req.abort_all:
        check_rid(req.rid)
    aborted = state.frontend.abort(req.rid, everything=req.abort_all)
    log.info("abort asked", target=req.rid or None, abort_all=req.abort_all, aborted=aborted)
    return Reply(body={"status": "ok", "aborted": aborted})


async def model_info(state: ServeState, body: bytes, call: Call) -> Reply:
    """SGLang's GET /get_model_info."""
    path = state.cfg.model or state.model_name
    return Reply(body={"model_path": path, "tokenizer_path": path, "is_generation": True,
                       "served_model_name": state.model_name})


async def server_info(state: ServeState, body: bytes, call: Call) -> Reply:
    """SGLang's GET /get_server_info: the server's arguments (its ServerConfig, the API key left out),
    the KV pool's tokens and the longest request (SGLang's max_total_num_tokens and max_req_input_len,
    which its benchmark and router read), whether it runs deterministic, and the version."""
    limits = await state.limits()
    stats = state.frontend.stats
    assert stats is not None  # ready implies stats arrived
    info = msgspec.json.decode(state.cfg.to_json())
    info.pop("api_key", None)
    info.update(max_total_num_tokens=stats.kv_pages_total * state.cfg.page_size, max_req_input_len=limits.max_context,
                deterministic=stats.deterministic, version=VERSION)
    return Reply(body=info)
