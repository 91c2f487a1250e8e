"""What every tool-call format shares: the call types, the streaming state machine, and the
structure a grammar needs to force a call.

A format says two things (a `ToolCallParser` subclass): where a call starts (`find_begin`:
a begin marker such as `<tool_call>`), and what a call's body holds so far (`block`: the
function name once it is complete, the arguments text so far, where the call ends). The
`ToolStream` here does the rest, the same way for every format:

* Text that could be the start of a marker is held back until it is decided, so a marker
  split across chunks works and nothing streamed is ever taken back.
* A call's name is sent first (with its id), then argument fragments; each fragment
  extends the last, so their concatenation is the arguments JSON.
* A call to a function the request did not declare is not a tool call: its text, markers
  included, is left as content (the client sees what the model wrote instead of an
  invented call it cannot dispatch; vLLM and SGLang do the same).
* After the first call, whitespace between or after calls is dropped (other text after a
  call is content); content before the first call is kept as the model wrote it.
* `parse(text)` (non-streaming) runs the same stream over the whole text, so the streamed
  and non-streamed results are equal by construction, however the text is split.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, ClassVar

# Models put raw control characters (newlines) inside strings: accept them.
DECODER = json.JSONDecoder(strict=False)


def new_call_id() -> str:
    """An OpenAI-style tool call id; made once per call, so stable within a response."""
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    """A finished call: `arguments` is the JSON text of the arguments object."""

    name: str
    arguments: str = ""
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallDelta:
    """Streamed piece of call `index`: the first carries id and name, later ones arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        fn: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            out["id"], out["type"] = self.id, "function"
        if self.name is not None:
            fn = {"name": self.name, "arguments": self.arguments}
        out["function"] = fn
        return out


