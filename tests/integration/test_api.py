"""The OpenAI-compatible API through the real stack (bin/serve, all processes, real model)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.integration.conftest import Server

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


def chat(client: openai.OpenAI, text: str, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], **kw)


def test_chat_greedy_answers_and_counts_usage(client: openai.OpenAI) -> None:
    # Japan, not France: SmolLM2's first token for France is a near tie (0.08 nats) that bf16
    # (any path) may break the other way; float32 and deterministic bf16 both answer Tokyo
    r = chat(client, "What is the capital of Japan?", max_tokens=16, temperature=0)
    assert "Tokyo" in r.choices[0].message.content
    assert r.usage.completion_tokens <= 16 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.choices[0].finish_reason in ("stop", "length")


def test_the_readme_question_twice_gives_one_answer(client: openai.OpenAI, server: Server) -> None:
    """Issue 21: the README's question at temperature 0, fresh and then with its prompt from the
    prefix cache, streamed and not, on the CPU default (deterministic inference on, as /health
    says; bf16 where the CPU has native bf16, else float32): one answer, and its first token's
    logprobs bit for bit. tests/engine/test_deterministic.py checks batches, chunks and overlap."""
    assert httpx.get(f"{server.http}/health").json() == {"status": "ok", "deterministic": True}
    kw = dict(max_tokens=32, temperature=0, logprobs=True, top_logprobs=2)
    question = "What is the capital of France?"
    first, again = (chat(client, question, **kw) for _ in range(2))
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert "Paris" in first.choices[0].message.content
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.choices[0].logprobs.content[0] == first.choices[0].logprobs.content[0]
    streamed = list(chat(client, question, stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == first.choices[0].message.content


def test_completion_stream_equals_non_stream(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt="The three primary colors are", max_tokens=20, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text and text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # vLLM's continuous_usage_stats: the usage so far in every chunk, its completion count growing to the total
    every = list(client.completions.create(
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}, **kw))
    counts = [c.usage.completion_tokens for c in every if c.choices]
    assert counts == sorted(counts) and counts[-1] == full.usage.completion_tokens and counts[0] < counts[-1]
    assert all(c.usage.prompt_tokens == full.usage.prompt_tokens for c in every)


def test_chat_stream_finishes(client: openai.OpenAI) -> None:
    stream = chat(client, "Say hello.", max_tokens=12, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert "".join(c.choices[0].delta.content or "" for c in chunks).strip()


def test_stop_string_trims_text(client: openai.OpenAI) -> None:
    base = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    text = base.choices[0].text
    assert "," in text, text
    cut = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[","])
    assert cut.choices[0].text == text[: text.index(",")]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[","], stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text
    kept = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[","],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == text[: text.index(",") + 1] and kept.choices[0].finish_reason == "stop"


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = chat(client, "Name a fruit.", max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        tops = item.top_logprobs
        assert len(tops) == 3 and item.logprob <= 0
        assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert tops[0].token == item.token and abs(tops[0].logprob - item.logprob) < 1e-4  # greedy


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens
    # the chosen token always, then the top 2: "up to logprobs+1 elements" (OpenAI's legacy completions)
    assert all(len(t) <= 3 and tok in t for t, tok in zip(lp.top_logprobs, lp.tokens, strict=True))


def test_streamed_logprobs_and_usage_match_non_stream(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=2)
    full = client.completions.create(**kw).choices[0].logprobs
    chunks = list(client.completions.create(stream=True, **kw))
    lps = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for lp in lps for t in lp.tokens] == full.tokens
    offsets = [o for lp in lps for o in lp.text_offset]
    assert offsets == full.text_offset  # offsets continue across chunks
    chat_kw = dict(max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    whole = chat(client, "Name a fruit.", **chat_kw)
    parts = list(chat(client, "Name a fruit.", stream=True, stream_options={"include_usage": True}, **chat_kw))
    got = [item.token for p in parts if p.choices and p.choices[0].logprobs for item in p.choices[0].logprobs.content]
    assert got == [item.token for item in whole.choices[0].logprobs.content]
    assert parts[0].choices[0].delta.role == "assistant"
    assert parts[-1].usage is not None and parts[-1].usage.completion_tokens == whole.usage.completion_tokens
    every = list(chat(client, "Name a fruit.", stream=True,
                      stream_options={"include_usage": True, "continuous_usage_stats": True}, **chat_kw))
    assert every[0].choices[0].delta.role == "assistant" and every[0].usage.completion_tokens == 0
    assert all(p.usage.prompt_tokens == whole.usage.prompt_tokens for p in every)
    assert every[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_seed_reproducible_and_n(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=42)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    c = client.completions.create(**{**kw, "seed": 7}).choices[0].text
    assert a == b and a != c
    many = client.completions.create(**{**kw, "n": 3})
    assert sorted(ch.index for ch in many.choices) == [0, 1, 2]
    assert len({ch.text for ch in many.choices}) >= 2


def test_models_health_and_request_id(server: Server, client: openai.OpenAI) -> None:
    models = httpx.get(f"{server.base_url}/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL  # GET /v1/models/{model}
    with pytest.raises(openai.NotFoundError, match="The model `no-such-model` does not exist."):
        client.models.retrieve("no-such-model")  # the wording of a request's unknown model, vLLM's
    assert httpx.get(f"{server.http}/health").status_code == 200
    r = httpx.post(
        f"{server.base_url}/completions",
        headers={"x-request-id": "my-rid-1"},
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "my-rid-1"


def test_native_generate_with_ids(server: Server) -> None:
    r = httpx.post(
        f"{server.http}/generate",
        timeout=60,
        json={"input_ids": [504, 3575, 282, 4649, 314], "sampling_params": {"max_new_tokens": 5, "temperature": 0}},
    )
    body = r.json()
    assert r.status_code == 200, body
    assert len(body["output_ids"]) == 5 and body["meta_info"]["prompt_tokens"] == 5


def test_logit_bias_bans_and_forces_tokens(client: openai.OpenAI, server: Server) -> None:
    """OpenAI's logit_bias through the whole stack: -100 bans the greedy first token (native
    /generate, ids in and out), +100 forces a token at every step, and in a chat completion too."""
    def gen(**sampling) -> list[int]:  # noqa: ANN003
        r = httpx.post(f"{server.http}/generate", timeout=60, json={
            "input_ids": [504, 3575, 282, 4649, 314], "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                        "ignore_eos": True, **sampling}})
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    plain = gen()
    banned = gen(logit_bias={str(plain[0]): -100})
    assert banned[0] != plain[0]
    assert gen(logit_bias={"1234": 100}) == [1234] * 4
    forced = chat(client, "What is the capital of Japan?", max_tokens=3, temperature=0.7, seed=1,
                  logit_bias={"1234": 100})
    again = chat(client, "What is the capital of Japan?", max_tokens=3, temperature=0, logit_bias={"1234": 100})
    assert forced.choices[0].message.content == again.choices[0].message.content
    assert forced.usage.completion_tokens == 3


def test_min_tokens_holds_off_eos_and_stop_strings(client: openai.OpenAI) -> None:
    """vLLM's min_tokens: the answer that ended with EOS goes on past it, its greedy text the
    short answer's continuation; a stop string in the first min_tokens tokens does not end it."""
    q = "What is the capital of Japan?"
    short = chat(client, q, max_tokens=40, temperature=0)
    n = short.usage.completion_tokens
    assert short.choices[0].finish_reason == "stop" and n < 30, short  # ended by EOS
    long = chat(client, q, max_tokens=40, temperature=0, extra_body={"min_tokens": n + 5})
    assert long.usage.completion_tokens >= n + 5
    assert long.choices[0].message.content.startswith(short.choices[0].message.content)
    held = chat(client, q, max_tokens=40, temperature=0, stop=["Tokyo"], extra_body={"min_tokens": n})
    assert "Tokyo" in held.choices[0].message.content and held.usage.completion_tokens >= n
    cut = chat(client, q, max_tokens=40, temperature=0, stop=["Tokyo"])
    assert "Tokyo" not in cut.choices[0].message.content and cut.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        chat(client, q, max_tokens=3, extra_body={"min_tokens": 4})


