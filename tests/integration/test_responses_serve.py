"""/v1/responses served (the shared server, the real default model): the answer is the chat
endpoint's for the same conversation, streamed as OpenAI's event sequence, read by the OpenAI SDK,
constrained by text.format, and what it cannot take is a 400 after which the server answers."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.integration.conftest import Server

CONVERSATION = [{"role": "developer", "content": "Answer in one short sentence."},
                {"role": "user", "content": [{"type": "input_text", "text": "What is the capital of France?"}]}]
AS_CHAT = [{"role": "system", "content": "Answer in one short sentence."},
           {"role": "user", "content": "What is the capital of France?"}]


def _post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.http}{path}", json=body, timeout=120)


def _text(resp: dict[str, Any]) -> str:
    (msg,) = [it for it in resp["output"] if it["type"] == "message"]
    return "".join(part["text"] for part in msg["content"])


def _events(raw: str) -> list[dict[str, Any]]:
    out = []
    for block in raw.strip().split("\n\n"):
        name, data = block.split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        out.append(event)
    return out


@pytest.mark.parametrize("max_tokens", [6, 48])
def test_the_answer_is_the_chats_streamed_or_not(server: Server, max_tokens: int) -> None:
    """Greedy: the response's text and token counts are /v1/chat/completions' for the same messages
    (instructions and developer as system turns); cut at max_output_tokens it is incomplete; streamed,
    the deltas add up to that text, every event named as its type, numbered in order."""
    chat = _post(server, "/v1/chat/completions", {"messages": AS_CHAT, "temperature": 0, "max_tokens": max_tokens})
    assert chat.status_code == 200
    want = chat.json()
    body = {"input": CONVERSATION, "temperature": 0, "max_output_tokens": max_tokens}
    resp = _post(server, "/v1/responses", body)
    assert resp.status_code == 200
    got = resp.json()
    assert got["object"] == "response" and got["id"].startswith("resp_")
    assert _text(got) == want["choices"][0]["message"]["content"]
    assert got["usage"]["input_tokens"] == want["usage"]["prompt_tokens"]
    assert got["usage"]["output_tokens"] == want["usage"]["completion_tokens"]
    cut = want["choices"][0]["finish_reason"] == "length"
    assert got["status"] == ("incomplete" if cut else "completed")
    assert got["incomplete_details"] == ({"reason": "max_output_tokens"} if cut else None)
    with httpx.stream("POST", f"{server.http}/v1/responses", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _events(r.read().decode())
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == ("response.incomplete" if cut else "response.completed")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == _text(got) == _text(events[-1]["response"])
    assert events[-1]["response"]["usage"]["output_tokens"] == got["usage"]["output_tokens"]


def test_logprobs_are_the_chats(server: Server) -> None:
    """top_logprobs: the message's text carries the chat's logprobs for the same answer (greedy), and
    streamed, the text deltas carry them in order."""
    chat = _post(server, "/v1/chat/completions", {"messages": AS_CHAT, "temperature": 0, "max_tokens": 6,
                                                  "logprobs": True, "top_logprobs": 2}).json()
    want = chat["choices"][0]["logprobs"]["content"]
    body = {"input": CONVERSATION, "temperature": 0, "max_output_tokens": 6, "top_logprobs": 2}
    got = _post(server, "/v1/responses", body).json()
    (msg,) = [it for it in got["output"] if it["type"] == "message"]
    assert msg["content"][0]["logprobs"] == want and len(want) == 6
    with httpx.stream("POST", f"{server.http}/v1/responses", json={**body, "stream": True}, timeout=120) as r:
        events = _events(r.read().decode())
    streamed = [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert streamed == want == done["logprobs"]


def test_the_openai_sdk_reads_it(server: Server) -> None:
    client = OpenAI(base_url=f"{server.http}/v1", api_key="none", max_retries=0, timeout=120)
    r = client.responses.create(model="SmolLM2-135M-Instruct", input=CONVERSATION, instructions="Be kind.",
                                temperature=0, max_output_tokens=40)
    assert r.status == "completed" and "Paris" in r.output_text
    with client.responses.stream(model="SmolLM2-135M-Instruct", input=CONVERSATION, instructions="Be kind.",
                                 temperature=0, max_output_tokens=40) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == r.output_text and kinds[-1] == "response.completed"


def test_text_format_constrains_the_answer(server: Server) -> None:
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}}, "required": ["city"],
              "additionalProperties": False}
    body = {"input": "Which city is the capital of France? Answer in JSON.", "temperature": 0,
            "max_output_tokens": 30, "text": {"format": {"type": "json_schema", "name": "city", "schema": schema}}}
    r = _post(server, "/v1/responses", body)
    assert r.status_code == 200 and json.loads(_text(r.json()))["city"] in ("Paris", "Lyon")


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://a/b.png"}]}]}, "input"),
    ({"input": "x", "max_tokens": 5}, None),  # the chat's field name: unknown here
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 10**9}, "max_output_tokens"),  # past the context: the chat's check
])
def test_what_it_cannot_take_is_a_400_and_the_server_answers_on(server: Server, body: dict[str, Any],
                                                               param: str | None) -> None:
    r = _post(server, "/v1/responses", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and (param is None or err["param"] == param)
    ok = _post(server, "/v1/responses", {"input": "Hi", "max_output_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] == 2
