"""Request validation: every bad input maps to a 4xx with an OpenAI-style body."""

from __future__ import annotations

import msgspec
import pytest

from engine.serve.errors import ApiError, api_error_body, error_body, from_validation
from engine.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateBody,
    check_unsupported,
    decode_body,
)
from engine.serve.validate import (
    Limits,
    as_sent,
    check_ids,
    check_length,
    check_model,
    check_params,
    check_rid,
    check_unset,
    completion_prompts,
    fan_out,
    make_params,
    native_params,
    native_prompt,
    native_request,
    openai_params,
    prediction_ids,
    resolve_max_tokens,
    text_features,
)
from engine.tokenizer import load_tokenizer
from models.default_model import ensure_default_model
from msgs.params import SamplingParams

LIMITS = Limits(max_context=100, vocab_size=1000)
CHAT_OK = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


def _raises(status: int, fn, *args, param: str | None = "", **kw) -> ApiError:  # noqa: ANN001
    with pytest.raises(ApiError) as info:
        fn(*args, **kw)
    err = info.value
    assert err.status == status, err.message
    if param != "":
        assert err.param == param, (err.param, err.message)
    body = api_error_body(err)["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert body["type"] == ("invalid_request_error" if status < 500 else "server_error")
    return err


# -- bodies -----------------------------------------------------------------------------


def test_valid_bodies_decode() -> None:
    req = decode_body(CHAT_OK, ChatCompletionRequest)
    assert req.messages[0].content == "hi" and req.n == 1
    comp = decode_body(b'{"prompt": [1, 2], "user": "u", "max_tokens": 3}', CompletionRequest)
    assert comp.prompt == [1, 2]


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        (b"{not json", None, "invalid JSON"),
        (b"", None, "empty"),
        (b"[1, 2]", None, "object"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}', "max_tokens", "int"),
        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature", "float"),
        (b'{"messages": [{"role": "user", "content": "x"}], "n": true}', "n", "int"),
        (b'{"messages": [{"role": "user", "content": "x"}], "frobnicate": 1}', "frobnicate", "unknown"),
        (b'{"messages": [{"role": "user", "content": "x"}], "stop": [1]}', "stop[0]", "str"),
        (b'{"messages": "hello"}', "messages", "array"),
        (b'{"model": "m"}', "messages", "missing"),
        (b'{"messages": [{"content": "x"}]}', "messages[0]", "role"),
    ],
)
def test_bad_chat_bodies_are_400(body: bytes, param: str | None, needle: str) -> None:
    err = _raises(400, decode_body, body, ChatCompletionRequest, param=param)
    assert needle in err.message


def test_null_fields_mean_the_default() -> None:
    body = (
        b'{"messages": [{"role": "user", "content": "x"}], "n": null, "stream": null, "logprobs": null,'
        b' "max_tokens": null, "temperature": null, "stop": null, "ignore_eos": null, "skip_special_tokens": null}'
    )
    req = decode_body(body, ChatCompletionRequest)
    assert req.n == 1 and req.stream is False and req.ignore_eos is False and req.skip_special_tokens is True
    params = make_params(openai_params(req), 5)
    assert params.logprobs is False and params.temperature == 1.0 and params.stop == []


def test_generate_null_fields_mean_the_default() -> None:
    """/generate's sampling_params: null is unset, as the README says, with or without model defaults
    (it was so only for the fields the model's generation_config sets)."""
    raw = decode_body(b'{"text": "x", "sampling_params": {"temperature": null, "stop": null, "top_k": null,'
                      b' "seed": null, "max_new_tokens": 3}}', GenerateBody).sampling_params
    params, given = native_params(raw)
    assert params.temperature == 1.0 and params.stop == [] and params.top_k == -1 and params.seed is None and given
    params, _ = native_params(raw, {"temperature": 0.6, "top_k": 20})
    assert params.temperature == 0.6 and params.top_k == 20 and params.stop == []
    params, given = native_params({"max_new_tokens": None})  # null max_new_tokens: to the context's end
    assert not given and params.max_new_tokens > 10**9
    _raises(400, native_params, {"bogus": None}, param="sampling_params.bogus")  # unknown, null or not


