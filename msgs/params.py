"""Per-request generation parameters, shared by the tokenizer, scheduler and SDK."""

from __future__ import annotations

import math

import msgspec

INT32 = 2**31
MAX_TOP_LOGPROBS = 20
MAX_STOP = 16
MAX_STOP_CHARS = 1024
MAX_STOP_IDS = 256
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit)
MAX_BIAS = 100.0  # |bias| per token (OpenAI's range)
# allowed_token_ids' entries: each rank's sampler keeps a [slots, width] table of them (a width of
# 4096 is 8 MB at 256 slots); a larger set is better said by a regex or grammar constraint
MAX_ALLOWED_TOKEN_IDS = 4096
# vLLM's bad_words: each word is banned as one or two token sequences (engine/serve/validate.py
# bad_words_ids), each at most MAX_BAD_WORD_TOKENS tokens: the sampler keeps a slot's last
# MAX_BAD_WORD_TOKENS - 1 output tokens to match their prefixes (engine/run/bad_words.py)
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256
MAX_BAD_WORD_TOKENS = 16
MAX_PREDICTION_TOKENS = 32768  # a predicted output's tokens (the scheduler indexes its n-grams once)
# prompt tokens a step of a request that scores its prompt (prompt_logprobs): the worker holds that
# chunk's logits as [n, vocab] float32 and their log_softmax (512 x 152k: 2 x 311 MB)
PROMPT_SCORE_CHUNK = 512
GRAMMAR_SPECS = ("json_schema", "regex", "ebnf", "structural_tag")  # SamplingParams' constraint fields
MAX_GRAMMAR_CHARS = 65536  # a json_schema / regex / ebnf / structural_tag text; more is a 400, not a slow compile


class Grammar(msgspec.Struct, frozen=True):
    """A checked grammar as it travels tokenizer -> scheduler -> every rank (never pickled).

    Set only by the tokenizer, from the request's json_schema / regex / ebnf /
    response_format / forced tool_choice (whatever a client sends here is overwritten)."""

    key: str  # SHA-256 of what was compiled: the worker's cache key and the replica's digest entry
    data: bytes  # zlib of the structural tag's JSON that every rank compiles (engine/tokenizer.py compile_grammar)
    stop_ids: list[int]  # tokens that end the grammar: the scheduler stops the request on them
    compiled_bytes: int = 0  # its compiled size as the tokenizer measured it: GrammarKeys' byte budget


