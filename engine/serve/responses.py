"""/v1/responses: OpenAI's Responses API, stateless, on the chat path.

The request is mapped onto a chat request (`chat_request`: instructions and input items become
messages, flat function tools the chat's nested ones, text.format the response_format) and run by
openai_api.start_chat, so tools, reasoning, grammars and every check are the chat's. The answer is
a `response` object whose `output` holds typed items: the reasoning (where the server's reasoning
parser separates it), the message, the function calls. Streamed, it is OpenAI's event sequence
(response.created ... response.completed), each item opened, filled by deltas and closed in order.
Nothing is stored: previous_response_id and conversation are refused, so a client sends the whole
conversation (as vLLM's and OpenAI's stateless mode, store false, expect).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import structlog

from engine.serve import formats as fmt
from engine.serve.errors import ApiError
from engine.serve.generate import Delta, GenerationFailed, first_then_rest
from engine.serve.openai_api import ChatRun, finish, namer, start_chat
from engine.serve.parsers.output import ChatOutput, OutputDelta
from engine.serve.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ResponsesRequest,
    check_unsupported,
    decode_body,
    refuse,
)
from engine.serve.state import Call, Reply, ServeState
from engine.serve.validate import check_model

log = structlog.get_logger()

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")
_EFFORTS = ("minimal", "low", "medium", "high")
# fields refused unless at these values: (harmless values, why)
_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "previous_response_id": ((None,), "this server keeps no responses: send the whole conversation in input"),
    "conversation": ((None,), "this server keeps no conversations: send the whole conversation in input"),
    "background": ((None, False), "background responses are not supported"),
    "prompt": ((None,), "stored prompt templates are not supported"),
    "max_tool_calls": ((None,), "max_tool_calls is not supported"),
    "truncation": ((None, "disabled"), "truncation auto is not supported: the prompt must fit the context"),
}
# asked by stateless clients (reasoning is returned as text), and the answer's token logprobs
_INCLUDABLE = ("reasoning.encrypted_content", LOGPROBS := "message.output_text.logprobs")


async def responses(state: ServeState, body: bytes, call: Call) -> Reply:
    req = decode_body(body, ResponsesRequest)
    check_model(req.model, state.accepted_models)
    chat = chat_request(req)
    try:
        check_unsupported(chat)
        run = await start_chat(state, chat, len(body), call)
    except ApiError as exc:  # the chat's checks name the chat's fields: name this body's
        raise _as_sent(exc) from None
    created = int(time.time())
    head = _head(req, state.model_name, "resp_" + run.rid if not run.rid.startswith("resp_") else run.rid, created)
    if req.stream:
        deltas = await first_then_rest(run.gen)
        return Reply(stream=_stream(state, run, deltas, head, chat), close=run.gen.close, rid=run.rid)
    (c,) = await finish(run.gen)
    output = run.new_output()
    output.feed(c.text)
    output.finish()
    items = _items(output, c.finish_reason, _logprobs(state, chat, c.token_ids, c.logprobs, c.top_logprobs))
    use = _usage(state, c.prompt_tokens, c.completion_tokens, c.cached_tokens, output)
    return Reply(body=_done(head, items, use, c.finish_reason), rid=run.rid)


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that answers `req`, or a 400 naming the field it cannot take."""
    refuse(req, _REFUSED)
    for what in req.include or []:
        if what not in _INCLUDABLE:
            raise ApiError(400, f"include {what!r} is not supported", param="include")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise ApiError(400, f"max_output_tokens must be at least 1, got {req.max_output_tokens}",
                       param="max_output_tokens")
    effort = (req.reasoning or {}).get("effort")
    if effort is not None and effort not in _EFFORTS:
        raise ApiError(400, f"reasoning.effort must be one of {', '.join(_EFFORTS)}", param="reasoning")
    logprobs = LOGPROBS in (req.include or []) or bool(req.top_logprobs)
    return ChatCompletionRequest(
        messages=_messages(req), model=req.model, max_completion_tokens=req.max_output_tokens,
        logprobs=logprobs, top_logprobs=req.top_logprobs if logprobs else None,
        temperature=req.temperature, top_p=req.top_p, stream=bool(req.stream), tools=_tools(req.tools),
        tool_choice=_tool_choice(req.tool_choice), parallel_tool_calls=req.parallel_tool_calls,
        response_format=_response_format(req.text), reasoning_effort=effort, user=req.user,
        top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty, seed=req.seed,
        ignore_eos=bool(req.ignore_eos),
        request_id=req.request_id, priority=req.priority,
    )


