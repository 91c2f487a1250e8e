"""A served model's generation_config.json sampling defaults (--sampling-defaults model, the
default) reach every front: a request that leaves temperature unset on a model that recommends
temperature 0 gets the greedy answer, over /v1/completions, /v1/chat/completions, /generate and
the SDK; one that sets it gets what it set. The same server runs `--grammar-backend none`: every
constraint is a 400 and no grammar checker process starts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from msgs.sdk import Client
from tests.integration.conftest import Server, start_server, stop_server

PROMPT = "Once upon a time, in a small village,"


@pytest.fixture(scope="module")
def greedy_model(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The default model, its generation_config.json recommending temperature 0."""
    model = tmp_path_factory.mktemp("model")
    for f in default_model_dir.iterdir():
        if f.name != "generation_config.json":
            (model / f.name).symlink_to(f)
    gen = json.loads((default_model_dir / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.0}))
    srv = start_server(tmp_path_factory.mktemp("logs"), "--model", str(model), "--max-total-tokens", "4096",
                       "--grammar-backend", "none")
    yield srv
    stop_server(srv)


def _completion(srv: Server, **params: object) -> tuple[str, list[float]]:
    body = {"prompt": PROMPT, "max_tokens": 12, "logprobs": 0, "seed": 3, **params}
    r = httpx.post(f"{srv.http}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def test_an_unset_temperature_is_the_model_s(greedy_model: Server) -> None:
    srv = greedy_model
    greedy = _completion(srv, temperature=0)
    sampled = _completion(srv, temperature=1.0)
    assert sampled != greedy  # what OpenAI's default (1.0) would give here: the test can tell them apart
    assert _completion(srv) == greedy
    assert _completion(srv, temperature=None) == greedy  # null is unset too (OpenAI's clients send it)
    gen = {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "seed": 3}}
    r = httpx.post(f"{srv.http}/generate", json=gen, timeout=120)
    assert r.status_code == 200 and r.json()["text"] == greedy[0], r.text
    gen["sampling_params"]["temperature"] = 1.0
    assert httpx.post(f"{srv.http}/generate", json=gen, timeout=120).json()["text"] == sampled[0]
    with Client(srv.sdk) as c:
        assert c.generate(PROMPT, max_new_tokens=12, seed=3).text == greedy[0]
        assert c.generate(PROMPT, max_new_tokens=12, seed=3, temperature=None).text == greedy[0]  # null: unset
        assert c.generate(PROMPT, max_new_tokens=12, seed=3, temperature=1.0).text == sampled[0]
    chat = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8, "seed": 3}
    unset = httpx.post(f"{srv.http}/v1/chat/completions", json=chat, timeout=120).json()
    zero = httpx.post(f"{srv.http}/v1/chat/completions", json={**chat, "temperature": 0}, timeout=120).json()
    assert unset["choices"][0]["message"] == zero["choices"][0]["message"]


def test_grammar_backend_none_refuses_constraints_and_runs_no_checker(greedy_model: Server) -> None:
    srv = greedy_model
    chat = {"messages": [{"role": "user", "content": "A name?"}], "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}}
    gen = {"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "regex": "[a-z]+"}}
    for path, body, param in (("/v1/chat/completions", chat, "response_format"), ("/generate", gen, "regex")):
        r = httpx.post(f"{srv.http}{path}", json=body, timeout=120)
        assert r.status_code == 400 and "--grammar-backend none" in r.text and param in r.text, r.text
    r = httpx.post(f"{srv.http}/v1/chat/completions", json={**chat, "response_format": None}, timeout=120)
    assert r.status_code == 200, r.text  # the server serves on
    procs = psutil.Process(srv.proc.pid).children(recursive=True)
    assert any("procs.tokenizer" in p.cmdline() for p in procs)
    assert not any("engine.serve.grammar_checker" in p.cmdline() for p in procs)
