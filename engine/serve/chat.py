"""Chat prompts: OpenAI messages -> the model's chat template -> token ids.

The template is rendered to text (add_generation_prompt=True unless the request says otherwise,
or continue_final_message) and then tokenized without
adding special tokens: templates write their own BOS, so adding it again would double it
(the same two steps as vLLM). Any failure to render is the request's fault (a template
that raises on an unexpected role, content the template cannot handle): a 400, whatever
the exception type (jinja errors, a TypeError from `tojson` on an Undefined, ...).

History tool calls: templates want `function.arguments` as a dict (they apply `tojson` or
iterate over its items), while OpenAI clients send the JSON text. The text is decoded for
the template; text holding one JSON document followed by junk (seen in long agent
histories) keeps its leading document instead of failing the whole conversation; text
that is not JSON at all is passed on unchanged, as a string.
"""

from __future__ import annotations

import inspect
import json
from functools import cache, lru_cache
from typing import Any

import msgspec

from engine.serve.errors import ApiError
from engine.serve.protocol import ChatMessage
from engine.serve.validate import IDS_ONLY, Limits, encode_within
from engine.tokenizer import TextTokenizer, chat_template_problem

ROLES = ("system", "developer", "user", "assistant", "tool")


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Plain dicts for the template. Text parts are joined with newlines (as vLLM does
    for string-content templates); any other part type is refused."""
    if not messages:
        raise ApiError(400, "messages must be a non-empty array", param="messages")
    out = []
    for i, msg in enumerate(messages):
        if msg.role not in ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}", param=f"messages[{i}].role")
        item: dict[str, Any] = {"role": msg.role, "content": _content(msg, i)}
        for key in ("name", "tool_call_id", "reasoning_content"):
            value = getattr(msg, key)
            if value is not None:
                item[key] = value
        if msg.tool_calls is not None:
            item["tool_calls"] = [
                _history_call(call, f"messages[{i}].tool_calls[{j}]") for j, call in enumerate(msg.tool_calls)
            ]
        out.append(item)
    return out


_DECODER = json.JSONDecoder(strict=False)


def _history_call(call: Any, where: str) -> dict[str, Any]:
    """A past assistant tool call as the template gets it: arguments decoded (see above)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(400, f"{where} must be an object with function.name", param=where)
    args = fn.get("arguments")
    if isinstance(args, str):
        fn = {**fn, "arguments": salvage_arguments(args)}
    return {**call, "function": fn}


def salvage_arguments(text: str) -> Any:
    """The arguments of a past call: its JSON document (the leading one when junk follows),
    or the text itself when it does not start with a JSON object."""
    try:
        value, _ = _DECODER.raw_decode(text.strip())
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _content(msg: ChatMessage, i: int) -> str:
    if isinstance(msg.content, str):
        return msg.content
    if msg.content is None or msg.content is msgspec.UNSET:
        # OpenAI: content is required, except on an assistant turn (which may only call tools).
        # "" as vLLM renders it: templates that print message['content'] (SmolLM2's) fail on None,
        # and those that test it (`if message.content`) read "" the same way
        if msg.role != "assistant":
            raise ApiError(400, f"messages[{i}].content is required for role {msg.role!r}", f"messages[{i}].content")
        return ""
    texts = []
    for part in msg.content:
        if part.type != "text":
            raise ApiError(
                400, f"content part type {part.type!r} is not supported (text only)", f"messages[{i}].content"
            )
        if part.text is None:
            raise ApiError(400, f"messages[{i}].content: a text part needs its text", f"messages[{i}].content")
        texts.append(part.text)
    return "\n".join(texts)


@cache
def _reserved_kwargs() -> frozenset[str]:
    """apply_chat_template's own parameters: chat_template_kwargs must not set them."""
    from transformers import PreTrainedTokenizerBase

    return frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"kwargs"}


def render_chat(
    tok: TextTokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template: str | None = None,
) -> str:
    """The prompt text for a conversation, ending with the assistant's generation prompt, or
    (continue_final_message, vLLM's extension) with the final message left open so that the
    model continues it (transformers cuts the render after that message's content). `template`:
    the request's own chat template (checked by request_template) instead of the tokenizer's."""
    if tok.chat_template is None and template is None:
        raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages")
    if add_generation_prompt and continue_final_message:
        raise ApiError(400, "continue_final_message needs add_generation_prompt false", "continue_final_message")
    if continue_final_message and not messages[-1].get("content"):
        raise ApiError(400, "continue_final_message needs a final message with text content", "continue_final_message")
    kwargs = dict(template_kwargs or {})
    clash = sorted(set(kwargs) & _reserved_kwargs())
    if clash:
        raise ApiError(400, f"chat_template_kwargs may not set {', '.join(clash)}", param="chat_template_kwargs")
    try:
        text = tok.hf.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=False, chat_template=template, **kwargs
        )
    except Exception as exc:  # noqa: BLE001 - jinja raises anything; all of it is the input's fault
        raise ApiError(400, f"the chat template failed to render these messages: {exc}", "messages") from None
    if not isinstance(text, str):
        raise ApiError(400, "the chat template did not render to text", param="messages")
    return text


def chat_text(
    tok: TextTokenizer | None,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template: str | None = None,
) -> str:
    """A chat request's prompt text (validation + rendering)."""
    if tok is None:
        raise ApiError(400, f"chat is not available: {IDS_ONLY}", param="messages")
    return render_chat(tok, message_dicts(messages), tools, template_kwargs,
                       add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                       template=template)


def request_template(template: str | None, trusted: bool) -> str | None:
    """A request's own chat template (vLLM's `chat_template`), checked: it needs a server started with
    --trust-request-chat-template (a template is code the sender runs here, if in jinja's sandbox) and
    must compile; a 400 naming chat_template otherwise."""
    if template is None:
        return None
    if not trusted:
        raise ApiError(400, "a per-request chat template needs a server started with --trust-request-chat-template "
                       "(or start it with --chat-template)", param="chat_template")
    if not template.strip():
        raise ApiError(400, "chat_template is empty", param="chat_template")
    problem = _template_problem(template)
    if problem is not None:
        raise ApiError(400, f"chat_template: {problem}", param="chat_template")
    return template


_template_problem = lru_cache(maxsize=64)(chat_template_problem)  # a client sends one template again and again


def chat_prompt(
    tok: TextTokenizer | None,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    limits: Limits | None = None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
    keep_last: int | None = None,
    template: str | None = None,
) -> tuple[str, list[int]]:
    """A chat request's prompt text and token ids; with `limits`, a text too long to fit the
    context is refused before it is tokenized. The text tells a reasoning parser whether the
    template pre-filled `<think>`. add_special_tokens: the tokenizer's own (BOS) on top of the
    template's (vLLM's default, false, as the template writes them); keep_last: prompt_limit's."""
    text = chat_text(tok, messages, tools, template_kwargs, add_generation_prompt=add_generation_prompt,
                     continue_final_message=continue_final_message, template=template)
    assert tok is not None  # chat_text refused it
    if limits is None:
        return text, tok.encode(text, add_special_tokens=add_special_tokens)
    return text, encode_within(tok, text, limits, "messages", add_special_tokens, keep_last)


def chat_prompt_ids(
    tok: TextTokenizer | None,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of a chat request's prompt."""
    return chat_prompt(tok, messages, tools, template_kwargs)[1]
