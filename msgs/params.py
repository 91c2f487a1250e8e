"""Per-request generation parameters, shared by the tokenizer, scheduler and SDK."""

from __future__ import annotations

import math

import msgspec

INT32 = 2**31
MAX_TOP_LOGPROBS = 20
MAX_STOP = 16
MAX_STOP_CHARS = 1024
MAX_STOP_IDS = 256


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the user asked for. Stop strings are enforced by the tokenizer (it owns text);
    every other stop condition by the scheduler."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True

    def validate(self, vocab_size: int | None = None) -> str | None:
        """Return a human-readable problem, or None when the params are acceptable.

        The one check of sampling parameters: HTTP, /generate, the SDK and the scheduler
        all call it, and it is at least as strict as the worker's sampler (finite floats,
        bounded integers), so a request that passes can never fail a replica. NaN fails
        every comparison below, so only infinities need the explicit isfinite."""
        checks = [
            (0 <= self.max_new_tokens < INT32, "max_tokens must be in [0, 2**31)"),
            (math.isfinite(self.temperature) and self.temperature >= 0, "temperature must be a finite number >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k == -1 or 1 <= self.top_k < INT32, "top_k must be -1 or in [1, 2**31)"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (0 < self.repetition_penalty <= 2, "repetition_penalty must be in (0, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]"),
            (self.top_logprobs == 0 or self.logprobs, "top_logprobs requires logprobs"),
            (len(self.stop) <= MAX_STOP, f"at most {MAX_STOP} stop strings"),
            (all(0 < len(s) <= MAX_STOP_CHARS for s in self.stop), f"stop strings must be 1..{MAX_STOP_CHARS} chars"),
            (len(self.stop_token_ids) <= MAX_STOP_IDS, f"at most {MAX_STOP_IDS} stop_token_ids"),
            (all(0 <= t < (vocab_size or INT32) for t in self.stop_token_ids), _ids_problem(vocab_size)),
            (self.seed is None or 0 <= self.seed < 2**63, "seed must be in [0, 2**63)"),
        ]
        for ok, problem in checks:
            if not ok:
                return problem
        return None


def _ids_problem(vocab_size: int | None) -> str:
    if vocab_size is None:
        return "stop_token_ids must be in [0, 2**31)"
    return f"stop_token_ids must be token ids in [0, {vocab_size}) (the vocabulary size)"
