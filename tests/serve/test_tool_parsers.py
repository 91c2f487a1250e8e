"""Tool-call parsers on recorded model outputs, non-streamed and streamed split at every
character boundary (the streamed pieces must add up to the non-streamed result)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.serve.parsers import TOOL_CALL_PARSERS, tool_call_parser
from engine.serve.parsers.base import ToolCallParser, ToolDelta

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "object"}}},
    },
}
TOOLS = [WEATHER, TIME, SEARCH]

Calls = list[tuple[str, dict[str, Any]]]

# (parser, model output, expected content, expected calls)
CASES: list[tuple[str, str, str, Calls]] = [
    # Hermes / Qwen2.5 / Qwen3
    (
        "hermes",
        'Let me check the weather.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
        "\n</tool_call>",
        "Let me check the weather.\n",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": {"query": "a \\"quoted\\" } brace {", '
        '"filters": {"lang": ["en", "fr"], "n": 2.5e1, "ok": true, "x": null}}}\n</tool_call>',
        "",
        [
            ("get_weather", {"city": "Tokyo"}),
            ("get_time", {}),
            (
                "search",
                {"query": 'a "quoted" } brace {', "filters": {"lang": ["en", "fr"], "n": 25.0, "ok": True, "x": None}},
            ),
        ],
    ),
    (  # arguments before the name: held until the name is known, then sent whole
        "hermes",
        '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call>',
        "",
        [("get_weather", {"city": "Oslo"})],
    ),
    (  # double-encoded arguments (a JSON string) are unwrapped
        "hermes",
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>',
        "",
        [("get_weather", {"city": "Rome"})],
    ),
    (  # a function the request did not declare: the block stays content, verbatim
        "hermes",
        'Hmm. <tool_call>\n{"name": "launch_rockets", "arguments": {"n": 3}}\n</tool_call> '
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\nDone.',
        'Hmm. <tool_call>\n{"name": "launch_rockets", "arguments": {"n": 3}}\n</tool_call> \nDone.',
        [("get_time", {})],
    ),
    ("hermes", "No tools needed: 3 < 4 and <tool is not a marker. Non-ASCII: é 🚀", None, []),
    ("hermes", "<tool_call>this is not json</tool_call> ok", "<tool_call>this is not json</tool_call> ok", []),
    # Llama 3.x JSON
    (
        "llama3",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima", "days": 2}}',
        "",
        [("get_weather", {"city": "Lima", "days": 2})],
    ),
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Lima"}}; {"name": "get_time", "parameters": {}}',
        "",
        [("get_weather", {"city": "Lima"}), ("get_time", {})],
    ),
    ("llama3", 'The answer is {"name": "get_time", "parameters": {}}', None, []),
    ("llama3", '{"city": "Lima", "temp": 21}', None, []),
    ("llama3", '{"name": "launch_rockets", "parameters": {}}', None, []),
    # DeepSeek-V3
    (
        "deepseek_v3",
        "I'll look both up.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Cairo", "days": 1}\n```<｜tool▁call▁end｜>\n'
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n"
        '```json\n{"query": "pyramids ``` fence", "filters": {}}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "I'll look both up.",
        [("get_weather", {"city": "Cairo", "days": 1}), ("search", {"query": "pyramids ``` fence", "filters": {}})],
    ),
    (
        "deepseek_v3",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>nope\n```json\n{}\n```<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜>",
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>nope\n```json\n{}\n```<｜tool▁call▁end｜>",
        [],
    ),
    (
        "deepseek_v31",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Kyiv"}<｜tool▁call▁end｜>'
        "<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "",
        [("get_weather", {"city": "Kyiv"}), ("get_time", {})],
    ),
    # GLM-4.5
    (
        "glm45",
        "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New York</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>zip</arg_key>\n<arg_value>10001</arg_value>\n"
        "</tool_call>\n<tool_call>get_time\n</tool_call>",
        "Checking.\n",
        [("get_weather", {"city": "New York", "days": 3, "zip": "10001"}), ("get_time", {})],
    ),
    (
        "glm45",
        '<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>line one\nline "two"</arg_value>\n'
        '<arg_key>filters</arg_key>\n<arg_value>{"site": "x.org", "n": 2}</arg_value>\n</tool_call>',
        "",
        [("search", {"query": 'line one\nline "two"', "filters": {"site": "x.org", "n": 2}})],
    ),
    (  # padding the grammar allows around a value (xgrammar's glm45_xml) is not the value's
        "glm45",
        "<tool_call>get_weather\n<arg_key> city </arg_key>\n<arg_value>  Paris \n\n</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>\n3\n</arg_value>\n</tool_call>",
        "",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    (
        "glm45",
        "<tool_call>rm_rf\n<arg_key>path</arg_key>\n<arg_value>/</arg_value>\n</tool_call>",
        "<tool_call>rm_rf\n<arg_key>path</arg_key>\n<arg_value>/</arg_value>\n</tool_call>",
        [],
    ),
    # an audit: raw control characters inside a call's strings (models write them; the client's
    # json.loads, as in test_parse_and_stream_at_every_split, refuses them unescaped)
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\nris\t", "zip": "a\\"\x01"}}\n</tool_call>',
        "",
        [("get_weather", {"city": "Pa\nris\t", "zip": 'a"\x01'})],
    ),
    (
        "deepseek_v3",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Ca\nIro"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "",
        [("get_weather", {"city": "Ca\nIro"})],
    ),
]


def _streamed(parser: ToolCallParser, pieces: list[str]) -> tuple[ToolDelta, list[ToolDelta]]:
    stream = parser.stream()
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    total = ToolDelta()
    for d in deltas:
        total.extend(d)
    return total, deltas


def _check_deltas(deltas: list[ToolDelta], calls: Calls) -> None:
    """Each call starts with its id and name, then only argument fragments; ids unique."""
    seen: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for c in d.calls:
            if c.index not in seen:
                assert c.name is not None and c.id is not None and c.id.startswith("call_")
                assert c.index == len(seen)  # calls are numbered in order
                seen[c.index] = {"name": c.name, "args": c.arguments}
            else:
                assert c.name is None and c.id is None
                seen[c.index]["args"] += c.arguments
    assert [(s["name"], json.loads(s["args"])) for s in seen.values()] == calls


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_parse_and_stream_at_every_split(name: str, text: str, content: str | None, calls: Calls) -> None:
    cls = tool_call_parser(name)
    got_content, got_calls = cls(TOOLS).parse(text)
    assert got_content == (text if content is None else content)
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert len({c.id for c in got_calls}) == len(got_calls)
    expected = [(c.name, c.arguments) for c in got_calls]
    for k in range(len(text) + 1):
        total, deltas = _streamed(cls(TOOLS), [text[:k], text[k:]])
        assert total.content == got_content, f"split at {k}"
        _check_deltas(deltas, calls)
    # one character at a time: a marker is always split across chunks
    stream = cls(TOOLS).stream()
    deltas = [stream.feed(ch) for ch in text] + [stream.finish()]
    assert "".join(d.content for d in deltas) == got_content
    assert [(c.name, c.arguments) for c in stream.calls] == expected
    _check_deltas(deltas, calls)


def test_names_come_before_arguments_finish() -> None:
    """The name is sent as soon as it is complete, long before the call ends."""
    text = '<tool_call>\n{"name": "search", "arguments": {"query": "' + "x" * 50 + '"}}\n</tool_call>'
    stream = tool_call_parser("hermes")(TOOLS).stream()
    cut = text.index('"arguments"')
    first = stream.feed(text[:cut])
    assert [(c.name, c.arguments) for c in first.calls] == [("search", "")]
    middle = stream.feed(text[cut : cut + 40])
    assert middle.calls and middle.calls[0].name is None and middle.calls[0].arguments.startswith("{")


def test_marker_prefix_is_held_then_released() -> None:
    stream = tool_call_parser("hermes")(TOOLS).stream()
    assert stream.feed("a <tool_").content == "a "
    assert stream.feed("box> b").content == "<tool_box> b"
    assert stream.finish().content == ""


def test_whitespace_after_calls_is_dropped_but_content_kept() -> None:
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n\n'
    assert tool_call_parser("hermes")(TOOLS).parse(text)[0] == ""
    text2 = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n\nThat is all.'
    assert tool_call_parser("hermes")(TOOLS).parse(text2)[0] == "\n\nThat is all."


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    content, calls = tool_call_parser("hermes")(TOOLS, max_calls=1).parse(text)
    assert content == "" and [c.name for c in calls] == ["get_weather"]


def test_truncated_call_keeps_what_was_streamed() -> None:
    """Output cut by max_tokens inside a call: the call holds the arguments sent so far
    (streamed and non-streamed agree; the arguments are not valid JSON then)."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    content, calls = tool_call_parser("hermes")(TOOLS).parse(text)
    assert content == "" and calls[0].name == "get_weather" and calls[0].arguments == '{"city": "Par'
    # cut before the name is complete: that is content
    assert tool_call_parser("hermes")(TOOLS).parse('<tool_call>{"na')[0] == '<tool_call>{"na'