def _chat(extra: str) -> ChatCompletionRequest:
    return decode_body(b'{"messages": [{"role": "user", "content": "x"}], ' + extra.encode() + b"}",
                       ChatCompletionRequest)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ('"max_completion_tokens": 200', "max_completion_tokens"),
        ('"max_tokens": 200', "max_tokens"),
        ('"guided_choice": ["' + "y" * 70000 + '"]', "guided_choice"),
        ('"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"description": "'
         + "d" * 70000
         + '"}}}', "response_format"),
        ('"response_format": {"type": "json_object"}, "regex": "a+"', "response_format"),
        ('"guided_regex": "' + "a" * 70000 + '"', "guided_regex"),
    ],
)
def test_errors_name_the_field_the_client_sent(extra: str, param: str) -> None:
    """Checks after openai_params see SamplingParams' names (json_schema, regex, ebnf, max_tokens);
    as_sent turns them back into the body's (response_format, guided_*, max_completion_tokens)."""
    req = _chat(extra)

    def build() -> SamplingParams:
        with as_sent(req):
            kw = openai_params(req)
            want = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            max_new = resolve_max_tokens(want, None, 10, LIMITS)
            check_length(10, max_new, LIMITS)
            return make_params(kw, max_new, LIMITS.vocab_size)

    err = _raises(400, build, param=param)
    assert err.message.startswith(param) or "maximum context length" in err.message, err.message


def test_repetition_penalty_keeps_its_reciprocal_finite() -> None:
    """Below float32's normal range the sampler's logits / penalty overflowed (1e-45 passed as > 0)."""
    for bad in (1e-45, 1e-31, 0.0):
        assert "repetition_penalty" in (SamplingParams(repetition_penalty=bad).validate() or "")
    assert SamplingParams(repetition_penalty=1e-30).validate() is None


def test_unknown_sampling_param_in_generate() -> None:
    body = decode_body(b'{"text": "x", "sampling_params": {"max_new_tokens": 2, "bogus": 1}}', GenerateBody)
    _raises(400, native_params, body.sampling_params, param="sampling_params.bogus")
    body = decode_body(b'{"text": "x", "sampling_params": {"temperature": "x"}}', GenerateBody)
    _raises(400, native_params, body.sampling_params, param="sampling_params.temperature")
    _raises(400, decode_body, b'{"text": "x", "prompt": "y"}', GenerateBody, param="prompt")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ('"stream_options": {"include_usage": true}', "stream_options"),
        ('"response_format": {"type": "xml"}', "response_format"),
        ('"modalities": ["audio"]', "modalities"),
    ],
)
def test_unsupported_chat_features_are_400(extra: str, param: str) -> None:
    req = decode_body(
        b'{"messages": [{"role": "user", "content": "x"}], ' + extra.encode() + b"}", ChatCompletionRequest
    )
    _raises(400, check_unsupported, req, param=param)


def test_logit_bias_keys_become_token_ids_checked_against_the_vocabulary() -> None:
    def chat(bias: str) -> ChatCompletionRequest:
        return decode_body(b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": ' + bias.encode() + b"}",
                           ChatCompletionRequest)

    kw = openai_params(chat('{"5": 1.5, "999": -100}'))
    assert make_params(kw, 4, LIMITS.vocab_size).logit_bias == {5: 1.5, 999: -100.0}
    # decimal digits only (int() takes the others), and few (int() refuses 4,300 digits: was a 500)
    for key in ("five", "-1", " 5 ", "05", "1_0", "\u0663", "", "1" * 5000):
        _raises(400, openai_params, chat(f'{{"{key}": 1}}'), param="logit_bias")
    _raises(400, chat, '{"5": "a lot"}')  # the body's type check
    for bad in ('{"1000": 1}', '{"5": 100.5}', "{" + ", ".join(f'"{i}": 1' for i in range(301)) + "}"):
        _raises(400, make_params, openai_params(chat(bad)), 4, LIMITS.vocab_size, param="logit_bias")


