"""vLLM's allowed_token_ids through the engine: greedy tokens are transformers' argmax over the
allowed set at every step (float32, the same weights), and with NGRAM speculation (chains and
draft trees) greedy and seeded sampled answers are the plain engine's, every token in the set."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import ServerConfig
from engine.local import LocalEngine
from msgs.params import SamplingParams

ALLOWED = [7, 8, 9, 10, 11, 12, 40, 41]
LOOP = [7, 8, 9, 10, 11] * 4  # NGRAM finds drafts in its own tokens


def _engine(path: Path, **kw) -> LocalEngine:  # noqa: ANN003
    return LocalEngine(ServerConfig(model=str(path), dtype="float32", page_size=4, max_prefill_tokens=16,
                                    max_total_tokens=1024, **kw))


def test_greedy_is_transformers_argmax_over_the_allowed_set(tiny: Path) -> None:
    prompt = [3, 50, 60, 70, 80, 90, 100]
    got = _engine(tiny).generate([prompt], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True,
                                                          allowed_token_ids=ALLOWED))[0].output_ids
    model = AutoModelForCausalLM.from_pretrained(tiny, torch_dtype=torch.float32)
    ids, want = list(prompt), []
    with torch.no_grad():
        for _ in range(12):
            logits = model(torch.tensor([ids])).logits[0, -1]
            best = ALLOWED[int(logits[ALLOWED].argmax())]
            want.append(best)
            ids.append(best)
    assert got == want
    assert len(set(want)) > 1  # the set's argmax moves: not a constant answer


@pytest.mark.parametrize("spec", [{}, {"speculative_eagle_topk": 3, "speculative_num_draft_tokens": 8}],
                         ids=["chains", "trees"])
def test_speculation_keeps_the_plain_answers(tiny: Path, spec: dict) -> None:
    greedy = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True, allowed_token_ids=ALLOWED)
    sampled = SamplingParams(max_new_tokens=30, temperature=0.9, seed=4, ignore_eos=True, allowed_token_ids=ALLOWED)
    want = _engine(tiny).generate([LOOP, LOOP], [greedy, sampled])
    eng = _engine(tiny, speculative_algorithm="NGRAM", **spec)
    got = eng.generate([LOOP, LOOP], [greedy, sampled])
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    assert all(set(g.output_ids) <= set(ALLOWED) for g in got)
    assert eng.core.state.spec_stats.accepted > 0, "drafts were verified and accepted"
    assert eng.core.leak_free()