# the chat request's fields (as its checks name them) -> the Responses request's that set them
_SENT_AS = (("max_completion_tokens", "max_output_tokens"), ("response_format", "text"), ("messages", "input"),
            ("reasoning_effort", "reasoning"))


def _as_sent(exc: ApiError) -> ApiError:
    """A chat check's error naming the field this body sent (tools[i].function.x as tools[i].x; messages
    as input, whose items map onto the chat's turns only roughly: its message keeps the turn's path)."""
    param = exc.param or ""
    if param.startswith("tools[") and ".function" in param:
        sent = param.replace(".function", "", 1)
    else:
        sent = next((new for old, new in _SENT_AS if param == old or param.startswith((old + ".", old + "["))), param)
    if sent == param:
        return exc
    keep = sent == "input" or not exc.message.startswith(param)  # (the message's chat path says which turn)
    return ApiError(exc.status, exc.message if keep else sent + exc.message[len(param):], sent, exc.code)


def _messages(req: ResponsesRequest) -> list[ChatMessage]:
    """instructions (a system message first) and input as chat messages: message items by role
    (developer as system), function_call items as the assistant's tool calls (consecutive ones in
    one message), function_call_output items as tool messages; reasoning items are left out, as
    chat templates leave past reasoning out."""
    out = [ChatMessage(role="system", content=req.instructions)] if req.instructions is not None else []
    if isinstance(req.input, str):
        return [*out, ChatMessage(role="user", content=req.input)]
    for i, item in enumerate(req.input):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            role = _ROLES.get(role) if isinstance(role, str) else None
            if role is None:
                raise ApiError(400, f"{where}.role must be one of {', '.join(_ROLES)}", param="input")
            out.append(ChatMessage(role=role, content=_text(item.get("content"), where)))
        elif kind == "function_call":
            call = {"id": _str(item, "call_id", where), "type": "function",
                    "function": {"name": _str(item, "name", where), "arguments": _str(item, "arguments", where)}}
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and last.tool_calls is not None:
                last.tool_calls.append(call)
            elif last is not None and last.role == "assistant" and isinstance(last.content, str):
                last.tool_calls = [call]
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            out.append(ChatMessage(role="tool", tool_call_id=_str(item, "call_id", where),
                                   content=_str(item, "output", where)))
        elif kind != "reasoning":
            raise ApiError(400, f"{where}: input items of type {kind!r} are not supported (messages, function_call, "
                           "function_call_output, reasoning)", param="input")
    if not out:
        raise ApiError(400, "input holds no message", param="input")
    return out


def _text(content: Any, where: str) -> str:
    """A message item's content as text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or a list of text parts", param="input")
    texts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") in _TEXT_PARTS and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ApiError(400, f"{where}.content: only text parts are supported, got {kind!r}", param="input")
        texts.append(part["text"])
    return "".join(texts)


def _str(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ApiError(400, f"{where}.{key} must be a string", param="input")
    return value


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The Responses API's flat function tools as the chat's nested ones."""
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            kind = t.get("type") if isinstance(t, dict) else None
            raise ApiError(400, f"tools[{i}]: only function tools with a name are supported, got {kind!r}",
                           param="tools")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiError(400, "tool_choice must be auto, none, required or {\"type\": \"function\", \"name\": ...}",
                   param="tool_choice")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format as the chat's response_format (verbosity: a hint, ignored)."""
    unknown = sorted(set(text or {}) - {"format", "verbosity"})
    if unknown:
        raise ApiError(400, f"text.{unknown[0]} is not supported", param="text")
    form = (text or {}).get("format")
    if form is not None and not isinstance(form, dict):
        raise ApiError(400, "text.format must be an object", param="text")
    if form is None or form.get("type") == "text":
        return None
    if form.get("type") == "json_object":
        return {"type": "json_object"}
    if form.get("type") == "json_schema":
        schema = {k: form[k] for k in ("name", "schema", "strict", "description") if k in form}
        return {"type": "json_schema", "json_schema": schema}
    raise ApiError(400, f"text.format type {form.get('type')!r} is not supported", param="text")


