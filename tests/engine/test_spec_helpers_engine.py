"""A json_schema request speculating with its grammar matchers in helper processes (the GPU's
default, here `grammar_helpers=2` on CPU): NGRAM drafts are verified with each drafted position
masked by the helpers, so the request answers the tokens it gets without speculation, valid
JSON, with drafts accepted, and no page left behind."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.config import ServerConfig
from engine.local import LocalEngine
from engine.serve.grammar import compilable, json_format
from engine.tokenizer import grammar_data, load_tokenizer, tokenizer_info
from msgs.params import Grammar, SamplingParams

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
PEOPLE = {"type": "array", "items": PERSON, "minItems": 2, "maxItems": 2}  # repeated keys: n-grams to draft
PROMPT = "Give me a JSON object with a person's name and age:"


def _engine(model: str, **kw) -> LocalEngine:  # noqa: ANN003
    # one torch thread: the helpers need a core of the 2-core CI host (OpenMP barriers stall otherwise)
    return LocalEngine(ServerConfig(model=model, dtype="float32", max_total_tokens=2048, max_running_requests=4,
                                    cpu_threads=1, **kw))


@pytest.fixture(autouse=True, scope="module")
def _threads_back() -> Iterator[None]:
    """The engines set torch's thread count process-wide: give the next module the one it had."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _grammar(path: str, vocab: int, schema: dict, key: str) -> Grammar:
    tok = load_tokenizer(path)
    assert tok is not None
    info = tokenizer_info(tok.hf, vocab)
    tag = {"type": "structural_tag", "format": json_format(schema)}
    return Grammar(key, grammar_data(compilable(json.dumps(tag))), [int(t) for t in info.stop_token_ids])


def test_json_schema_speculates_with_grammar_helpers(default_model_dir: Path) -> None:
    path = str(default_model_dir)
    tok = load_tokenizer(path)
    assert tok is not None
    spec = _engine(path, speculative_algorithm="NGRAM", grammar_helpers=2)
    try:
        grammar = spec.runner.grammar
        assert grammar._helpers is not None and grammar.verifies_drafts
        vocab = spec.runner.mcfg.vocab_size
        params = [SamplingParams(max_new_tokens=64, temperature=0, grammar=_grammar(path, vocab, PEOPLE, "people")),
                  SamplingParams(max_new_tokens=40, temperature=0, grammar=_grammar(path, vocab, PERSON, "person"))]
        prompts = [tok.encode(PROMPT)] * 2  # slots 0 and 1: one in each helper
        got = spec.generate(prompts, params)
        st = spec.core.state.spec_stats
        assert st.rows > 0 and st.accepted > 0, st  # drafts verified, some accepted
        assert grammar.rejected == 0 and spec.core.leak_free()
    finally:
        spec.runner.grammar.close()
    want = _engine(path).generate(prompts, params)  # in-process matchers, no speculation
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert [r.finish_reason for r in got] == ["stop", "stop"]
    docs = [json.loads(tok.decode(r.output_ids)) for r in got]
    assert len(docs[0]) == 2 and all(set(d) == {"name", "age"} for d in docs[0]) and set(docs[1]) == {"name", "age"}
