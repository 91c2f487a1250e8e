"""Hermes / Qwen format: `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`,
one block per call (parallel calls are consecutive blocks)."""

from __future__ import annotations

from typing import Any, ClassVar

from engine.serve.parsers.base import Block, ToolCallParser, ToolStructure, ToolTag, arguments_schema, dumps
from engine.serve.parsers.base import tool_functions as _functions
from engine.serve.parsers.jsoncall import call_block

BEGIN, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolCallParser):
    name: ClassVar[str] = "hermes"
    begins: ClassVar[tuple[str, ...]] = (BEGIN,)

    def block(self, body: str, final: bool) -> Block:
        at = body.find(END)
        if at < 0:
            return call_block(body, None, final)
        return call_block(body[:at], at + len(END), final)

    @classmethod
    def structure(cls, tools: list[dict[str, Any]]) -> ToolStructure:
        tags = tuple(
            ToolTag(name, f'{BEGIN}\n{{"name": {dumps(name)}, "arguments": ', arguments_schema(fn), f"}}\n{END}")
            for name, fn in _functions(tools).items()
        )
        return ToolStructure(triggers=(BEGIN,), tags=tags, separator="\n")
