"""Reasoning parsers: `<think>...</think>` becomes `reasoning_content`, the rest `content`.

Rules (each a bug some production parser had):

* Only LEADING start markers are stripped (a run of them, whitespace between allowed). A
  `<think>` inside the reasoning or the content is text the model wrote and stays.
* Whitespace the model produced is kept, in the reasoning and in the content: nothing is
  stripped except the markers themselves and whitespace before a leading start marker.
* Where the prompt already ends with the start marker (a template that pre-fills
  `<think>`, as DeepSeek-R1's and Qwen3-2507-thinking's do), the output starts inside the
  reasoning. DeepSeek-R1 is always read that way: its older templates did not pre-fill.
* Thinking turned off: `chat_template_kwargs` {"enable_thinking": false} for formats that
  take it (qwen3, glm45), or a prompt that ends with the end marker (those templates
  close an empty think block when thinking is off): the whole output is content.
* An output that ends inside the reasoning (no end marker) is all reasoning.
* Under a grammar (json_schema, regex, ebnf, a forced tool call) the constraint starts after the
  end marker and a gap of at most GAP_CHARS whitespace characters the grammar allows there
  (engine/serve/grammar.py, `with_reasoning`): that gap is dropped from the content, which is then
  exactly what the constraint matched (a `[0-9]+` regex's content began "\n\n" before).

The stream holds back only text that could still be a marker, so a marker split across
chunks works and nothing is taken back; `parse` runs the same stream over the whole text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from engine.serve.parsers.base import partial_marker, skip_ws

GAP_CHARS = 4  # whitespace a grammar allows between the end marker and its constraint


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """One request's reasoning format; `stream()` makes a parser per choice."""

    name: ClassVar[str] = ""
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    always_reasons: ClassVar[bool] = False  # the output starts inside reasoning, marker or not
    thinking_kwarg: ClassVar[str | None] = "enable_thinking"  # the template kwarg that turns it off

    def __init__(self, prompt: str = "", template_kwargs: dict[str, Any] | None = None, gap: int = 0) -> None:
        tail = prompt.rstrip()
        kwargs = template_kwargs or {}
        off = self.thinking_kwarg is not None and kwargs.get(self.thinking_kwarg) is False
        self.enabled = not off and not tail.endswith(self.end)
        self.starts_inside = self.always_reasons or tail.endswith(self.start)
        self.gap = gap  # GAP_CHARS where a grammar constrains the content (its whitespace gap is dropped)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)

    def parse(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None when the output has none, content)."""
        stream = self.stream()
        a, b = stream.feed(text), stream.finish()
        return (a.reasoning + b.reasoning if stream.reasoned else None), a.content + b.content


class DeepSeekR1Reasoning(ReasoningParser):
    name: ClassVar[str] = "deepseek-r1"
    always_reasons: ClassVar[bool] = True
    thinking_kwarg: ClassVar[str | None] = None  # R1 always thinks


class Qwen3Reasoning(ReasoningParser):
    name: ClassVar[str] = "qwen3"


class Glm45Reasoning(ReasoningParser):
    name: ClassVar[str] = "glm45"


class ReasoningStream:
    """Phases: "start" (are there leading start markers?), "reasoning", "content"."""

    def __init__(self, parser: ReasoningParser) -> None:
        self._p = parser
        self._buf = ""
        self._pos = 0
        self._phase = "start" if parser.enabled else "content"
        self.reasoned = False  # a reasoning phase happened (reasoning_content is not None)
        self._gap = 0  # gap whitespace still to drop (after the end marker, under a grammar)

    def feed(self, text: str) -> ReasoningDelta:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> ReasoningDelta:
        return self._run(final=True)

    def _run(self, final: bool) -> ReasoningDelta:
        out = ReasoningDelta()
        if self._phase == "start":
            self._start(final)
        if self._phase == "reasoning":
            self._reasoning(out, final)
        if self._phase == "content":
            while self._gap and self._pos < len(self._buf) and self._buf[self._pos] in " \t\n":
                self._pos, self._gap = self._pos + 1, self._gap - 1
            if self._pos < len(self._buf):
                self._gap = 0  # the constraint's own text has begun
            out.content += self._buf[self._pos :]
            self._pos = len(self._buf)
        return out

    def _start(self, final: bool) -> None:
        start, buf = self._p.start, self._buf
        i, stripped = 0, False
        while buf.startswith(start, j := skip_ws(buf, i)):
            i, stripped = j + len(start), True
        rest = buf[i:].lstrip()
        if not final and start.startswith(rest) and rest != start:
            return  # nothing but whitespace and maybe part of a marker: undecided
        if stripped or self._p.starts_inside:
            self._phase, self._pos, self.reasoned = "reasoning", i, True
        else:
            self._phase = "content"

    def _reasoning(self, out: ReasoningDelta, final: bool) -> None:
        end = self._p.end
        at = self._buf.find(end, self._pos)
        if at >= 0:
            out.reasoning += self._buf[self._pos : at]
            self._pos, self._phase, self._gap = at + len(end), "content", self._p.gap
            return
        upto = len(self._buf) if final else len(self._buf) - partial_marker(self._buf, self._pos, (end,))
        out.reasoning += self._buf[self._pos : upto]
        self._pos = max(self._pos, upto)
