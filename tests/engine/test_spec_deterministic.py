"""Speculative decoding in bf16 with deterministic inference on: a token's logits do not depend on
its row's shape (engine/layers/batch_invariant.py), so a verify row of k + 1 tokens scores each
position as a one-token decode step would, and every draft source answers the greedy tokens of
plain decoding bit for bit in bf16 too (the float32 checks: test_spec_engine.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import ServerConfig
from engine.local import LocalEngine
from engine.tokenizer import load_tokenizer
from msgs.params import SamplingParams

TEXTS = ["The quick brown fox jumps over the lazy dog. " * 3, "1, 2, 3, 4, 5, 6, 7, 8, 9,",
         "Once upon a time, in a small village"]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)


def _engine(model: str, **kw) -> LocalEngine:  # noqa: ANN003
    return LocalEngine(ServerConfig(model=model, dtype="bfloat16", enable_deterministic_inference=True,
                                    max_total_tokens=2048, max_running_requests=4, **kw))


@pytest.fixture(scope="module")
def setup(default_model_dir: Path) -> tuple[str, list[list[int]], list[list[int]]]:
    tok = load_tokenizer(str(default_model_dir))
    assert tok is not None
    prompts = [tok.encode(t) for t in TEXTS]
    want = [r.output_ids for r in _engine(str(default_model_dir)).generate(prompts, GREEDY)]
    return str(default_model_dir), prompts, want


@pytest.mark.parametrize("kw", [
    {"speculative_algorithm": "NGRAM", "max_prefill_tokens": 32},
    {"speculative_algorithm": "STANDALONE", "speculative_draft_layers": 6, "speculative_num_steps": 2},
], ids=["ngram", "self-draft"])
def test_bf16_deterministic_speculation_equals_plain(setup: tuple, kw: dict) -> None:
    model, prompts, want = setup
    eng = _engine(model, **kw)
    assert [r.output_ids for r in eng.generate(prompts, GREEDY)] == want
    again = eng.generate(prompts, GREEDY)  # prompts (and, for NGRAM, answers) from the prefix cache
    assert [r.output_ids for r in again] == want
    st = eng.core.state.spec_stats
    assert st.rows > 0 and 0 < st.accepted <= st.drafted, st
    assert eng.core.leak_free()
