"""The model's generation_config.json sampling defaults: read once, refused when unusable, and
filling only what a request leaves unset (OpenAI body, /generate sampling_params)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config import ServerConfig
from engine.serve.protocol import ChatCompletionRequest, CompletionRequest, decode_body
from engine.serve.sampling_defaults import model_sampling_defaults
from engine.serve.validate import native_params, openai_params


def _dir(tmp_path: Path, gen: object) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    return str(tmp_path)


def test_the_fields_the_file_sets_are_read(tmp_path: Path) -> None:
    assert model_sampling_defaults(str(tmp_path)) == {}  # no file
    qwen3 = {"do_sample": True, "eos_token_id": [1, 2], "temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert model_sampling_defaults(_dir(tmp_path, qwen3)) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert model_sampling_defaults(_dir(tmp_path, {"top_k": 0, "min_p": 0.05, "repetition_penalty": 1.1,
                                                   "top_p": None})) == {
        "top_k": -1, "min_p": 0.05, "repetition_penalty": 1.1}  # HF's top_k 0 is off: our -1


@pytest.mark.parametrize("gen, problem", [({"top_p": 0}, "top_p"), ({"temperature": "hot"}, "temperature"),
                                          ({"repetition_penalty": 5.0}, "repetition_penalty"), ([1, 2], "object")])
def test_an_unusable_file_fails_the_start_naming_the_field(tmp_path: Path, gen: object, problem: str) -> None:
    with pytest.raises(ValueError, match=problem) as info:
        model_sampling_defaults(_dir(tmp_path, gen))
    assert "generation_config.json" in str(info.value)


def test_the_flag_takes_model_or_openai() -> None:
    assert ServerConfig().sampling_defaults == "model"
    assert ServerConfig(sampling_defaults="openai").sampling_defaults == "openai"
    with pytest.raises(ValueError, match="--sampling-defaults"):
        ServerConfig(sampling_defaults="vllm")


def test_defaults_fill_only_what_a_request_leaves_unset() -> None:
    defaults = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    chat = decode_body(b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 0.5, "temperature": null}',
                       ChatCompletionRequest)
    kw = openai_params(chat, defaults)
    assert (kw["temperature"], kw["top_k"], kw["top_p"]) == (0.6, 20, 0.5)
    assert "min_p" not in kw and "temperature" not in openai_params(chat)
    completion = decode_body(b'{"prompt": "hi", "temperature": 0, "top_k": -1}', CompletionRequest)
    kw = openai_params(completion, defaults)
    assert (kw["temperature"], kw["top_k"], kw["top_p"]) == (0, -1, 0.95)
    params, _ = native_params({"temperature": 1.0, "max_new_tokens": 3}, defaults)
    assert (params.temperature, params.top_k, params.top_p, params.max_new_tokens) == (1.0, 20, 0.95, 3)
    assert native_params(None, defaults)[0].temperature == 0.6
    assert native_params({"temperature": None}, defaults)[0].temperature == 0.6  # null is unset, as over OpenAI
    assert native_params(None)[0].temperature == 1.0
