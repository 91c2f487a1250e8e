"""Hypothesis strategies for SamplingParams, shared by the contract test and the fuzz test."""

from __future__ import annotations

from hypothesis import strategies as st

from msgs.params import SamplingParams


def sampling_params(
    floats: st.SearchStrategy[float],
    ints: st.SearchStrategy[int],
    max_new: st.SearchStrategy[int],
    top_logprobs: st.SearchStrategy[int],
    stop: st.SearchStrategy[list[str]] | None = None,
) -> st.SearchStrategy[SamplingParams]:
    """SamplingParams with every numeric field drawn from `floats` / `ints` (no validation:
    the point is to see what the server does with values it must refuse)."""
    return st.builds(
        SamplingParams,
        max_new_tokens=max_new,
        temperature=floats,
        top_p=floats,
        top_k=ints,
        min_p=floats,
        repetition_penalty=floats,
        frequency_penalty=floats,
        presence_penalty=floats,
        seed=st.none() | ints,
        stop=stop if stop is not None else st.just([]),
        stop_token_ids=st.lists(ints, max_size=3),
        logprobs=st.booleans(),
        top_logprobs=top_logprobs,
    )