@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
def test_forced_choice_drops_a_call_cut_before_its_name(name: str) -> None:
    """Under tool_choice required / named (the grammar allows calls only) an output that ends
    (max_tokens) inside a block whose name is not complete drops that block: no markup reaches
    the content, streamed at every split or not; the calls before it stay. Without a forced
    choice the unfinished block is content, as before."""
    parser = tool_call_parser(name)
    whole = parser.structure([WEATHER]).tags[0]
    text = whole.begin + '{"city": "Paris"}' + whole.end
    at = whole.begin.index("get_weather")
    trigger = parser.structure([WEATHER]).triggers[0]
    for cut in (trigger, trigger[: max(1, len(trigger) // 2)], whole.begin[:at], whole.begin[: at + 3]):
        out = text + cut
        content, calls = parser(TOOLS, forced=True).parse(out)
        assert content == "" and [c.name for c in calls] == ["get_weather"], (name, out, content)
        for i in range(len(out) + 1):
            stream = parser(TOOLS, forced=True).stream()
            parts = [stream.feed(out[:i]), stream.feed(out[i:]), stream.finish()]
            assert "".join(p.content for p in parts) == "", (name, out, i)


def test_named_tool_choice_forces_one_call() -> None:
    """A named tool_choice means one call of that function (OpenAI's and vLLM's meaning): its
    grammar stops after the first call and its parser keeps only that one, whatever
    parallel_tool_calls says (the model used to repeat the call until max_tokens)."""
    from engine.serve.grammar import tools_format
    from engine.serve.parsers.tool_request import check_tools

    named = {"type": "function", "function": {"name": "get_weather"}}
    for parallel in (None, True):
        req = check_tools(TOOLS, named, parallel, "hermes")
        assert req is not None and not req.parallel and req.make_parser().max_calls == 1
        assert tools_format(req.structure(), req.parallel)["stop_after_first"] is True
    required = check_tools(TOOLS, "required", None, "hermes")
    assert required is not None and required.parallel and required.make_parser().max_calls is None


def test_ids_differ_across_responses() -> None:
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    a = tool_call_parser("hermes")(TOOLS).parse(text)[1][0].id
    b = tool_call_parser("hermes")(TOOLS).parse(text)[1][0].id
    assert a != b and len(a) == len("call_") + 24


@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
def test_structure_renders_calls_the_parser_reads(name: str) -> None:
    """The grammar contract: prefix + begin + arguments JSON + end (+ separator + ...) +
    suffix, as a grammar would force it, parses back into the same calls."""
    cls = tool_call_parser(name)
    st = cls.structure([WEATHER, TIME])
    assert [t.name for t in st.tags] == ["get_weather", "get_time"]
    assert st.tags[0].schema == WEATHER["function"]["parameters"]
    assert all(any(t.begin.startswith(tr) for tr in st.triggers) for t in st.tags)
    args = [{"city": "Paris", "days": 2}, {}]
    if st.args_format == "json":
        bodies = [json.dumps(a) for a in args]
    else:
        assert st.args_format == "glm45_xml"
        bodies = ["".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in a.items()) for a in args]
    text = st.prefix + st.separator.join(t.begin + b + t.end for t, b in zip(st.tags, bodies, strict=True)) + st.suffix
    content, calls = cls([WEATHER, TIME]).parse(text)
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", args[0]), ("get_time", {})]


def test_arguments_that_are_not_an_object_are_their_json() -> None:
    """An audit: "arguments": "Paris" gave the bare text Paris and null gave "null" with finish "stop";
    any value is its JSON (vLLM's json.dumps), a string holding an object is that object, and each
    such finished call is a tool call."""
    from engine.serve.parsers.output import _whole_json

    for value, args in (('"Paris"', '"Paris"'), ("null", "null"), ("[1, 2]", "[1, 2]"),
                        ('"{\\"city\\": \\"Oslo\\"}"', '{"city": "Oslo"}')):
        text = '<tool_call>{"name": "get_weather", "arguments": ' + value + "}</tool_call>"
        _, calls = tool_call_parser("hermes")(TOOLS).parse(text)
        assert [c.arguments for c in calls] == [args] and _whole_json(args), value


def test_glm45_call_the_output_ended_after_a_whole_pair_is_closed() -> None:
    """An audit: EOS after a whole pair with no </tool_call> left the arguments open ({"city": "Paris")."""
    text = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
    _, calls = tool_call_parser("glm45")(TOOLS).parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    _, cut = tool_call_parser("glm45")(TOOLS).parse(text + "<arg_key>da")  # cut inside a pair: open
    assert cut[0].arguments == '{"city": "Paris"'