def test_min_tokens_is_vllms_name_for_min_new_tokens_and_at_most_max_tokens() -> None:
    def chat(extra: str) -> ChatCompletionRequest:
        return decode_body(b'{"messages": [{"role": "user", "content": "x"}], ' + extra.encode() + b"}",
                           ChatCompletionRequest)

    assert make_params(openai_params(chat('"min_tokens": 4')), 4).min_new_tokens == 4
    assert make_params(openai_params(chat('"min_tokens": null')), 4).min_new_tokens == 0
    for bad in ('"min_tokens": 5', '"min_tokens": -1'):
        _raises(400, make_params, openai_params(chat(bad)), 4, param="min_tokens")
    _raises(400, chat, '"min_tokens": 1.5')  # the body's type check
    params, _ = native_params({"min_new_tokens": 3, "max_new_tokens": 8})
    assert params.min_new_tokens == 3


def test_harmless_unimplemented_fields_pass() -> None:
    body = (
        b'{"messages": [{"role": "user", "content": "x"}], "user": "u", "logit_bias": {}, "store": false,'
        b' "response_format": {"type": "text"}, "parallel_tool_calls": true, "stream": true,'
        b' "stream_options": {"include_usage": true}, "metadata": {"a": "b"}}'
    )
    check_unsupported(decode_body(body, ChatCompletionRequest))
    comp = decode_body(b'{"prompt": "x", "echo": false, "best_of": 1, "n": 1}', CompletionRequest)
    check_unsupported(comp)


@pytest.mark.parametrize(
    ("extra", "param"),
    [('"prompt_logprobs": 1, "stream": true', "prompt_logprobs"), ('"suffix": "s"', "suffix"),
     ('"best_of": 3', "best_of")],
)
def test_unsupported_completion_features_are_400(extra: str, param: str) -> None:
    req = decode_body(b'{"prompt": "x", ' + extra.encode() + b"}", CompletionRequest)
    _raises(400, check_unsupported, req, param=param)


# -- model, params, limits --------------------------------------------------------------


def test_unknown_model_is_404_model_not_found() -> None:
    err = _raises(404, check_model, "gpt-4", ("smol", "/models/smol"), param="model")
    assert err.code == "model_not_found"
    check_model("smol", ("smol",))
    check_model(None, ("smol",))


@pytest.mark.parametrize("n", [0, 17, -1])
def test_n_out_of_range(n: int) -> None:
    req = decode_body(b'{"prompt": "x", "n": %d}' % n, CompletionRequest)
    _raises(400, openai_params, req, param="n")


def test_top_logprobs_needs_logprobs() -> None:
    req = decode_body(b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', ChatCompletionRequest)
    _raises(400, openai_params, req, param="top_logprobs")


@pytest.mark.parametrize("body, kind, param", [
    (b'{"prompt": "x", "logprobs": 21}', CompletionRequest, "logprobs"),  # was "top_logprobs", absent here
    (b'{"prompt": "x", "logprobs": -1}', CompletionRequest, "logprobs"),
    (b'{"prompt": "x", "max_tokens": -1}', CompletionRequest, "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}', ChatCompletionRequest,
     "max_completion_tokens"),  # was reported as max_tokens
])
def test_an_error_names_the_field_the_client_sent(body: bytes, kind: type, param: str) -> None:
    err = _raises(400, openai_params, decode_body(body, kind), param=param)
    assert param in err.message


def test_openai_params_mapping() -> None:
    req = decode_body(
        b'{"messages": [{"role": "user", "content": "x"}], "stop": "END", "temperature": 0, "seed": 7,'
        b' "logprobs": true, "top_logprobs": 3, "top_k": 5, "ignore_eos": true, "stop_token_ids": [9],'
        b' "skip_special_tokens": false, "presence_penalty": 0.5}',
        ChatCompletionRequest,
    )
    params = make_params(openai_params(req), 10)
    assert params.stop == ["END"] and params.temperature == 0 and params.seed == 7
    assert params.logprobs and params.top_logprobs == 3 and params.top_k == 5
    assert params.ignore_eos and params.stop_token_ids == [9] and not params.skip_special_tokens
    assert params.presence_penalty == 0.5 and params.max_new_tokens == 10
    comp = decode_body(b'{"prompt": "x", "logprobs": 2}', CompletionRequest)
    kw = openai_params(comp)
    assert kw["logprobs"] is True and kw["top_logprobs"] == 2


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("temperature", -1.0, "temperature"),
        ("top_p", 0.0, "top_p"),
        ("top_k", 0, "top_k"),
        ("min_p", 2.0, "min_p"),
        ("repetition_penalty", 0.0, "repetition_penalty"),
        ("frequency_penalty", 3.0, "frequency_penalty"),
        ("presence_penalty", -3.0, "presence_penalty"),
        ("top_logprobs", 21, "top_logprobs"),
        ("stop", [""], "stop"),
        ("seed", -1, "seed"),
        ("max_new_tokens", -1, "max_tokens"),
        ("stop", ["x"] * 17, "stop"),
        ("stop_token_ids", [1] * 257, "stop_token_ids"),
    ],
)
def test_sampling_params_problems_are_400(field: str, value: object, param: str) -> None:
    _raises(400, check_params, SamplingParams(**{field: value}), param=param)