def test_tokenize_and_detokenize_agree_with_generation(client: openai.OpenAI, server: Server) -> None:
    """vLLM's /tokenize and /detokenize: chat messages count what the chat endpoint prompts with,
    a prompt's ids are what /generate counts for its text, and detokenize inverts tokenize."""
    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{server.http}{path}", timeout=60, json=body)

    messages = [{"role": "user", "content": "What is the capital of Japan?"}]
    tok = post("/tokenize", {"model": MODEL, "messages": messages}).json()
    used = chat(client, messages[0]["content"], max_tokens=1, temperature=0).usage.prompt_tokens
    assert tok["count"] == len(tok["tokens"]) == used and tok["max_model_len"] > used and tok["token_strs"] is None
    text = "The quick brown fox jumps over the lazy dog."
    ids = post("/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert len(ids["token_strs"]) == ids["count"] and "".join(ids["token_strs"]).replace("\u0120", " ") == text
    gen = post("/generate", {"text": text, "sampling_params": {"max_new_tokens": 1}}).json()
    assert gen["meta_info"]["prompt_tokens"] == ids["count"]
    assert post("/detokenize", {"tokens": ids["tokens"]}).json() == {"prompt": text}
    info = httpx.get(f"{server.http}/tokenizer_info", timeout=60).json()  # lm-eval's remote tokenizer check
    assert info["eos_token"] and info["chat_template"] and info["model_max_length"] == tok["max_model_len"]
    eos = post("/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert len(eos) == 1 and post("/detokenize", {"tokens": eos}).json()["prompt"] == info["eos_token"]
    for path, body, status in (("/tokenize", {}, 400), ("/tokenize", {"prompt": "a", "messages": messages}, 400),
                               ("/tokenize", {"prompt": "a", "bogus": 1}, 400), ("/detokenize", {"tokens": [-1]}, 400),
                               ("/detokenize", {"tokens": [10**9]}, 400), ("/detokenize", {"tokens": "ab"}, 400),
                               ("/tokenize", {"model": "no-such-model", "prompt": "a"}, 404),
                               ("/tokenize", {"messages": messages, "tools": [{"bad": 1}]}, 400)):  # as chat checks
        r = post(path, body)
        assert r.status_code == status and "error" in r.json(), (path, body, r.text)


def test_echo_logprobs_score_the_prompt_as_lm_eval_asks(server: Server) -> None:
    """lm-evaluation-harness's loglikelihood request (completions, token ids, echo, logprobs 1,
    max_tokens 1): the prompt's tokens with logprobs (the first null), then the completion's;
    the same scores as /generate's SGLang-style input_token_logprobs."""
    ids = [504, 3575, 282, 4649, 314, 3575, 282]
    r = httpx.post(f"{server.http}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": [ids], "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x <= 0 for x in lp["token_logprobs"][1:])
    for tok, v, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
        assert top[tok] == v and len(top) in (1, 2)  # the prompt's own token, and the top 1 where it is not it
    assert choice["text"].startswith("".join(lp["tokens"][: len(ids)]))
    native = httpx.post(f"{server.http}/generate", timeout=60, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0, "prompt_logprobs": 2}}).json()
    scores = native["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in scores] == ids and scores[0][0] is None
    assert [round(v, 4) for v, _, _ in scores[1:]] == [round(v, 4) for v in lp["token_logprobs"][1 : len(ids)]]
    assert len(native["meta_info"]["input_top_logprobs"][1]) == 2
    chunks = [json.loads(line[6:]) for line in httpx.post(f"{server.http}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": [ids], "max_tokens": 3, "temperature": 0, "logprobs": 1, "echo": True,
        "stream": True}).text.splitlines() if line.startswith("data: {")]
    streamed = [c["choices"][0] for c in chunks if c["choices"]]
    whole = httpx.post(f"{server.http}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": [ids], "max_tokens": 3, "temperature": 0, "logprobs": 1, "echo": True}).json()
    assert "".join(c["text"] for c in streamed) == whole["choices"][0]["text"]
    for key in ("tokens", "token_logprobs", "text_offset"):  # the prompt's part arrives first, then each token's
        assert [x for c in streamed for x in c["logprobs"][key]] == whole["choices"][0]["logprobs"][key], key
    zero = httpx.post(f"{server.http}/v1/completions", timeout=60, json={  # the prompt scored, nothing generated
        "model": MODEL, "prompt": [ids], "max_tokens": 0, "temperature": 0, "logprobs": 1, "echo": True}).json()
    zc = zero["choices"][0]
    assert zc["finish_reason"] == "length" and zero["usage"]["completion_tokens"] == 0, zero
    assert zc["logprobs"]["token_logprobs"] == lp["token_logprobs"][: len(ids)]
    assert zc["logprobs"]["tokens"] == lp["tokens"][: len(ids)] and zc["text"] == "".join(lp["tokens"][: len(ids)])
    bare = httpx.post(f"{server.http}/generate", timeout=60, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 0, "prompt_logprobs": 2}}).json()["meta_info"]
    assert bare["input_token_logprobs"] == scores and bare["completion_tokens"] == 0
    bad = httpx.post(f"{server.http}/generate", timeout=60, json={"input_ids": ids,
                                                                  "sampling_params": {"prompt_logprobs": 21}})
    assert bad.status_code == 400 and "prompt_logprobs" in bad.text, bad.text


