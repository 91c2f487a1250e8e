"""Speculation by batch size (--speculative-num-steps-by-batch-size, docs/architecture.md) on the
default model in float32 (LocalEngine's parts driven step by step: the served Step stream,
digests checked every step, overlap on). With tiny thresholds (more than 2 decode rows: 1 draft;
more than 4: none) a batch that grows from 2 to 6 requests and then drains as they finish at
different max_tokens (one a json_schema request) passes through every regime, one way and back:
greedy tokens equal those without speculation for each chain draft source and for NGRAM trees (a
separate draft model, whose KV must follow the plain steps, still has its drafts accepted); a step
above the cap carries no drafts (an ordinary decode step), a step below it no more drafts a row
than the cap; the accept-length counters agree with the requests' own usage. Bad rule lists fail
at start."""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine.args import parse_args
from engine.config import SPEC_BY_BATCH_DEFAULT, ServerConfig
from engine.local import LocalEngine
from engine.sched.request import Status
from engine.sched.spec import SpecPolicy
from engine.tokenizer import load_tokenizer
from msgs.codec import pack_ids, unpack_ids
from msgs.params import Grammar, SamplingParams
from msgs.requests import TokenizedRequest
from tests.engine.test_spec_eagle import float32_engine, threads_back  # noqa: F401 (threads_back: a fixture)
from tests.engine.test_spec_engine import _grammar
from tests.models.draft_heads import write_head

TEXTS = ["def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
         "The quick brown fox jumps over the lazy dog. " * 3, "1, 2, 3, 4, 5, 6, 7, 8, 9,",
         "The capital of France is", "Once upon a time, in a small village", "a b c a b c a b c a b"]
MAX_NEW = [16, 14, 3, 6, 9, 12]  # the first two run from the start, the others arrive at step ARRIVE
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}  # request 1's json_schema
ARRIVE = 3
RULES = "2:1,4:0"  # more than 2 decode rows: 1 draft a row; more than 4: no speculation
STEPS = 3  # --speculative-num-steps


def _cap(rows: int, top: int = STEPS) -> int:
    """RULES, written out: the most drafts a row may get in a step of `rows` decode rows (`top`:
    without a rule, --speculative-num-steps; a tree's nodes)."""
    return 0 if rows > 4 else 1 if rows > 2 else top




@dataclass
class Run:
    tokens: dict[int, list[int]] = field(default_factory=dict)  # request index -> its output tokens
    usage: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # -> its last usage `spec`
    caps: list[int] = field(default_factory=list)  # per step with decode rows: the cap its rows implied
    drafts: list[list[int] | None] = field(default_factory=list)  # ... and its rows' drafts (None: no verify)
    ones: list[int] = field(default_factory=list)  # ... and its one-token rows (plain decode rows)
    trees: int = 0  # steps that verified a draft tree


def greedy(grammar: Grammar | None = None) -> list[SamplingParams]:
    """Greedy requests of MAX_NEW tokens; with `grammar`, request 1 is constrained by it."""
    out = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in MAX_NEW]
    if grammar is not None:
        out[1] = SamplingParams(max_new_tokens=40, temperature=0, grammar=grammar)
    return out