def test_two_constraints_name_the_first_given() -> None:
    _raises(400, check_params, SamplingParams(json_schema="{}", regex="a+"), param="json_schema")
    _raises(400, check_params, SamplingParams(regex="a+", ebnf='root ::= "a"'), param="regex")


def test_max_tokens_resolution() -> None:
    assert resolve_max_tokens(None, None, 30, LIMITS) == 70  # chat: whatever the context leaves
    assert resolve_max_tokens(None, 16, 30, LIMITS) == 16
    assert resolve_max_tokens(None, 16, 95, LIMITS) == 5  # a default never overflows
    assert resolve_max_tokens(40, 16, 30, LIMITS) == 40
    _raises(400, resolve_max_tokens, -1, None, 30, LIMITS, param="max_tokens")


def test_context_length_checks() -> None:
    check_length(30, 70, LIMITS)
    err = _raises(400, check_length, 100, 1, LIMITS, param="prompt")
    assert "maximum context length is 100 tokens, but the prompt has 100 tokens" in err.message
    err = _raises(400, check_length, 150, 0, LIMITS, "messages", param="messages")
    assert "but the messages have 150 tokens" in err.message
    err = _raises(400, check_length, 10, 101, LIMITS, param="max_tokens")
    assert "larger than the maximum context length" in err.message
    err = _raises(400, check_length, 60, 50, LIMITS, "messages", param="max_tokens")
    assert "you requested 110 tokens (60 in the messages, 50 in the completion)" in err.message


def test_token_id_checks() -> None:
    check_ids([0, 999], LIMITS)
    _raises(400, check_ids, [], LIMITS, param="prompt")
    err = _raises(400, check_ids, [1, 1000], LIMITS, param="prompt")
    assert "1000" in err.message
    _raises(400, check_ids, [-1], LIMITS, "input_ids", param="input_ids")


# -- prompts and fan-out ----------------------------------------------------------------


def test_completion_prompt_shapes(text_tok) -> None:
    assert completion_prompts([1, 2, 3], None, LIMITS) == [[1, 2, 3]]
    assert completion_prompts([[1], [2, 3]], None, LIMITS) == [[1], [2, 3]]
    assert completion_prompts("hello", text_tok, LIMITS) == [text_tok.encode("hello")]
    assert len(completion_prompts(["a", "b"], text_tok, LIMITS)) == 2
    _raises(400, completion_prompts, [], text_tok, LIMITS, param="prompt")
    _raises(400, completion_prompts, [1, "a"], text_tok, LIMITS, param="prompt")
    _raises(400, completion_prompts, [True, 2], text_tok, LIMITS, param="prompt")
    _raises(400, completion_prompts, "text", None, LIMITS, param="prompt")  # ids-only mode