def test_vllm_prompt_logprobs_on_chat_and_completions(client: openai.OpenAI, server: Server) -> None:
    """vLLM's prompt_logprobs: null, then per prompt token {id: {logprob, rank, decoded_token}}
    with its top alternatives; the chat prompt's scores are /generate's for the same ids."""
    messages = [{"role": "user", "content": "What is the capital of Japan?"}]
    r = httpx.post(f"{server.http}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}).json()
    ids = httpx.post(f"{server.http}/tokenize", timeout=60, json={"messages": messages}).json()["tokens"]
    scores = r["prompt_logprobs"]
    assert len(scores) == len(ids) == r["usage"]["prompt_tokens"] and scores[0] is None
    native = httpx.post(f"{server.http}/generate", timeout=60, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0, "prompt_logprobs": 2}}).json()
    for entry, (v, t, _), top in zip(scores[1:], native["meta_info"]["input_token_logprobs"][1:],
                                     native["meta_info"]["input_top_logprobs"][1:], strict=True):
        assert round(entry[str(t)]["logprob"], 4) == round(v, 4)
        assert [entry[str(a)]["rank"] for _, a, _ in top] == [1, 2] and len(entry) in (2, 3)
    comp = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0,
                                     extra_body={"prompt_logprobs": 0})
    assert [list(e) for e in comp.choices[0].prompt_logprobs[1:]] == [[str(t)] for t in ids[1:]]
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model=MODEL, prompt="x", stream=True, extra_body={"prompt_logprobs": 1})


