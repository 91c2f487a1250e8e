"""Structured output end to end (bin/serve on the default model, CPU, official openai client):
json_schema answers that validate, pydantic parse, forced tool calls, regex/ebnf, 400s for
what does not compile, and an unconstrained request unchanged by constrained batch mates."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import psutil
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests.integration.conftest import Server, start_server, stop_server

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        tmp_path_factory.mktemp("structured"),
        "--tool-call-parser", "hermes",
        "--chat-template", "configs/templates/smollm2-hermes-tools.jinja",
        "--max-total-tokens", "16384",
        "--trust-request-chat-template",
        grammar=True,
    )  # fmt: skip
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def client(srv: Server) -> OpenAI:
    return OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=120)


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props), "additionalProperties": False}


NAME = {"type": "string", "minLength": 1, "maxLength": 12}
SCHEMAS = [
    ("person", _obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("color", _obj({"color": {"enum": ["red", "green", "blue"]}})),
    ("flag", _obj({"ok": {"type": "boolean"}})),
    ("tags", _obj({"tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}})),
    ("nested", _obj({"user": _obj({"id": {"type": "integer", "minimum": 1, "maximum": 999}, "name": NAME})})),
    ("code", _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}})),
    ("scores", _obj({"scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                "minItems": 1, "maxItems": 4}})),
    ("city", _obj({"city": {"type": "string", "minLength": 3, "maxLength": 10},
                   "country": {"enum": ["FR", "DE", "IT"]}})),
    ("point", _obj({"x": {"type": "number", "minimum": -10, "maximum": 10}, "y": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 5}})),
    ("items", _obj({"items": {"type": "array", "maxItems": 2, "items": _obj({"sku": {"type": "string",
                    "maxLength": 6}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}})}})),
    ("optional", _obj({"title": NAME, "note": {"type": "string", "maxLength": 10}}, required=["title"])),
    ("status", _obj({"status": {"enum": ["open", "closed"]}, "count": {"type": "integer", "minimum": 0,
                                                                       "maximum": 50}})),
]  # fmt: skip

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": _obj({"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["C", "F"]}}),
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone",
        "parameters": _obj({"zone": {"type": "string", "maxLength": 16}}),
    },
}


def _ask_json(client: OpenAI, name: str, schema: dict) -> tuple[str, str]:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Reply with a JSON {name} object."}],
        max_tokens=128,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
    )
    return r.choices[0].message.content or "", r.choices[0].finish_reason


def _checkers(srv: Server) -> list[psutil.Process]:
    """The tokenizer process's grammar checker children."""
    tok = next(p for p in psutil.Process(srv.proc.pid).children(recursive=True) if "procs.tokenizer" in p.cmdline())
    return [c for c in tok.children() if "engine.serve.grammar_checker" in c.cmdline()]


def test_the_grammar_checker_starts_with_the_server(srv: Server, client: OpenAI) -> None:
    """The module's first test: before any constrained request a checker runs (started once the
    scheduler was ready), and the first json_schema request compiles on it, starting no other."""
    deadline = time.monotonic() + 60
    while not (started := _checkers(srv)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(started) == 1, "a checker started with the server, before any constrained request"
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A name?"}], max_tokens=8,
                                       temperature=0, response_format={"type": "json_schema", "json_schema": {
                                           "name": "n", "schema": _obj({"name": NAME})}})
    assert r.choices[0].message.content
    assert [p.pid for p in _checkers(srv)] == [started[0].pid]


def test_every_json_schema_answer_validates(client: OpenAI) -> None:
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # all at once: one batch of constrained rows
        answers = list(pool.map(lambda ns: _ask_json(client, *ns), SCHEMAS))
    for (name, schema), (text, finish) in zip(SCHEMAS, answers, strict=True):
        assert finish == "stop", (name, text)
        obj = json.loads(text)
        jsonschema.validate(obj, schema)
        # in the order the schema declares (person: name then age; status: status then count), as OpenAI
        # and xgrammar give them: a sorted schema text once made every object's keys alphabetical
        assert list(obj) == [k for k in schema["properties"] if k in obj], (name, text)


