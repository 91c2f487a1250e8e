"""Turning API requests into scheduler requests: prompts, SamplingParams, limits.

Shared by the OpenAI routes, /generate and the ZMQ SDK so that the same input gets the
same answer everywhere. Every function raises `ApiError` (4xx) on bad input.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from engine.config import ServerConfig
from engine.serve.errors import ApiError, from_validation
from engine.serve.grammar import response_format_spec
from engine.serve.protocol import ChatCompletionRequest, CompletionRequest
from engine.tokenizer import TextTokenizer
from msgs.params import (
    GRAMMAR_SPECS,
    INT32,
    MAX_BAD_WORD_TOKENS,
    MAX_PREDICTION_TOKENS,
    MAX_TOP_LOGPROBS,
    MODEL_DEFAULT_FIELDS,
    SamplingParams,
)

T = TypeVar("T")
OFF_LOOP_BYTES = 1 << 16  # a request this large is tokenized on a thread


async def off_loop(size: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs), on a worker thread when the request is `size` >= OFF_LOOP_BYTES bytes:
    tokenizing a long prompt (~0.4 s a MB; tokenizers releases the GIL) must not stall every other
    client of the one event loop. Small ones run inline: a thread hop costs more than they do."""
    if size < OFF_LOOP_BYTES:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)

MAX_N = 16
MAX_RID_LEN = 256
MAX_SUBREQUESTS = 256  # prompts x n of one HTTP request
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
IDS_ONLY = "this server has no tokenizer (the model directory has no tokenizer files); send token ids"
_PARAM_NAMES = set(SamplingParams.__struct_fields__) | {"max_tokens", "min_tokens"}
_UNSETTABLE = set(SamplingParams.__struct_fields__) - {"max_new_tokens"}  # /generate: null = unset
_DEFAULT_PARAMS_VALUES = {name: getattr(SamplingParams(), name) for name in MODEL_DEFAULT_FIELDS}


@dataclass(frozen=True)
class Limits:
    """What the scheduler accepts, from its SchedulerStats."""

    max_context: int
    vocab_size: int
    eos_ids: tuple[int, ...] = ()  # the model's end tokens


@dataclass(frozen=True)
class SubRequest:
    """One scheduler request; an API request with n > 1 or several prompts has many."""

    rid: str
    index: int  # choice index in the response
    prompt_index: int
    ids: list[int]
    params: SamplingParams


def check_rid(rid: str, param: str = "rid") -> str:
    """A client-chosen request id: 1..256 printable ASCII characters, no whitespace (it is echoed in
    the x-request-id header, which holds Latin-1 at most: an audit's "✓" was a 500 after the whole
    generation had run)."""
    if (not 0 < len(rid) <= MAX_RID_LEN or not rid.isascii() or not rid.isprintable()
            or any(c.isspace() for c in rid)):
        raise ApiError(400, f"{param} must be 1..{MAX_RID_LEN} printable ASCII characters without spaces", param)
    return rid


def check_unset(unset: list[str], params: SamplingParams) -> None:
    """An SDK request's `unset` (GenerateRequest): fields of MODEL_DEFAULT_FIELDS its caller left
    out, so each still holds SamplingParams' own default (the client sends them so); a name
    outside those fields, or a field the params set, is the frame's error, not a silent override."""
    for name in unset:
        if name not in MODEL_DEFAULT_FIELDS:
            raise ApiError(400, f"unset: {name[:50]!r} is not one of {', '.join(MODEL_DEFAULT_FIELDS)}", "unset")
        if getattr(params, name) != _DEFAULT_PARAMS_VALUES[name]:
            raise ApiError(400, f"unset lists {name}, which the params set", "unset")


def check_params(params: SamplingParams, vocab_size: int | None = None, eos_ids: tuple[int, ...] = ()) -> None:
    problem = params.validate(vocab_size, eos_ids)
    if problem is not None:
        first = problem.split()[0].rstrip(",:")
        raise ApiError(400, problem, param=first if first in _PARAM_NAMES else None)