class _Untouchable:
    """A tokenizer that fails the test if anything is encoded with it."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"tokenized before the prompt count was checked ({name})")


def test_too_many_prompts_are_refused_before_any_is_tokenized() -> None:
    """An audit's 1M one-character prompts were all tokenized (and given params on the event loop)
    before fan_out refused them: 10 s to 5 min of a stalled server for a 400."""
    with pytest.raises(ApiError, match="at most 256 prompts x n") as info:
        completion_prompts(["a"] * 257, _Untouchable(), LIMITS)
    assert info.value.status == 400 and info.value.param == "prompt"
    with pytest.raises(ApiError, match="got 64 x 5") as info:
        completion_prompts([[1]] * 64, _Untouchable(), LIMITS, n=5)
    assert info.value.param == "n"
    assert len(completion_prompts([[1]] * 64, _Untouchable(), LIMITS, n=4)) == 64


def test_no_length_bound_where_one_token_can_stand_for_any_text(text_tok) -> None:
    """The bound holds only where no step can swallow text (a review's counterexamples: an added
    token with rstrip took 8,007 characters of whitespace as 1 token; a fused unknown, 10,000)."""
    import copy
    import json

    from engine.tokenizer import _bounded

    spec = json.loads(text_tok.hf.backend_tokenizer.to_str())
    assert _bounded(spec)
    changes = [("added_tokens", lambda s: s["added_tokens"][0].update(rstrip=True)),
               ("pre_tokenizer", lambda s: s.update(pre_tokenizer={"type": "WhitespaceSplit"})),
               ("pre_tokenizer", lambda s: s.update(pre_tokenizer={"type": "Sequence", "pretokenizers": [
                   {"type": "ByteLevel"}, {"type": "Split", "behavior": "Removed"}]})),
               ("normalizer", lambda s: s.update(normalizer={"type": "Strip", "left": True, "right": True})),
               ("model", lambda s: s["model"].update(type="WordPiece")),
               ("model", lambda s: s["model"].update(fuse_unk=True))]
    for _, change in changes:
        broken = copy.deepcopy(spec)
        change(broken)
        assert not _bounded(broken)
    kept = copy.deepcopy(spec)
    kept["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [{"type": "Split", "behavior": "Isolated"},
                                                                    {"type": "ByteLevel"}]}  # Llama 3's shape
    assert _bounded(kept)


def test_a_text_too_long_for_the_context_is_refused_before_it_is_tokenized(text_tok, monkeypatch) -> None:
    """No token of the default model stands for more than its longest piece's characters, so a
    text longer than max_context times that cannot fit: a 400 without tokenizing it. A text just
    under the bound is tokenized and counted as before."""
    longest = text_tok.max_piece_chars
    assert longest == max(len(p) for p in text_tok.hf.get_vocab()) > 1
    assert text_tok.fewest_tokens("x" * (3 * longest + 1)) == 4
    worst = max(text_tok.hf.get_vocab(), key=len)  # the longest piece, as text
    text = text_tok.decode(text_tok.encode(worst * 3, add_special_tokens=False))
    assert len(text_tok.encode(text, add_special_tokens=False)) >= text_tok.fewest_tokens(text)
    huge = "a" * (LIMITS.max_context * longest)
    calls = []
    monkeypatch.setattr(text_tok, "encode", lambda *a, **k: calls.append(a) or [1])
    for call, param in (((completion_prompts, huge, text_tok, LIMITS), "prompt"),
                        ((native_prompt, huge, None, text_tok, LIMITS), "prompt")):
        err = _raises(400, *call, param=param)
        assert f"has at least {LIMITS.max_context} tokens ({len(huge)} characters)" in err.message
    assert calls == []
    assert completion_prompts(huge[:-longest], text_tok, LIMITS) == [[1]] and len(calls) == 1


def test_fan_out_n_and_seeds() -> None:
    base = SamplingParams(seed=10)
    (one,) = fan_out("r", [[1, 2]], [base], 1)
    assert one.rid == "r" and one.index == 0
    subs = fan_out("r", [[1, 2]], [base], 3)
    assert [s.rid for s in subs] == ["r-0", "r-1", "r-2"]
    assert [s.params.seed for s in subs] == [10, 11, 12]
    unseeded = fan_out("r", [[1], [2]], [SamplingParams(), SamplingParams()], 2)
    assert [(s.rid, s.index, s.prompt_index) for s in unseeded] == [
        ("r-0", 0, 0),
        ("r-1", 1, 0),
        ("r-2", 2, 1),
        ("r-3", 3, 1),
    ]
    assert all(s.params.seed is None for s in unseeded)
    _raises(400, fan_out, "r", [[1]] * 100, [base] * 100, 16, param="n")


def test_native_requests(text_tok) -> None:
    params, given = native_params({"temperature": 0})
    assert not given and params.max_new_tokens == 128
    assert native_params({"max_new_tokens": 5})[1]
    assert native_params({"stop": "x"})[0].stop == native_params({"stop": ["x"]})[0].stop == ["x"]  # SGLang's str
    _raises(400, native_params, {"stop": 3}, param="sampling_params.stop")
    assert native_params({"stop": ",", "no_stop_trim": True})[0].include_stop_str_in_output  # SGLang's name
    params, given = native_params({"max_new_tokens": None})  # SGLang's "up to the context's end"
    assert not given and params.max_new_tokens > 2**30
    _raises(400, native_prompt, None, None, text_tok, LIMITS, param="text")
    _raises(400, native_prompt, "x", [1], text_tok, LIMITS, param="text")
    _raises(400, native_prompt, "x", None, None, LIMITS, param="text")  # ids-only mode
    assert native_prompt(None, [4, 5], None, LIMITS) == [4, 5]
    clipped = native_request([1] * 90, params, False, LIMITS, text_tok)
    assert clipped.max_new_tokens == 10  # an unset default is clipped to the context left
    assert native_request([1] * 30, *native_params({"max_new_tokens": None}), LIMITS, text_tok).max_new_tokens == 70
    _raises(400, native_request, [1] * 90, SamplingParams(max_new_tokens=20), True, LIMITS, text_tok)
    _raises(400, native_request, [1], SamplingParams(stop=["x"]), True, LIMITS, None, param="stop")


def test_request_ids() -> None:
    assert check_rid("abc-123_:.") == "abc-123_:."
    for bad in ("", "has space", "x" * 257, "tab\there", "nl\n"):
        _raises(400, check_rid, bad, "x-request-id", param="x-request-id")


def test_error_body_shape() -> None:
    assert error_body(404, "nope", "model", "model_not_found") == {
        "error": {"message": "nope", "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    }
    assert error_body(500, "boom")["error"]["type"] == "server_error"


def test_a_wrongly_typed_dict_key_names_its_field() -> None:
    """msgspec reports a dict key of the wrong type as "at `key` in `$.field`": the 400 names the
    field (under the native route's sampling_params prefix too), as for any other field."""
    with pytest.raises(msgspec.ValidationError) as exc:
        msgspec.convert({"logit_bias": {"abc": 1.0}}, SamplingParams, str_keys=True)
    assert from_validation(exc.value).param == "logit_bias"
    err = from_validation(exc.value, "sampling_params")
    assert err.param == "sampling_params.logit_bias" and "$.sampling_params.logit_bias" in err.message


def test_an_sdk_frames_unset_names_only_defaults_it_left() -> None:
    check_unset(["temperature", "top_p"], SamplingParams())  # what the client sends
    for unset, params in ((["no_such"], SamplingParams()), (["temperature"], SamplingParams(temperature=0.0))):
        with pytest.raises(ApiError) as err:
            check_unset(unset, params)
        assert err.value.status == 400 and err.value.param == "unset"


def test_ids_the_front_end_derives_are_checked_against_the_vocabulary() -> None:
    """bad_words and a chat prediction become token ids at the edge: ids past the model's vocabulary
    (a tokenizer larger than the model's embedding) are a 400 there, naming the field the client
    sent, not an error at the scheduler; within it they pass."""
    tok = load_tokenizer(str(ensure_default_model()))
    small = Limits(max_context=100, vocab_size=100)  # the words' tokens are past 100
    params = SamplingParams(bad_words=["Paris"])
    with pytest.raises(ApiError) as err:
        text_features(params, tok, small)
    assert err.value.status == 400 and err.value.param == "bad_words", err.value.message
    assert text_features(params, tok, Limits(max_context=100, vocab_size=49152)).bad_words_ids
    body = msgspec.json.encode({"messages": [{"role": "user", "content": "hi"}],
                                "prediction": {"type": "content", "content": "Paris"}})
    req = decode_body(body, ChatCompletionRequest)
    kw = {**openai_params(req), "prediction_ids": prediction_ids(tok, req.prediction)}
    with pytest.raises(ApiError) as err, as_sent(req):
        make_params(kw, 8, small.vocab_size)
    assert err.value.status == 400 and err.value.param == "prediction", err.value.message
