"""OpenAI's newer fields and vLLM's / SGLang's extensions on the OpenAI endpoints (an audit: every
one was a 400 "unknown field", which breaks clients written for vLLM): hints accepted, the ones
this server can serve honoured, the rest named in a 400 unless they carry their harmless value."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from engine.serve.protocol import REFUSED, REFUSED_IN_CHAT
from tests.integration.conftest import Server

MESSAGES = [{"role": "user", "content": "Name a colour."}]


def _post(server: Server, path: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}/{path}", json=body, timeout=120)


def _chat(server: Server, **body: Any) -> httpx.Response:
    return _post(server, "chat/completions", messages=MESSAGES, max_tokens=4, temperature=0, **body)


def test_hints_are_accepted_and_a_body_request_id_is_the_requests_id(server: Server) -> None:
    r = _chat(server, prompt_cache_key="k1", safety_identifier="u-1", verbosity="low", user="me",
              request_id="my-chat-1")
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "chatcmpl-my-chat-1" and r.headers["x-request-id"] == "my-chat-1"
    r = _post(server, "completions", prompt="Hello", max_tokens=2, rid="my-cmpl-1", prompt_cache_key="k1",
              safety_identifier="u-1", verbosity="low")  # SGLang's name for the id; OpenAI's hints here too
    assert r.status_code == 200 and r.json()["id"] == "cmpl-my-cmpl-1", r.text
    r = httpx.post(f"{server.base_url}/completions", json={"prompt": "Hello", "max_tokens": 2, "rid": "body"},
                   headers={"x-request-id": "header-1"}, timeout=120)
    assert r.json()["id"] == "cmpl-header-1"  # the header wins, as on /generate
    assert _chat(server, request_id="has space").status_code == 400
    # an audit: a non-Latin-1 id passed, ran, and was a 500 when echoed in the x-request-id header
    for path, body in (("completions", {"prompt": "Hi", "max_tokens": 1, "request_id": "✓"}),
                       ("chat/completions", {"messages": MESSAGES, "max_tokens": 1, "rid": "Āx"})):
        r = _post(server, path, **body)
        assert r.status_code == 400 and "ASCII" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{server.http}/generate", json={"text": "hi", "rid": "😀", "stream": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid", r.text


@pytest.mark.parametrize("name", sorted(REFUSED | REFUSED_IN_CHAT))
def test_what_is_not_served_is_named_and_its_harmless_value_passes(server: Server, name: str) -> None:
    harmless, why = (REFUSED | REFUSED_IN_CHAT)[name]
    real = {"priority": 5, "length_penalty": 0.5,
            "spaces_between_special_tokens": False, "lora_path": "a", "prediction": {"type": "content",
            "content": "x"}, "audio": {"voice": "x"}, "functions": [{"name": "f"}], "function_call": "auto",
            "web_search_options": {}, "chat_template": "{{ x }}", "documents": [{"text": "x"}],
            "stream_reasoning": False}.get(name, True)
    r = _chat(server, **{name: real})
    assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
    assert r.json()["error"]["message"] == why
    for value in harmless:
        assert _chat(server, **{name: value}).status_code == 200, (name, value)
    if name in REFUSED:  # the completions endpoint takes the shared ones alike
        assert _post(server, "completions", prompt="Hi", max_tokens=1, **{name: real}).status_code == 400


def _contains(ids: list[int], seq: list[int]) -> bool:
    return any(ids[i:i + len(seq)] == seq for i in range(len(ids) - len(seq) + 1))


def test_bad_words_are_not_generated(server: Server) -> None:
    """vLLM's bad_words (a 400 until the forty-eighth session): each word's token sequences, as a text
    starts with it and after a space, never appear in the output of /generate, completions or chat,
    greedy or sampled; the greedy answer that had them changes. Too many words, a word of only
    spaces or of too many tokens, or words beside a grammar or allowed_token_ids are a 400."""
    def tokens(text: str) -> list[int]:
        return httpx.post(f"{server.http}/tokenize", json={"prompt": text, "add_special_tokens": False},
                          timeout=30).json()["tokens"]

    def generate(**sampling: Any) -> dict:
        r = httpx.post(f"{server.http}/generate", timeout=60, json={"text": "The capital of France is",
                       "sampling_params": {"max_new_tokens": 8, "temperature": 0, **sampling}})
        assert r.status_code == 200, r.text
        return r.json()

    free = generate()
    assert "Paris" in free["text"], free
    words = ["Paris", "the city of"]
    seqs = [tokens(w) for w in words] + [tokens(" " + w) for w in words]
    assert any(_contains(free["output_ids"], s) for s in seqs)
    for sampling in ({}, {"temperature": 1.0, "seed": 5}):
        g = generate(bad_words=words, **sampling)
        assert not any(_contains(g["output_ids"], s) for s in seqs), (g, seqs)
        if not sampling:
            assert g["output_ids"] != free["output_ids"]
    assert generate(bad_words_ids=seqs)["output_ids"] == free["output_ids"]  # the front end's field: replaced
    r = _post(server, "completions", prompt="The capital of France is", max_tokens=8, temperature=0, bad_words=words)
    assert r.status_code == 200, r.text
    assert "Paris" not in r.json()["choices"][0]["text"], r.text  # (here the one-token " Paris" was the way)
    r = _chat(server, bad_words=["Red", "red"])
    assert r.status_code == 200, r.text
    for body in ({"bad_words": ["x"] * 65}, {"bad_words": ["  "]}, {"bad_words": [" ".join("abcdefghijklmnopq")]},
                 {"bad_words": ["x"], "regex": "[0-9]+"}, {"bad_words": ["x"], "allowed_token_ids": tokens(" x")}):
        r = _post(server, "completions", prompt="Hi", max_tokens=1, **body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words", (body, r.text)


def test_return_tokens_as_token_ids_names_the_logprobs_tokens(server: Server) -> None:
    """vLLM's return_tokens_as_token_ids (a 400 until the forty-eighth session): every logprobs token,
    chosen and top, is "token_id:<id>" (its bytes that text's) in completions and chat, streamed or not;
    the ids are the answer's (greedy, as /generate gives them) and the text is unchanged."""
    g = httpx.post(f"{server.http}/generate", timeout=60, json={"text": "The capital of France is", "sampling_params": {
        "max_new_tokens": 5, "temperature": 0}}).json()
    named = [f"token_id:{t}" for t in g["output_ids"]]
    r = _post(server, "completions", prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=2,
              return_tokens_as_token_ids=True)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["logprobs"]["tokens"] == named and c["text"] == g["text"], (c, g)
    assert all(k.startswith("token_id:") for top in c["logprobs"]["top_logprobs"] for k in top), c
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2,
            "return_tokens_as_token_ids": True}
    plain = _post(server, "chat/completions", **{**body, "return_tokens_as_token_ids": False}).json()
    r = _post(server, "chat/completions", **body)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [e["logprob"] for e in content] == [e["logprob"] for e in plain["choices"][0]["logprobs"]["content"]]
    for e in content:
        assert e["token"].startswith("token_id:") and e["bytes"] == list(e["token"].encode()), e
        assert all(t["token"].startswith("token_id:") for t in e["top_logprobs"]), e
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json={**body, "stream": True}, timeout=60) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: {")]
    streamed = [e["token"] for line in lines for ch in json.loads(line[6:])["choices"]
                for e in (ch.get("logprobs") or {}).get("content") or []]
    assert streamed == [e["token"] for e in content]


def test_allowed_token_ids_restrict_what_is_sampled(server: Server) -> None:
    """vLLM's allowed_token_ids (a 400 until the forty-seventh session): completions, chat and
    /generate draw only those tokens, greedy and sampled; an empty, out-of-vocabulary or too large
    set, or one beside a grammar (whose next tokens could all lie outside it), is a 400 naming the field."""
    words = [" cat", " dog", " bird"]
    ids = [httpx.post(f"{server.http}/tokenize", json={"prompt": w, "add_special_tokens": False},
                      timeout=30).json()["tokens"] for w in words]
    assert all(len(t) == 1 for t in ids), ids
    allowed = [t[0] for t in ids]
    r = _post(server, "completions", prompt="My favourite animals:", max_tokens=6, temperature=0,
              allowed_token_ids=allowed)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert text and text.replace(" cat", "").replace(" dog", "").replace(" bird", "") == "", text
    r = _chat(server, allowed_token_ids=allowed[:1])
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == " cat" * 4, r.text
    for temperature in (0, 1.0):
        g = httpx.post(f"{server.http}/generate", timeout=60, json={"text": "Pets:", "sampling_params": {
            "max_new_tokens": 8, "temperature": temperature, "seed": 3, "allowed_token_ids": allowed}}).json()
        assert len(g["output_ids"]) == 8 and set(g["output_ids"]) <= set(allowed), g
    vocab = httpx.get(f"{server.http}/tokenizer_info", timeout=30).json().get("vocab_size", 49152)
    for bad in ([], [vocab], list(range(5000))):
        r = _post(server, "completions", prompt="Hi", max_tokens=1, allowed_token_ids=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
    r = _post(server, "completions", prompt="Hi", max_tokens=1, allowed_token_ids=allowed, regex="[0-9]+")
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text  # nothing left
    r = _post(server, "completions", prompt="Hi", max_tokens=4, min_tokens=2, allowed_token_ids=allowed[:1],
              stop_token_ids=allowed[:1])  # every allowed token ends the output, and min_tokens forbids it
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
    eos = httpx.get(f"{server.http}/tokenizer_info", timeout=30).json()["eos_token"]
    eos_id = httpx.post(f"{server.http}/tokenize", json={"prompt": eos, "add_special_tokens": False},
                        timeout=30).json()["tokens"]
    r = _post(server, "completions", prompt="Hi", max_tokens=4, min_tokens=2, allowed_token_ids=eos_id)
    assert r.status_code == 400 and "min_tokens" in r.json()["error"]["message"], (r.text, eos, eos_id)
    r = _post(server, "completions", prompt="Hi", max_tokens=4, min_tokens=2, allowed_token_ids=eos_id, ignore_eos=True)
    assert r.status_code == 200, r.text  # EOS ends nothing then


def test_priority_needs_the_priority_policy(server: Server) -> None:
    """vLLM's request priority: this server runs --scheduling-policy fcfs, so a non-zero priority is
    a 400 naming the field (vLLM refuses it so too), on chat, completions and /generate; 0 passes."""
    assert _chat(server, priority=0).status_code == 200
    for r in (_chat(server, priority=-3), _post(server, "completions", prompt="Hi", max_tokens=1, priority=2),
              httpx.post(f"{server.http}/generate", timeout=60,
                         json={"text": "Hi", "sampling_params": {"max_new_tokens": 1, "priority": 1}})):
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
        assert "--scheduling-policy priority" in r.json()["error"]["message"]


def test_top_k_zero_is_disabled_and_a_negative_seed_is_a_seed(server: Server) -> None:
    """Current vLLM's top_k 0 means "no top-k" (-1 here, as SGLang); vLLM takes any int64 seed."""
    def text(**kw: Any) -> str:
        r = _post(server, "completions", prompt="Once upon a time", max_tokens=8, temperature=1.0, **kw)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    assert text(top_k=0, seed=7) == text(top_k=-1, seed=7) == text(seed=7)
    assert text(seed=-1) == text(seed=-1)
    assert _post(server, "completions", prompt="Hi", max_tokens=1, seed=2**64).status_code == 400


def test_no_stop_trim_keeps_the_stop_string(server: Server) -> None:
    body = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 12, "temperature": 0, "stop": [" 7"]}
    trimmed = _post(server, "completions", **body).json()["choices"][0]["text"]
    kept = _post(server, "completions", **body, no_stop_trim=True).json()["choices"][0]["text"]
    assert kept == trimmed + " 7" and kept == _post(server, "completions", **body,
                                                    include_stop_str_in_output=True).json()["choices"][0]["text"]


def test_truncate_prompt_tokens_keeps_the_last_tokens(server: Server) -> None:
    ids = list(range(1000, 1050))
    r = _post(server, "completions", prompt=ids, max_tokens=3, temperature=0, truncate_prompt_tokens=10, echo=True,
              logprobs=0)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 10
    same = _post(server, "completions", prompt=ids[-10:], max_tokens=3, temperature=0, echo=True, logprobs=0)
    assert r.json()["choices"][0]["text"] == same.json()["choices"][0]["text"]
    long_text = "word " * 20000  # far past the context: refused unread without truncation
    assert _post(server, "completions", prompt=long_text, max_tokens=2).status_code == 400
    r = _post(server, "completions", prompt=long_text, max_tokens=2, truncate_prompt_tokens=64)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 64, r.text
    r = _chat(server, truncate_prompt_tokens=5)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 5, r.text
    for bad in (0, -2, 10**6):
        r = _chat(server, truncate_prompt_tokens=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def test_add_special_tokens_is_taken(server: Server) -> None:
    """vLLM's default is false for chat (the template writes them) and true for a prompt."""
    plain = _chat(server).json()["usage"]["prompt_tokens"]
    assert _chat(server, add_special_tokens=False).json()["usage"]["prompt_tokens"] == plain
    assert _chat(server, add_special_tokens=True).status_code == 200
    r = _post(server, "completions", prompt="Hello there", max_tokens=1, add_special_tokens=False)
    assert r.status_code == 200, r.text


def test_logprobs_zero_gives_the_chosen_tokens_logprob(server: Server) -> None:
    """An audit: completions' logprobs 0 had top_logprobs null; vLLM gives each token's own."""
    r = _post(server, "completions", prompt="The capital", max_tokens=3, temperature=0, logprobs=0)
    lp = r.json()["choices"][0]["logprobs"]
    assert [list(d.items()) for d in lp["top_logprobs"]] == [[(t, v)] for t, v in
                                                             zip(lp["tokens"], lp["token_logprobs"], strict=True)]
    r = _post(server, "completions", prompt="The capital", max_tokens=2, temperature=0, logprobs=0, echo=True)
    tops = r.json()["choices"][0]["logprobs"]["top_logprobs"]
    assert tops[0] is None and all(len(d) == 1 for d in tops[1:])


def test_stop_reason_names_what_stopped_it(server: Server) -> None:
    """vLLM's stop_reason: the stop string or stop_token_ids entry; null for EOS or length."""
    body = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 12, "temperature": 0}
    assert _post(server, "completions", **body, stop=[" 7"]).json()["choices"][0]["stop_reason"] == " 7"
    assert _post(server, "completions", **body).json()["choices"][0]["stop_reason"] is None
    six = httpx.post(f"{server.http}/tokenize", json={"prompt": " 6"}, timeout=30).json()["tokens"][-1]
    got = _post(server, "completions", **body, stop_token_ids=[six]).json()["choices"][0]
    assert got["finish_reason"] == "stop" and got["stop_reason"] == six
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json={
            "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "stream": True, "stop": ["e"]}, timeout=120) as r:
        chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert '"stop_reason":"e"' in chunks[-1].replace(" ", "")
    assert _chat(server).json()["choices"][0]["stop_reason"] is None


def test_version(server: Server) -> None:
    r = httpx.get(f"{server.http}/version", timeout=30)
    assert r.status_code == 200 and r.json()["version"]


def test_generate_takes_sglangs_n(server: Server) -> None:
    """An audit: /generate refused sampling_params.n (SGLang's SamplingParams has it): n answers of
    one prompt, prompt-major for a batch; a seeded request's samples are seed + j, reproducible."""
    def gen(**body: Any) -> httpx.Response:
        return httpx.post(f"{server.http}/generate", json=body, timeout=120)

    sp = {"max_new_tokens": 6, "temperature": 1.0, "seed": 11, "n": 3}
    r = gen(text="Once upon a time", sampling_params=sp)
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, list) and len(out) == 3 and len({o["text"] for o in out}) > 1
    assert [o["text"] for o in gen(text="Once upon a time", sampling_params=sp).json()] == [o["text"] for o in out]
    one = gen(text="Once upon a time", sampling_params={**sp, "n": 1, "seed": 12}).json()
    assert one["text"] == out[1]["text"]  # sample 1 is seed + 1
    batch = gen(input_ids=[[504, 3575], [282, 4649, 314]], sampling_params={"max_new_tokens": 2, "temperature": 0,
                                                                            "n": 2}).json()
    assert len(batch) == 4 and batch[0]["output_ids"] == batch[1]["output_ids"]
    assert [b["meta_info"]["prompt_tokens"] for b in batch] == [2, 2, 3, 3]
    for bad in ({"n": 0}, {"n": 17}, {"n": "2"}):
        r = gen(text="x", sampling_params=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert gen(text="x", sampling_params={"n": 2}, stream=True).status_code == 400
    assert gen(text="x", sampling_params={"n": 1, "max_new_tokens": 1}).status_code == 200


def test_sglang_logprob_lists_are_there_when_no_token_came(server: Server) -> None:
    """An audit: with return_logprob, an answer of no tokens (max_new_tokens 0, or aborted while
    queued) lacked meta_info.output_token_logprobs, and clients indexing it broke."""
    r = httpx.post(f"{server.http}/generate", timeout=60, json={
        "text": "Hello", "sampling_params": {"max_new_tokens": 0}, "return_logprob": True})
    meta = r.json()["meta_info"]
    assert r.status_code == 200 and meta["output_token_logprobs"] == [] and meta["output_top_logprobs"] == []


def test_a_requests_chat_template_needs_the_servers_trust(server: Server) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "chat_template": "{{ messages[0].content }}"}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in r.json()["error"]["message"]


def test_get_server_info_is_sglangs(server: Server) -> None:
    """SGLang's /get_server_info: the arguments the server runs with (the test server's
    --max-total-tokens and --max-prefill-tokens), the KV pool's tokens, the longest request, the
    version; never the API key."""
    info = httpx.get(f"{server.http}/get_server_info", timeout=30).json()
    assert info["max_total_tokens"] == 16384 and info["max_prefill_tokens"] == 512
    assert info["max_total_num_tokens"] >= 16384 and info["max_total_num_tokens"] % info["page_size"] == 0
    version = httpx.get(f"{server.http}/version", timeout=30).json()["version"]
    assert info["version"] == version and "api_key" not in info
    stats = httpx.post(f"{server.http}/tokenize", json={"prompt": "x"}, timeout=30).json()
    assert info["max_req_input_len"] == stats["max_model_len"]
