"""Speculative decoding end to end on the default model in float32 (LocalEngine: the served
Step stream, digests checked every step, overlap on): greedy tokens with speculation equal the
tokens without, batched, from the prefix cache and in prefill chunks; NGRAM accepts more than
one token a step on a repetitive prompt; the self-draft accepts some drafts but not all; stop
ids and max_new_tokens end a request exactly where they would without speculation; a
json_schema request stays valid; no page leaks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config import ServerConfig
from engine.local import LocalEngine, Result
from engine.replica import rank_replica
from engine.serve.grammar import compilable, json_format
from engine.tokenizer import grammar_data, load_tokenizer, tokenizer_info
from msgs.codec import pack_ids
from msgs.params import Grammar, SamplingParams
from msgs.requests import TokenizedRequest
from msgs.steps import Step, TrimReq

CODE = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
        "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n")
TEXTS = [CODE, "The capital of France is", "1, 2, 3, 4, 5, 6, 7, 8, 9,", "Once upon a time, in a small village",
         "The quick brown fox jumps over the lazy dog. " * 3, "Give me a JSON object with a person's name and age:"]
GREEDY = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(default_model_dir: Path) -> tuple[str, list[list[int]]]:
    tok = load_tokenizer(str(default_model_dir))
    assert tok is not None
    return str(default_model_dir), [tok.encode(t) for t in TEXTS]


def _engine(model: str, **kw) -> LocalEngine:  # noqa: ANN003
    return LocalEngine(ServerConfig(**{"model": model, "dtype": "float32", "max_total_tokens": 4096,
                                       "max_running_requests": 8, **kw}))


@pytest.fixture(scope="module")
def plain(model: tuple[str, list[list[int]]]) -> LocalEngine:
    return _engine(model[0])


@pytest.fixture(scope="module")
def ngram(model: tuple[str, list[list[int]]]) -> LocalEngine:
    eng = _engine(model[0], speculative_algorithm="NGRAM", max_prefill_tokens=32)  # chunked prefill too
    STEPS[id(eng)] = _recording(eng)
    return eng


STEPS: dict[int, list[Step]] = {}  # every Step an engine's scheduler planned (by id of the engine)


def _ids(results: list[Result]) -> list[list[int]]:
    assert all(r.finish_reason == "length" for r in results), results
    return [r.output_ids for r in results]


def _recording(eng: LocalEngine) -> list[Step]:
    """Every Step the engine's scheduler plans from now on."""
    steps: list[Step] = []
    plan = eng.core.plan

    def record() -> Step | None:
        step = plan()
        if step is not None:
            steps.append(step)
        return step

    eng.core.plan = record  # type: ignore[method-assign]
    return steps


def test_ngram_greedy_equals_plain_batched_cached_chunked(model, plain: LocalEngine, ngram: LocalEngine) -> None:  # noqa: ANN001
    prompts = model[1][:4]
    want = _ids(plain.generate(prompts, GREEDY))
    before = ngram.core.state.spec_stats.rows
    assert _ids(ngram.generate(prompts, GREEDY)) == want  # 4 prompts in one batch, prefilled in 32-token chunks
    again = ngram.generate(prompts, GREEDY)  # their prompts' pages from the prefix cache now
    assert _ids(again) == want and again[0].cached_tokens >= 32
    stats = ngram.core.state.spec_stats
    assert stats.rows > before
    assert ngram.core.leak_free()
    # another replica of the whole stream (a cache controller's, a second rank's) ends where the
    # worker and the scheduler's mirror are, trims included
    steps = STEPS[id(ngram)]
    assert steps[0].seq == 1 and any(isinstance(op, TrimReq) for st in steps for op in st.ops)
    replay = rank_replica()
    for st in steps:
        replay.apply_step(st)
    assert replay.digest() == ngram.runner.replica.digest() == ngram.core.replica.digest()


def test_seeded_sampling_equals_plain(model, plain: LocalEngine, ngram: LocalEngine) -> None:  # noqa: ANN001
    """Sampled rows: the rejection rule draws each token as a one-token step would, so a seeded
    request answers the same tokens (the logits agreeing, as they do here in float32)."""
    prompts = [model[1][4], model[1][0]]
    params = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.95, seed=5, ignore_eos=True)
    assert _ids(ngram.generate(prompts, params)) == _ids(plain.generate(prompts, params))


def test_ngram_accepts_more_than_one_token_a_step(model, ngram: LocalEngine) -> None:  # noqa: ANN001
    _, prompts = model
    eng = ngram
    st = eng.core.state.spec_stats
    rows, accepted, empty, void = st.rows, st.accepted, st.empty, st.void
    steps, planned = eng.steps_run, len(STEPS[id(eng)])
    (res,) = eng.generate([prompts[4]], SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True))
    verifies = sum(s.forward is not None and s.forward.drafts is not None for s in STEPS[id(eng)][planned:])
    # each verify row answered with drafts (rows), without (empty) or nothing (void); with overlap the
    # last one may be planned before the answer that ended the request, and then is not counted
    counted = (st.rows - rows) + (st.empty - empty) + (st.void - void)
    assert counted <= verifies <= counted + 1 and st.empty >= empty
    length = 1 + (st.accepted - accepted) / (st.rows - rows)
    assert length > 2, f"accept length {length:.2f} on a repetitive prompt"
    assert st.rows - rows < 24 / 2  # half the verify rows of one token each, or fewer
    assert eng.steps_run - steps <= 24
    assert len(res.output_ids) == 24