# -- the answer -------------------------------------------------------------------------


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _reasoning_item(text: str, item_id: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": "completed"}


def _text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _logprobs(state: ServeState, chat: ChatCompletionRequest, ids: list[int], lps: list[float] | None,
              tops: list[list[tuple[int, float]]] | None) -> list[dict[str, Any]]:
    """The tokens' logprobs in OpenAI's shape (the chat's entries: token, logprob, bytes,
    top_logprobs), where the request asked for them; else none."""
    if not chat.logprobs:
        return []
    return (fmt.chat_logprobs(namer(state, chat), ids, lps, tops) or {}).get("content", [])


def _message_item(text: str | None, item_id: str, status: str = "completed",
                  logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text, logprobs)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(call_id: str, name: str, arguments: str, item_id: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _items(output: ChatOutput, reason: str | None, logprobs: list[dict[str, Any]] | None = None
           ) -> list[dict[str, Any]]:
    """The output items of a finished choice: reasoning, message, calls (as the stream opens them:
    a message where there is text, or where there is nothing else). `logprobs`: every token's of the
    answer, on the message's text (the tokens of its reasoning and calls among them)."""
    items = []
    if output.reasoned and output.reasoning_text:
        items.append(_reasoning_item(output.reasoning_text, _item_id("rs")))
    if output.content or not (items or output.calls):
        items.append(_message_item(output.content, _item_id("msg"), _status(reason), logprobs))
    items += [_call_item(c.id, c.name, c.arguments, _item_id("fc")) for c in output.calls]
    return items


def _status(reason: str | None) -> str:
    return "incomplete" if reason == "length" else "completed"


def _usage(state: ServeState, prompt: int, completion: int, cached: int, output: ChatOutput) -> dict[str, Any]:
    """The Responses API's usage; reasoning_tokens counts the reasoning text's tokens."""
    reasoning = len(state.tok.encode(output.reasoning_text, add_special_tokens=False)) if output.reasoning_text else 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": min(reasoning, completion)},
            "total_tokens": prompt + completion}


def _head(req: ResponsesRequest, model: str, resp_id: str, created: int) -> dict[str, Any]:
    """The response object's fields but status, output and usage."""
    effort = (req.reasoning or {}).get("effort")
    return {
        "id": resp_id, "object": "response", "created_at": created, "model": model, "error": None,
        "incomplete_details": None, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": None, "reasoning": {"effort": effort, "summary": None}, "store": False,
        "temperature": req.temperature, "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": req.tools or [],
        "top_p": req.top_p, "truncation": "disabled", "user": req.user,
    }


def _done(head: dict[str, Any], items: list[dict[str, Any]], use: dict[str, Any] | None,
          reason: str | None) -> dict[str, Any]:
    status = _status(reason)
    details = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {**head, "status": status, "incomplete_details": details, "output": items, "usage": use}


class _Events:
    """SSE events of one response, numbered in order."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        data = fmt.to_json({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


class _Items:
    """The stream's output items: each parsed delta opens, fills and closes them in order (one
    open at a time: the reasoning, the message, then each call)."""

    def __init__(self, event: _Events) -> None:
        self.event = event
        self.pending: list[dict[str, Any]] = []  # tokens' logprobs not yet sent with a text delta
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being filled
        self.calls: dict[int, dict[str, Any]] = {}  # a call's index -> its item

    def feed(self, d: OutputDelta, logprobs: list[dict[str, Any]] | None = None) -> list[bytes]:
        """The events of one parsed delta; `logprobs`: its tokens', sent with the next text delta."""
        self.pending += logprobs or []
        out: list[bytes] = []
        if d.reasoning:
            if self.open is None or self.open["type"] != "reasoning":
                out += self._start(_reasoning_item("", _item_id("rs")) | {"status": "in_progress", "content": []})
            self.open["content"].append(d.reasoning)  # type: ignore[index]
            out.append(self.event("response.reasoning_text.delta", item_id=self.open["id"],  # type: ignore[index]
                                  output_index=len(self.items) - 1, content_index=0, delta=d.reasoning))
        if d.content:
            if self.open is None or self.open["type"] != "message":
                out += self._start_message()
            self.open["text"].append(d.content)  # type: ignore[index]
            lps, self.pending = self.pending, []
            self.open["lps"] += lps  # type: ignore[index]
            out.append(self.event("response.output_text.delta", item_id=self.open["id"],  # type: ignore[index]
                                  output_index=len(self.items) - 1, content_index=0, delta=d.content, logprobs=lps))
        for c in d.calls:
            item = self.calls.get(c.index)
            if item is None:
                item = self.calls[c.index] = _call_item(c.id or _item_id("call"), c.name or "", "", _item_id("fc"),
                                                         "in_progress")
                out += self._start(item)
                item["pieces"] = []
            if c.arguments:
                item["pieces"].append(c.arguments)
                out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self.items.index(item), delta=c.arguments))
        return out

    def _start_message(self) -> list[bytes]:
        out = self._start(_message_item(None, _item_id("msg"), "in_progress"))
        self.open["text"], self.open["lps"] = [], []  # type: ignore[index]
        return [*out, self.event("response.content_part.added", item_id=self.open["id"],  # type: ignore[index]
                                 output_index=len(self.items) - 1, content_index=0, part=_text_part(""))]

    def empty_message(self, reason: str | None) -> list[bytes]:
        """An answer with no text, reasoning or call is still a message, of no text."""
        return self._start_message() + self.close(reason)

    def _start(self, item: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.open = item
        self.items.append(item)
        shown = {k: v for k, v in item.items() if k not in ("text", "lps", "pieces")}
        return [*out, self.event("response.output_item.added", output_index=len(self.items) - 1, item=shown)]

    def close(self, reason: str | None = None) -> list[bytes]:
        """Close the open item (its done events), with the answer's finish reason at the end."""
        item, self.open = self.open, None
        if item is None:
            return []
        i = self.items.index(item)
        out = []
        if item["type"] == "reasoning":
            text = "".join(item["content"])
            item.update(_reasoning_item(text, item["id"]))
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                                  text=text))
        elif item["type"] == "message":
            text = "".join(item.pop("text"))
            lps = item.pop("lps") + (self.pending if reason is not None else [])
            part = _text_part(text, lps)
            item.update(_message_item(text, item["id"], _status(reason), lps))
            out += [self.event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                               text=text, logprobs=lps),
                    self.event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                               part=part)]
        else:
            args = "".join(item.pop("pieces"))
            item.update(arguments=args, status="completed")
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                  arguments=args))
        return [*out, self.event("response.output_item.done", output_index=i, item=item)]


