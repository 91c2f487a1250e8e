"""Output parsers of chat completions: tool calls (`--tool-call-parser`) and reasoning
(`--reasoning-parser`).

The registries map a flag value to "module:Class" and import on lookup, so that the names
can be checked (engine/config.py) without importing the parsers, let alone torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.serve.parsers.base import ToolCallParser
    from engine.serve.parsers.reasoning import ReasoningParser

TOOL_CALL_PARSERS = {
    "hermes": "engine.serve.parsers.hermes:HermesParser",
    "qwen25": "engine.serve.parsers.hermes:HermesParser",  # Qwen2.5/Qwen3 write the Hermes format
    "llama3": "engine.serve.parsers.llama3:Llama3Parser",
    "deepseek_v3": "engine.serve.parsers.deepseek_v3:DeepSeekV3Parser",
    "deepseek_v31": "engine.serve.parsers.deepseek_v3:DeepSeekV31Parser",
    "glm45": "engine.serve.parsers.glm45:Glm45Parser",
}

REASONING_PARSERS = {
    "deepseek-r1": "engine.serve.parsers.reasoning:DeepSeekR1Reasoning",
    "qwen3": "engine.serve.parsers.reasoning:Qwen3Reasoning",
    "glm45": "engine.serve.parsers.reasoning:Glm45Reasoning",
}


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
