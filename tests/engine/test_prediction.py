"""OpenAI's predicted outputs as NGRAM's draft source (SamplingParams.prediction_ids, set by the
chat front end from `prediction`): the answer is the plain engine's, greedy and seeded sampled, with
any prediction (right, wrong, absent); a right one (the answer itself, which the prompt does not
hold) is drafted from and accepted far more than the request's own tokens give."""

from __future__ import annotations

from pathlib import Path

from engine.config import ServerConfig
from engine.local import LocalEngine
from msgs.params import SamplingParams

PROMPT = [3, 50, 60, 70, 80, 90, 100]


def _engine(path: Path, **kw) -> LocalEngine:  # noqa: ANN003
    return LocalEngine(ServerConfig(model=str(path), dtype="float32", page_size=4, max_prefill_tokens=16,
                                    max_total_tokens=1024, **kw))


def test_a_prediction_is_drafted_from_and_never_changes_the_answer(tiny: Path) -> None:
    greedy = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=24, temperature=0.9, seed=3, ignore_eos=True)
    want = [o.output_ids for o in _engine(tiny).generate([PROMPT, PROMPT], [greedy, sampled])]
    accepted = {}
    for name, prediction in (("none", []), ("right", want[0]), ("wrong", [(t + 7) % 256 for t in want[0]])):
        eng = _engine(tiny, speculative_algorithm="NGRAM", speculative_num_steps=4)
        params = [SamplingParams(**{**{f: getattr(p, f) for f in p.__struct_fields__}, "prediction_ids": prediction})
                  for p in (greedy, sampled)]
        got = [o.output_ids for o in eng.generate([PROMPT, PROMPT], params)]
        assert got == want, name
        accepted[name] = eng.core.state.spec_stats.accepted
        assert eng.core.leak_free()
    assert accepted["right"] >= 12 and accepted["right"] > 2 * accepted["none"], accepted