def test_json_object_and_sampled_json(client: OpenAI) -> None:
    name, schema = SCHEMAS[0]
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A person as JSON."}],
        max_tokens=128,
        temperature=1.0,
        seed=3,
        n=2,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
    )
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), schema)


class Pet(BaseModel):
    name: str = Field(max_length=10)
    legs: int = Field(ge=0, le=8)


def test_parse_with_a_pydantic_model(client: OpenAI) -> None:
    r = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a pet."}],
        max_tokens=96,
        temperature=0,
        response_format=Pet,
    )
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and 0 <= pet.legs <= 8


def _check_calls(calls: list, allowed: dict[str, dict]) -> None:
    assert calls
    for call in calls:
        schema = allowed[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls(client: OpenAI, choice: str) -> None:
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello there!"}],  # nothing in it asks for a tool
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=96,
        temperature=0,
    )
    c = r.choices[0]
    allowed = {"get_weather": WEATHER, "get_time": TIME} if choice == "required" else {"get_time": TIME}
    _check_calls(c.message.tool_calls, allowed)
    assert len(c.message.tool_calls) == 1
    assert c.finish_reason == ("tool_calls" if choice == "required" else "stop")


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_streamed(client: OpenAI, choice: str) -> None:
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=96,
        temperature=0,
        stream=True,
    )
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    finish = None
    for chunk in stream:
        d = chunk.choices[0].delta
        for tc in d.tool_calls or []:
            if tc.function and tc.function.name:
                names[tc.index] = tc.function.name
            args[tc.index] = args.get(tc.index, "") + ((tc.function.arguments or "") if tc.function else "")
        finish = chunk.choices[0].finish_reason or finish
    assert names and set(names) == set(args)
    allowed = {"get_weather": WEATHER, "get_time": TIME}
    for i, name in names.items():
        jsonschema.validate(json.loads(args[i]), allowed[name]["function"]["parameters"])
    assert finish in ("tool_calls", "stop")


def test_responses_function_calls_are_the_chats(client: OpenAI) -> None:
    """/v1/responses with a named tool_choice: its function_call item is the chat's tool call (greedy,
    the same turns), streamed or not; then the call and its output sent back as input items give the
    chat's next answer for the same history."""
    flat = [{"type": "function", **t["function"]} for t in (WEATHER, TIME)]
    ask = "What is the weather in Paris?"
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": ask}], tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=96, temperature=0)
    (want,) = chat.choices[0].message.tool_calls
    kw = {"model": MODEL, "input": ask, "tools": flat, "tool_choice": {"type": "function", "name": "get_weather"},
          "max_output_tokens": 96, "temperature": 0}
    r = client.responses.create(**kw)
    (call,) = [it for it in r.output if it.type == "function_call"]
    assert (call.name, call.arguments) == (want.function.name, want.function.arguments)
    with client.responses.stream(**kw) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    (streamed,) = [it for it in final.output if it.type == "function_call"]
    assert (streamed.name, streamed.arguments, deltas) == (call.name, call.arguments, call.arguments)
    history = [{"role": "user", "content": ask},
               {"role": "assistant", "content": None, "tool_calls": [want.model_dump()]},
               {"role": "tool", "tool_call_id": want.id, "content": "sunny, 21C"}]
    chat2 = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, TIME], max_tokens=24,
                                           temperature=0)
    items = [{"role": "user", "content": ask},
             {"type": "function_call", "call_id": want.id, "name": want.function.name,
              "arguments": want.function.arguments},
             {"type": "function_call_output", "call_id": want.id, "output": "sunny, 21C"}]
    r2 = client.responses.create(model=MODEL, input=items, tools=flat, max_output_tokens=24, temperature=0)
    assert r2.output_text == (chat2.choices[0].message.content or "")


