"""The tools side of the chat API without a server: tool definitions and tool_choice
validated strictly, history tool calls rendered, --chat-template, the config flags."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from serve_fixtures import write_model_dir

from engine.config import ServerConfig
from engine.serve.chat import chat_prompt_ids, message_dicts, render_chat, salvage_arguments
from engine.serve.errors import ApiError
from engine.serve.parsers.tool_request import check_tools
from engine.serve.protocol import ChatCompletionRequest, check_unsupported, decode_body
from engine.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "configs" / "templates" / "smollm2-hermes-tools.jinja"
FN = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
TOOL = {"type": "function", "function": FN}


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        ([{"type": "function", "function": {"parameters": {}}}], None, "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "has space"}}], None, "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "tools[0].function.parameters"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, "tools[0].function.parameters"),
        ([{"type": "retrieval"}], None, "tools[0].type"),
        ([{"type": "function"}], None, "tools[0].function"),
        (["f"], None, "tools[0]"),
        (
            [TOOL, {"type": "function", "function": {"name": "f", "descripton": "typo"}}],
            None,
            "tools[1].function.descripton",
        ),
        ([TOOL, TOOL], None, "tools[1].function.name"),
        ([{"type": "function", "function": {"name": "f\n"}}], None, "tools[0].function.name"),  # '$' took it
        ([TOOL], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([TOOL], "sometimes", "tool_choice"),
        ([TOOL], {"type": "function"}, "tool_choice"),
        (None, "required", "tool_choice"),
        ([], {"type": "function", "function": {"name": "get_weather"}}, "tool_choice"),
    ],
)
def test_malformed_tools_are_400_naming_the_field(tools: Any, choice: Any, param: str) -> None:
    with pytest.raises(ApiError) as info:
        check_tools(tools, choice, None, "hermes")
    assert info.value.status == 400 and info.value.param == param


def test_valid_tools_and_choices() -> None:
    assert check_tools(None, None, None, "hermes") is None
    assert check_tools(None, "auto", None, "") is None
    req = check_tools([TOOL], None, None, "hermes")
    assert req is not None and req.choice == "auto" and req.parses and req.parallel
    named = check_tools(
        [TOOL, {"type": "function", "function": {"name": "b"}}],
        {"type": "function", "function": {"name": "b"}},
        False,
        "hermes",
    )
    assert named is not None and named.choice == "named" and [t["function"]["name"] for t in named.allowed] == ["b"]
    assert not named.parallel and named.make_parser().max_calls == 1
    structure = named.structure()
    assert structure is not None and [t.name for t in structure.tags] == ["b"]
    assert structure.tags[0].schema == {"type": "object"}  # no parameters: any object
    assert check_tools([TOOL], "auto", None, "hermes").structure() is None  # nothing forced


def test_forcing_a_call_needs_a_parser() -> None:
    # without --tool-call-parser, tools are only rendered into the prompt
    plain = check_tools([TOOL], "auto", None, "")
    assert plain is not None and not plain.parses
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(ApiError) as info:
            check_tools([TOOL], choice, None, "")
        assert info.value.status == 400 and "--tool-call-parser" in info.value.message


def test_tool_choice_is_no_longer_refused_by_check_unsupported() -> None:
    body = b'{"messages": [{"role": "user", "content": "x"}], "tools": [], "tool_choice": "required"}'
    check_unsupported(decode_body(body, ChatCompletionRequest))


# -- history -----------------------------------------------------------------------------


def test_salvage_arguments() -> None:
    assert salvage_arguments('{"city": "Paris"}') == {"city": "Paris"}
    assert salvage_arguments('{"city": "Paris"}\n{"junk": tr') == {"city": "Paris"}  # leading doc kept
    assert salvage_arguments('{"a": 1}}') == {"a": 1}
    assert salvage_arguments("not json at all") == "not json at all"
    assert salvage_arguments('{"half": ') == '{"half": '
    assert salvage_arguments("3 apples") == "3 apples"  # not an object: left as the text


def _messages(raw: str) -> list[Any]:
    return decode_body(b'{"messages": ' + raw.encode() + b"}", ChatCompletionRequest).messages


HISTORY = """[
  {"role": "user", "content": "Weather in Paris?"},
  {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
    "function": {"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}garbage after"}}]},
  {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
  {"role": "assistant", "tool_calls": [{"id": "call_2", "type": "function",
    "function": {"name": "get_weather", "arguments": "not json"}}]},
  {"role": "tool", "tool_call_id": "call_2", "content": "?"}
]"""


@pytest.fixture(scope="module")
def tools_tok(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - TextTokenizer
    model = write_model_dir(tmp_path_factory.mktemp("tools"))
    tok = load_tokenizer(str(model), str(TEMPLATE))
    assert tok is not None
    return tok


def test_history_with_tool_calls_renders(tools_tok) -> None:
    msgs = message_dicts(_messages(HISTORY))
    assert msgs[1]["content"] == ""  # null content of a tool-calling turn, as vLLM renders it
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert msgs[3]["tool_calls"][0]["function"]["arguments"] == "not json"
    text = render_chat(tools_tok, msgs, [TOOL])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "garbage" not in text and '"arguments": not json}' in text
    assert "<tools>\n" + '{"type": "function"' in text and "<tool_response>\nsunny, 21C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_malformed_history_call_is_400() -> None:
    with pytest.raises(ApiError) as info:
        message_dicts(_messages('[{"role": "assistant", "content": null, "tool_calls": [{"id": "x"}]}]'))
    assert info.value.status == 400 and info.value.param == "messages[0].tool_calls[0]"


def test_template_type_error_is_400(tmp_path: Path) -> None:
    # `tojson` of an Undefined attribute raises TypeError inside jinja, not a TemplateError
    path = tmp_path / "bad.jinja"
    path.write_text("{% for m in messages %}{{ m.nothing | tojson }}{% endfor %}")
    tok = load_tokenizer(str(write_model_dir(tmp_path / "m")), str(path))
    assert tok is not None
    with pytest.raises(ApiError) as info:
        chat_prompt_ids(tok, _messages('[{"role": "user", "content": "hi"}]'))
    assert info.value.status == 400 and "chat template failed" in info.value.message


# -- --chat-template and the config ------------------------------------------------------


def test_chat_template_file_replaces_the_models(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}>>")
    tok = load_tokenizer(str(write_model_dir(tmp_path / "m")), str(path))
    assert tok is not None and render_chat(tok, [{"role": "user", "content": "hi"}]) == "[user] hi\n>>"
    path.write_text("{% for m in messages %}")  # does not compile: a startup error, not a 400 per request
    with pytest.raises(ValueError, match="does not compile"):
        load_tokenizer(str(write_model_dir(tmp_path / "m2")), str(path))


def test_config_fields(tmp_path: Path) -> None:
    cfg = ServerConfig(tool_call_parser="hermes", reasoning_parser="qwen3", chat_template=str(TEMPLATE))
    assert Path(cfg.chat_template).is_absolute()
    assert ServerConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="tool-call-parser"):
        ServerConfig(tool_call_parser="mistral-ish")
    with pytest.raises(ValueError, match="reasoning-parser"):
        ServerConfig(reasoning_parser="o1")
    with pytest.raises(ValueError, match="no such file"):
        ServerConfig(chat_template=str(tmp_path / "missing.jinja"))


def test_parser_registry_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, engine.config, engine.serve.parsers; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_a_requests_own_chat_template(tmp_path: Path) -> None:
    """vLLM's per-request chat_template: refused unless the server trusts it, refused empty or when it
    does not compile (400s naming chat_template), else rendered in place of the model's, also for a
    model that has none."""
    from engine.serve.chat import chat_text, request_template

    own = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}>>{% endif %}"
    for template, trusted, says in ((own, False, "--trust-request-chat-template"), ("  ", True, "empty"),
                                    ("{% for m in messages %}", True, "does not compile")):
        with pytest.raises(ApiError) as info:
            request_template(template, trusted)
        assert info.value.status == 400 and info.value.param == "chat_template" and says in info.value.message
    assert request_template(None, False) is None and request_template(own, True) == own
    msgs = _messages('[{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]')
    for model in (write_model_dir(tmp_path / "m"), write_model_dir(tmp_path / "plain", chat_template=None)):
        tok = load_tokenizer(str(model))
        assert tok is not None
        assert chat_text(tok, msgs, template=own) == "<system>s<user>hi>>"
    tok = load_tokenizer(str(write_model_dir(tmp_path / "m3")))
    assert tok is not None and chat_text(tok, msgs) != chat_text(tok, msgs, template=own)  # the model's otherwise
