"""Per-request generation parameters, shared by the tokenizer, scheduler and SDK."""

from __future__ import annotations

import msgspec


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

    def validate(self) -> str | None:
        """Return a human-readable problem, or None when the params are acceptable."""
        checks = [
            (self.max_new_tokens >= 0, "max_tokens must be >= 0"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 1, "top_k must be -1 or >= 1"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (0 <= self.top_logprobs <= 20, "top_logprobs must be in [0, 20]"),
            (self.top_logprobs == 0 or self.logprobs, "top_logprobs requires logprobs"),
            (len(self.stop) <= 16, "at most 16 stop strings"),
            (all(s for s in self.stop), "stop strings must be non-empty"),
            (self.seed is None or 0 <= self.seed < 2**63, "seed must be in [0, 2**63)"),
        ]
        for ok, problem in checks:
            if not ok:
                return problem
        return None
