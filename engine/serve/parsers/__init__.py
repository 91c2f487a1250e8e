"""Output parsers of chat completions: tool calls (`--tool-call-parser`) and reasoning
(`--reasoning-parser`).

The registries (engine/parser_names.py) map a flag value to "module:Class", imported on lookup
here; the names are checked by ServerConfig without importing the parsers, let alone torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from engine.parser_names import REASONING_PARSERS, TOOL_CALL_PARSERS

if TYPE_CHECKING:
    from engine.serve.parsers.base import ToolCallParser
    from engine.serve.parsers.reasoning import ReasoningParser

def _load(table: dict[str, str], kind: str, name: str) -> type:
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r} (known: {', '.join(sorted(table))})")
    module, cls = table[name].split(":")
    return getattr(importlib.import_module(module), cls)


def tool_call_parser(name: str) -> type[ToolCallParser]:
    """The parser class of a --tool-call-parser name (construct it per request with the tools)."""
    return _load(TOOL_CALL_PARSERS, "tool-call parser", name)


def reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class of a --reasoning-parser name."""
    return _load(REASONING_PARSERS, "reasoning parser", name)
