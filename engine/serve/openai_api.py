"""/v1/chat/completions and /v1/completions: validate, submit, answer (JSON or SSE)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import structlog

from engine.serve import formats as fmt
from engine.serve.chat import chat_prompt, request_template
from engine.serve.errors import api_error_body
from engine.serve.generate import Choice, Delta, Generation, GenerationFailed, collect, first_then_rest
from engine.serve.grammar import Reasoning, constrain, service_of
from engine.serve.parsers import reasoning_parser
from engine.serve.parsers.output import ChatOutput, chat_outputs
from engine.serve.parsers.tool_request import ToolRequest, check_tools
from engine.serve.protocol import ChatCompletionRequest, CompletionRequest, check_unsupported, decode_body
from engine.serve.state import Call, Reply, ServeState
from engine.serve.validate import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    Limits,
    as_sent,
    check_ids,
    check_length,
    check_model,
    check_policy,
    completion_prompts,
    fan_out,
    make_params,
    off_loop,
    openai_params,
    prediction_ids,
    prompt_limit,
    request_rid,
    resolve_max_tokens,
    text_features,
)
from engine.tokenizer import TextTokenizer
from msgs.params import SamplingParams

log = structlog.get_logger()


def _params_for(
    state: ServeState,
    ids: list[int],
    kw: dict[str, Any],
    requested: int | None,
    default: int | None,
    limits: Limits,
    what: str,
) -> SamplingParams:
    check_ids(ids, limits, param=what)
    max_new = resolve_max_tokens(requested, default, len(ids), limits)
    check_length(len(ids), max_new, limits, what)
    params = make_params(kw, max_new, limits.vocab_size, limits.eos_ids)
    params = text_features(params, state.tok, limits)
    check_policy(params, state.cfg)
    return params


def stop_reason(c: Choice | Delta, stop_ids: frozenset[int]) -> int | str | None:
    """vLLM's stop_reason: the stop string or stop_token_ids entry that ended the choice; null
    for EOS (SGLang's matched_stop would name it) or any other end."""
    return c.matched if isinstance(c.matched, str) or c.matched in stop_ids else None


async def finish(gen: Generation) -> list[Choice]:
    try:
        return await collect(gen)  # GenerationFailed is an ApiError: a 5xx JSON error
    finally:
        gen.close()


def _include_usage(req: ChatCompletionRequest | CompletionRequest) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _usage_every_chunk(req: ChatCompletionRequest | CompletionRequest) -> bool:
    """vLLM's stream_options.continuous_usage_stats (with include_usage): usage so far in every chunk."""
    return _include_usage(req) and bool(req.stream_options and req.stream_options.continuous_usage_stats)


# -- chat -------------------------------------------------------------------------------


@dataclass
class ChatRun:
    """A chat request admitted and submitted: its id, token ids, generation, a maker of each
    choice's output parser, its tools and its stop_token_ids (/v1/chat/completions and
    /v1/responses answer it each in their own format)."""

    rid: str
    ids: list[int]
    gen: Generation
    new_output: Callable[[], ChatOutput]
    tools: ToolRequest | None
    stop_ids: frozenset[int]


async def start_chat(state: ServeState, req: ChatCompletionRequest, body_len: int, call: Call) -> ChatRun:
    """Validate `req` (decoded, check_unsupported passed), render and tokenize its messages, build and
    constrain its parameters, and submit it: every 4xx is raised here, before anything runs."""
    rid = request_rid(req, call.rid, call.rid_given)
    tools = check_tools(req.tools, req.tool_choice, req.parallel_tool_calls, state.cfg.tool_call_parser)
    with as_sent(req):
        kw = openai_params(req, state.sampling_defaults)
    stop_ids = frozenset(kw["stop_token_ids"])  # (stop_reason's)
    limits = await state.limits()
    template_kwargs = req.chat_template_kwargs
    if req.reasoning_effort is not None:  # chat_template_kwargs, where it names one, wins
        template_kwargs = {"reasoning_effort": req.reasoning_effort, **(template_kwargs or {})}
    prompt, ids = await off_loop(body_len, chat_prompt, state.tok, req.messages, req.tools, template_kwargs, limits,
                                 add_generation_prompt=bool(req.add_generation_prompt),
                                 continue_final_message=bool(req.continue_final_message),
                                 add_special_tokens=bool(req.add_special_tokens), keep_last=prompt_limit(req, limits),
                                 template=request_template(req.chat_template, state.cfg.trust_request_chat_template))
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    structure = tools.structure() if tools is not None else None
    forced = (structure, tools.parallel) if structure is not None and tools is not None else None
    reasoning = _reasoning(state, prompt, template_kwargs)
    if req.prediction is not None:  # a hint for NGRAM's drafts (engine/sched/spec.py), never the answer
        kw["prediction_ids"] = await off_loop(body_len, prediction_ids, state.tok, req.prediction)
    with as_sent(req):
        params = _params_for(state, ids, kw, requested, None, limits, "messages")
        params = await constrain(service_of(state), params, limits.vocab_size, forced, reasoning)
    # SGLang's separate_reasoning false: the reasoning stays in the content; vLLM's include_reasoning
    # false: it is left out of the answer
    new_output = chat_outputs(state.cfg.reasoning_parser if req.separate_reasoning else "", tools, prompt,
                              template_kwargs, constrained=reasoning is not None and params.grammar is not None,
                              shown=bool(req.include_reasoning))
    subs = fan_out(rid, [ids], [params], req.n)
    log.info("chat request", prompt_tokens=len(ids), n=req.n, max_tokens=params.max_new_tokens, stream=req.stream)
    gen = await Generation.start(state.frontend, state.tok, rid, subs, call.t0, req.stream)
    return ChatRun(rid, ids, gen, new_output, tools, stop_ids)


async def chat_completions(state: ServeState, body: bytes, call: Call) -> Reply:
    req = decode_body(body, ChatCompletionRequest)
    check_model(req.model, state.accepted_models)
    check_unsupported(req)
    run = await start_chat(state, req, len(body), call)
    rid, gen, tools, stop_ids = run.rid, run.gen, run.tools, run.stop_ids
    created = int(time.time())
    if req.stream:
        deltas = await first_then_rest(gen)
        parsed = _Parsed(run.new_output, tools)
        stream = _chat_stream(state, gen, deltas, rid, created, req.logprobs, _include_usage(req), parsed,
                              _usage_every_chunk(req), stop_ids, namer(state, req))
        return Reply(stream=stream, close=gen.close, rid=rid)
    choices = await finish(gen)
    out = []
    for c in choices:
        output = run.new_output()
        output.feed(c.text)
        output.finish()
        lp = fmt.chat_logprobs(namer(state, req), c.token_ids, c.logprobs, c.top_logprobs) if req.logprobs else None
        out.append(fmt.chat_choice(c.index, output.message(), output.finish_reason(c.finish_reason, tools), lp,
                                   stop_reason(c, stop_ids)))
    use = fmt.with_spec(fmt.usage_of((c.prompt_index, c.prompt_tokens, c.completion_tokens, c.cached_tokens)
                                     for c in choices), (c.spec for c in choices))
    body = fmt.chat_completion(rid, state.model_name, created, out, use)
    if req.prompt_logprobs is not None:  # vLLM's: the response's, not a choice's
        body["prompt_logprobs"] = _vllm_scores(state, run.ids, choices[0], req.prompt_logprobs)
    return Reply(body=body, rid=rid)


def _reasoning(state: ServeState, prompt: str, template_kwargs: dict[str, Any] | None) -> Reasoning | None:
    """Where this request's reasoning ends, when a reasoning parser is on and the prompt
    leaves thinking enabled: a grammar applies only after that marker."""
    if not state.cfg.reasoning_parser:
        return None
    parser = reasoning_parser(state.cfg.reasoning_parser)(prompt, template_kwargs)
    return Reasoning(parser.start, parser.end, parser.starts_inside) if parser.enabled else None


class _Parsed:
    """Each streamed choice's output parser (reasoning, tool calls), made on first use."""

    def __init__(self, new_output: Callable[[], ChatOutput], tools: ToolRequest | None) -> None:
        self._new, self._tools = new_output, tools
        self._outputs: dict[int, ChatOutput] = {}

    def delta(self, d: Delta) -> tuple[dict[str, Any], str | None]:
        """The chunk's `delta` and finish_reason for one text delta."""
        output = self._outputs.get(d.index)
        if output is None:
            output = self._outputs[d.index] = self._new()
        parsed = output.feed(d.text)
        if d.finish_reason is None:
            return parsed.openai_delta(), None
        parsed.extend(output.finish())
        return parsed.openai_delta(), output.finish_reason(d.finish_reason, self._tools)


async def _sse(
    gen: Generation,
    deltas: AsyncIterator[Delta],
    include_usage: bool,
    chunk: Callable[[list[dict[str, Any]], dict[str, Any] | None], bytes],
    choice_of: Callable[[Delta], dict[str, Any] | None],
    first: list[bytes],
    usage_every: bool = False,
) -> AsyncIterator[bytes]:
    """The SSE body both endpoints share: `first` events, one chunk per delta that carries
    anything (`choice_of` returns None otherwise; with `usage_every`, the usage so far in it),
    the usage chunk when asked, [DONE]. A failed generation (the scheduler failed it, or a
    server process died) ends the stream with an OpenAI-style error event then [DONE], so a
    client never takes a crash for a finished answer. The generation is closed however the
    stream ends."""
    prompt_of = {s.index: s.prompt_index for s in gen.subs}
    counts: dict[int, tuple[int, int, int, int]] = {}
    specs: dict[int, tuple[int, int, int] | None] = {}
    try:
        for event in first:
            yield event
        try:
            async for d in deltas:
                counts[d.index] = (prompt_of[d.index], d.prompt_tokens, d.completion_tokens, d.cached_tokens)
                specs[d.index] = d.spec
                choice = choice_of(d)
                if choice is not None:
                    yield chunk([choice], fmt.usage_of(counts.values()) if usage_every else None)
        except GenerationFailed as exc:
            log.warning("stream failed", status=exc.status, error=exc.message)
            yield fmt.sse(api_error_body(exc))
        else:
            if include_usage:
                yield chunk([], fmt.with_spec(fmt.usage_of(counts.values()), specs.values()))
        yield fmt.SSE_DONE
    finally:
        gen.close()


def _chat_stream(
    state: ServeState,
    gen: Generation,
    deltas: AsyncIterator[Delta],
    rid: str,
    created: int,
    logprobs: bool,
    include_usage: bool,
    parsed: _Parsed,
    usage_every: bool = False,
    stop_ids: frozenset[int] = frozenset(),
    tok: TextTokenizer | None = None,
) -> AsyncIterator[bytes]:
    """tok: what names the logprobs' tokens (namer)."""
    model = state.model_name

    def chunk(choices: list[dict[str, Any]], use: dict[str, Any] | None) -> bytes:
        return fmt.sse(fmt.chat_chunk(rid, model, created, choices, include_usage, use))

    def choice_of(d: Delta) -> dict[str, Any] | None:
        lp = fmt.chat_logprobs(tok, d.token_ids, d.logprobs, d.top_logprobs) if logprobs else None
        delta, finish = parsed.delta(d)
        if not (delta or finish or lp):
            return None  # nothing to send (maybe text held back by a parser)
        return fmt.chat_chunk_choice(d.index, delta, finish, lp, stop_reason(d, stop_ids))

    # with usage in every chunk, the role chunks' too: the prompt's tokens, none generated yet
    start = fmt.usage_of((s.prompt_index, len(s.ids), 0, 0) for s in gen.subs) if usage_every else None
    roles = [
        chunk([fmt.chat_chunk_choice(s.index, {"role": "assistant", "content": ""}, None, None)], start)
        for s in gen.subs
    ]
    return _sse(gen, deltas, include_usage, chunk, choice_of, roles, usage_every)


# -- completions ------------------------------------------------------------------------


async def completions(state: ServeState, body: bytes, call: Call) -> Reply:
    req = decode_body(body, CompletionRequest)
    check_model(req.model, state.accepted_models)
    check_unsupported(req)
    rid = request_rid(req, call.rid, call.rid_given)
    with as_sent(req):
        kw = openai_params(req, state.sampling_defaults)
    stop_ids = frozenset(kw["stop_token_ids"])  # (stop_reason's)
    if req.echo and req.logprobs is not None:  # the prompt's logprobs too (lm-eval's loglikelihood)
        kw["prompt_logprobs"] = max(req.logprobs, req.prompt_logprobs or 0)
    limits = await state.limits()
    prompts = await off_loop(len(body), completion_prompts, req.prompt, state.tok, limits, req.n,
                             req.add_special_tokens is not False, prompt_limit(req, limits))
    default = COMPLETIONS_DEFAULT_MAX_TOKENS
    with as_sent(req):
        params = [_params_for(state, ids, kw, req.max_tokens, default, limits, "prompt") for ids in prompts]
        params = [await constrain(service_of(state), p, limits.vocab_size) for p in params]
    subs = fan_out(rid, prompts, params, req.n)
    log.info(
        "completion request",
        prompt_tokens=sum(len(p) for p in prompts),
        prompts=len(prompts),
        n=req.n,
        max_tokens=params[0].max_new_tokens,
        stream=req.stream,
    )
    gen = await Generation.start(state.frontend, state.tok, rid, subs, call.t0, req.stream)
    created = int(time.time())
    want_lp = req.logprobs is not None
    if req.stream:
        deltas = await first_then_rest(gen)
        echo = [(_prompt_text(req.prompt, i, ids, state.tok), ids) for i, ids in enumerate(prompts)] if req.echo \
            else None
        stream = _completion_stream(state, gen, deltas, rid, created, want_lp, _include_usage(req), echo,
                                    _usage_every_chunk(req), stop_ids, namer(state, req))
        return Reply(stream=stream, close=gen.close, rid=rid)
    choices = await finish(gen)
    out = []
    for c in choices:
        prompt = prompts[c.prompt_index]
        text, lp = c.text, None
        if req.echo:  # the prompt as given (a string) or decoded (ids), then the completion
            text = _prompt_text(req.prompt, c.prompt_index, prompt, state.tok) + text
            lp = fmt.echo_logprobs(namer(state, req), prompt, c)[0] if want_lp else None
        elif want_lp:
            lp = fmt.completion_logprobs(namer(state, req), c.token_ids, c.logprobs, c.top_logprobs)[0]
        out.append(fmt.completion_choice(c.index, text, c.finish_reason, lp, stop_reason(c, stop_ids)))
        if req.prompt_logprobs is not None:
            out[-1]["prompt_logprobs"] = _vllm_scores(state, prompt, c, req.prompt_logprobs)
    use = fmt.with_spec(fmt.usage_of((c.prompt_index, c.prompt_tokens, c.completion_tokens, c.cached_tokens)
                                     for c in choices), (c.spec for c in choices))
    return Reply(body=fmt.completion(rid, state.model_name, created, out, use), rid=rid)


def namer(state: ServeState, req: ChatCompletionRequest | CompletionRequest) -> TextTokenizer | None:
    """The tokenizer that names the logprobs' tokens; None (each token as "token_id:<id>", its bytes
    those of that text) where vLLM's return_tokens_as_token_ids asks for it."""
    return None if req.return_tokens_as_token_ids else state.tok


def _vllm_scores(state: ServeState, prompt: list[int], c: Choice, k: int) -> list[dict[str, Any] | None] | None:
    tops = [alts[:k] for alts in c.prompt_top_logprobs] if c.prompt_top_logprobs is not None and k else None
    return fmt.vllm_prompt_logprobs(state.tok, prompt, c.prompt_logprobs, tops)


def _prompt_text(prompt: str | list[Any], i: int, ids: list[int], tok: TextTokenizer | None) -> str:
    """Prompt i of a completions body as echo returns it: as given when text, else decoded."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt[i], str):
        return prompt[i]
    return tok.decode(ids, skip_special_tokens=False) if tok is not None else ""


def _completion_stream(
    state: ServeState,
    gen: Generation,
    deltas: AsyncIterator[Delta],
    rid: str,
    created: int,
    logprobs: bool,
    include_usage: bool,
    echo: list[tuple[str, list[int]]] | None = None,
    usage_every: bool = False,
    stop_ids: frozenset[int] = frozenset(),
    tok: TextTokenizer | None = None,
) -> AsyncIterator[bytes]:
    """echo: each prompt's text and ids, sent (with their logprobs) before its choices' first text;
    tok: what names the logprobs' tokens (namer)."""
    model = state.model_name
    offsets: dict[int, fmt.TextOffset] = {}
    prompt_of = {s.index: s.prompt_index for s in gen.subs}
    echoed: set[int] = set()

    def chunk(choices: list[dict[str, Any]], use: dict[str, Any] | None) -> bytes:
        body = fmt.completion(rid, model, created, choices, use)
        if not include_usage:
            del body["usage"]
        return fmt.sse(body)

    def choice_of(d: Delta) -> dict[str, Any] | None:
        lp = None
        if echo is not None and d.index not in echoed:  # the first delta: the prompt first
            echoed.add(d.index)
            text, ids = echo[prompt_of[d.index]]
            if logprobs:
                lp, offsets[d.index] = fmt.echo_logprobs(tok, ids, d)
            return fmt.completion_choice(d.index, text + d.text, d.finish_reason, lp, stop_reason(d, stop_ids))
        if logprobs:
            lp, offsets[d.index] = fmt.completion_logprobs(
                tok, d.token_ids, d.logprobs, d.top_logprobs, offsets.get(d.index, fmt.TextOffset())
            )
        if not (d.text or d.finish_reason or lp):
            return None
        return fmt.completion_choice(d.index, d.text, d.finish_reason, lp, stop_reason(d, stop_ids))

    return _sse(gen, deltas, include_usage, chunk, choice_of, [], usage_every)
