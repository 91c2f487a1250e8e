"""/v1/responses without a server: the request mapped onto the chat's (messages, tools, formats),
what it cannot take named in a 400, and the streamed items equal to the whole answer's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from serve_fixtures import write_model_dir

from engine.serve.chat import chat_prompt
from engine.serve.errors import ApiError
from engine.serve.parsers.output import chat_outputs
from engine.serve.parsers.tool_request import check_tools
from engine.serve.protocol import ChatCompletionRequest, ResponsesRequest, decode_body
from engine.serve.responses import _Events, _Items, _items, chat_request
from engine.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "configs" / "templates" / "smollm2-hermes-tools.jinja"
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}}


def _req(**body: Any) -> ResponsesRequest:
    return decode_body(json.dumps(body).encode(), ResponsesRequest)


def _chat(**body: Any) -> ChatCompletionRequest:
    return decode_body(json.dumps(body).encode(), ChatCompletionRequest)


def test_input_items_become_the_chat_messages(tmp_path: Path) -> None:
    """Instructions, message items (developer as system, text parts joined), function calls (two in a
    row in one assistant turn) and their outputs render the prompt the same chat messages render;
    reasoning items are left out."""
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                        {"type": "input_text", "text": "Paris and Rome?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "rain"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny in Paris, rain in Rome."}]},
        {"role": "user", "content": "Thanks"},
    ]
    tools = [{"type": "function", "name": "get_weather", "description": "Weather now", "parameters": PARAMS}]
    got = chat_request(_req(input=items, instructions="You answer weather questions.", tools=tools,
                            tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=7,
                            temperature=0.5, top_p=0.9, top_k=5, seed=3, parallel_tool_calls=False))
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "get_weather", "arguments": f'{{"city": "{c}"}}'}}
             for i, c in ((1, "Paris"), (2, "Rome"))]
    want = _chat(messages=[
        {"role": "system", "content": "You answer weather questions."},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "assistant", "content": "Sunny in Paris, rain in Rome."},
        {"role": "user", "content": "Thanks"},
    ], tools=[{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                                "parameters": PARAMS}}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_completion_tokens=7,
        temperature=0.5, top_p=0.9, top_k=5, seed=3, parallel_tool_calls=False)
    assert got == want
    tok = load_tokenizer(str(write_model_dir(tmp_path / "m")), str(TEMPLATE))
    assert tok is not None
    text, ids = chat_prompt(tok, got.messages, got.tools)
    assert (text, ids) == chat_prompt(tok, want.messages, want.tools)
    assert "<tool_response>\nrain\n</tool_response>" in text and "Be brief." in text
    assert chat_request(_req(input="hi")).messages == _chat(messages=[{"role": "user", "content": "hi"}]).messages


def test_formats_and_effort_map_to_the_chats() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    form = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    got = chat_request(_req(input="x", text={"format": form, "verbosity": "low"}, reasoning={"effort": "low"}))
    assert got.response_format == {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema,
                                                                          "strict": True}}
    assert got.reasoning_effort == "low"
    assert chat_request(_req(input="x", text={"format": {"type": "json_object"}})).response_format == {
        "type": "json_object"}
    assert chat_request(_req(input="x", text={"format": {"type": "text"}})).response_format is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning"),
        ({"input": [{"type": "message", "role": "critic", "content": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
        ({"input": [{"role": "user", "content": "x"}, {"type": "web_search_call"}]}, "input"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input"),  # no call_id
        ({"input": ["hi"]}, "input[0]"),  # (msgspec names the element)
        ({"input": []}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"text": {"format": {"type": "grammar"}}}, "text"),
        ({"text": {"fromat": {"type": "text"}}}, "text"),
    ],
)
def test_what_it_cannot_take_is_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as info:
        chat_request(_req(**{"input": "x", **body}))
    assert info.value.status == 400 and info.value.param == param


def test_unknown_fields_are_refused() -> None:
    with pytest.raises(ApiError) as info:
        _req(input="x", max_tokens=5)  # the chat's name, not this endpoint's
    assert info.value.status == 400 and "max_tokens" in info.value.message
    chat_request(_req(input="x", include=["reasoning.encrypted_content"], store=True, metadata={"k": "v"}))


def _stream_items(text: str, step: int, new_output) -> list[dict[str, Any]]:  # noqa: ANN001
    """The items _Items builds from `text` fed `step` characters at a time, and its events' types."""
    output = new_output()
    items = _Items(_Events())
    events: list[bytes] = []
    for i in range(0, len(text), step):
        events += items.feed(output.feed(text[i : i + step]))
    events += items.feed(output.finish()) + items.close("stop")
    kinds = [json.loads(e.split(b"\ndata: ", 1)[1])["type"] for e in events]
    seqs = [json.loads(e.split(b"\ndata: ", 1)[1])["sequence_number"] for e in events]
    assert seqs == list(range(len(events)))
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == len(items.items)
    return items.items


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_streamed_items_are_the_whole_answers(step: int) -> None:
    """Reasoning, text and two calls (the qwen3 reasoning parser, hermes calls), streamed in pieces of
    any size: the closed items are the non-streamed answer's, in its order (ids aside)."""
    tools = check_tools([{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}], "auto",
                        None, "hermes")
    new_output = chat_outputs("qwen3", tools, "<|im_start|>assistant\n", None)
    text = ("<think>Two cities.</think>Checking both.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
            "{\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
            "{\"city\": \"Rome\"}}\n</tool_call>")
    whole = new_output()
    whole.feed(text)
    whole.finish()
    want = _items(whole, "stop")
    got = _stream_items(text, step, new_output)

    def strip(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in it.items() if k not in ("id", "call_id")} for it in items]

    assert [it["type"] for it in want] == ["reasoning", "message", "function_call", "function_call"]
    assert strip(got) == strip(want)
    assert json.loads(got[3]["arguments"]) == {"city": "Rome"}
    plain = chat_outputs("", None, "", None)
    assert strip(_stream_items("Just text.", step, plain)) == strip(_items(_whole(plain, "Just text."), "stop"))


def _whole(new_output, text: str):  # noqa: ANN001, ANN202
    out = new_output()
    out.feed(text)
    out.finish()
    return out


def test_the_chats_errors_name_this_bodys_fields() -> None:
    """A chat check's 400 names the field the client sent: a tool's name, max_output_tokens, text."""
    from engine.serve.responses import _as_sent

    chat = chat_request(_req(input="x", tools=[{"type": "function", "name": "has space"}]))
    with pytest.raises(ApiError) as info:
        check_tools(chat.tools, chat.tool_choice, None, "hermes")
    assert info.value.param == "tools[0].function.name" and _as_sent(info.value).param == "tools[0].name"
    for chat_name, sent in (("max_completion_tokens", "max_output_tokens"), ("response_format", "text"),
                            ("messages[2].content", "input"), ("temperature", "temperature")):
        exc = _as_sent(ApiError(400, f"{chat_name} is wrong", chat_name))
        assert (exc.param, exc.message) == (sent, f"{sent} is wrong" if sent != "input" else f"{chat_name} is wrong")


def test_logprobs_are_asked_by_include_or_top_logprobs() -> None:
    assert not chat_request(_req(input="x")).logprobs
    got = chat_request(_req(input="x", include=["message.output_text.logprobs"]))
    assert got.logprobs and got.top_logprobs is None
    got = chat_request(_req(input="x", top_logprobs=3))
    assert got.logprobs and got.top_logprobs == 3
