"""bin/serve --tp-size 2 with --speculative-algorithm NGRAM: verify steps and their multi-token
answers cross the real processes (Step with drafts, SpecDone, TrimReq on both ranks' replicas and
the scheduler's mirror, digests and token chains compared every 8 steps: a rank that trimmed
differently stops the server); max_tokens and stop strings hold exactly; the accept length reaches
/metrics and the scheduler's log; no page leaks when idle.
(Token-for-token equality with speculation off: tests/engine/test_spec_engine.py.)"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import Server, start_server, stop_server

PROMPT = "The quick brown fox jumps over the lazy dog. " * 3


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    os.environ["STRATA_DIGEST_EVERY"] = "8"
    try:
        srv = start_server(tmp_path_factory.mktemp("spec-logs"), "--tp-size", "2", "--cpu-threads", "1",
                           "--dtype", "float32", "--max-total-tokens", "4096",
                           "--speculative-algorithm", "NGRAM", "--speculative-num-steps", "4")
    finally:
        del os.environ["STRATA_DIGEST_EVERY"]
    yield srv
    assert stop_server(srv) == 0


def _complete(srv: Server, **body) -> dict:  # noqa: ANN003
    body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "temperature": 0, **body}
    r = httpx.post(f"{srv.base_url}/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_speculative_server_answers_exactly(spec_server: Server) -> None:
    full = _complete(spec_server, max_tokens=24, ignore_eos=True)
    use = full["usage"]
    assert use["completion_tokens"] == 24
    # the request's own accept length: its verify rows answered more than a token each
    details = use["completion_tokens_details"]
    assert use["spec_accept_length"] > 1.5 and details["accepted_prediction_tokens"] > 0
    # drafts are accepted or rejected, at most --speculative-num-steps (4) a verify row: rows from the
    # accept length ((rows + accepted) / rows)
    rows = round(details["accepted_prediction_tokens"] / (use["spec_accept_length"] - 1))
    drafted = details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"]
    assert 0 < rows and details["rejected_prediction_tokens"] >= 0 and drafted <= 4 * rows, (rows, details)
    r = httpx.post(f"{spec_server.http}/generate", timeout=120, json={
        "text": PROMPT, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}})
    meta = r.json()["meta_info"]
    # its tokens: the prefill's first, then (1 + accepted) per verify row (accept length x rows), plain rows
    rows = meta["spec_verify_ct"]
    assert 0 < rows and meta["spec_accept_length"] > 1.5 and round(meta["spec_accept_length"] * rows) <= 23
    text = full["choices"][0]["text"]
    for n in (3, 10):  # a multi-token step answers past max_tokens: cut exactly
        assert _complete(spec_server, max_tokens=n, ignore_eos=True)["usage"]["completion_tokens"] == n
    stop = "lazy"
    assert stop in text
    tokens = _complete(spec_server, max_tokens=24, ignore_eos=True, logprobs=0)["choices"][0]["logprobs"]["tokens"]
    done = next(i for i in range(len(tokens)) if stop in "".join(tokens[: i + 1])) + 1
    answer = _complete(spec_server, max_tokens=24, ignore_eos=True, stop=[stop], logprobs=0)
    cut = answer["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == text[: text.index(stop)]
    # tokens and usage end at the token that completed the stop, within a multi-token step too
    assert cut["logprobs"]["tokens"] == tokens[:done] and answer["usage"]["completion_tokens"] == done
    m = spec_server.wait_idle()
    assert m["strata_kv_leak_free"] == 1
    count, total = m["strata_spec_accept_length_count"], m["strata_spec_accept_length_sum"]
    assert count > 0 and total / count > 1.5, (count, total)
    lines = [json.loads(line) for line in Path(spec_server.log_dir, "scheduler.log").read_text().splitlines()
             if '"speculative decoding"' in line]
    assert lines and lines[-1]["accept_length"] > 1.5
    assert m["strata_spec_empty_rows_total"] >= lines[-1]["empty"] >= 0  # rows that found no draft


def test_a_stop_token_inside_a_verify_row_counts_only_the_drafts_kept(spec_server: Server) -> None:
    """An audit: accepted drafts after a stop token were counted in accepted_prediction_tokens (OpenAI's:
    prediction tokens that appear in the completion), which could pass completion_tokens."""
    def generate(**params) -> dict:  # noqa: ANN003
        r = httpx.post(f"{spec_server.http}/generate", timeout=120, json={"text": PROMPT, "sampling_params": {
            "max_new_tokens": 24, "temperature": 0, "ignore_eos": True, **params}})
        assert r.status_code == 200, r.text
        return r.json()

    ids = generate()["output_ids"]
    i = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])  # inside the first verify row's answer
    meta = generate(stop_token_ids=[ids[i]])["meta_info"]
    assert meta["completion_tokens"] == i + 1
    use = _complete(spec_server, max_tokens=24, ignore_eos=True, stop_token_ids=[ids[i]])["usage"]
    assert use["completion_tokens"] == i + 1
    assert 0 < use["completion_tokens_details"]["accepted_prediction_tokens"] <= i  # (the first is the prefill's)


def test_speculative_tp2_gives_the_plain_tp1_tokens(spec_server: Server, server: Server,
                                                   default_model_dir: Path) -> None:
    """Greedy tokens equal a plain float32 engine's (tp=1, speculation off, in process: the session's
    server runs --dtype auto, bf16 on a CPU with native bf16, so it is no reference for a float32
    server): NGRAM verification at tp=2 changes no token. (Its stop strings: the test above.)"""
    from engine.config import ServerConfig
    from engine.local import LocalEngine
    from msgs.params import SamplingParams

    prompt = httpx.post(f"{spec_server.http}/tokenize", json={"prompt": PROMPT}, timeout=60).json()["tokens"]
    r = httpx.post(f"{spec_server.http}/generate", timeout=120, json={
        "input_ids": prompt, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    eng = LocalEngine(ServerConfig(model=str(default_model_dir), device="cpu", dtype="float32",
                                   max_total_tokens=4096))
    want = eng.generate([prompt], SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True))[0]
    assert r.json()["output_ids"] == want.output_ids
    plain = _complete(server, max_tokens=4)
    assert "spec_accept_length" not in plain["usage"]  # no speculation, no such counts


def test_a_predicted_output_is_drafted_from(spec_server: Server) -> None:
    """OpenAI's chat `prediction` (a string, or text parts): the answer is the same, and a prediction
    that is the answer is accepted as drafts far more than the prompt's own tokens give; a prediction
    of another shape is a 400 naming it."""
    def chat(**extra: object) -> dict:
        r = httpx.post(f"{spec_server.base_url}/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Write a short poem about the sea."}], "max_tokens": 32,
            "temperature": 0, "ignore_eos": True, **extra})
        assert r.status_code == 200, r.text
        return r.json()

    plain = chat()
    text = plain["choices"][0]["message"]["content"]
    for prediction in ({"type": "content", "content": text},
                       {"type": "content", "content": [{"type": "text", "text": text[:40]}, {"type": "text",
                                                                                             "text": text[40:]}]}):
        got = chat(prediction=prediction)
        assert got["choices"][0]["message"]["content"] == text
        accepted = got["usage"]["completion_tokens_details"]["accepted_prediction_tokens"]
        assert accepted >= 16 and accepted > 2 * plain["usage"]["completion_tokens_details"][
            "accepted_prediction_tokens"], (got["usage"], plain["usage"])
    for bad in ("text", {"type": "audio", "content": "x"}, {"type": "content", "content": [{"type": "image"}]}):
        r = httpx.post(f"{spec_server.base_url}/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prediction": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prediction", r.text
