"""Property-based: arbitrary sampling parameters and bodies against the running server.

Every request gets a 4xx with an OpenAI-style error body or an answer, never a 5xx; the
server keeps serving; greedy output for a fixed prompt is the same before and after.
Generation lengths stay tiny (max_tokens is either small or rejected) to keep CI fast.
"""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from msgs.params import SamplingParams
from msgs.sdk import Client, StrataError
from tests.integration.conftest import Server
from tests.param_strategies import sampling_params

SETTINGS = settings(
    max_examples=60, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck)
)
PROMPT = "The capital of France is"

# JSON values of every kind, including ones no schema expects
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
# never null or a mid-sized number: those would generate up to the whole context
NOT_A_NUMBER = JSON.filter(lambda v: v is not None and (isinstance(v, bool) or not isinstance(v, int | float)))
SMALL_MAX = st.integers(-3, 3) | st.sampled_from([10**6, 2**31, 2**63]) | NOT_A_NUMBER
NUMBER = st.floats(allow_nan=False, allow_infinity=False) | st.integers(-(2**66), 2**66) | st.sampled_from([0, 1, -1])
PARAM_VALUES = {
    "temperature": NUMBER | JSON,
    "top_p": NUMBER | JSON,
    "top_k": NUMBER | JSON,
    "min_p": NUMBER | JSON,
    "seed": NUMBER | JSON,
    "presence_penalty": NUMBER | JSON,
    "frequency_penalty": NUMBER | JSON,
    "repetition_penalty": NUMBER | JSON,
    "stop": JSON | st.lists(st.text(max_size=4), max_size=20),
    "stop_token_ids": JSON | st.lists(st.integers(-5, 10**6), max_size=3),
    "n": st.integers(-2, 20) | JSON,
    "logprobs": JSON,
    "top_logprobs": st.integers(-2, 30) | JSON,
    "ignore_eos": JSON,
    "skip_special_tokens": JSON,
    "stream": st.booleans(),
    "logit_bias": JSON,
    "response_format": JSON,
    "tools": JSON,
    "tool_choice": JSON,
    "user": JSON,
    "bogus_field": JSON,
}


RAW = st.binary(max_size=64) | st.sampled_from(
    [b'{"prompt": "x", "temperature": Infinity}', b'{"prompt": "x", "top_p": NaN}', b'{"text": "x"', b"\xff\xfe"]
)


def _some_params() -> st.SearchStrategy[dict[str, Any]]:
    keys = st.lists(st.sampled_from(sorted(PARAM_VALUES)), max_size=4, unique=True)
    return keys.flatmap(lambda ks: st.fixed_dictionaries({k: PARAM_VALUES[k] for k in ks}))


def _check(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error", err
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        assert "data: [DONE]" in r.text and '"error"' not in r.text, r.text[:300]


def _greedy(server: Server) -> str:
    r = httpx.post(f"{server.base_url}/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def baseline(server: Server) -> str:
    before = _greedy(server)
    yield before
    assert _greedy(server) == before
    m = server.wait_idle()
    assert m["strata_kv_leak_free"] == 1


@SETTINGS
@given(params=_some_params(), max_tokens=SMALL_MAX, chat=st.booleans())
def test_openai_routes_answer_or_4xx(server: Server, baseline: str, params: dict, max_tokens: Any, chat: bool) -> None:
    body: dict[str, Any] = {"max_tokens": max_tokens, **params}
    if chat:
        body["messages"] = [{"role": "user", "content": "Hi"}]
        path = "/chat/completions"
    else:
        body["prompt"] = PROMPT
        path = "/completions"
    _check(httpx.post(server.base_url + path, json=body, timeout=60))


@SETTINGS
@given(body=JSON, raw=RAW,
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/responses", "/generate"]))
def test_arbitrary_bodies_are_4xx(server: Server, baseline: str, body: Any, raw: bytes, path: str) -> None:
    _check(httpx.post(server.http + path, content=json.dumps(body), timeout=60))
    _check(httpx.post(server.http + path, content=raw, timeout=60))


@SETTINGS
@given(
    messages=st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]) | JSON},
            optional={"content": JSON, "tool_calls": JSON, "name": JSON, "tool_call_id": JSON},
        ),
        max_size=4,
    )
)
def test_arbitrary_messages_are_answered_or_4xx(server: Server, baseline: str, messages: list) -> None:
    _check(httpx.post(f"{server.base_url}/chat/completions", json={"messages": messages, "max_tokens": 2}, timeout=60))


@SETTINGS
@given(items=st.lists(
    st.fixed_dictionaries({}, optional={"type": st.sampled_from(["message", "function_call", "function_call_output",
                                                                 "reasoning", "x"]) | JSON,
                                        "role": st.sampled_from(["user", "developer", "assistant", "tool"]) | JSON,
                                        "content": JSON, "call_id": JSON, "name": JSON, "arguments": JSON,
                                        "output": JSON}),
    max_size=4),
    extras=st.fixed_dictionaries({}, optional={k: JSON for k in ("text", "tools", "tool_choice", "reasoning", "include",
                                                                "instructions", "truncation", "background")}))
def test_arbitrary_response_items_are_answered_or_4xx(server: Server, baseline: str, items: list, extras: dict) -> None:
    body = {"input": items, "max_output_tokens": 2, **extras}
    _check(httpx.post(f"{server.base_url}/responses", json=body, timeout=60))


FLOAT = st.floats() | st.sampled_from([math.inf, -math.inf, math.nan, 0.0, 1.0, 2.0])
INT = st.integers(-(2**63), 2**63 - 1) | st.integers(-3, 3)
SDK_PARAMS = sampling_params(
    FLOAT,
    INT,
    max_new=st.integers(-3, 3) | st.sampled_from([10**6, 2**31, 2**62]),
    top_logprobs=st.integers(-2, 30),
    stop=st.lists(st.text(max_size=3), max_size=3),
)


@SETTINGS
@given(params=SDK_PARAMS, ids=st.none() | st.lists(st.integers(-(2**31), 2**31 - 1), max_size=4))
def test_sdk_params_answer_or_4xx(server: Server, baseline: str, params: SamplingParams, ids: list | None) -> None:
    """The SDK can send what JSON cannot (inf, NaN, any int64): a 4xx or an answer."""
    kw = {f: getattr(params, f) for f in SamplingParams.__struct_fields__}
    with Client(server.sdk) as c:
        try:
            out = c.generate(ids if ids is not None else PROMPT, **kw)
        except StrataError as exc:
            assert 400 <= exc.status < 500, exc
        else:
            assert out.finish_reason in ("stop", "length")
