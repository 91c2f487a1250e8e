"""Chat templates: rendering, tokenization, and every failure as a 400."""

from __future__ import annotations

from pathlib import Path

import pytest
from serve_fixtures import write_model_dir

from engine.serve.chat import chat_prompt, chat_prompt_ids, message_dicts, render_chat
from engine.serve.errors import ApiError
from engine.serve.protocol import ChatCompletionRequest, decode_body
from engine.serve.validate import Limits
from engine.tokenizer import has_tokenizer_files, load_tokenizer


def _messages(body: bytes):  # noqa: ANN202
    return decode_body(b'{"messages": ' + body + b"}", ChatCompletionRequest).messages


def test_messages_too_long_for_the_context_are_refused_untokenized(text_tok) -> None:
    """The rendered text's length alone proves it cannot fit: a 400 on `messages`, as its count's."""
    limits = Limits(max_context=64, vocab_size=49152)
    content = "a" * (64 * text_tok.max_piece_chars)
    msgs = _messages(b'[{"role": "user", "content": "%s"}]' % content.encode())
    with pytest.raises(ApiError) as info:
        chat_prompt(text_tok, msgs, None, None, limits)
    assert info.value.status == 400 and info.value.param == "messages"
    assert "the messages have at least" in info.value.message
    text, ids = chat_prompt(text_tok, msgs)  # without limits: tokenized as before
    assert len(ids) > 64 and content in text


def test_renders_with_generation_prompt(text_tok) -> None:
    msgs = message_dicts(_messages(b'[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]'))
    text = render_chat(text_tok, msgs)
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_prompt_ids_do_not_add_special_tokens_twice(text_tok) -> None:
    msgs = _messages(b'[{"role": "user", "content": "hello"}]')
    ids = chat_prompt_ids(text_tok, msgs)
    text = render_chat(text_tok, message_dicts(msgs))
    assert ids == text_tok.encode(text, add_special_tokens=False)
    assert text_tok.decode(ids, skip_special_tokens=False) == text


def test_text_parts_are_joined(text_tok) -> None:
    msgs = _messages(b'[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]')
    assert message_dicts(msgs)[0]["content"] == "a\nb"


@pytest.mark.parametrize("content", [b'"content": null, ', b""])
def test_a_tool_calling_turn_without_content_renders(default_model_dir, content: bytes) -> None:
    """The OpenAI agent loop's shape: an assistant turn with tool_calls and null (or no) content,
    then the tool's answer. The default model's template prints message['content']: "" there."""
    msgs = _messages(b'[{"role": "user", "content": "weather?"}, {"role": "assistant", ' + content
                     + b'"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", '
                     b'"arguments": "{\\"city\\": \\"Paris\\"}"}}]}, '
                     b'{"role": "tool", "tool_call_id": "c1", "content": "sunny"}]')
    dicts = message_dicts(msgs)
    assert dicts[1]["content"] == "" and dicts[1]["tool_calls"]
    tok = load_tokenizer(str(default_model_dir))
    assert tok is not None
    text = render_chat(tok, dicts)
    assert "weather?" in text and "sunny" in text


def test_generation_prompt_off_and_continue_final_message(text_tok) -> None:
    """vLLM's chat extensions: no generation prompt, or the final (assistant) message left open."""
    convo = _messages(b'[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]')
    msgs = message_dicts(convo)
    closed = render_chat(text_tok, msgs, add_generation_prompt=False)
    assert closed.endswith("<|im_start|>assistant\nThe answer is<|im_end|>\n")
    open_ = render_chat(text_tok, msgs, add_generation_prompt=False, continue_final_message=True)
    assert open_.endswith("<|im_start|>assistant\nThe answer is") and closed.startswith(open_)
    assert render_chat(text_tok, message_dicts(convo[:1]), add_generation_prompt=False).endswith("hi<|im_end|>\n")
    with pytest.raises(ApiError, match="add_generation_prompt false"):
        render_chat(text_tok, msgs, continue_final_message=True)  # both on
    with pytest.raises(ApiError, match="text content"):
        render_chat(text_tok, [*msgs[:1], {"role": "assistant", "content": ""}], add_generation_prompt=False,
                    continue_final_message=True)


def test_template_kwargs_reach_the_template(text_tok) -> None:
    msgs = message_dicts(_messages(b'[{"role": "user", "content": "hi"}]'))
    assert render_chat(text_tok, msgs, template_kwargs={"greeting": "HEY"}).endswith("assistant\nHEY")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"[]", "messages"),
        (b'[{"role": "wizard", "content": "x"}]', "messages[0].role"),
        (b'[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]', "messages[0].content"),
    ],
)
def test_bad_messages_are_400(text_tok, body: bytes, param: str) -> None:
    with pytest.raises(ApiError) as info:
        chat_prompt_ids(text_tok, _messages(body))
    assert info.value.status == 400 and info.value.param == param


def test_template_failure_is_400(text_tok) -> None:
    # The template raises on roles it does not know (raise_exception), like many real ones.
    with pytest.raises(ApiError) as info:
        chat_prompt_ids(text_tok, _messages(b'[{"role": "tool", "content": "42", "tool_call_id": "t"}]'))
    assert info.value.status == 400
    assert "chat template failed" in info.value.message and "unsupported role tool" in info.value.message


def test_template_type_error_is_400(text_tok) -> None:
    # content None on a non-tool-call turn becomes ""; a None that reaches string
    # concatenation in the template must still be a clean 400.
    msgs = [{"role": "user", "content": None}]
    with pytest.raises(ApiError) as info:
        render_chat(text_tok, msgs)
    assert info.value.status == 400


def test_reserved_template_kwargs_are_refused(text_tok) -> None:
    msgs = message_dicts(_messages(b'[{"role": "user", "content": "hi"}]'))
    with pytest.raises(ApiError) as info:
        render_chat(text_tok, msgs, template_kwargs={"tokenize": True})
    assert info.value.status == 400 and info.value.param == "chat_template_kwargs"


def test_model_without_chat_template(tmp_path: Path) -> None:
    tok = load_tokenizer(str(write_model_dir(tmp_path / "plain", chat_template=None)))
    assert tok is not None and tok.chat_template is None
    with pytest.raises(ApiError) as info:
        chat_prompt_ids(tok, _messages(b'[{"role": "user", "content": "hi"}]'))
    assert info.value.status == 400 and "no chat template" in info.value.message


def test_ids_only_mode(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert not has_tokenizer_files(str(tmp_path))
    assert load_tokenizer(str(tmp_path)) is None
    with pytest.raises(ApiError) as info:
        chat_prompt_ids(None, _messages(b'[{"role": "user", "content": "hi"}]'))
    assert info.value.status == 400 and "no tokenizer" in info.value.message
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing"))


def test_default_model_chat_template(default_model_dir) -> None:
    tok = load_tokenizer(str(default_model_dir))
    assert tok is not None and tok.chat_template
    ids = chat_prompt_ids(tok, _messages(b'[{"role": "user", "content": "What is 2+2?"}]'))
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n") and "What is 2+2?" in text