def _drive(eng: LocalEngine, prompts: list[list[int]], params: list[SamplingParams], top: int = STEPS) -> Run:
    """Requests 0 and 1 first, the others submitted before step ARRIVE is planned; overlap on (two
    steps in flight, as LocalEngine._drive). Each planned Step is checked against the rows that
    were decoding when it was planned."""
    run, inflight, planned = Run(), deque(), 0
    core = eng.core
    todo = deque(range(len(prompts)))
    while True:
        for report in eng.runner.grammar_reports(wait=not inflight and core.busy):  # request 1's grammar
            assert core.on_grammar_ready(report) == []
        while todo and (todo[0] < 2 or planned >= ARRIVE):
            i = todo.popleft()
            assert core.submit(TokenizedRequest(rid=f"q{i}", input_ids=pack_ids(prompts[i]), params=params[i])) is None
        while len(inflight) < 2:
            rows = sum(r.status == Status.RUNNING and not r.in_prefill and r.pending_tokens < r.max_new_tokens
                       for r in core.running)
            if (step := core.plan()) is None:
                break
            planned += 1
            inflight.append(step)
            if rows and step.forward is not None:
                d = step.forward.drafts
                run.caps.append(_cap(rows, top))
                run.drafts.append(None if d is None else unpack_ids(d.num_drafts))
                run.ones.append(unpack_ids(step.forward.extend_lens).count(1))
                run.trees += d is not None and bool(d.parents)
        if not inflight:
            if not todo and not eng.runner.compiling:
                return run
            planned += 1
            continue
        for out in core.on_done(eng.runner.run_step(inflight.popleft())):
            i = int(out.rid[1:])
            run.tokens.setdefault(i, []).extend(out.new_ids)
            if out.spec is not None:
                run.usage[i] = out.spec


@pytest.fixture(scope="module")
def setup(default_model_dir: Path) -> tuple[str, list[list[int]], list[SamplingParams], list[list[int]]]:
    """The model, the prompts, their parameters (request 1 a json_schema one) and their greedy
    tokens without speculation."""
    model = str(default_model_dir)
    tok = load_tokenizer(model)
    assert tok is not None
    prompts = [tok.encode(t) for t in TEXTS]
    eng = float32_engine(model)
    params = greedy(_grammar(model, eng.runner.mcfg.vocab_size, PERSON, "by-batch-person"))
    plain = eng.generate(prompts, params)
    assert plain[1].finish_reason == "stop" and set(json.loads(tok.decode(plain[1].output_ids))) == {"name", "age"}
    return model, prompts, params, [r.output_ids for r in plain]