def test_sglang_batch_and_logprob_fields_as_lm_eval_sends_them(server: Server) -> None:
    """lm-evaluation-harness's sglang-generate loglikelihood request: a batch of input_ids with
    SGLang's top-level return_logprob, logprob_start_len 0 and top_logprobs_num 1; a list of
    answers whose input_token_logprobs equal the sampling_params form's, one at a time."""
    ids = [[504, 3575, 282, 4649, 314], [3575, 282, 4649, 314, 3575, 282]]

    def gen(body: dict) -> httpx.Response:
        return httpx.post(f"{server.http}/generate", timeout=60, json=body)

    r = gen({"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
             "logprob_start_len": 0, "top_logprobs_num": 1, "return_logprob": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, list) and len(out) == 2
    for one, prompt in zip(out, ids, strict=True):
        meta = one["meta_info"]
        scores, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
        assert [t for _, t, _ in scores] == prompt and scores[0][0] is None and tops[0] is None
        assert all(len(t) == 1 for t in tops[1:]) and len(meta["output_token_logprobs"]) == 1
        alone = gen({"input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0,
                                                              "prompt_logprobs": 0}}).json()["meta_info"]
        assert [round(v, 4) for v, _, _ in scores[1:]] == [round(v, 4) for v, _, _ in alone["input_token_logprobs"][1:]]
    texts = gen({"text": ["The capital of France is", "Hello, how are you?"], "sampling_params": {"max_new_tokens": 2},
                 "return_logprob": True, "logprob_start_len": 2, "return_text_in_logprobs": True}).json()
    first = texts[0]["meta_info"]
    assert len(first["input_token_logprobs"]) == first["prompt_tokens"] - 2
    assert all(isinstance(e[2], str) for e in first["input_token_logprobs"] + first["output_token_logprobs"])
    for body in ({"input_ids": ids, "stream": True}, {"input_ids": [1, [2]]}, {"text": ["a"], "input_ids": [[1]]},
                 {"input_ids": [[1, 2], 3]}, {"input_ids": [[1, 2], 3.5]}, {"input_ids": [[1], True]},
                 {"input_ids": ids[0], "return_logprob": True, "logprob_start_len": 5}, {"input_ids": []}):
        bad = gen(body)
        assert bad.status_code == 400 and "error" in bad.json(), (body, bad.text)