# the fields a model's generation_config.json may give defaults for (ServerConfig.sampling_defaults)
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
MIN_REPETITION_PENALTY = 1e-30  # float32's normal range starts near 1.2e-38: its reciprocal stays finite


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the user asked for. Stop strings are enforced by the tokenizer (it owns text);
    every other stop condition by the scheduler."""

    max_new_tokens: int = 128
    # EOS, stop_token_ids and stop strings do not end the output before this many tokens
    # (SGLang's min_new_tokens, vLLM's min_tokens): the sampler masks the stop tokens meanwhile
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    # keep the stop string that ended the output in its text (vLLM's name; SGLang's no_stop_trim)
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # the logprob of every prompt token after the first (and this many top alternatives), returned
    # with the first output: vLLM's prompt_logprobs; such a prompt is prefilled without the prefix cache
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # token id -> a value in [-100, 100] added to its logit before sampling (OpenAI's logit_bias)
    logit_bias: dict[int, float] = {}
    # vLLM's allowed_token_ids: only these tokens can be sampled (every other logit is -inf before the
    # penalties; logprobs stay the model's own, as with logit_bias); None: every token
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words: a word's tokens are never generated in a row (its last token is masked where the
    # output so far ends with the rest); tokenized by the front end into bad_words_ids, which it always
    # sets (whatever a client sends there is replaced)
    bad_words: list[str] = []
    bad_words_ids: list[list[int]] = []
    # OpenAI's predicted output (chat's `prediction`), tokenized by the front end: never changes the answer;
    # under --speculative-algorithm NGRAM the drafts are also looked up in it (engine/sched/spec.py)
    prediction_ids: list[int] = []
    # vLLM's request priority, under --scheduling-policy priority: lower values are admitted first and
    # retracted last (ties by arrival); 0 for every request otherwise
    priority: int = 0
    # Constrained decoding (SGLang's names): at most one; compiled by the tokenizer into `grammar`.
    json_schema: str | None = None  # a JSON Schema, as JSON text
    regex: str | None = None
    ebnf: str | None = None
    # SGLang's (and response_format's, vLLM's): JSON text {"structures": [{"begin", "schema", "end"}], "triggers":
    # [...]}: free text, where a trigger starts one of the structures, whose content then follows its schema
    structural_tag: str | None = None
    grammar: Grammar | None = None

    def validate(self, vocab_size: int | None = None, eos_ids: tuple[int, ...] | list[int] = ()) -> str | None:
        """Return a human-readable problem, or None when the params are acceptable (`eos_ids`: the
        model's end tokens, where the caller knows them).

        The one check of sampling parameters: HTTP, /generate, the SDK and the scheduler
        all call it, and it is at least as strict as the worker's sampler (finite floats,
        bounded integers), so a request that passes can never fail a replica. NaN fails
        every comparison below, so only infinities need the explicit isfinite."""
        specs = self.grammar_specs()
        ends = set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_ids))
        long = next((k for k, v in specs.items() if len(v) > MAX_GRAMMAR_CHARS), None)
        checks = [
            (0 <= self.max_new_tokens < INT32, "max_tokens must be in [0, 2**31)"),
            (0 <= self.min_new_tokens <= self.max_new_tokens,
             f"min_tokens must be in [0, max_tokens], and max_tokens is {self.max_new_tokens}"),
            (math.isfinite(self.temperature) and self.temperature >= 0, "temperature must be a finite number >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k == -1 or 1 <= self.top_k < INT32, "top_k must be -1 or in [1, 2**31)"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            # from 1e-30: the sampler divides logits by it in float32, where a smaller value is 0 or subnormal
            (MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2,
             f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]"),
            (self.top_logprobs == 0 or self.logprobs, "top_logprobs requires logprobs"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS,
             f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}]"),
            (len(self.stop) <= MAX_STOP, f"stop takes at most {MAX_STOP} strings"),
            (all(0 < len(s) <= MAX_STOP_CHARS for s in self.stop), f"stop strings must be 1..{MAX_STOP_CHARS} chars"),
            (len(self.stop_token_ids) <= MAX_STOP_IDS, f"stop_token_ids takes at most {MAX_STOP_IDS} ids"),
            (all(0 <= t < (vocab_size or INT32) for t in self.stop_token_ids), _ids_problem(vocab_size)),
            (self.seed is None or 0 <= self.seed < 2**63, "seed must be in [0, 2**63)"),
            (len(self.logit_bias) <= MAX_LOGIT_BIAS, f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens"),
            (all(0 <= t < (vocab_size or INT32) for t in self.logit_bias),
             f"logit_bias keys must be token ids in [0, {vocab_size or INT32})"),
            (all(-MAX_BIAS <= v <= MAX_BIAS for v in self.logit_bias.values()),
             f"logit_bias values must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}]"),
            (self.allowed_token_ids is None or 1 <= len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS,
             f"allowed_token_ids must hold 1 to {MAX_ALLOWED_TOKEN_IDS} token ids (a larger set: a regex or grammar)"),
            (all(0 <= t < (vocab_size or INT32) for t in self.allowed_token_ids or ()),
             f"allowed_token_ids must be token ids in [0, {vocab_size or INT32})"),
            (-INT32 <= self.priority < INT32, "priority must be in [-2**31, 2**31)"),
            (len(self.prediction_ids) <= MAX_PREDICTION_TOKENS,
             f"prediction_ids takes at most {MAX_PREDICTION_TOKENS} tokens"),
            (all(0 <= t < (vocab_size or INT32) for t in self.prediction_ids),
             f"prediction_ids must be token ids in [0, {vocab_size or INT32})"),
            (len(self.bad_words) <= MAX_BAD_WORDS, f"bad_words takes at most {MAX_BAD_WORDS} words"),
            (all(0 < len(w) <= MAX_BAD_WORD_CHARS and not w.isspace() for w in self.bad_words),
             f"bad_words must be words of 1..{MAX_BAD_WORD_CHARS} characters, not only whitespace"),
            (len(self.bad_words_ids) <= 2 * MAX_BAD_WORDS
             and all(1 <= len(w) <= MAX_BAD_WORD_TOKENS for w in self.bad_words_ids),
             f"bad_words_ids takes at most {2 * MAX_BAD_WORDS} sequences of 1..{MAX_BAD_WORD_TOKENS} token ids"),
            (all(0 <= t < (vocab_size or INT32) for w in self.bad_words_ids for t in w),
             f"bad_words_ids must be token ids in [0, {vocab_size or INT32})"),
            (not (self.bad_words or self.bad_words_ids) or (not specs and self.grammar is None),
             "bad_words cannot be combined with a grammar constraint (its next tokens could all be banned)"),
            (not (self.bad_words or self.bad_words_ids) or self.allowed_token_ids is None,
             "bad_words cannot be combined with allowed_token_ids (the words could ban the whole set)"),
            (self.allowed_token_ids is None or (not specs and self.grammar is None),
             "allowed_token_ids cannot be combined with a grammar constraint"),
            # every allowed token ends the output and min_tokens masks them all: nothing left to draw
            (not (self.allowed_token_ids and self.min_new_tokens and set(self.allowed_token_ids) <= ends),
             "allowed_token_ids holds only tokens that end the output (EOS, stop_token_ids), which min_tokens "
             "forbids"),
            (len(specs) <= 1,
             f"{' and '.join(specs)}: give at most one of json_schema, regex, ebnf and structural_tag"),
            (long is None, f"{long} must be at most {MAX_GRAMMAR_CHARS} characters"),
        ]
        for ok, problem in checks:
            if not ok:
                return problem
        return None


    def grammar_specs(self) -> dict[str, str]:
        """The constrained-decoding fields the client set: name -> text."""
        return {k: v for k in GRAMMAR_SPECS if (v := getattr(self, k)) is not None}


def _ids_problem(vocab_size: int | None) -> str:
    if vocab_size is None:
        return "stop_token_ids must be in [0, 2**31)"
    return f"stop_token_ids must be token ids in [0, {vocab_size}) (the vocabulary size)"
