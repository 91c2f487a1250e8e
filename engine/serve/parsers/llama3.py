"""Llama-3.x JSON format: the output is `{"name": "f", "parameters": {...}}`, optionally
after `<|python_tag|>`; parallel calls are separated by `;`.

There is no begin marker, so a call is only recognised where vLLM recognises one: at the
very start of the output (leading whitespace aside) and right after a call. An output that
starts with any other text is all content. A JSON object without a known function name is
content too (it is held until it closes: only then is it known not to be a call).
`<|python_tag|>` is a special token, skipped by the detokenizer unless the request sets
skip_special_tokens=false; both forms parse the same.
"""

from __future__ import annotations

from typing import Any, ClassVar

from engine.serve.parsers.base import Block, ToolCallParser, ToolStructure, ToolTag, arguments_schema, dumps, skip_ws
from engine.serve.parsers.base import tool_functions as _functions
from engine.serve.parsers.jsoncall import call_block

PYTHON_TAG = "<|python_tag|>"


class Llama3Parser(ToolCallParser):
    name: ClassVar[str] = "llama3"

    def find_begin(self, buf: str, pos: int, final: bool, fresh: bool) -> tuple[int, int, bool] | int:
        if not fresh:
            return len(buf)
        i = skip_ws(buf, pos)
        if pos > 0 and buf.startswith(";", i):  # the separator after a call
            i = skip_ws(buf, i + 1)
        if i == len(buf) or (PYTHON_TAG.startswith(buf[i:]) and buf[i:] != PYTHON_TAG):
            return len(buf) if final else pos  # undecided: hold it
        if buf.startswith(PYTHON_TAG, i):
            return pos, i + len(PYTHON_TAG), True
        if buf[i] == "{":
            return pos, i, True
        return len(buf)

    def block(self, body: str, final: bool) -> Block:
        return call_block(body, None, final, ends_at_close=True)

    @classmethod
    def structure(cls, tools: list[dict[str, Any]]) -> ToolStructure:
        tags = tuple(
            ToolTag(name, f'{{"name": {dumps(name)}, "parameters": ', arguments_schema(fn), "}")
            for name, fn in _functions(tools).items()
        )
        return ToolStructure(triggers=('{"name"',), tags=tags, separator="; ")
