"""Reasoning parsers on recorded outputs, streamed at every split; and the per-choice
pipeline (reasoning, then tool calls) that the chat endpoint runs."""

from __future__ import annotations

import json

import pytest

from engine.serve.parsers import reasoning_parser
from engine.serve.parsers.output import OutputDelta, chat_outputs
from engine.serve.parsers.tool_request import check_tools

QWEN3_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
R1_PROMPT = "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>\n"
QWEN3_OFF_PROMPT = QWEN3_PROMPT + "<think>\n\n</think>\n\n"
GLM_OFF_PROMPT = "[gMASK]<sop><|user|>\nhi<|assistant|>\n<think></think>"

# (parser, prompt, output, reasoning, content)
CASES = [
    ("qwen3", QWEN3_PROMPT, "<think>\nThe user greets.\n</think>\n\nHello!", "\nThe user greets.\n", "\n\nHello!"),
    # a <think> inside the reasoning is text, not a marker to delete
    (
        "qwen3",
        QWEN3_PROMPT,
        "<think>Should I write <think> literally? Yes.</think>Use <think> tags.",
        "Should I write <think> literally? Yes.",
        "Use <think> tags.",
    ),
    ("qwen3", QWEN3_PROMPT, "Plain answer, no thinking.  ", None, "Plain answer, no thinking.  "),
    ("qwen3", QWEN3_PROMPT, "<think>\nstill thinking when max_tokens hit", "\nstill thinking when max_tokens hit", ""),
    # the template pre-filled <think>: the output starts inside the reasoning
    ("qwen3", QWEN3_PROMPT + "<think>\n", "Let me see.\n</think>\n\n42", "Let me see.\n", "\n\n42"),
    ("deepseek-r1", R1_PROMPT, "Hmm, hi.\n</think>\n\nHello there.", "Hmm, hi.\n", "\n\nHello there."),
    ("deepseek-r1", "", "  No start marker at all</think>x", "  No start marker at all", "x"),
    ("deepseek-r1", R1_PROMPT, "<think>\nrepeated start</think>ok", "\nrepeated start", "ok"),
    # thinking turned off by the template: a closed empty block ends the prompt
    ("qwen3", QWEN3_OFF_PROMPT, "<think>not reasoning</think> ok", None, "<think>not reasoning</think> ok"),
    ("glm45", GLM_OFF_PROMPT, "\nHello.", None, "\nHello."),
    # GLM: repeated leading markers are all stripped; whitespace before them too
    (
        "glm45",
        "<|assistant|>",
        "\n<think><think>Think.\n</think>\nAnswer <think> kept\n",
        "Think.\n",
        "\nAnswer <think> kept\n",
    ),
]


@pytest.mark.parametrize(("name", "prompt", "text", "reasoning", "content"), CASES)
def test_parse_and_stream_at_every_split(
    name: str, prompt: str, text: str, reasoning: str | None, content: str
) -> None:
    parser = reasoning_parser(name)(prompt)
    assert parser.parse(text) == (reasoning, content)
    for k in range(len(text) + 1):
        stream = parser.stream()
        parts = [stream.feed(text[:k]), stream.feed(text[k:]), stream.finish()]
        assert "".join(p.reasoning for p in parts) == (reasoning or ""), f"split at {k}"
        assert "".join(p.content for p in parts) == content, f"split at {k}"
    stream = parser.stream()
    parts = [stream.feed(ch) for ch in text] + [stream.finish()]
    assert "".join(p.reasoning for p in parts) == (reasoning or "")
    assert "".join(p.content for p in parts) == content


@pytest.mark.parametrize(("text", "content"), [
    ("<think>hm</think>\n\n22", "22"),  # the grammar's gap (at most GAP_CHARS whitespace) is not content
    ("<think>hm</think>22", "22"),
    ("<think>hm</think>\n \t\n 7", " 7"),  # past the gap: the constraint's own text (its pattern allowed it)
])
def test_under_a_grammar_the_gap_after_the_reasoning_is_dropped(text: str, content: str) -> None:
    for k in range(len(text) + 1):  # the chat endpoint's per-choice pipeline, streamed at every split
        out = chat_outputs("qwen3", None, QWEN3_PROMPT, None, constrained=True)()
        parts = [out.feed(text[:k]), out.feed(text[k:]), out.finish()]
        assert "".join(p.content for p in parts) == content, f"split at {k}"
        assert "".join(p.reasoning for p in parts) == "hm"
    unconstrained = reasoning_parser("qwen3")(QWEN3_PROMPT)
    assert unconstrained.parse(text)[1] == text.split("</think>")[1]  # without a grammar, kept


def test_enable_thinking_false_means_no_reasoning() -> None:
    for name in ("qwen3", "glm45"):
        parser = reasoning_parser(name)(QWEN3_PROMPT, {"enable_thinking": False})
        assert parser.parse("<think>x</think>y") == (None, "<think>x</think>y")
    # DeepSeek-R1 always reasons: the kwarg is not its switch
    assert reasoning_parser("deepseek-r1")(R1_PROMPT, {"enable_thinking": False}).parse("a</think>b") == ("a", "b")


