"""Sampling restrictions through the engine (token ids: LocalEngine has no front end), against
transformers on the same weights (float32) and against the plain engine under NGRAM speculation
(chains and draft trees, greedy and seeded sampled answers):

* vLLM's allowed_token_ids: greedy tokens are transformers' argmax over the allowed set;
* vLLM's bad_words (as token sequences): greedy tokens are transformers' argmax with vLLM's rule
  applied at every step (a sequence's last token masked where the output so far ends with the rest).
"""

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
SPEC = pytest.mark.parametrize("spec", [{}, {"speculative_eagle_topk": 3, "speculative_num_draft_tokens": 8}],
                               ids=["chains", "trees"])


def _engine(path: Path, **kw) -> LocalEngine:  # noqa: ANN003
    return LocalEngine(ServerConfig(model=str(path), dtype="float32", page_size=4, max_prefill_tokens=16,
                                    max_total_tokens=1024, **kw))


def _speculation_keeps(path: Path, spec: dict, prompt: list[int], params: list[SamplingParams]) -> list[list[int]]:
    """The answers under NGRAM speculation (drafts verified and accepted) = the plain engine's; returned."""
    want = _engine(path).generate([prompt] * len(params), params)
    eng = _engine(path, speculative_algorithm="NGRAM", **spec)
    got = [g.output_ids for g in eng.generate([prompt] * len(params), params)]
    assert got == [w.output_ids for w in want]
    assert eng.core.state.spec_stats.accepted > 0, "drafts were verified and accepted"
    assert eng.core.leak_free()
    return got


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


@SPEC
def test_allowed_tokens_under_speculation(tiny: Path, spec: dict) -> None:
    greedy = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True, allowed_token_ids=ALLOWED)
    sampled = SamplingParams(max_new_tokens=30, temperature=0.9, seed=4, ignore_eos=True, allowed_token_ids=ALLOWED)
    got = _speculation_keeps(tiny, spec, LOOP, [greedy, sampled])
    assert all(set(g) <= set(ALLOWED) for g in got)


def _banned(words: list[list[int]], output: list[int]) -> set[int]:
    """vLLM's rule: a word's last token, where the output ends with the rest of the word."""
    return {w[-1] for w in words if len(w) - 1 <= len(output) and output[len(output) - len(w) + 1:] == w[:-1]}


def _contains(output: list[int], word: list[int]) -> bool:
    return any(output[i:i + len(word)] == word for i in range(len(output) - len(word) + 1))


def test_greedy_is_transformers_argmax_without_the_banned_tokens(tiny: Path) -> None:
    prompt = [3, 50, 60, 70, 80, 90, 100]
    n = 16
    eng = _engine(tiny)
    free = eng.generate([prompt], SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))[0].output_ids
    # words that bite: one token of the free answer, and its pairs / triples further on (their prefixes
    # come up only if the answer gets there again)
    words = [[free[3]], free[1:3], free[5:8], free[9:11]]
    got = eng.generate([prompt], SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True,
                                                bad_words_ids=words))[0].output_ids
    model = AutoModelForCausalLM.from_pretrained(tiny, torch_dtype=torch.float32)
    ids, want, bans = list(prompt), [], 0
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            banned = _banned(words, want)
            bans += len(banned)
            logits[list(banned)] = float("-inf")
            want.append(int(logits.argmax()))
            ids.append(want[-1])
    assert got == want
    assert got != free and bans > n  # the words changed the answer, and more than the one-token word banned
    assert not any(_contains(got, w) for w in words)
    assert eng.core.leak_free()


@SPEC
def test_bad_words_under_speculation(tiny: Path, spec: dict) -> None:
    """The prompt is a context where the model's greedy answer has fallen into a loop, so NGRAM drafts the
    loop and the target follows it; a pair of the loop is a bad word: a verify row's history holds the
    drafts before it, so the pair's second token is masked after the drafted first, as when sampled."""
    free = _engine(tiny).generate([LOOP], SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True))[0]
    loop = free.output_ids[45:48]
    assert free.output_ids[48:51] == loop, "the premise: the greedy answer loops here"
    words = [loop[1:3], [loop[0], 77, 50], [40]]
    greedy = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True, bad_words_ids=words)
    sampled = SamplingParams(max_new_tokens=24, temperature=0.9, seed=4, ignore_eos=True, bad_words_ids=words)
    got = _speculation_keeps(tiny, spec, LOOP + free.output_ids[:45], [greedy, sampled])
    assert not any(_contains(g, w) for g in got for w in words)