def check_ids(ids: list[int], limits: Limits, param: str = "prompt") -> None:
    if not ids:
        raise ApiError(400, "the prompt is empty (0 tokens)", param=param)
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is out of range for the vocabulary (size {limits.vocab_size})", param)


def resolve_max_tokens(requested: int | None, default: int | None, prompt_len: int, limits: Limits) -> int:
    """The user's max_tokens, or the default clipped to what the context leaves."""
    room = limits.max_context - prompt_len
    if requested is None:
        return max(0, room if default is None else min(default, room))
    if requested < 0:
        raise ApiError(400, f"max_tokens must be >= 0, got {requested}", param="max_tokens")
    return requested


def _too_long(ctx: int, what: str, tokens: str) -> ApiError:
    return ApiError(
        400,
        f"This model's maximum context length is {ctx} tokens, but the {what} "
        f"{'have' if what == 'messages' else 'has'} {tokens}. Please reduce the length of the {what}.",
        param="messages" if what == "messages" else "prompt",
    )


def check_length(prompt_len: int, max_new: int, limits: Limits, what: str = "prompt") -> None:
    """vLLM-style context checks: the prompt must leave room, and so must max_tokens."""
    ctx = limits.max_context
    if prompt_len >= ctx:
        raise _too_long(ctx, what, f"{prompt_len} tokens")
    if max_new > ctx:
        raise ApiError(
            400, f"max_tokens ({max_new}) is larger than the maximum context length ({ctx} tokens)", "max_tokens"
        )
    if prompt_len + max_new > ctx:
        raise ApiError(
            400,
            f"This model's maximum context length is {ctx} tokens. However, you requested "
            f"{prompt_len + max_new} tokens ({prompt_len} in the {what}, {max_new} in the completion). "
            f"Please reduce the length of the {what} or completion.",
            param="max_tokens",
        )


def text_features(params: SamplingParams, tok: TextTokenizer | None, limits: Limits) -> SamplingParams:
    """params with its bad_words tokenized into bad_words_ids (a client's bad_words_ids replaced) and
    checked against the vocabulary like every other id; 400 for a text feature (stop strings,
    bad_words) without a tokenizer."""
    if tok is None and params.stop:
        raise ApiError(400, f"stop strings need text: {IDS_ONLY}", param="stop")
    if tok is None and params.bad_words:
        raise ApiError(400, f"bad_words need text: {IDS_ONLY}", param="bad_words")
    ids = bad_words_ids(tok, params.bad_words) if tok is not None and params.bad_words else []
    if not (ids or params.bad_words_ids):
        return params
    params = msgspec.structs.replace(params, bad_words_ids=ids)
    with renamed({"bad_words_ids": "bad_words"}):  # (the field the client sent)
        check_params(params, limits.vocab_size, limits.eos_ids)
    return params


def prediction_ids(tok: TextTokenizer | None, prediction: Any) -> list[int]:
    """The tokens of OpenAI's chat `prediction` ({"type": "content", "content": a string or text
    parts}); 400 for another shape, a server without a tokenizer or more than MAX_PREDICTION_TOKENS."""
    content = prediction.get("content") if isinstance(prediction, dict) else None
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(prediction, dict) or prediction.get("type") != "content" or not isinstance(content, str):
        raise ApiError(400, 'prediction must be {"type": "content", "content": a string or text parts}',
                       param="prediction")
    if tok is None:
        raise ApiError(400, f"prediction needs text: {IDS_ONLY}", param="prediction")
    if len(content) > 8 * MAX_PREDICTION_TOKENS:  # (more characters than such tokens can hold: not read)
        raise ApiError(400, f"prediction takes at most {MAX_PREDICTION_TOKENS} tokens", param="prediction")
    ids = tok.encode(content, add_special_tokens=False)
    if len(ids) > MAX_PREDICTION_TOKENS:
        raise ApiError(400, f"prediction takes at most {MAX_PREDICTION_TOKENS} tokens", param="prediction")
    return ids