def test_sglang_health_generate_and_model_info(server: Server) -> None:
    """SGLang's probes: /health_generate answers one generated token; /get_model_info the model."""
    r = httpx.get(f"{server.http}/health_generate", timeout=60)
    assert r.status_code == 200 and r.json()["status"] == "ok" and len(r.json()["output_ids"]) == 1, r.text
    info = httpx.get(f"{server.http}/get_model_info", timeout=60).json()
    assert info["is_generation"] is True and info["served_model_name"] == MODEL and info["model_path"]


def test_chat_continues_the_final_assistant_message(client: openai.OpenAI) -> None:
    """vLLM's continue_final_message: the answer continues the assistant's open message."""
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                       extra_body={"add_generation_prompt": False, "continue_final_message": True})
    text = r.choices[0].message.content
    assert "Paris" in text and not text.lstrip().startswith("The"), text  # not a new turn
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                       extra_body={"continue_final_message": True})


@pytest.mark.parametrize(
    "body,status",
    [
        ("{not json", 400),
        (json.dumps({"model": MODEL, "messages": "hi"}), 400),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "bogus_field": 1}), 400),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}), 400),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}), 400),
        (json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}), 404),
        (json.dumps({"model": MODEL, "messages": []}), 400),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -2}), 400),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x " * 20000}]}), 400),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 0}), 400),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "max"}), 400),
    ],
)
def test_bad_input_gets_4xx_with_openai_error(server: Server, body: str, status: int) -> None:
    r = httpx.post(
        f"{server.base_url}/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=60
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]