def test_stop_ids_and_max_tokens_exact_with_multi_token_steps(model, plain: LocalEngine,  # noqa: ANN001
                                                               ngram: LocalEngine) -> None:
    _, prompts = model
    (ref,) = plain.generate([prompts[4]], SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))
    stop = ref.output_ids[9]  # inside a run of accepted drafts: the step answers tokens past it
    first = ref.output_ids.index(stop)
    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[stop])
    cuts = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in (1, 2, 5, 7)]
    got, *cut = ngram.generate([prompts[4]] * 5, [params, *cuts])
    assert got.finish_reason == "stop" and got.output_ids == ref.output_ids[: first + 1]
    for c, p in zip(cut, cuts, strict=True):
        assert c.finish_reason == "length" and c.output_ids == ref.output_ids[: p.max_new_tokens]
    assert ngram.core.leak_free()


def _grammar(path: str, vocab: int, schema: dict, key: str) -> Grammar:
    tok = load_tokenizer(path)
    info = tokenizer_info(tok.hf, vocab)
    tag = {"type": "structural_tag", "format": json_format(schema)}
    return Grammar(key, grammar_data(compilable(json.dumps(tag))), [int(t) for t in info.stop_token_ids])


def test_json_schema_speculates_and_stays_valid(model, plain: LocalEngine, ngram: LocalEngine) -> None:  # noqa: ANN001
    """Constrained requests speculate: each drafted position is masked by the grammar after the
    drafts before it (a draft it refuses is masked out one position earlier, so never accepted),
    and the matcher advances by the answered tokens only: the same tokens as without speculation."""
    path, prompts = model
    tok = load_tokenizer(path)
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    people = {"type": "array", "items": person, "minItems": 3, "maxItems": 3}
    vocab = ngram.runner.mcfg.vocab_size
    params = [SamplingParams(max_new_tokens=64, temperature=0, grammar=_grammar(path, vocab, people, "spec-people")),
              SamplingParams(max_new_tokens=40, temperature=0, grammar=_grammar(path, vocab, person, "spec-person")),
              GREEDY]
    batch = [prompts[5], prompts[5], prompts[4]]  # next to an unconstrained speculating request
    st = ngram.core.state.spec_stats
    rows, accepted = st.rows, st.accepted
    got = ngram.generate(batch, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in plain.generate(batch, params)]
    assert got[0].finish_reason == got[1].finish_reason == "stop"
    docs = [json.loads(tok.decode(r.output_ids)) for r in got[:2]]
    assert len(docs[0]) == 3 and all(set(d) == {"name", "age"} for d in docs[0]) and set(docs[1]) == {"name", "age"}
    assert st.rows - rows > 0 and st.accepted > accepted  # drafts were verified, some accepted
    assert ngram.runner.grammar.rejected == 0
    assert ngram.core.leak_free()


def test_self_draft_greedy_equals_plain_and_accepts_some(model, plain: LocalEngine) -> None:  # noqa: ANN001
    path, prompts = model
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    want = _ids(plain.generate(prompts[1:3], params))
    eng = _engine(path, speculative_algorithm="STANDALONE", speculative_draft_layers=20, speculative_num_steps=2)
    assert _ids(eng.generate(prompts[1:3], params)) == want
    st = eng.core.state.spec_stats
    assert 0 < st.accepted < st.drafted, st
    assert eng.core.leak_free()


def test_penalized_requests_speculate_with_the_same_tokens(model, plain: LocalEngine,  # noqa: ANN001
                                                             ngram: LocalEngine) -> None:
    prompts = [model[1][4], model[1][0]]
    rows = ngram.core.state.spec_stats.rows
    for params in (SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=1.2,
                                  frequency_penalty=0.3),
                   SamplingParams(max_new_tokens=16, temperature=0.7, seed=9, ignore_eos=True, presence_penalty=0.5),
                   SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True,  # logit_bias: verify rows too
                                  logit_bias={model[1][4][1]: 5.0, model[1][4][2]: -5.0})):
        assert _ids(ngram.generate(prompts, params)) == _ids(plain.generate(prompts, params))
    assert ngram.core.state.spec_stats.rows > rows