def bad_words_ids(tok: TextTokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's tokenization of bad_words: each word as it starts a text, and also after a space where
    that is another first token of as many tokens (the word inside a text); 400 for a word of more
    than MAX_BAD_WORD_TOKENS tokens or of none."""
    out: list[list[int]] = []
    for word in words:
        first = tok.encode(word.lstrip(), add_special_tokens=False)
        spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
        if not 1 <= len(first) <= MAX_BAD_WORD_TOKENS:
            raise ApiError(400, f"bad_words: {word[:40]!r} is {len(first)} tokens (1..{MAX_BAD_WORD_TOKENS} "
                           "taken)", param="bad_words")
        out.append(first)
        if spaced and spaced[0] != first[0] and len(spaced) == len(first):
            out.append(spaced)
    return out


def check_policy(params: SamplingParams, cfg: ServerConfig) -> None:
    """A request priority needs the priority policy (vLLM refuses it under fcfs too)."""
    if params.priority != 0 and cfg.scheduling_policy != "priority":
        raise ApiError(400, "priority needs --scheduling-policy priority (this server serves requests first come, "
                       "first served)", param="priority")


def check_model(model: str | None, accepted: tuple[str, ...]) -> None:
    if model is not None and model not in accepted:
        raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def openai_params(req: ChatCompletionRequest | CompletionRequest, defaults: dict[str, Any] | None = None
                  ) -> dict[str, Any]:
    """SamplingParams fields from an OpenAI body (max_new_tokens is added per prompt); `defaults`
    (the model's) fill the sampling fields it leaves unset."""
    if not 1 <= req.n <= MAX_N:
        raise ApiError(400, f"n must be in 1..{MAX_N}, got {req.n}", param="n")
    for name in ("max_tokens", "max_completion_tokens"):  # by the name the client used
        value = getattr(req, name, None)
        if value is not None and value < 0:
            raise ApiError(400, f"{name} must be >= 0, got {value}", param=name)
    kw: dict[str, Any] = {
        "stop": [req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        "stop_token_ids": list(req.stop_token_ids or []),
        "ignore_eos": req.ignore_eos,
        "include_stop_str_in_output": bool(req.include_stop_str_in_output or req.no_stop_trim),
        "skip_special_tokens": req.skip_special_tokens,
        "seed": _seed(req.seed),
    }
    for name in MODEL_DEFAULT_FIELDS:
        _set(kw, name, getattr(req, name))
        if name not in kw and defaults and name in defaults:
            kw[name] = defaults[name]
    if kw.get("top_k") == 0:  # current vLLM's "disabled" (its default); -1 is ours and SGLang's
        kw["top_k"] = -1
    _set(kw, "min_new_tokens", req.min_tokens)
    _set(kw, "prompt_logprobs", req.prompt_logprobs)
    _set(kw, "allowed_token_ids", req.allowed_token_ids)
    _set(kw, "bad_words", req.bad_words)
    _set(kw, "priority", req.priority)
    _set(kw, "presence_penalty", req.presence_penalty)
    _set(kw, "frequency_penalty", req.frequency_penalty)
    _set(kw, "regex", req.regex)
    _set(kw, "ebnf", req.ebnf)
    if req.logit_bias:
        kw["logit_bias"] = _logit_bias(req.logit_bias)
    kw.update(response_format_spec(req.response_format))
    guided = guided_spec(req)
    if guided is not None:
        field, name, spec = guided
        if any(kw.get(k) for k in GRAMMAR_SPECS):
            raise ApiError(400, f"{field} with regex, ebnf or response_format: give one constraint", param=field)
        kw[name] = spec
    kw.update(_logprob_params(req))
    return kw


@contextmanager
def renamed(names: dict[str, str]) -> Iterator[None]:
    """An ApiError raised inside whose field is a key of `names` names that key's value instead
    (its param, and its message where the message starts with the field)."""
    try:
        yield
    except ApiError as exc:
        if exc.param not in names:
            raise
        sent = names[exc.param]
        message = sent + exc.message[len(exc.param):] if exc.message.startswith(exc.param) else exc.message
        raise ApiError(exc.status, message, sent, exc.code) from None


def as_sent(req: ChatCompletionRequest | CompletionRequest) -> AbstractContextManager[None]:
    """An ApiError raised inside names the field as this OpenAI body sent it: the checks after
    openai_params see SamplingParams' names (json_schema, regex, ebnf, max_tokens), which a client
    that sent response_format, guided_choice or max_completion_tokens never used."""
    return renamed(_names_sent(req))


# the shared checks name OpenAI's fields; /generate and the SDK send SamplingParams' (max_new_tokens)
NATIVE_NAMES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}


def _names_sent(req: ChatCompletionRequest | CompletionRequest) -> dict[str, str]:
    """SamplingParams' name -> the field this body set it by, where the two differ."""
    names = {}
    if getattr(req, "max_completion_tokens", None) is not None:
        names["max_tokens"] = "max_completion_tokens"
    if (req.response_format or {}).get("type", "text") != "text":
        names["json_schema"] = names["structural_tag"] = "response_format"
    guided = guided_spec(req)
    if guided is not None:
        names[guided[1]] = guided[0]
    if getattr(req, "prediction", None) is not None:
        names["prediction_ids"] = "prediction"
    if isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None and req.prompt_logprobs is None:
        names["prompt_logprobs"] = "echo"  # (echo with logprobs scores the prompt)
    return names


_STRUCTURED_OUTPUTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")  # its fields


def guided_spec(req: CompletionRequest | ChatCompletionRequest) -> tuple[str, str, str] | None:
    """vLLM's constraint, where one is given: guided_json / guided_regex / guided_choice /
    guided_grammar, or (vLLM >= 0.12) structured_outputs' json / regex / choice / grammar /
    json_object / structural_tag. (The field's name, our field, the spec): json_schema, regex, ebnf
    (a choice: an EBNF alternation of its strings as JSON literals) or structural_tag. 400 where two
    are given."""
    so = req.structured_outputs
    given = [(name, getattr(req, name)) for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
             if getattr(req, name) is not None]
    if so is not None:
        given += [(f"structured_outputs.{k}", getattr(so, k)) for k in _STRUCTURED_OUTPUTS
                  if getattr(so, k) not in (None, False)]
    if len(given) > 1:
        raise ApiError(400, f"give at most one of {', '.join(f for f, _ in given)}", param=given[1][0])
    if not given:
        return None
    field, value = given[0]
    kind = field.removeprefix("guided_").removeprefix("structured_outputs.")
    if kind == "json":
        return field, "json_schema", value if isinstance(value, str) else json.dumps(value)
    if kind == "json_object":
        return field, "json_schema", '{"type": "object"}'
    if kind == "regex":
        return field, "regex", value
    if kind == "grammar":
        return field, "ebnf", value
    if kind == "structural_tag":
        return field, "structural_tag", value
    if not value or not all(value):
        raise ApiError(400, f"{field} must be a list of non-empty strings", param=field)
    return field, "ebnf", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as JSON object keys) with int keys; SamplingParams.validate
    checks the ids against the vocabulary and the values' range."""
    out: dict[int, float] = {}
    for key, value in bias.items():
        # decimal digits only: int() would take " 5 ", "1_0" and other scripts' digits, and "05" would merge with "5"
        if not (key.isascii() and key.isdigit()) or (len(key) > 1 and key[0] == "0") or len(key) > 10:
            raise ApiError(400, f"logit_bias keys must be token ids (decimal digits), got {key[:50]!r}",
                           param="logit_bias")
        out[int(key)] = float(value)
    return out


def _seed(seed: int | None) -> int | None:
    """Any int64, as vLLM takes it (some clients send -1): a negative one folded into [0, 2**63)."""
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise ApiError(400, f"seed must be a 64-bit integer, got {seed}", param="seed")
    return None if seed is None else seed % 2**63


def request_rid(req: Any, call_rid: str, header_given: bool) -> str:
    """The request's id: an x-request-id header's, else the body's request_id (vLLM's, the OpenAI
    routes) or rid (SGLang's, every route), else the one the server made."""
    for name in ("request_id", "rid"):
        value = getattr(req, name, None)
        if value is not None and not header_given:
            return check_rid(value, name)
    return call_rid


def prompt_limit(req: ChatCompletionRequest | CompletionRequest, limits: Limits) -> int | None:
    """vLLM's truncate_prompt_tokens: the prompt keeps its last k tokens (-1: the context's
    length); None: no truncation."""
    k = req.truncate_prompt_tokens
    if k is None:
        return None
    if k != -1 and not 1 <= k <= limits.max_context:
        raise ApiError(400, f"truncate_prompt_tokens must be -1 or in [1, {limits.max_context}] (the context), "
                       f"got {k}", param="truncate_prompt_tokens")
    return limits.max_context if k == -1 else k


def _set(kw: dict[str, Any], name: str, value: Any) -> None:
    if value is not None:
        kw[name] = value


def _logprob_params(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    if isinstance(req, CompletionRequest):  # legacy: logprobs is the number of top tokens
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.logprobs}", param="logprobs")
        return {"logprobs": req.logprobs is not None, "top_logprobs": req.logprobs or 0}
    if req.top_logprobs and not req.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    return {"logprobs": bool(req.logprobs), "top_logprobs": req.top_logprobs or 0}


def make_params(kw: dict[str, Any], max_new: int, vocab_size: int | None = None,
                eos_ids: tuple[int, ...] = ()) -> SamplingParams:
    # convert (not the constructor) type-checks every field: a mistyped value would
    # otherwise be encoded, fail to decode in the scheduler, and hang the request.
    try:
        params = msgspec.convert({**kw, "max_new_tokens": max_new}, SamplingParams)
    except msgspec.ValidationError as exc:
        raise from_validation(exc) from None
    check_params(params, vocab_size, eos_ids)
    return params


def check_subrequests(prompts: int, n: int) -> None:
    if prompts * n > MAX_SUBREQUESTS:
        raise ApiError(400, f"at most {MAX_SUBREQUESTS} prompts x n per request (got {prompts} x {n})",
                       param="prompt" if n == 1 else "n")


def fan_out(rid: str, prompts: list[list[int]], params: list[SamplingParams], n: int) -> list[SubRequest]:
    """One SubRequest per (prompt, sample). A single one keeps the rid; otherwise rid-k.

    Seeded samples get seed+i so that n samples differ yet stay reproducible."""
    check_subrequests(len(prompts), n)
    if len(prompts) * n == 1:
        return [SubRequest(rid, 0, 0, prompts[0], params[0])]
    subs = []
    for p, (ids, base) in enumerate(zip(prompts, params, strict=True)):
        for i in range(n):
            k = p * n + i
            sp = base if base.seed is None else msgspec.structs.replace(base, seed=(base.seed + i) % 2**63)
            subs.append(SubRequest(f"{rid}-{k}", k, p, ids, sp))
    return subs


def encode_within(tok: TextTokenizer, text: str, limits: Limits, what: str = "prompt",
                  add_special_tokens: bool = True, keep_last: int | None = None) -> list[int]:
    """tok.encode(text), refused unread when its length alone shows that it cannot fit the
    context: tokenizing a 60 MB body costs about a minute of CPU before its count's 400.
    keep_last (prompt_limit): the last tokens only, the text's length then no reason to refuse."""
    if keep_last is not None:
        return tok.encode(text, add_special_tokens=add_special_tokens)[-keep_last:]
    fewest = tok.fewest_tokens(text)
    if fewest >= limits.max_context:
        raise _too_long(limits.max_context, what, f"at least {fewest} tokens ({len(text)} characters)")
    return tok.encode(text, add_special_tokens=add_special_tokens)


def completion_prompts(prompt: str | list[Any], tok: TextTokenizer | None, limits: Limits, n: int = 1,
                       add_special_tokens: bool = True, keep_last: int | None = None) -> list[list[int]]:
    """The token ids of each prompt of a /v1/completions body (n samples each: their count is
    checked before any prompt is tokenized); keep_last: prompt_limit's."""
    def encode(text: str) -> list[int]:
        if tok is None:
            raise ApiError(400, f"text prompts are not available: {IDS_ONLY}", param="prompt")
        return encode_within(tok, text, limits, add_special_tokens=add_special_tokens, keep_last=keep_last)

    cut = slice(-keep_last if keep_last is not None else None, None)
    if isinstance(prompt, str):
        return [encode(prompt)]
    if not prompt:
        raise ApiError(400, "prompt must not be an empty array", param="prompt")
    if all(type(t) is int for t in prompt):
        return [list(prompt[cut])]
    check_subrequests(len(prompt), n)
    if all(isinstance(t, str) for t in prompt):
        return [encode(t) for t in prompt]
    if all(isinstance(p, list) and all(type(t) is int for t in p) for p in prompt):
        return [list(p[cut]) for p in prompt]
    raise ApiError(
        400, "prompt must be a string, an array of strings, an array of token ids or an array of those", "prompt"
    )


def native_params(raw: dict[str, Any] | None, defaults: dict[str, Any] | None = None
                  ) -> tuple[SamplingParams, bool]:
    """SamplingParams from a /generate body, and whether max_new_tokens was given. As SGLang takes
    them: `stop` may be one string, and max_new_tokens null means up to the context's end (not given,
    and no default: `native_request` clips it to the room left). `defaults` (the model's) fill the
    sampling keys it does not have."""
    # a null field is unset, as on the OpenAI routes (SamplingParams' default, or the model's);
    # max_new_tokens null has its own meaning (below)
    # (an unknown key stays, null or not, for the 400 that names it)
    raw = {k: v for k, v in (raw or {}).items() if v is not None or k not in _UNSETTABLE}
    if defaults:
        raw = {**defaults, **raw}
    if isinstance(raw.get("stop"), str):
        raw["stop"] = [raw["stop"]]
    if "no_stop_trim" in raw:  # SGLang's name
        raw["include_stop_str_in_output"] = raw.pop("no_stop_trim")
    if "max_new_tokens" in raw and raw["max_new_tokens"] is None:
        raw["max_new_tokens"] = INT32 - 1
        given = False
    else:
        given = "max_new_tokens" in raw
    try:
        params = msgspec.convert(raw, SamplingParams, str_keys=True)  # JSON keys: logit_bias's ids
    except msgspec.ValidationError as exc:
        raise from_validation(exc, prefix="sampling_params") from None
    return params, given


def native_prompt(text: str | None, input_ids: list[int] | None, tok: TextTokenizer | None,
                  limits: Limits) -> list[int]:
    """The prompt of /generate or an SDK request: exactly one of text and input_ids."""
    if (text is None) == (input_ids is None):
        raise ApiError(400, "give exactly one of text and input_ids", param="text")
    if input_ids is not None:
        return list(input_ids)
    if tok is None:
        raise ApiError(400, f"text prompts are not available: {IDS_ONLY}", param="text")
    return encode_within(tok, text or "", limits)  # the same error as its count's (check_length)


def native_request(
    ids: list[int], params: SamplingParams, max_given: bool, limits: Limits, tok: TextTokenizer | None
) -> SamplingParams:
    """Validate a native request; an unset max_new_tokens is clipped to the context left."""
    check_ids(ids, limits, param="input_ids")
    if not max_given:
        room = max(0, limits.max_context - len(ids))
        params = msgspec.structs.replace(params, max_new_tokens=min(params.max_new_tokens, room))
    check_params(params, limits.vocab_size, limits.eos_ids)
    params = text_features(params, tok, limits)
    check_length(len(ids), params.max_new_tokens, limits)
    return params
