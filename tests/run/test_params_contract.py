"""The one parameter check (msgs.params.SamplingParams.validate) is at least as strict as
the worker's sampler: whatever passes it can never make a replica raise."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.run.runner import _sample_params
from msgs.params import SamplingParams
from msgs.steps import AddReq, WorkerSampling
from tests.param_strategies import sampling_params

FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1.0, 2.0, 1e-300, 1e300, math.inf, -math.inf, math.nan]),
)
INTS = st.one_of(st.integers(-(2**64), 2**64), st.sampled_from([-1, 0, 1, 20, 21, 2**31 - 1, 2**31, 2**63]))
PARAMS = sampling_params(FLOATS, INTS, max_new=INTS, top_logprobs=INTS)


@settings(max_examples=400, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(PARAMS)
def test_what_validate_accepts_the_sampler_accepts(p: SamplingParams) -> None:
    if p.validate(vocab_size=1000) is not None:
        return
    fields = {f: getattr(p, f) for f in WorkerSampling.__struct_fields__ if f != "seed"}
    op = AddReq(slot=0, rid="r", sampling=WorkerSampling(**fields, seed=p.seed or 0), prompt_ids=b"")
    _sample_params(op)  # raises ValueError on anything the sampler refuses
    assert all(0 <= t < 1000 for t in p.stop_token_ids)
    assert math.isfinite(p.temperature) and 0 < p.repetition_penalty <= 2


def test_validate_names_the_problem() -> None:
    assert "temperature" in SamplingParams(temperature=math.inf).validate()
    assert "temperature" in SamplingParams(temperature=math.nan).validate()
    assert "repetition_penalty" in SamplingParams(repetition_penalty=math.inf).validate()
    assert "stop_token_ids" in SamplingParams(stop_token_ids=[1000]).validate(vocab_size=1000)
    assert SamplingParams(stop_token_ids=[999]).validate(vocab_size=1000) is None
    assert "top_k" in SamplingParams(top_k=0).validate()