async def _stream(state: ServeState, run: ChatRun, deltas: AsyncIterator[Delta], head: dict[str, Any],
                  chat: ChatCompletionRequest) -> AsyncIterator[bytes]:
    """response.created, response.in_progress, the items' events, then response.completed (or
    .incomplete at max_output_tokens, or .failed where the generation failed: a client never takes
    a crash for an answer). The generation is closed however the stream ends."""
    event = _Events()
    items = _Items(event)
    output = run.new_output()
    start = {**head, "status": "in_progress", "output": [], "usage": None}
    last: Delta | None = None
    try:
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        try:
            async for d in deltas:
                last = d
                parsed = output.feed(d.text)
                if d.finish_reason is not None:
                    parsed.extend(output.finish())
                for chunk in items.feed(parsed, _logprobs(state, chat, d.token_ids, d.logprobs, d.top_logprobs)):
                    yield chunk
        except GenerationFailed as exc:
            log.warning("responses stream failed", status=exc.status, error=exc.message)
            for chunk in items.close():
                yield chunk
            failed = {**head, "status": "failed", "output": items.items, "usage": None,
                      "error": {"code": exc.code or "server_error", "message": exc.message}}
            yield event("response.failed", response=failed)
            return
        reason = last.finish_reason if last is not None else None
        for chunk in items.close(reason):
            yield chunk
        if not items.items:  # an empty answer is still a message
            for chunk in items.empty_message(reason):
                yield chunk
        use = (_usage(state, last.prompt_tokens, last.completion_tokens, last.cached_tokens, output)
               if last is not None else None)
        body = _done(head, items.items, use, reason)
        yield event("response.incomplete" if body["status"] == "incomplete" else "response.completed", response=body)
    finally:
        run.gen.close()
