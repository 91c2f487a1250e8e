"""Response bodies: OpenAI chat/completions objects and chunks, logprobs, usage, SSE.

Pure functions of their inputs (no I/O), so they are easy to test and to reuse for the
streaming and non-streaming paths.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from engine.tokenizer import TextTokenizer

LOGPROB_FLOOR = -9999.0  # -inf is not JSON; OpenAI clients expect a number
_json = msgspec.json.Encoder()


def sse(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def to_json(obj: Any) -> bytes:
    return _json.encode(obj)


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def usage_of(rows: Iterable[tuple[int, int, int, int]]) -> dict[str, Any]:
    """Usage of a request from (prompt_index, prompt, completion, cached) per choice: the
    prompt counts once per distinct prompt (as OpenAI does for n > 1)."""
    prompt = cached = completion = 0
    seen: set[int] = set()
    for prompt_index, p, c, k in rows:
        completion += c
        if prompt_index not in seen:
            seen.add(prompt_index)
            prompt += p
            cached += k
    return usage(prompt, completion, cached)


def with_spec(use: dict[str, Any], specs: Iterable[tuple[int, int, int] | None]) -> dict[str, Any]:
    """Usage plus speculative decoding's counts when any choice verified drafts: drafts accepted
    and rejected (OpenAI's predicted-output fields) and the accept length, tokens answered per
    verify row ((verify rows + accepted) / verify rows)."""
    rows = drafted = accepted = 0
    for s in specs:
        if s:
            rows, drafted, accepted = rows + s[0], drafted + s[1], accepted + s[2]
    if rows:
        use["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                            "rejected_prediction_tokens": drafted - accepted}
        use["spec_accept_length"] = round((rows + accepted) / rows, 4)
    return use


def _lp(x: float) -> float:
    return x if x > LOGPROB_FLOOR else LOGPROB_FLOOR


def token_text(tok: TextTokenizer | None, token_id: int) -> str:
    # Without a tokenizer, name tokens the way vLLM's return_tokens_as_token_ids does.
    return tok.token_text(token_id) if tok is not None else f"token_id:{token_id}"


def token_bytes(tok: TextTokenizer | None, token_id: int) -> list[int]:
    """The token's UTF-8 bytes (part of a character split over tokens: OpenAI's logprobs `bytes`)."""
    return list(tok.token_bytes(token_id)) if tok is not None else list(token_text(tok, token_id).encode())


@dataclass(frozen=True)
class TextOffset:
    """Where the next token starts in a completion's text: `chars` characters in, after the
    `pending` bytes of a character whose other bytes are still to come."""

    chars: int = 0
    pending: bytes = b""

    def start_of(self, data: bytes) -> int:
        """Where a token of these bytes starts: inside the pending character if its first byte
        carries that character on (the character's offset), else after the U+FFFDs the pending
        bytes become (an invalid lead byte, then " world": the space starts at 1, not 0)."""
        if not self.pending or not data:
            return self.chars
        try:
            codecs.getincrementaldecoder("utf-8")("strict").decode(self.pending + data[:1])
        except UnicodeDecodeError:
            return self.chars + len(self.pending.decode("utf-8", "replace"))
        return self.chars

    def after(self, data: bytes) -> TextOffset:
        """The offset after a token of these bytes (characters completed by them counted)."""
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        dec.setstate((self.pending, 0))
        text = dec.decode(data)
        return TextOffset(self.chars + len(text), dec.getstate()[0])


def chat_logprobs(
    tok: TextTokenizer | None,
    ids: list[int],
    logprobs: list[float] | None,
    tops: list[list[tuple[int, float]]] | None,
) -> dict[str, Any] | None:
    """OpenAI chat format: {"content": [{token, logprob, bytes, top_logprobs}, ...]}."""
    if logprobs is None:
        return None
    content = []
    for i, (tid, lp) in enumerate(zip(ids, logprobs, strict=False)):
        text = token_text(tok, tid)
        alts = tops[i] if tops is not None and i < len(tops) else []
        content.append(
            {
                "token": text,
                "logprob": _lp(lp),
                "bytes": token_bytes(tok, tid),
                "top_logprobs": [_alt(tok, t, v) for t, v in alts],
            }
        )
    return {"content": content}


def _alt(tok: TextTokenizer | None, tid: int, lp: float) -> dict[str, Any]:
    return {"token": token_text(tok, tid), "logprob": _lp(lp), "bytes": token_bytes(tok, tid)}


def completion_logprobs(
    tok: TextTokenizer | None,
    ids: list[int],
    logprobs: list[float] | None,
    tops: list[list[tuple[int, float]]] | None,
    offset: TextOffset = TextOffset(),
) -> tuple[dict[str, Any] | None, TextOffset]:
    """Legacy completions format; returns it and the text offset after these tokens (a token
    that ends inside a character moves it only once the character is whole)."""
    if logprobs is None:
        return None, offset
    tokens, offsets = [], []
    for tid in ids[: len(logprobs)]:
        tokens.append(token_text(tok, tid))
        if tok is None:  # ids-only: there is no text
            offsets.append(offset.chars)
            continue
        data = tok.token_bytes(tid)
        offsets.append(offset.start_of(data))
        offset = offset.after(data)
    # the chosen token first, then its alternatives: "up to logprobs+1 elements" (OpenAI); logprobs 0
    # (no alternatives asked for) still gives the chosen token's, as vLLM does
    alternatives = tops[: len(tokens)] if tops is not None else [[]] * len(tokens)
    top = [{token_text(tok, tid): _lp(lp), **{token_text(tok, t): _lp(v) for t, v in alts}}
           for tid, lp, alts in zip(ids, logprobs, alternatives, strict=False)]
    body = {"tokens": tokens, "token_logprobs": [_lp(x) for x in logprobs], "top_logprobs": top, "text_offset": offsets}
    return body, offset


def chat_completion(
    rid: str, model: str, created: int, choices: list[dict[str, Any]], use: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": use,
    }


def chat_choice(
    index: int, message: dict[str, Any], finish: str | None, logprobs: dict[str, Any] | None,
    stop_reason: int | str | None = None,
) -> dict[str, Any]:
    """`message`: {"role": "assistant", "content": ...} plus `reasoning_content` and
    `tool_calls` when the server parses them (engine.serve.parsers.output.ChatOutput).
    stop_reason (vLLM's): the stop string or stop_token_ids entry that ended it, else null."""
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish,
            "stop_reason": stop_reason}


def chat_chunk(
    rid: str,
    model: str,
    created: int,
    choices: list[dict[str, Any]],
    include_usage: bool,
    use: dict[str, Any] | None = None,
) -> dict[str, Any]:
    chunk = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": created, "model": model}
    chunk["choices"] = choices
    if include_usage:
        chunk["usage"] = use
    return chunk


def chat_chunk_choice(
    index: int, delta: dict[str, Any], finish: str | None, logprobs: dict[str, Any] | None,
    stop_reason: int | str | None = None,
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop_reason}


def completion(
    rid: str, model: str, created: int, choices: list[dict[str, Any]], use: dict[str, Any] | None
) -> dict[str, Any]:
    body = {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": model}
    body["choices"] = choices
    body["usage"] = use
    return body


def completion_choice(index: int, text: str, finish: str | None, logprobs: dict[str, Any] | None,
                      stop_reason: int | str | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop_reason}


def native_finish(finish: str | None, matched: int | str | None, completion_tokens: int) -> dict[str, Any] | None:
    """SGLang's meta_info.finish_reason: {"type": "stop", "matched": token id or stop string},
    {"type": "length", "length": tokens}, or {"type": <reason>}; None while running."""
    if finish is None:
        return None
    if finish == "stop":
        return {"type": "stop", "matched": matched}
    if finish == "length":
        return {"type": "length", "length": completion_tokens}
    return {"type": finish}


def native_meta(rid: str, prompt: int, completion_tokens: int, cached: int, finish: str | None,
                spec: tuple[int, int, int] | None = None, matched: int | str | None = None) -> dict[str, Any]:
    meta = {
        "id": rid,
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "cached_tokens": cached,
        "finish_reason": native_finish(finish, matched, completion_tokens),
    }
    if spec and spec[0]:  # as SGLang's meta_info: verify rows, and tokens answered per verify row
        meta["spec_verify_ct"] = spec[0]
        meta["spec_accept_length"] = round((spec[0] + spec[2]) / spec[0], 4)
    return meta


def echo_logprobs(tok: TextTokenizer | None, prompt: list[int], c: Any) -> tuple[dict[str, Any] | None, TextOffset]:
    """Legacy completions' logprobs with `echo`: the prompt's tokens first (the first token has
    no logprob), then the completion's; c is a generate.Choice (or the first Delta) whose prompt
    was scored. Returns it and the text offset after it."""
    if c.prompt_logprobs is None:
        return None, TextOffset()
    head, off = completion_logprobs(tok, prompt[:1], [0.0], None)
    rest, off = completion_logprobs(tok, prompt[1:], c.prompt_logprobs, c.prompt_top_logprobs, off)
    tops = c.top_logprobs if c.logprobs is not None else []  # None: max_tokens 0, no output tokens
    out, off = completion_logprobs(tok, c.token_ids, c.logprobs if c.logprobs is not None else [], tops, off)
    assert head is not None and rest is not None and out is not None
    body = {k: head[k] + rest[k] + out[k] for k in ("tokens", "text_offset")}
    body["token_logprobs"] = [None] + rest["token_logprobs"] + out["token_logprobs"]
    tops = (rest["top_logprobs"], out["top_logprobs"])
    body["top_logprobs"] = [None] + tops[0] + tops[1]
    return body, off


def vllm_prompt_logprobs(tok: TextTokenizer | None, prompt: list[int], logprobs: list[float] | None,
                         tops: list[list[tuple[int, float]]] | None) -> list[dict[str, Any] | None] | None:
    """vLLM's prompt_logprobs: null for the first token, then per token {id: {logprob, rank,
    decoded_token}} for the prompt's token and its top alternatives (rank 1..k; the prompt
    token's rank is null unless it is among them)."""
    if logprobs is None:
        return None
    out: list[dict[str, Any] | None] = [None]
    for i, (t, v) in enumerate(zip(prompt[1:], logprobs, strict=True)):
        alts = tops[i] if tops is not None else []
        rank = next((r + 1 for r, (a, _) in enumerate(alts) if a == t), None)
        entry = {str(t): {"logprob": _lp(v), "rank": rank, "decoded_token": token_text(tok, t)}}
        for r, (a, av) in enumerate(alts):
            entry.setdefault(str(a), {"logprob": _lp(av), "rank": r + 1, "decoded_token": token_text(tok, a)})
        out.append(entry)
    return out


def native_logprobs(
    meta: dict[str, Any], ids: list[int], logprobs: list[float] | None, tops: list[list[tuple[int, float]]] | None,
    tok: TextTokenizer | None = None,
) -> None:
    """SGLang's shape: [[logprob, token_id, null], ...] and per-token lists of those (with `tok`,
    SGLang's return_text_in_logprobs: the token's text instead of null)."""
    def entry(v: float | None, t: int) -> list[Any]:
        return [None if v is None else _lp(v), t, token_text(tok, t) if tok is not None else None]

    if logprobs is not None:
        meta["output_token_logprobs"] = [entry(v, t) for v, t in zip(logprobs, ids, strict=False)]
    if tops is not None:
        meta["output_top_logprobs"] = [[entry(v, t) for t, v in alts] for alts in tops]


def native_input_logprobs(meta: dict[str, Any], prompt: list[int], logprobs: list[float],
                          tops: list[list[tuple[int, float]]] | None, start: int = 0,
                          tok: TextTokenizer | None = None) -> None:
    """SGLang's input_token_logprobs / input_top_logprobs from prompt token `start` (the first
    token's logprob and alternatives null); `tok` as for native_logprobs."""
    sub: dict[str, Any] = {}
    native_logprobs(sub, prompt, [None, *logprobs], None if tops is None else [[], *tops], tok)  # type: ignore[list-item]
    meta["input_token_logprobs"] = sub["output_token_logprobs"][start:]
    if tops is not None:
        meta["input_top_logprobs"] = ([None] + sub["output_top_logprobs"][1:])[start:]
