"""A call written as one JSON object, `{"name": ..., "arguments": {...}}`, read as far as
the text goes (Hermes/Qwen and Llama-3 write calls this way).

The object's top-level fields are scanned with the stdlib decoder (C speed), so re-reading
a growing call on every delta stays cheap. A value that does not decode yet is the one
still being written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from engine.serve.parsers.base import DECODER, Block, dumps, skip_ws, strict_json

ARG_KEYS = ("arguments", "parameters")  # Llama-3 templates say "parameters"


@dataclass
class ObjectScan:
    """Top-level fields seen so far: key -> (value start, value end or None if unfinished)."""

    fields: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    end: int | None = None  # index after the closing brace
    ok: bool = True  # False: the text is not a JSON object


def scan_object(text: str, i: int = 0) -> ObjectScan:
    out = ObjectScan()
    i = skip_ws(text, i)
    if i == len(text):
        return out
    if text[i] != "{":
        out.ok = False
        return out
    i = skip_ws(text, i + 1)
    if text.startswith("}", i):
        out.end = i + 1
        return out
    while i < len(text):
        i = _field(text, i, out)
        if i < 0:
            return out
        i = skip_ws(text, i)
        if i == len(text):
            return out
        if text[i] == "}":
            out.end = i + 1
            return out
        if text[i] != ",":
            out.ok = False
            return out
        i = skip_ws(text, i + 1)
    return out


def _field(text: str, i: int, out: ObjectScan) -> int:
    """Scan `"key": value` at i; the index after it, or -1 when the text ends (or breaks) first."""
    if text[i] != '"':
        out.ok = False
        return -1
    try:
        key, j = DECODER.raw_decode(text, i)
    except ValueError:
        return -1  # the key is not finished
    j = skip_ws(text, j)
    if j == len(text):
        return -1
    if text[j] != ":":
        out.ok = False
        return -1
    v = skip_ws(text, j + 1)
    if v == len(text):
        return -1
    try:
        _, e = DECODER.raw_decode(text, v)
    except ValueError:
        out.fields[key] = (v, None)
        return -1
    if e == len(text) and text[v] not in '{["':
        out.fields[key] = (v, None)  # a number or literal at the end may still grow
        return -1
    out.fields[key] = (v, e)
    return e


def call_block(scope: str, end: int | None, final: bool, ends_at_close: bool = False) -> Block:
    """The Block of a JSON-object call whose text (without any end marker) is `scope`;
    `end` is the block's end (marker included) if known; `ends_at_close`: the block ends
    with the object (formats without an end marker)."""
    scan = scan_object(scope)
    if ends_at_close:
        end = scan.end
    if not scan.ok:
        return Block(end=end, invalid=True)
    closed = scan.end is not None or end is not None or final
    span = scan.fields.get("name")
    if span is None or span[1] is None:
        return Block(end=end, invalid=closed)
    name = json.loads(scope[span[0] : span[1]])
    if not isinstance(name, str):
        return Block(end=end, invalid=True)
    return Block(name=name, args=_arguments(scope, scan, scan.end is not None or end is not None), end=end)


def _arguments(scope: str, scan: ObjectScan, complete: bool) -> str:
    """The arguments text so far. An object is streamed as the model writes it (raw control
    characters in its strings escaped); any other value is sent whole once complete: a JSON
    string holding an object is unwrapped (some models double-encode the arguments), anything
    else is its JSON, as vLLM's json.dumps gives. A complete call without arguments has {}; one
    the output cut short (max_tokens, a stop string) keeps what it had, not a made-up {}."""
    span = next((scan.fields[k] for k in ARG_KEYS if k in scan.fields), None)
    if span is None:
        return "{}" if complete else ""
    v, e = span
    if scope[v] == "{":
        return strict_json(scope[v:e] if e is not None else scope[v:])
    if e is None:
        return ""
    value = DECODER.decode(scope[v:e])
    if isinstance(value, str):  # double-encoded arguments: the object inside, else the string's JSON
        try:
            if isinstance(DECODER.decode(value), dict):
                return strict_json(value.strip())
        except ValueError:
            pass
    return dumps(value)
