"""DeepSeek-V3 special-token format:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

and DeepSeek-V3.1's shorter one (`deepseek_v31`): `<｜tool▁call▁begin｜>get_weather
<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>` inside the same outer markers. The outer
calls-begin/calls-end markers are dropped from the content.
"""

from __future__ import annotations

from typing import Any, ClassVar

from engine.serve.parsers.base import (
    DECODER,
    Block,
    ToolCallParser,
    ToolStructure,
    ToolTag,
    arguments_schema,
    skip_ws,
    strict_json,
)
from engine.serve.parsers.base import tool_functions as _functions

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE = "```"


def json_args(text: str, v: int) -> str:
    """The arguments object starting at or after `v`, as far as it is written."""
    v = skip_ws(text, v)
    if v == len(text) or text[v] != "{":
        return ""
    try:
        _, e = DECODER.raw_decode(text, v)
    except ValueError:
        return strict_json(text[v:])
    return strict_json(text[v:e])


class DeepSeekV3Parser(ToolCallParser):
    name: ClassVar[str] = "deepseek_v3"
    begins: ClassVar[tuple[str, ...]] = (CALL_BEGIN,)
    drops: ClassVar[tuple[str, ...]] = (CALLS_BEGIN, CALLS_END)

    def block(self, body: str, final: bool) -> Block:
        at = body.find(CALL_END)
        scope = body if at < 0 else body[:at]
        end = None if at < 0 else at + len(CALL_END)
        closed = end is not None or final
        b = self._read(scope, closed)
        b.end = end
        if b.name is None and closed:
            b.invalid = True
        return b

    def _read(self, scope: str, closed: bool) -> Block:
        sep = scope.find(SEP)
        if sep < 0:
            return Block()
        rest = scope[sep + len(SEP) :]
        nl = rest.find("\n")
        if nl < 0:
            return Block(name=rest.strip() or None) if closed else Block()
        name = rest[:nl].strip()
        after = skip_ws(rest, nl)
        if rest.startswith(FENCE, after):  # ```json then a newline, then the object
            line = rest.find("\n", after)
            args = "" if line < 0 else json_args(rest, line + 1)
        else:
            args = json_args(rest, after)
        return Block(name=name, args=args or ("{}" if closed else ""))

    @classmethod
    def structure(cls, tools: list[dict[str, Any]]) -> ToolStructure:
        tags = tuple(
            ToolTag(
                name, f"{CALL_BEGIN}function{SEP}{name}\n{FENCE}json\n", arguments_schema(fn), f"\n{FENCE}{CALL_END}"
            )
            for name, fn in _functions(tools).items()
        )
        return ToolStructure(triggers=(CALL_BEGIN,), tags=tags, prefix=CALLS_BEGIN, suffix=CALLS_END)


class DeepSeekV31Parser(DeepSeekV3Parser):
    name: ClassVar[str] = "deepseek_v31"

    def _read(self, scope: str, closed: bool) -> Block:
        sep = scope.find(SEP)
        if sep < 0:
            return Block()
        args = json_args(scope, sep + len(SEP))
        return Block(name=scope[:sep].strip(), args=args or ("{}" if closed else ""))

    @classmethod
    def structure(cls, tools: list[dict[str, Any]]) -> ToolStructure:
        tags = tuple(
            ToolTag(name, f"{CALL_BEGIN}{name}{SEP}", arguments_schema(fn), CALL_END)
            for name, fn in _functions(tools).items()
        )
        return ToolStructure(triggers=(CALL_BEGIN,), tags=tags, prefix=CALLS_BEGIN, suffix=CALLS_END)
