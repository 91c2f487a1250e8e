"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, validated strictly.

A malformed tool definition is a 400 naming the field (`tools[1].function.name`), never a
template error later or a silently ignored tool.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from engine.serve.errors import ApiError
from engine.serve.parsers import tool_call_parser
from engine.serve.parsers.base import ToolCallParser, ToolStructure

NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")  # OpenAI's rule, plus '.' and ':' (MCP-style names)
_TOOL_KEYS = {"type", "function"}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


@dataclass(frozen=True)
class ToolRequest:
    """What a request asks of tools. `choice`: none | auto | required | named."""

    tools: list[dict[str, Any]]
    choice: str
    function: str | None  # the named function (choice "named")
    parallel: bool
    parser: str  # the server's --tool-call-parser ("" = none: tools are only rendered)

    @property
    def parses(self) -> bool:
        """Whether the output is parsed into tool calls."""
        return bool(self.parser) and self.choice != "none"

    @property
    def allowed(self) -> list[dict[str, Any]]:
        """The tools a call may use: just the named one for a named tool_choice."""
        if self.choice == "named":
            return [t for t in self.tools if t["function"]["name"] == self.function]
        return self.tools

    def make_parser(self) -> ToolCallParser:
        return tool_call_parser(self.parser)(self.allowed, max_calls=None if self.parallel else 1,
                                             forced=self.choice in ("required", "named"))

    def structure(self) -> ToolStructure | None:
        """For grammar enforcement: the format's triggers, begin/end strings and the
        argument schema of each allowed tool when the request forces a call (tool_choice
        required or named); None when nothing is forced. See ToolCallParser.structure."""
        if not self.parses or self.choice not in ("required", "named"):
            return None
        return tool_call_parser(self.parser).structure(self.allowed)


def check_tools(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None, parser: str
) -> ToolRequest | None:
    """The validated request, or None when it has no tools (and forces none)."""
    choice, function = _choice(tool_choice)
    if not tools:
        if choice in ("required", "named"):
            raise ApiError(400, f"tool_choice {choice!r} needs a non-empty tools array", param="tool_choice")
        return None
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = _check_tool(tool, f"tools[{i}]")
        if name in seen:
            raise ApiError(400, f"duplicate tool name {name!r}", param=f"tools[{i}].function.name")
        seen.add(name)
    if choice == "named" and function not in seen:
        raise ApiError(400, f"tool_choice names function {function!r}, which is not in tools", param="tool_choice")
    if choice in ("required", "named") and not parser:
        raise ApiError(
            400,
            f"tool_choice {'a named function' if choice == 'named' else repr(choice)} needs a tool-call parser: "
            "start the server with --tool-call-parser",
            param="tool_choice",
        )
    # a named tool_choice forces one call of that function (OpenAI's and vLLM's meaning): its grammar
    # stops after the first call and its parser keeps one, whatever parallel_tool_calls says
    return ToolRequest(tools, choice, function, parallel is not False and choice != "named", parser)


def _choice(tool_choice: Any) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, None
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if tool_choice.get("type") == "function" and isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return "named", fn["name"]
    raise ApiError(
        400,
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


def _check_tool(tool: Any, where: str) -> str:
    if not isinstance(tool, dict):
        raise ApiError(400, f"{where} must be an object", param=where)
    if tool.get("type") != "function":
        raise ApiError(400, f'{where}.type must be "function"', param=f"{where}.type")
    extra = sorted(set(tool) - _TOOL_KEYS)
    if extra:
        raise ApiError(400, f"{where} has unknown fields: {', '.join(extra)}", param=f"{where}.{extra[0]}")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ApiError(400, f"{where}.function must be an object", param=f"{where}.function")
    where = f"{where}.function"
    extra = sorted(set(fn) - _FUNCTION_KEYS)
    if extra:
        raise ApiError(400, f"{where} has unknown fields: {', '.join(extra)}", param=f"{where}.{extra[0]}")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):  # fullmatch: '$' would take a final newline
        raise ApiError(400, f"{where}.name must be 1-64 characters of a-z, A-Z, 0-9, _ . : -", param=f"{where}.name")
    if not isinstance(fn.get("description", ""), str | None):
        raise ApiError(400, f"{where}.description must be a string", param=f"{where}.description")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise ApiError(400, f"{where}.parameters must be a JSON Schema object", param=f"{where}.parameters")
    if isinstance(params, dict) and not isinstance(params.get("properties", {}), dict):
        raise ApiError(400, f"{where}.parameters.properties must be an object", param=f"{where}.parameters")
    if not isinstance(fn.get("strict", False), bool | None):
        raise ApiError(400, f"{where}.strict must be a boolean", param=f"{where}.strict")
    return name