def test_min_new_tokens_masks_stops_in_verify_rows(model, plain: LocalEngine, ngram: LocalEngine) -> None:  # noqa: ANN001
    """min_new_tokens under speculation: a stop token the greedy answer would draw at its 3rd
    token is masked in the verify rows below the line as in plain decode, then ends it after."""
    prompts = [model[1][4], model[1][0]]
    free = _ids(plain.generate(prompts[:1], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)))[0]
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True, min_new_tokens=8,
                            stop_token_ids=[free[2]])
    want = plain.generate(prompts, params)
    assert want[0].output_ids[:2] == free[:2] and free[2] not in want[0].output_ids[:8]
    assert [r.output_ids for r in ngram.generate(prompts, params)] == [r.output_ids for r in want]


def test_retraction_and_abort_mid_speculation_leave_no_leak(model, plain: LocalEngine) -> None:  # noqa: ANN001
    """A pool too small for the batch: speculating requests are retracted (their verify rows'
    worst-case pages given back) and re-prefilled, with the tokens they would get anyway; then a
    request aborted while its verify step is in flight: every page comes back."""
    path, prompts = model
    batch = [prompts[4], prompts[0], prompts[4][:20], prompts[2]]
    params = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
    want = _ids(plain.generate(batch, params))
    eng = _engine(path, speculative_algorithm="NGRAM", max_total_tokens=12 * 16)
    assert _ids(eng.generate(batch, params)) == want
    assert eng.core.retractions > 0 and eng.core.leak_free()
    core, runner = eng.core, eng.runner
    for i, ids in enumerate(batch[:2]):
        assert core.submit(TokenizedRequest(rid=f"a{i}", input_ids=pack_ids(ids), params=params)) is None
    aborted = False
    while (step := core.plan()) is not None:  # one step at a time: abort between a verify's send and answer
        victim = core.reqs.get("a0")
        if not aborted and step.forward is not None and step.forward.drafts is not None and victim is not None \
                and victim.inflight:
            assert core.abort("a0") is not None
            aborted = True
        core.on_done(runner.run_step(step))
    assert aborted and core.idle
    core.plan()  # publishes the last FreeReq
    assert core.leak_free()


def test_ngram_drafts_from_the_prefix_cache(model, plain: LocalEngine, ngram: LocalEngine) -> None:  # noqa: ANN001
    """A prompt asked again: its drafts are the cached continuation of its tokens in the radix tree
    (the first answer's), not only its own n-grams: nearly every draft is accepted, tokens unchanged."""
    prompt = model[1][3]  # "Once upon a time...": little to find in its own tokens
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    (want,) = _ids(plain.generate([prompt], params))
    assert _ids(ngram.generate([prompt], params)) == [want]  # the first answer enters the tree at its end
    st = ngram.core.state.spec_stats
    rows, accepted = st.rows, st.accepted
    assert _ids(ngram.generate([prompt], params)) == [want]
    length = 1 + (st.accepted - accepted) / (st.rows - rows)
    assert length > 3.5, f"accept length {length:.2f} with the answer cached (3 drafts: 4 at most)"
    assert ngram.core.leak_free()


def test_a_corrupting_oracle_lowers_acceptance_not_the_tokens(model, plain: LocalEngine) -> None:  # noqa: ANN001
    """--speculative-corrupt-drafts 0.5 (bin/bench spec --corrupt): the cached answer's drafts,
    each spoiled with chance 1/2, are accepted about 1 + 1/2 + 1/4 + 1/8 tokens a row (3 drafts),
    and the answer is still plain decoding's."""
    prompt = model[1][3]
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    (want,) = _ids(plain.generate([prompt], params))
    eng = _engine(model[0], speculative_algorithm="NGRAM", speculative_corrupt_drafts=0.5)
    assert _ids(eng.generate([prompt], params)) == [want]
    st = eng.core.state.spec_stats
    rows, accepted = st.rows, st.accepted
    assert _ids(eng.generate([prompt], params)) == [want]
    length = 1 + (st.accepted - accepted) / (st.rows - rows)
    assert 1.2 < length < 3.0, f"accept length {length:.2f} with half the oracle's drafts spoiled"
    assert eng.core.leak_free()


def test_overlapped_rows_chain_and_void_rows_answer_nothing(model, plain: LocalEngine,  # noqa: ANN001
                                                            ngram: LocalEngine) -> None:
    """Overlap while speculating: a request's next verify row is planned before its previous one
    answers (after a row without drafts, or a streak of fully accepted ones), as if every draft
    were accepted; where one was not, the worker voids the chained row on the device and the
    scheduler agrees (it checks every answer). Tokens stay those of plain decoding."""
    prompts = [model[1][4], model[1][2], model[1][1]]  # repetitive, counting, short: all three cases
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    want = _ids(plain.generate(prompts, params))
    st = ngram.core.state.spec_stats
    chained, void = st.chained, st.void
    assert _ids(ngram.generate(prompts, params)) == want
    assert st.chained > chained and st.void > void, "no row was chained, or none was void"
    steps = STEPS[id(ngram)]
    assert any(s.forward is not None and s.forward.drafts is not None and s.forward.drafts.chained for s in steps)
    print(f"\nchained rows {st.chained - chained}, void {st.void - void}")
    assert ngram.core.leak_free()
