"""One choice's output text through the reasoning parser, then the tool-call parser.

Tool calls are only looked for in the content, never inside the reasoning (a model that
drafts a call while thinking has not made it).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.serve.parsers import reasoning_parser
from engine.serve.parsers.base import ToolCall, ToolCallDelta, ToolDelta, ToolStream
from engine.serve.parsers.reasoning import GAP_CHARS, ReasoningParser, ReasoningStream
from engine.serve.parsers.tool_request import ToolRequest


@dataclass
class OutputDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: OutputDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        calls = ToolDelta(calls=self.calls)
        calls.extend(ToolDelta(calls=other.calls))
        self.calls = calls.calls

    def openai_delta(self) -> dict[str, Any]:
        """The chat chunk's `delta` (only the keys with something in them)."""
        out: dict[str, Any] = {}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.content:
            out["content"] = self.content
        if self.calls:
            out["tool_calls"] = [c.to_openai() for c in self.calls]
        return out


def _whole_json(text: str) -> bool:
    """Whether a call's arguments are whole JSON (a finished call's always are; one a stop string
    cut short is not)."""
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class ChatOutput:
    """Incremental parse of one choice: `feed` text deltas, `finish` once at the end."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolRequest | None, shown: bool = True) -> None:
        self._reasoning: ReasoningStream | None = reasoning.stream() if reasoning else None
        self._shown = shown  # False: the reasoning is parsed out and dropped (vLLM's include_reasoning false)
        self._tools: ToolStream | None = tools.make_parser().stream() if tools and tools.parses else None
        self.reasoning_text = ""
        self.content = ""

    @property
    def calls(self) -> list[ToolCall]:
        return self._tools.calls if self._tools else []

    @property
    def reasoned(self) -> bool:
        return self._reasoning is not None and self._reasoning.reasoned

    def feed(self, text: str) -> OutputDelta:
        return self._step(text, final=False)

    def finish(self) -> OutputDelta:
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> OutputDelta:
        out = OutputDelta()
        content = text
        if self._reasoning is not None:
            r = self._reasoning.finish() if final else self._reasoning.feed(text)
            out.reasoning, content = r.reasoning, r.content
        if self._tools is not None:
            t = self._tools.feed(content)
            if final:
                t.extend(self._tools.finish())
            out.content, out.calls = t.content, t.calls
        else:
            out.content = content
        self.reasoning_text += out.reasoning
        self.content += out.content
        if not self._shown:
            out.reasoning = ""
        return out

    def finish_reason(self, reason: str | None, tools: ToolRequest | None) -> str | None:
        """OpenAI's: "tool_calls" when the model stopped after calling tools, except for
        a named tool_choice ("stop", as OpenAI answers it), and except where a stop string cut
        a call short (its arguments are not whole JSON: "stop", what ended it)."""
        if (reason == "stop" and self.calls and not (tools and tools.choice == "named")
                and all(_whole_json(c.arguments) for c in self.calls)):
            return "tool_calls"
        return reason

    def message(self) -> dict[str, Any]:
        """The non-streaming `message` of this choice (call after `finish`)."""
        # no content: null beside tool calls or reasoning (an answer cut inside its thinking), as vLLM
        # and SGLang give it; "" only for an answer that is really empty
        empty = None if self.calls or self.reasoned else ""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or empty}
        if self._reasoning is not None and self._shown:
            msg["reasoning_content"] = self.reasoning_text if self.reasoned else None
        if self.calls:
            msg["tool_calls"] = [c.to_openai() for c in self.calls]
        return msg


def chat_outputs(
    reasoning: str, tools: ToolRequest | None, prompt: str, template_kwargs: dict[str, Any] | None,
    constrained: bool = False, shown: bool = True,
) -> Callable[[], ChatOutput]:
    """A maker of one ChatOutput per choice of a request: `reasoning` is the server's
    --reasoning-parser ("" for none: the reasoning stays in the content), `prompt` the rendered
    prompt text (a pre-filled `<think>` at its end means the output starts inside the reasoning);
    `constrained`: a grammar follows the reasoning (the whitespace gap it allows is not content);
    `shown` False: the reasoning is dropped from the answer."""
    gap = GAP_CHARS if constrained else 0
    parser = reasoning_parser(reasoning)(prompt, template_kwargs, gap) if reasoning else None
    return lambda: ChatOutput(parser, tools, shown)