@dataclass
class ToolDelta:
    """What one `feed` produced: content text and call pieces (coalesced per call)."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def add(self, index: int, args: str = "", call_id: str | None = None, name: str | None = None) -> None:
        if self.calls and self.calls[-1].index == index:
            self.calls[-1].arguments += args
            return
        if args or name is not None:
            self.calls.append(ToolCallDelta(index, call_id, name, args))

    def extend(self, other: ToolDelta) -> None:
        self.content += other.content
        for d in other.calls:
            self.add(d.index, d.arguments, d.id, d.name)


@dataclass
class Block:
    """What a call's body (the text after its begin marker) holds so far.

    `name` is set only once complete, and never changes afterwards; `args` only grows
    (each value extends the previous one); `end` is the length of the body including the
    end marker, once seen; `invalid` says the block is not a call (it becomes content)."""

    name: str | None = None
    args: str = ""
    end: int | None = None
    invalid: bool = False


@dataclass(frozen=True)
class ToolTag:
    """One function as a grammar sees it: `begin` + arguments (matching `schema`) + `end`.

    With `args_format` "json" the arguments are one JSON document matching `schema`
    (xgrammar's StructuralTagItem(begin, schema, end)); with "glm45_xml" they are
    `<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n` pairs (GLM-4.5), one per property."""

    name: str
    begin: str
    schema: dict[str, Any]
    end: str


@dataclass(frozen=True)
class ToolStructure:
    """How a format writes calls, for grammar-constrained decoding (tool_choice required
    or named). Every tag's `begin` starts with one of `triggers`. A forced output is
    `prefix` + tag (`separator` + tag)* + `suffix`; `prefix`/`suffix` wrap the calls in
    formats that have an outer block (DeepSeek-V3), and are "" elsewhere."""

    triggers: tuple[str, ...]
    tags: tuple[ToolTag, ...]
    args_format: str = "json"
    prefix: str = ""
    separator: str = ""
    suffix: str = ""


def tool_functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> the `function` object of each (already validated) tool."""
    return {t["function"]["name"]: t["function"] for t in tools}


def arguments_schema(function: dict[str, Any]) -> dict[str, Any]:
    params = function.get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def partial_marker(buf: str, start: int, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of buf[start:] that is a proper prefix of a marker."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(buf) - start), best, -1):
            if buf.endswith(marker[:k]):
                best = k
                break
    return best


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


_CONTROL = re.compile(r"[\x00-\x1f]")


def strict_json(text: str) -> str:
    """JSON text (maybe unfinished) with the raw control characters inside its strings escaped:
    DECODER reads them, as models write them, but a client's json.loads refuses them. Each
    character's escape depends only on the text before it, so a streamed prefix's result is a
    prefix of the whole's (deltas stay append-only)."""
    if not _CONTROL.search(text):  # (C speed: this runs on the whole arguments text every delta)
        return text
    out, in_string, escaped = [], False, False
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
            elif c < " ":
                c = json.dumps(c)[1:-1]  # \n, \t, \u0000 ...
        elif c == '"':
            in_string = True
        out.append(c)
    return "".join(out)


class ToolCallParser:
    """A tool-call format. Construct one per request with the request's tools (the names
    a call may use). Subclasses set `begins` (and `drops`: wrapper markers removed from
    content) and implement `block` and `structure`."""

    name: ClassVar[str] = ""
    begins: ClassVar[tuple[str, ...]] = ()
    drops: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tools: list[dict[str, Any]], max_calls: int | None = None, forced: bool = False) -> None:
        self.tools = tool_functions(tools)
        self.max_calls = max_calls  # parallel_tool_calls=false: 1; later calls are dropped
        self.forced = forced  # tool_choice required / named: the grammar lets the output hold calls only

    def find_begin(self, buf: str, pos: int, final: bool, fresh: bool) -> tuple[int, int, bool] | int:
        """The next marker at or after `pos`: (start, end, opens_a_call), or, when there is
        none, how far the text is content for sure (a possible marker prefix held back).
        `fresh`: nothing but calls has been seen so far (formats without markers use it)."""
        markers = self.begins + self.drops
        hits = [(i, m) for m in markers if (i := buf.find(m, pos)) >= 0]
        if hits:
            start, marker = min(hits)
            return start, start + len(marker), marker in self.begins
        return len(buf) if final else len(buf) - partial_marker(buf, pos, markers)

    def block(self, body: str, final: bool) -> Block:
        raise NotImplementedError

    @classmethod
    def structure(cls, tools: list[dict[str, Any]]) -> ToolStructure:
        """Trigger, begin and end strings and the argument schema of each allowed tool:
        what a grammar needs to force this format's calls. `tools` are the request's
        validated tools (for a named tool_choice, just that one)."""
        raise NotImplementedError

    def stream(self) -> ToolStream:
        return ToolStream(self)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """Non-streaming: (content, calls). The same state machine as streaming."""
        stream = self.stream()
        out = stream.feed(text)
        out.extend(stream.finish())
        return out.content, stream.calls


class ToolStream:
    """Incremental parser of one output: `feed` text deltas, then `finish` once."""

    def __init__(self, parser: ToolCallParser) -> None:
        self._p = parser
        self._buf = ""
        self._pos = 0  # text before this is handled
        self._body: int | None = None  # where the open block's body starts
        self._begin = ""  # the open block's begin marker
        self._mode = ""  # the open block: "" undecided, "call", "content", "skip"
        self._sent = 0  # of the open block: argument chars sent (call) or text sent (content)
        self._hold = ""  # whitespace after a call: dropped unless content follows
        self._fresh = True
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> ToolDelta:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> ToolDelta:
        out = self._run(final=True)
        self._hold = ""
        return out

    def _run(self, final: bool) -> ToolDelta:
        out = ToolDelta()
        while self._step_block(out, final) if self._body is not None else self._step_content(out, final):
            pass
        return out

    def _step_content(self, out: ToolDelta, final: bool) -> bool:
        # under a forced choice a marker's prefix the output ends in is a call cut short: held, so dropped
        found = self._p.find_begin(self._buf, self._pos, final and not self._p.forced, self._fresh)
        if isinstance(found, int):
            self._content(out, self._buf[self._pos : found])
            self._pos = max(self._pos, found)
            return False
        start, end, opens = found
        self._content(out, self._buf[self._pos : start])
        self._pos = end
        if opens:
            self._hold = ""
            self._body, self._begin, self._mode, self._sent = end, self._buf[start:end], "", 0
        return True

    def _step_block(self, out: ToolDelta, final: bool) -> bool:
        assert self._body is not None
        body = self._buf[self._body :]
        b = self._p.block(body, final)
        if not self._mode:
            self._mode = self._decide(b, final)
            if not self._mode:
                return False  # the name is not complete yet: hold the block
            if self._mode == "call":
                assert b.name is not None
                self.calls.append(ToolCall(b.name))
                out.add(len(self.calls) - 1, call_id=self.calls[-1].id, name=b.name)
        used = b.end if b.end is not None else len(body)
        if self._mode == "content":
            text = self._begin + body[:used]
            self._content(out, text[self._sent :])
            self._sent = len(text)
        elif self._mode == "call":
            new = b.args[self._sent :]
            self._sent = len(b.args)
            self.calls[-1].arguments += new
            out.add(len(self.calls) - 1, new)
        if b.end is None and not final:
            return False
        self._pos, self._body = self._body + used, None
        self._fresh = self._mode in ("call", "skip") and self._fresh
        return True

    def _decide(self, b: Block, final: bool) -> str:
        if self._p.forced and final and b.end is None and (b.invalid or b.name not in self._p.tools):
            # under a forced choice the grammar allows nothing but calls: a block the output ends in
            # before its name is complete (max_tokens) is an unfinished call, dropped, not content
            # (`b.name not in tools` covers None and a name cut short)
            return "skip"
        if b.invalid or (b.name is not None and b.name not in self._p.tools):
            return "content"
        if b.name is None:
            return "content" if final or b.end is not None else ""
        limit = self._p.max_calls
        return "skip" if limit is not None and len(self.calls) >= limit else "call"

    def _content(self, out: ToolDelta, text: str) -> None:
        if not text:
            return
        self._fresh = False
        if self.calls:  # after a call, whitespace waits to see whether content follows
            text = self._hold + text
            keep = len(text.rstrip())
            text, self._hold = text[:keep], text[keep:]
        out.content += text
