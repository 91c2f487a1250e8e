"""SGLang-native /generate, and the request preparation it shares with the ZMQ SDK.

/generate answers {"text", "output_ids", "meta_info": {id, prompt_tokens,
completion_tokens, cached_tokens, finish_reason}}. Streamed events follow SGLang: each
carries the text and output ids so far (cumulative), then `data: [DONE]`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import structlog

from engine.serve import formats as fmt
from engine.serve.errors import api_error_body
from engine.serve.generate import Delta, Generation, GenerationFailed, collect, first_then_rest
from engine.serve.grammar import constrain, service_of
from engine.serve.protocol import GenerateBody, decode_body
from engine.serve.state import Call, Reply, ServeState
from engine.serve.validate import (
    SubRequest,
    check_engine_support,
    check_rid,
    native_params,
    native_prompt,
    native_request,
)
from msgs.params import SamplingParams

log = structlog.get_logger()


async def prepare(
    state: ServeState, text: str | None, input_ids: list[int] | None, params: SamplingParams, max_given: bool
) -> tuple[list[int], SamplingParams]:
    """Prompt ids and final params of a native request (HTTP or SDK); ApiError if bad."""
    limits = await state.limits()
    ids = native_prompt(text, input_ids, state.tok)
    params = native_request(ids, params, max_given, limits, state.tok)
    check_engine_support(params, state.cfg)
    return ids, await constrain(service_of(state), params, limits.vocab_size)


def _body(rid: str, text: str, ids: list[int], prompt: int, cached: int, finish: str | None, **lp: Any) -> dict:
    meta = fmt.native_meta(rid, prompt, len(ids), cached, finish, lp.get("spec"))
    fmt.native_logprobs(meta, ids, lp.get("logprobs"), lp.get("top_logprobs"))
    if lp.get("prompt_ids"):
        fmt.native_input_logprobs(meta, lp["prompt_ids"], lp.get("prompt_logprobs"), lp.get("prompt_top_logprobs"))
    return {"text": text, "output_ids": ids, "meta_info": meta}


async def generate_http(state: ServeState, body: bytes, call: Call) -> Reply:
    req = decode_body(body, GenerateBody)
    rid = call.rid
    if req.rid is not None and not call.rid_given:  # the x-request-id header wins over the body
        rid = check_rid(req.rid)
    params, max_given = native_params(req.sampling_params)
    ids, params = await prepare(state, req.text, req.input_ids, params, max_given)
    log.info("generate request", rid=rid, prompt_tokens=len(ids), max_tokens=params.max_new_tokens, stream=req.stream)
    gen = Generation(state.frontend, state.tok, rid, [SubRequest(rid, 0, 0, ids, params)], call.t0, req.stream)
    if req.stream:
        deltas = await first_then_rest(gen)
        return Reply(stream=_stream(gen, deltas, rid, ids), close=gen.close, rid=rid)
    try:
        (c,) = await collect(gen)  # GenerationFailed is an ApiError: a 5xx JSON error
    finally:
        gen.close()
    out = _body(
        rid,
        c.text,
        c.token_ids,
        c.prompt_tokens,
        c.cached_tokens,
        c.finish_reason,
        logprobs=c.logprobs,
        top_logprobs=c.top_logprobs,
        spec=c.spec,
        prompt_ids=ids,
        prompt_logprobs=c.prompt_logprobs,
        prompt_top_logprobs=c.prompt_top_logprobs,
    )
    return Reply(body=out, rid=rid)


async def _stream(gen: Generation, deltas: AsyncIterator[Delta], rid: str, prompt: list[int]) -> AsyncIterator[bytes]:
    text, ids = "", []
    lps: list[float] | None = None
    tops: list[list[tuple[int, float]]] | None = None
    scored: dict[str, Any] = {}  # the prompt's scores, in every event from the first (cumulative, as SGLang)
    try:
        try:
            async for d in deltas:
                text += d.text
                ids.extend(d.token_ids)
                if d.logprobs is not None:
                    lps = (lps or []) + d.logprobs
                if d.top_logprobs is not None:
                    tops = (tops or []) + d.top_logprobs
                if d.prompt_logprobs is not None:
                    scored = {"prompt_ids": prompt, "prompt_logprobs": d.prompt_logprobs,
                              "prompt_top_logprobs": d.prompt_top_logprobs}
                yield fmt.sse(
                    _body(rid, text, ids, len(prompt), d.cached_tokens, d.finish_reason, logprobs=lps,
                          top_logprobs=tops, spec=d.spec, **scored)
                )
        except GenerationFailed as exc:  # the error event, then [DONE] as after any stream
            log.warning("stream failed", status=exc.status, error=exc.message)
            yield fmt.sse(api_error_body(exc))
        yield fmt.SSE_DONE
    finally:
        gen.close()