def test_a_requests_own_chat_template_is_rendered(srv: Server) -> None:
    """With --trust-request-chat-template a chat request's chat_template replaces the server's: its
    prompt is the template's text (/tokenize with the same template counts the same tokens, and a
    completion of that text answers the same, greedy)."""
    own = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    chat = httpx.post(f"{srv.base_url}/chat/completions", json={"messages": msgs, "chat_template": own,
                                                                "max_tokens": 8, "temperature": 0}, timeout=60)
    assert chat.status_code == 200, chat.text
    text = "user: What is the capital of France?\nassistant:"
    tok = httpx.post(f"{srv.http}/tokenize", json={"messages": msgs, "chat_template": own}, timeout=60).json()
    plain = httpx.post(f"{srv.http}/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=60).json()
    assert tok["tokens"] == plain["tokens"] and chat.json()["usage"]["prompt_tokens"] == plain["count"]
    greedy = {"prompt": plain["tokens"], "max_tokens": 8, "temperature": 0}
    done = httpx.post(f"{srv.base_url}/completions", json=greedy, timeout=60).json()
    assert chat.json()["choices"][0]["message"]["content"] == done["choices"][0]["text"]
    bad = httpx.post(f"{srv.base_url}/chat/completions", json={"messages": msgs, "chat_template": "{% if %}"},
                     timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template"


def test_structural_tag_constrains_what_a_trigger_starts(srv: Server) -> None:
    """vLLM's response_format structural_tag and SGLang's sampling_params.structural_tag: free text, but
    where the model writes a trigger, one of the structures follows (its begin, JSON of its schema, its
    end). The answer to this question starts with the trigger ("The"), so the tag is taken."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    tag = {"structures": [{"begin": "The answer: ", "schema": schema, "end": "</answer>"}], "triggers": ["The"]}
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    chat = httpx.post(f"{srv.base_url}/chat/completions", timeout=120, json={
        "messages": msgs, "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "structural_tag", **tag}})
    assert chat.status_code == 200, chat.text
    text = chat.json()["choices"][0]["message"]["content"]
    assert text.startswith("The answer: ") and "</answer>" in text, text
    jsonschema.validate(json.loads(text[len("The answer: "):text.index("</answer>")]), schema)
    prompt = httpx.post(f"{srv.http}/tokenize", json={"messages": msgs}, timeout=60).json()["tokens"]
    native = httpx.post(f"{srv.http}/generate", timeout=120, json={
        "input_ids": prompt, "sampling_params": {"max_new_tokens": 40, "temperature": 0,
                                                 "structural_tag": json.dumps(tag)}})
    assert native.status_code == 200 and native.json()["text"] == text
    outputs = {"structural_tag": json.dumps(tag)}  # vLLM's structured_outputs field
    vllm = httpx.post(f"{srv.base_url}/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": 40, "temperature": 0, "structured_outputs": outputs})
    assert vllm.status_code == 200 and vllm.json()["choices"][0]["text"] == text
    for bad in ({"structures": [], "triggers": ["The"]}, {"structures": tag["structures"], "triggers": ["<x>"]},
                {**tag, "extra": 1}):
        r = httpx.post(f"{srv.base_url}/chat/completions", timeout=60, json={
            "messages": msgs, "response_format": {"type": "structural_tag", **bad}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


def test_regex_and_ebnf_on_completions_and_generate(client: OpenAI, srv: Server) -> None:
    r = client.completions.create(
        model=MODEL, prompt="The year was", max_tokens=16, temperature=0, extra_body={"regex": r" (19|20)[0-9]{2}\."}
    )
    assert r.choices[0].finish_reason == "stop"
    text = r.choices[0].text
    assert len(text) == 6 and text.endswith(".") and text[1:5].isdigit(), text
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Yes or no?"}],
        max_tokens=8,
        temperature=0,
        extra_body={"ebnf": 'root ::= "yes" | "no"'},
    )
    assert r.choices[0].message.content in ("yes", "no")
    body = {"text": "Colors:", "sampling_params": {"max_new_tokens": 64, "temperature": 0,
            "json_schema": json.dumps(SCHEMAS[1][1])}}  # fmt: skip
    out = httpx.post(f"{srv.http}/generate", json=body, timeout=120).json()
    jsonschema.validate(json.loads(out["text"]), SCHEMAS[1][1])
    metrics = srv.metrics()
    assert metrics["strata_grammar_compile_seconds_count"] >= 1
    again = httpx.post(f"{srv.http}/generate", json=body, timeout=120).json()  # the same schema: a cache hit
    assert again["text"] == out["text"]
    after = srv.metrics()
    assert after["strata_grammar_cache_hits_total"] == metrics["strata_grammar_cache_hits_total"] + 1
    assert after["strata_grammar_compile_seconds_count"] == metrics["strata_grammar_compile_seconds_count"]


def test_vllm_guided_fields(client: OpenAI) -> None:
    """vLLM's guided_choice / guided_regex / guided_json, on the same constraints as ours."""
    ask = [{"role": "user", "content": "Is the sky blue?"}]
    r = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=8, temperature=0,
                                       extra_body={"guided_choice": ["yes, \"blue\"", "no"]})
    assert r.choices[0].message.content in ('yes, "blue"', "no")
    r = client.completions.create(model=MODEL, prompt="The year was", max_tokens=16, temperature=0,
                                  extra_body={"guided_regex": r" (19|20)[0-9]{2}\."})
    assert len(r.choices[0].text) == 6 and r.choices[0].text[1:5].isdigit(), r.choices[0].text
    r = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=48, temperature=0,
                                       extra_body={"guided_json": SCHEMAS[1][1]})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[1][1])
    # response_format on /v1/completions (vLLM and SGLang take it there; OpenAI has it on chat only)
    fmt = {"type": "json_schema", "json_schema": {"name": "colors", "schema": SCHEMAS[1][1]}}
    r = client.completions.create(model=MODEL, prompt="Colors:", max_tokens=64, temperature=0,
                                  extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS[1][1])
    # vLLM >= 0.12 removed the guided_* fields for structured_outputs (an audit: a 400 here)
    r = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=48, temperature=0,
                                       extra_body={"structured_outputs": {"json": SCHEMAS[1][1]}})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[1][1])
    r = client.completions.create(model=MODEL, prompt="The year was", max_tokens=16, temperature=0,
                                  extra_body={"structured_outputs": {"regex": r" (19|20)[0-9]{2}\."}})
    assert len(r.choices[0].text) == 6 and r.choices[0].text[1:5].isdigit(), r.choices[0].text
    r = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=8, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["red", "blue"]}})
    assert r.choices[0].message.content in ("red", "blue")
    r = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=32, temperature=0,
                                       extra_body={"structured_outputs": {"json_object": True}})
    assert r.choices[0].finish_reason == "length" or isinstance(json.loads(r.choices[0].message.content), dict)


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, ""),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}, ""),
    ({"response_format": {"type": "json_schema"}}, ""),
    ({"response_format": {"type": "xml"}}, ""),
    ({"regex": "(unclosed"}, ""),
    ({"ebnf": "root ::= undefined_rule"}, ""),
    ({"ebnf": "not a grammar at all"}, ""),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, ""),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"}, ""),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
      "properties": {"a": {"type": "nonsense"}}}}}], "tool_choice": "required"}, ""),
    ({"tools": [WEATHER], "tool_choice": "required", "regex": "a"}, ""),
    ({"guided_choice": ["a"], "guided_regex": "a"}, ""),
    ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, ""),
    ({"guided_choice": []}, ""),
    ({"guided_regex": "(unclosed"}, ""),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, ""),
    ({"structured_outputs": {"whitespace_pattern": " "}}, ""),
    ({"structured_outputs": {"choice": ["a"]}, "guided_regex": "a"}, ""),
    ({"response_format": {}}, ""),  # OpenAI's type is required
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, ""),  # and json_schema's name
]  # fmt: skip


