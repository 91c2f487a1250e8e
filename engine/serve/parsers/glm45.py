"""GLM-4.5 format: arguments as key/value pairs, not JSON:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

The arguments JSON is built pair by pair (`{"city": "Paris", "days": 3}`): a pair is sent
once its `</arg_value>` is seen, the closing brace at `</tool_call>`. A value is a JSON
string when the tool's schema says the property is a string (or the text is not JSON);
otherwise the value's JSON (numbers, booleans, objects, arrays), as vLLM's glm45 parser does.
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from engine.serve.parsers.base import (
    Block,
    ToolCallParser,
    ToolStructure,
    ToolTag,
    arguments_schema,
    dumps,
    skip_ws,
)
from engine.serve.parsers.base import tool_functions as _functions

BEGIN, END = "<tool_call>", "</tool_call>"
KEY = "<arg_key>"
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN / Infinity: keep the text as a string


class Glm45Parser(ToolCallParser):
    name: ClassVar[str] = "glm45"
    begins: ClassVar[tuple[str, ...]] = (BEGIN,)

    def block(self, body: str, final: bool) -> Block:
        at = body.find(END)
        scope = body if at < 0 else body[:at]
        end = None if at < 0 else at + len(END)
        closed = end is not None or final
        start = skip_ws(scope, 0)
        cut = min((i for i in (scope.find("\n", start), scope.find(KEY, start)) if i >= 0), default=-1)
        if cut < 0 and not closed:
            return Block()  # the name is not complete yet
        name = (scope[start:] if cut < 0 else scope[start:cut]).strip()
        if not name:
            return Block(end=end, invalid=True)
        # a value without its surrounding whitespace, which the tool grammar lets the model add (and
        # GLM's template never writes): vLLM's and SGLang's glm45 parsers strip it too
        pairs = [f"{dumps(k.strip())}: {self._value(name, k.strip(), v.strip())}" for k, v in _PAIR.findall(scope)]
        # a call cut short stays open; one the output ended after a whole pair (EOS, no end marker) closes
        shut = end is not None or (final and scope.rstrip().endswith("</arg_value>"))
        args = "{" + ", ".join(pairs) + ("}" if shut else "")
        return Block(name=name, args=args, end=end)

    def _value(self, name: str, key: str, text: str) -> str:
        props = arguments_schema(self.tools.get(name, {})).get("properties") or {}
        kind = (props.get(key) or {}).get("type") if isinstance(props, dict) else None
        if kind != "string":
            try:
                return dumps(json.loads(text, parse_constant=_no_constant))
            except ValueError:
                pass
        return dumps(text)

    @classmethod
    def structure(cls, tools: list[dict[str, Any]]) -> ToolStructure:
        tags = tuple(
            ToolTag(name, f"{BEGIN}{name}\n", arguments_schema(fn), f"{END}") for name, fn in _functions(tools).items()
        )
        return ToolStructure(triggers=(BEGIN,), tags=tags, args_format="glm45_xml", separator="\n")