def test_an_agent_loop_turn_and_openai_fields_vllm_takes(client: openai.OpenAI, server: Server) -> None:
    """What agent frameworks send: an assistant turn that only called a tool (content null), the
    tool's answer, and OpenAI's reasoning_effort (to the template, which may ignore it); SGLang's
    /generate with stop as one string."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21C"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                       reasoning_effort="low")
    assert r.choices[0].finish_reason == "length" and r.usage.prompt_tokens > 20
    g = httpx.post(f"{server.http}/generate", timeout=60,
                   json={"text": "1, 2, 3,", "sampling_params": {"max_new_tokens": 16, "temperature": 0, "stop": ","}})
    assert g.status_code == 200 and "," not in g.json()["text"], g.text
    # SGLang's meta_info.finish_reason: an object saying what matched, or how long it ran
    assert g.json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": ","}, g.text

    def finish(params: dict) -> tuple[dict, list[int]]:
        out = httpx.post(f"{server.http}/generate", timeout=60,
                         json={"text": "1, 2, 3,", "sampling_params": {"temperature": 0, **params}}).json()
        return out["meta_info"]["finish_reason"], out["output_ids"]

    reason, ids = finish({"max_new_tokens": 3, "ignore_eos": True})
    assert reason == {"type": "length", "length": 3} and len(ids) == 3
    reason, ids = finish({"max_new_tokens": 8, "stop_token_ids": [ids[1]]})  # the second token, as an id
    assert reason == {"type": "stop", "matched": ids[-1]} and len(ids) == 2


def test_chat_template_failure_is_400(server: Server) -> None:
    # a content part type the template cannot render
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    }
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)
    assert 400 <= r.status_code < 500, r.text


def test_client_disconnect_frees_pages(server: Server) -> None:
    body = {
        "model": MODEL,
        "prompt": "Tell me a long story about dragons.",
        "max_tokens": 400,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data:") for line in got)
    m = server.wait_idle()
    assert m["strata_running_requests"] == 0 and m["strata_waiting_requests"] == 0
    assert m["strata_kv_leak_free"] == 1
    assert m["strata_kv_pages_used"] == m["strata_kv_cache_pages"]  # only the prefix cache holds pages
    cached = {"model": MODEL, "prompt": "Tell me a long story about dragons. " * 8, "max_tokens": 2}
    assert httpx.post(f"{server.base_url}/completions", json=cached, timeout=60).status_code == 200
    m = server.wait_idle()  # an audit: an idle server's pool is all prefix cache, free at need (SGLang's token_usage)
    assert m["strata_kv_cache_pages"] > 0 and m["strata_kv_usage"] == 0


def test_64_concurrent_streams_all_complete(server: Server) -> None:
    async def one(ac: openai.AsyncOpenAI, i: int) -> tuple[str, str]:
        stream = await ac.completions.create(
            model=MODEL, prompt=f"Item {i}:", max_tokens=8 + i % 5, temperature=0.7, seed=i, stream=True
        )
        text, reason = "", None
        async for c in stream:
            text += c.choices[0].text
            reason = c.choices[0].finish_reason or reason
        return text, reason

    async def main() -> list[tuple[str, str]]:
        ac = openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)
        return await asyncio.gather(*(one(ac, i) for i in range(64)))

    before = server.metrics()["strata_requests_total"]
    results = asyncio.run(main())
    assert len(results) == 64 and all(reason in ("stop", "length") for _, reason in results)
    m = server.wait_idle()
    assert m["strata_requests_total"] - before >= 64
    assert m["strata_kv_leak_free"] == 1 and m["strata_kv_pages_used"] == m["strata_kv_cache_pages"]


def test_metrics_exposed(server: Server) -> None:
    text = httpx.get(f"{server.http}/metrics").text
    for name in (
        "strata_requests_total",
        "strata_prompt_tokens_total",
        "strata_generation_tokens_total",
        'strata_cache_hit_tokens_total{tier="l1"}',
        "strata_kv_pages_used",
        "strata_ttft_seconds_bucket",
        "strata_step_seconds_bucket",
    ):
        assert name in text, name
    m = httpx.get(f"{server.http}/metrics").text
    hits = [line for line in m.splitlines() if line.startswith('strata_cache_hit_tokens_total{tier="l1"}')]
    assert float(hits[0].split()[-1]) > 0  # repeated chat prefixes hit the radix cache


def test_metrics_count_rejections_by_status_and_ends_by_reason(server: Server) -> None:
    """An audit: /metrics had no count of refused requests nor of how requests ended."""
    def value(name: str) -> float:
        line = [x for x in httpx.get(f"{server.http}/metrics").text.splitlines() if x.startswith(name + " ")]
        return float(line[0].split()[-1]) if line else 0.0

    rejected, length = 'strata_requests_rejected_total{status="400"}', 'strata_requests_finished_total{reason="length"}'
    before = (value(rejected), value(length))
    bad = httpx.post(f"{server.http}/generate", timeout=60, json={"input_ids": [1, 2], "sampling_params": {"top_p": 7}})
    assert bad.status_code == 400, bad.text
    ok = httpx.post(f"{server.http}/generate", timeout=60,
                    json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
    assert ok.status_code == 200, ok.text
    assert (value(rejected), value(length)) == (before[0] + 1, before[1] + 1)


def test_native_errors_name_the_fields_sent(server: Server) -> None:
    """An audit: /generate's 400s named OpenAI's fields (max_tokens, top_logprobs) for SGLang's
    max_new_tokens and top_logprobs_num."""
    def error(body: dict) -> dict:
        r = httpx.post(f"{server.http}/generate", timeout=60, json={"input_ids": [1, 2], **body})
        assert r.status_code == 400, r.text
        return r.json()["error"]

    too_long = error({"sampling_params": {"max_new_tokens": 10**6}})
    assert too_long["param"] == "max_new_tokens" and too_long["message"].startswith("max_new_tokens"), too_long
    tops = error({"return_logprob": True, "top_logprobs_num": 21})
    assert tops["param"] == "top_logprobs_num" and "top_logprobs_num must be in [0, 20]" in tops["message"], tops


def test_sglang_abort_request_ends_requests_with_what_they_generated(server: Server) -> None:
    """SGLang's POST /abort_request: by rid (a stream, and an n > 1 chat by its own rid: both
    choices), or abort_all; each client gets its partial answer with finish_reason "abort", the
    others run on, and no page leaks."""
    long = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
    abort = f"{server.http}/abort_request"
    with httpx.stream("POST", f"{server.http}/generate", timeout=120,
                      json={"text": "Tell me a story.", "sampling_params": long, "stream": True, "rid": "ab-1"}) as r:
        events = r.iter_lines()
        first = next(e for e in events if e.startswith("data:"))
        assert httpx.post(abort, json={"rid": "ab-1"}, timeout=30).json() == {"status": "ok", "aborted": 1}
        last = [e for e in events if e.startswith("data:") and e != "data: [DONE]"][-1]
    meta = json.loads(last[5:])["meta_info"]
    assert meta["finish_reason"] == {"type": "abort"}, meta
    assert len(json.loads(first[5:])["output_ids"]) <= meta["completion_tokens"] < 400

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as ac:
            chat = ac.post(f"{server.base_url}/chat/completions", headers={"x-request-id": "ab-2"},
                           json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 2,
                                 "max_tokens": 400, "temperature": 0.8, "ignore_eos": True})
            other = ac.post(f"{server.http}/generate", json={"text": "Hello", "sampling_params": {
                "max_new_tokens": 12, "temperature": 0, "ignore_eos": True}})
            rest = [asyncio.ensure_future(c) for c in (chat, other)]
            while (await ac.post(abort, json={"rid": "ab-2"})).json()["aborted"] < 2:
                await asyncio.sleep(0.05)  # (until both choices are in flight)
            return [await f for f in rest]

    chat, other = asyncio.run(main())
    assert [c["finish_reason"] for c in chat.json()["choices"]] == ["abort", "abort"], chat.text
    assert chat.json()["usage"]["completion_tokens"] < 800
    assert other.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 12}, other.text

    async def everything() -> list[dict]:
        async with httpx.AsyncClient(timeout=120) as ac:
            reqs = [asyncio.ensure_future(ac.post(f"{server.http}/generate", json={
                "text": f"Story {i}:", "sampling_params": long})) for i in range(2)]
            while (await ac.post(abort, json={"abort_all": True})).json()["aborted"] < 2:
                await asyncio.sleep(0.05)
            return [(await f).json() for f in reqs]

    assert [b["meta_info"]["finish_reason"] for b in asyncio.run(everything())] == [{"type": "abort"}] * 2
    for bad in ({"rid": ""}, {"rid": 5}, {"rid": "x", "why": 1}, {}):
        r = httpx.post(abort, json=bad, timeout=30)
        assert r.status_code == 400, (bad, r.text)
    assert httpx.post(abort, json={"rid": "nobody"}, timeout=30).json() == {"status": "ok", "aborted": 0}
    m = server.wait_idle()
    assert m["strata_kv_leak_free"] == 1 and m["strata_kv_pages_used"] == m["strata_kv_cache_pages"]