@pytest.mark.parametrize("extra", [b for b, _ in BAD], ids=range(len(BAD)))
def test_malformed_constraints_are_400s(srv: Server, extra: dict) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    r = httpx.post(f"{srv.base_url}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]


def test_generate_bad_schema_is_400_and_server_keeps_serving(client: OpenAI, srv: Server) -> None:
    for params in ({"json_schema": "{not json"}, {"json_schema": '{"type": 5}'}, {"regex": "[z-a]"}):
        r = httpx.post(f"{srv.http}/generate", json={"text": "x", "sampling_params": params}, timeout=60)
        assert r.status_code == 400, r.text
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"regex": "(("})
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length"


def test_unconstrained_greedy_unchanged_next_to_constrained(client: OpenAI, srv: Server) -> None:
    def plain() -> str:
        r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0)
        return r.choices[0].text

    alone = plain()
    with ThreadPoolExecutor(5) as pool:
        constrained = [pool.submit(_ask_json, client, *SCHEMAS[i]) for i in range(4)]
        mixed = pool.submit(plain)
        assert mixed.result() == alone
        for f in constrained:
            assert f.result()[1] == "stop"
    m = srv.wait_idle()
    assert m["strata_kv_leak_free"] == 1


def test_a_slow_grammar_compiles_on_the_ranks_while_others_decode(client: OpenAI, srv: Server) -> None:
    """A schema that takes a large part of a second to compile: the ranks compile it beside the
    steps (the scheduler's grammar gate, engine/sched/grammars.py), so a request decoding
    meanwhile goes on. The scheduler's `grammar ready` line counts the steps that went out while
    the ranks compiled; before the gate, the compile ran inside one step."""
    props = {f"f{i}": {"type": "string", "pattern": f"[a-z]{{2,{20 + i}}}"} for i in range(16)}
    log = srv.log_dir / "scheduler.log"
    before = len(log.read_text().splitlines())
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=400, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)  # decoding
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(_ask_json, client, "record", _obj(props))
        assert sum(1 for _ in chunks) > 0
        text, finish = slow.result()
    assert finish in ("stop", "length") and text.startswith("{")
    lines = [json.loads(x) for x in log.read_text().splitlines()[before:]]
    (ready,) = [x for x in lines if x.get("event") == "grammar ready"]
    assert ready["steps_meanwhile"] >= 1 and ready["requests"] == 1, ready
    assert srv.wait_idle()["strata_kv_leak_free"] == 1


