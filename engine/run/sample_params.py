"""A request's sampling parameters as the worker's sampler takes them, validated once."""

from __future__ import annotations

import math
from dataclasses import dataclass

from msgs.params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_BIAS,
    MAX_LOGIT_BIAS,
    MIN_REPETITION_PENALTY,
)

# Temperatures below this are treated as greedy (as vLLM does): 1/T would blow up the logits.
GREEDY_EPS = 1e-5
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, kw_only=True)
class SampleParams:
    """Per-request sampling parameters; validated once at construction (ValueError).

    temperature < GREEDY_EPS means greedy. top_p=1, top_k<=0, min_p=0, repetition_penalty=1,
    frequency_penalty=presence_penalty=0 disable the respective feature. repetition_penalty
    follows HF (prompt + generated tokens); frequency/presence follow OpenAI (generated only).
    `seed` is required: the scheduler fills a deterministic one when the user gives none.
    top_logprobs > 0 requires logprobs=True (as in the OpenAI API). logit_bias: (token id, bias)
    pairs added to the logits before the penalties (vLLM's order); logprobs stay the model's.
    min_new_tokens: min_stop_ids get -inf for the request's first that many output tokens
    (vLLM's min_tokens: what would end the output cannot be drawn before then). allowed_token_ids
    (vLLM's): every other token's logit is -inf before the bias and penalties; empty: every token.
    bad_words_ids (vLLM's bad_words as token sequences): a sequence's last token gets -inf where the request's
    output so far ends with the rest of it (engine/run/bad_words.py).
    """

    seed: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_new_tokens: int = 0
    min_stop_ids: tuple[int, ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    bad_words_ids: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        _check(_is_int(self.seed), f"seed must be an int, got {self.seed!r}")
        _check(_finite(self.temperature) and self.temperature >= 0, "temperature must be finite and >= 0")
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p must be in (0, 1]")
        _check(_is_int(self.top_k), "top_k must be an int (<= 0 disables it)")
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p must be in [0, 1]")
        _check(
            _finite(self.repetition_penalty) and MIN_REPETITION_PENALTY <= self.repetition_penalty,
            f"repetition_penalty must be finite and >= {MIN_REPETITION_PENALTY:g}",
        )
        _check(_finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
               "frequency_penalty must be in [-2, 2]")
        _check(_finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
               "presence_penalty must be in [-2, 2]")
        _check(isinstance(self.logprobs, bool), "logprobs must be a bool")
        _check(_is_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
               f"top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}]")
        _check(self.logprobs or self.top_logprobs == 0, "top_logprobs requires logprobs=True")
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS and all(
            _is_int(t) and t >= 0 and _finite(v) and -MAX_BIAS <= v <= MAX_BIAS for t, v in self.logit_bias),
            f"logit_bias: at most {MAX_LOGIT_BIAS} (token id >= 0, bias in [-{MAX_BIAS:g}, {MAX_BIAS:g}]) pairs")
        _check(_is_int(self.min_new_tokens) and self.min_new_tokens >= 0, "min_new_tokens must be an int >= 0")
        _check(all(_is_int(t) and t >= 0 for t in self.min_stop_ids), "min_stop_ids must be token ids >= 0")
        _check(len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS and all(
            _is_int(t) and t >= 0 for t in self.allowed_token_ids),
            f"allowed_token_ids: at most {MAX_ALLOWED_TOKEN_IDS} token ids >= 0")
        _check(len(self.bad_words_ids) <= 2 * MAX_BAD_WORDS and all(
            1 <= len(w) <= MAX_BAD_WORD_TOKENS and all(_is_int(t) and t >= 0 for t in w) for w in self.bad_words_ids),
            f"bad_words_ids: at most {2 * MAX_BAD_WORDS} sequences of 1..{MAX_BAD_WORD_TOKENS} token ids >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def uses_repetition(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def uses_freq_presence(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