def _source(kind: str, model: str, tmp: Path) -> dict[str, object]:
    if kind == "NGRAM":
        return {"speculative_algorithm": "NGRAM"}
    if kind == "NGRAM-tree":
        return {"speculative_algorithm": "NGRAM", "speculative_eagle_topk": 3, "speculative_num_draft_tokens": 8}
    if kind == "self-draft":
        return {"speculative_algorithm": "STANDALONE", "speculative_draft_layers": 20}
    if kind == "draft-model":  # the model as its own separate draft: its KV must follow plain decode steps too
        return {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": model}
    head = write_head(tmp / "EAGLE", json.loads((Path(model) / "config.json").read_text()), "EAGLE")
    return {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": str(head)}


@pytest.mark.parametrize("kind", ["NGRAM", "self-draft", "draft-model", "EAGLE", "NGRAM-tree"])
def test_greedy_equals_plain_as_the_batch_crosses_the_thresholds(kind: str, setup, tmp_path: Path) -> None:  # noqa: ANN001
    model, prompts, params, want = setup
    eng = float32_engine(model, speculative_num_steps=STEPS, speculative_num_steps_by_batch_size=RULES,
                  **_source(kind, model, tmp_path))
    top = eng.core.state.spec.cap(1)  # no rule: k drafts, a tree's nodes
    assert top == (7 if kind == "NGRAM-tree" else STEPS)
    st = eng.core.state.spec_stats
    for _ in range(2 if kind == "NGRAM-tree" else 1):  # again: the radix tree's continuations make trees
        before = (st.rows, st.drafted, st.accepted)
        run = _drive(eng, prompts, params, top)
        assert [run.tokens[i] for i in range(len(prompts))] == want
    # every regime, and each way: k -> 0 as requests arrive, 0 -> 1 -> k as they finish
    seen = iter(run.caps)
    assert all(c in seen for c in (top, 0, 1, top)), run.caps
    assert (run.trees > 0) == (kind == "NGRAM-tree")  # (a tree of more than 1 node below the cap)
    for cap, drafts in zip(run.caps, run.drafts, strict=True):
        # above the cap an ordinary decode step; below it, no row drafts more (a step may have no
        # verify row: every request waiting for its row in flight)
        assert drafts is None if cap == 0 else drafts is None or max(drafts) <= cap, (cap, drafts)
    assert max(n for c, n in zip(run.caps, run.ones, strict=True) if c == 0) >= 5  # plain decode rows
    assert st.plain > 0 and st.capped > 0 and st.rows > 0, st
    # the counters (of the last run) are the sum of the requests' own usage (verify rows, drafts, accepted)
    counted = tuple(now - was for now, was in zip((st.rows, st.drafted, st.accepted), before, strict=True))
    assert tuple(map(sum, zip(*run.usage.values(), strict=True))) == counted
    assert sum(st.hist) == st.rows and len(st.hist) <= STEPS + 1 and st.accepted <= st.drafted  # (a tree's depth)
    assert eng.runner.grammar.rejected == 0  # the constrained request's drafts masked, none refused
    assert eng.core.leak_free() and eng.runner.replica.digest() == eng.core.replica.digest()
    if kind == "draft-model":  # a draft whose KV missed a plain step's tokens would propose wrong drafts
        drafted, accepted = (sum(u[j] for i, u in run.usage.items() if i != 1) for j in (1, 2))  # (1: masked)
        assert accepted >= 0.9 * drafted, run.usage
    print(f"\n{kind}: accept length {st.accept_length:.2f}, plain rows {st.plain}, capped rows {st.capped}")


def test_cap_by_decode_rows() -> None:
    """The default rules: the configured drafts up to 4 decode rows, at most 3 up to 16, none above."""
    rules = ServerConfig(speculative_algorithm="NGRAM", speculative_num_steps=5).speculative_steps_by_batch
    assert rules == ((4, 3), (16, 0))
    policy = SpecPolicy("NGRAM", 5, by_batch=rules)
    assert [policy.cap(n) for n in (1, 4, 5, 16, 17, 64)] == [5, 5, 3, 3, 0, 0]
    assert SpecPolicy("NGRAM", 2, by_batch=rules).cap(8) == 2  # a rule never raises --speculative-num-steps
    assert SpecPolicy("NGRAM", 5).cap(1000) == 5  # no rules: every batch size speculates


def test_flag_parses_and_empty_turns_the_rules_off() -> None:
    cfg = parse_args(["--speculative-algorithm", "NGRAM", "--speculative-num-steps-by-batch-size", "8:2, 32:0"])
    assert cfg.speculative_steps_by_batch == ((8, 2), (32, 0))
    cfg = parse_args(["--speculative-algorithm", "NGRAM", "--speculative-num-steps-by-batch-size", ""])
    assert cfg.speculative_steps_by_batch == ()
    assert ServerConfig().speculative_num_steps_by_batch_size == SPEC_BY_BATCH_DEFAULT
    # inert without speculation, but allowed (bin/bench gives its plain and spec servers the same flags)
    assert parse_args(["--speculative-num-steps-by-batch-size="]).speculative_steps_by_batch == ()


@pytest.mark.parametrize(("value", "problem"), [
    ("4", "'4' is not ROWS:STEPS"),
    ("4:x", "'4:x' is not ROWS:STEPS"),
    ("4:-1", "'4:-1' is not ROWS:STEPS"),
    ("16:0,4:3", "ROWS must be strictly ascending"),
    ("4:3,4:0", "ROWS must be strictly ascending"),
    ("4:1,16:3", "STEPS must not grow with ROWS"),
    ("4:99", "STEPS must be in 0..16"),
])
def test_bad_rules_fail_at_start_naming_the_flag(value: str, problem: str) -> None:
    with pytest.raises(ValueError, match="--speculative-num-steps-by-batch-size") as e:
        ServerConfig(speculative_algorithm="NGRAM", speculative_num_steps_by_batch_size=value)
    assert problem in str(e.value)
    with pytest.raises(ValueError, match=f"--speculative-num-steps-by-batch-size '{value}': .*{problem}"):
        ServerConfig(speculative_num_steps_by_batch_size=value)  # checked without speculation too