def test_grammar_metrics_exported(srv: Server) -> None:
    text = httpx.get(f"{srv.http}/metrics", timeout=10).text
    assert "strata_grammar_compile_seconds_bucket" in text
    assert "strata_grammar_cache_hits_total" in text


def test_grammar_helper_processes_give_the_same_answers(srv: Server, client: OpenAI, tmp_path) -> None:  # noqa: ANN001
    """The GPU's matcher placement (grammar helper processes, here 2 on CPU) against the CPU's
    (in the worker): the same greedy answers, one request at a time and a batch that validates;
    the helpers are the worker's children and go with the server."""
    import psutil

    helped = start_server(
        tmp_path / "logs",
        "--tool-call-parser", "hermes",
        "--chat-template", "configs/templates/smollm2-hermes-tools.jinja",
        "--max-total-tokens", "16384",
        "--grammar-helpers", "2",
        grammar=True,
    )  # fmt: skip
    try:
        procs = psutil.Process(helped.proc.pid).children(recursive=True)
        helpers = [p for p in procs if "engine.run.grammar_helper" in " ".join(p.cmdline())]
        assert len(helpers) == 2
        other = OpenAI(base_url=helped.base_url, api_key="none", max_retries=0, timeout=120)
        for name, schema in SCHEMAS[:3]:  # one at a time; the batch below takes all
            assert _ask_json(other, name, schema) == _ask_json(client, name, schema), name
        with ThreadPoolExecutor(len(SCHEMAS)) as pool:
            answers = list(pool.map(lambda ns: _ask_json(other, *ns), SCHEMAS))
        for (name, schema), (text, finish) in zip(SCHEMAS, answers, strict=True):
            assert finish == "stop", (name, text)
            jsonschema.validate(json.loads(text), schema)
        assert helped.wait_idle()["strata_kv_leak_free"] == 1
    finally:
        assert stop_server(helped) == 0
    psutil.wait_procs(helpers, timeout=10)
    assert not any(p.is_running() for p in helpers)