def test_end_marker_split_across_chunks_is_held() -> None:
    stream = reasoning_parser("qwen3")().stream()
    assert stream.feed("<thi").reasoning == ""
    first = stream.feed("nk>abc</th")
    assert (first.reasoning, first.content) == ("abc", "")
    second = stream.feed("ink>done")
    assert (second.reasoning, second.content) == ("", "done")


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def _pipeline_run(pieces: list[str], reasoning: str, choice: str = "auto") -> tuple[OutputDelta, object]:
    tools = check_tools([WEATHER], choice, None, "hermes")
    output = chat_outputs(reasoning, tools, QWEN3_PROMPT, None)()
    total = OutputDelta()
    for p in pieces:
        total.extend(output.feed(p))
    total.extend(output.finish())
    return total, output


def test_reasoning_then_tool_calls() -> None:
    """A call drafted inside the reasoning is not a call; the one after it is."""
    text = (
        '<think>Maybe <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>? Yes.</think>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bern"}}\n</tool_call>'
    )
    for k in range(0, len(text) + 1, 7):
        total, output = _pipeline_run([text[:k], text[k:]], "qwen3")
        assert total.reasoning.startswith("Maybe <tool_call>") and total.reasoning.endswith("? Yes.")
        assert total.content == "\n"
        assert [json.loads(c.arguments) for c in total.calls if c.arguments.startswith("{")] == [{"city": "Bern"}]
    message = output.message()
    assert message["content"] == "\n" and message["reasoning_content"].endswith("Yes.")
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Bern"}'}
    assert output.finish_reason("stop", check_tools([WEATHER], "auto", None, "hermes")) == "tool_calls"


def test_finish_reason_and_message_shapes() -> None:
    call = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    named = {"type": "function", "function": {"name": "get_weather"}}
    _, output = _pipeline_run([call], "")
    assert output.message() == {"role": "assistant", "content": None, "tool_calls": output.message()["tool_calls"]}
    assert output.finish_reason("length", None) == "length"
    tools = check_tools([WEATHER], named, None, "hermes")
    _, output = _pipeline_run([call], "", named)
    assert output.finish_reason("stop", tools) == "stop"  # a named tool_choice: "stop", as OpenAI
    # tool_choice none: the text is left alone
    total, output = _pipeline_run([call], "", "none")
    assert total.content == call and output.message()["content"] == call and not output.calls
    delta = OutputDelta(reasoning="r", content="c").openai_delta()
    assert delta == {"reasoning_content": "r", "content": "c"}
    # a call a stop string or max_tokens cut short: its arguments as far as they went (none: "", not a
    # made-up "{}"), and a stop string's finish is "stop", not "tool_calls"
    auto = check_tools([WEATHER], "auto", None, "hermes")
    for cut, args in (('<tool_call>{"name": "get_weather", "arguments": {"city": "Be', '{"city": "Be'),
                      ('<tool_call>{"name": "get_weather", "arguments"', "")):
        _, output = _pipeline_run([cut], "")
        assert [c.arguments for c in output.calls] == [args]
        assert output.finish_reason("stop", auto) == "stop" and output.finish_reason("length", auto) == "length"


def test_separate_reasoning_and_include_reasoning_as_sglang_and_vllm_take_them() -> None:
    """An audit: SGLang's separate_reasoning and vLLM's include_reasoning were 400s (unknown fields).
    separate_reasoning false: the reasoning parser is off for the request (chat_completions passes
    no parser), the text stays content; include_reasoning false: parsed out and left out."""
    from engine.serve.protocol import ChatCompletionRequest, decode_body

    text = "<think>Let me think.</think>\nIt is 4."
    body = b'{"messages": [], "separate_reasoning": false, "include_reasoning": null}'
    req = decode_body(body, ChatCompletionRequest)
    assert (req.separate_reasoning, req.include_reasoning) == (False, True)
    kept = chat_outputs("", None, QWEN3_PROMPT, None)()
    kept.feed(text)
    kept.finish()
    assert kept.message() == {"role": "assistant", "content": text}
    shown = chat_outputs("qwen3", None, QWEN3_PROMPT, None)()
    shown.feed(text)
    shown.finish()
    assert shown.message()["reasoning_content"] == "Let me think."
    dropped = chat_outputs("qwen3", None, QWEN3_PROMPT, None, shown=False)()
    deltas = [dropped.feed(text[:9]), dropped.feed(text[9:]), dropped.finish()]
    assert "".join(d.content for d in deltas) == shown.content and not any(d.reasoning for d in deltas)
    assert all("reasoning_content" not in d.openai_delta() for d in deltas)
    assert dropped.message() == {"role": "assistant", "content": shown.content}
    cut = chat_outputs("qwen3", None, QWEN3_PROMPT, None)()  # max_tokens inside the thinking: content null
    cut.feed("<think>Let me")
    cut.finish()
    assert cut.message() == {"role": "assistant", "content": None, "reasoning_content": "Let me"}
