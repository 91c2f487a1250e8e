"""NGRAM draft trees end to end on the default model in float32 (LocalEngine: the served Step
stream, digests checked every step, overlap on): greedy and seeded tokens with trees equal the
tokens without speculation (batched, from the prefix cache, in prefill chunks); where the radix
tree holds two continuations of a prompt, the tree accepts at least what the chain does; no page
leaks; the Step stream replayed into a fresh replica ends at the worker's digest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config import ServerConfig
from engine.local import LocalEngine, Result
from engine.replica import rank_replica
from engine.tokenizer import load_tokenizer
from msgs.codec import pack_ids, unpack_ids
from msgs.params import SamplingParams
from msgs.requests import TokenizedRequest
from msgs.steps import Step
from tests.models.draft_heads import write_head

CODE = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
        "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n")
TEXTS = [CODE, "The capital of France is", "1, 2, 3, 4, 5, 6, 7, 8, 9,", "Once upon a time, in a small village",
         "The quick brown fox jumps over the lazy dog. " * 3]
GREEDY = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
TREE = dict(speculative_algorithm="NGRAM", speculative_eagle_topk=3, speculative_num_draft_tokens=8)


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


STEPS: list[Step] = []  # every Step the tree engine's scheduler planned


@pytest.fixture(scope="module")
def tree(model: tuple[str, list[list[int]]]) -> LocalEngine:
    eng = _engine(model[0], max_prefill_tokens=32, **TREE)  # chunked prefill too
    plan = eng.core.plan

    def record() -> Step | None:
        step = plan()
        if step is not None:
            STEPS.append(step)
        return step

    eng.core.plan = record  # type: ignore[method-assign]
    return eng


def _ids(results: list[Result]) -> list[list[int]]:
    assert all(r.finish_reason == "length" for r in results), results
    return [r.output_ids for r in results]


def test_tree_greedy_equals_plain_batched_cached_chunked(model, plain: LocalEngine, tree: LocalEngine) -> None:  # noqa: ANN001
    prompts = model[1][:4]
    want = _ids(plain.generate(prompts, GREEDY))
    assert _ids(tree.generate(prompts, GREEDY)) == want  # 4 prompts in one batch, prefilled in 32-token chunks
    again = tree.generate(prompts, GREEDY)  # their prompts' and answers' pages from the prefix cache now
    assert _ids(again) == want and again[0].cached_tokens >= 32
    trees = [unpack_ids(s.forward.drafts.parents) for s in STEPS
             if s.forward is not None and s.forward.drafts is not None and s.forward.drafts.parents]
    assert trees and any(any(p != i - 1 for i, p in enumerate(t)) for t in trees)  # real trees were verified
    assert tree.core.leak_free()
    replay = rank_replica()  # another replica of the whole stream (trims included) ends where the worker is
    for st in STEPS:
        replay.apply_step(st)
    assert replay.digest() == tree.runner.replica.digest() == tree.core.replica.digest()


def test_tree_seeded_and_penalized_requests_equal_plain(model, plain: LocalEngine, tree: LocalEngine) -> None:  # noqa: ANN001
    """Every node is drawn as a one-token step at its depth's position would draw it (the seeded
    Gumbel race), with the drafts on its path as its penalty history; only the accepted path is
    recorded: seeded and penalized requests answer the same tokens (the logits agreeing in float32)."""
    prompts = [model[1][4], model[1][0], model[1][4]]
    params = [SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.95, seed=5, ignore_eos=True),
              SamplingParams(max_new_tokens=12, temperature=0.7, seed=9, ignore_eos=True, presence_penalty=0.5),
              SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.2,
                             frequency_penalty=0.3)]
    assert _ids(tree.generate(prompts, params)) == _ids(plain.generate(prompts, params))
    assert tree.core.leak_free()


def _accepted(eng: LocalEngine, prompt: list[int], other: list[int], params: SamplingParams
              ) -> tuple[list[int], int, int]:
    """Answer `prompt`, then `prompt + other` (a later continuation in the radix tree that parts
    from the first answer after its first token: the prefill draws that one), then `prompt`
    again: its tokens, and its verify rows' accepted drafts and rows."""
    eng.generate([prompt], params)
    eng.generate([prompt + other], SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
    st = eng.core.state.spec_stats
    rows, accepted = st.rows, st.accepted
    (res,) = eng.generate([prompt], params)
    assert eng.core.leak_free()
    return res.output_ids, st.accepted - accepted, st.rows - rows


def test_tree_accepts_at_least_the_chain_where_the_cache_branches(model, plain: LocalEngine) -> None:  # noqa: ANN001
    """The radix tree holds two continuations of a prompt (its first answer, then a later prompt
    that goes on differently): the chain drafts the most recent (wrong), the tree holds both."""
    path, prompts = model
    prompt = prompts[3]  # "Once upon a time...", then its first answer token and "The capital of France is"
    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    (want,) = _ids(plain.generate([prompt], params))
    other = [want[0], *prompts[1]]
    assert want[1] != other[1]
    chain_ids, chain_acc, chain_rows = _accepted(_engine(path, speculative_algorithm="NGRAM"), prompt, other, params)
    tree_ids, tree_acc, tree_rows = _accepted(_engine(path, **TREE), prompt, other, params)
    assert chain_ids == tree_ids == want
    print(f"\naccept length: chain {1 + chain_acc / chain_rows:.2f}, tree {1 + tree_acc / tree_rows:.2f}")
    assert 1 + tree_acc / tree_rows > 1 + chain_acc / chain_rows  # the chain loses its first row, the tree not
    assert tree_rows <= chain_rows


def test_tree_retraction_and_abort_leave_no_leak(model, plain: LocalEngine) -> None:  # noqa: ANN001
    """A pool too small for the batch: requests verifying trees are retracted (their worst-case
    pages given back) and re-prefilled with the same tokens; then a request aborted while its
    tree's verify step is in flight: every page comes back."""
    path, prompts = model
    batch = [prompts[4], prompts[0], prompts[4][:20], prompts[2]]
    params = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
    want = _ids(plain.generate(batch, params))
    eng = _engine(path, max_total_tokens=12 * 16, **TREE)
    assert _ids(eng.generate(batch, params)) == want
    assert eng.core.retractions > 0 and eng.core.leak_free()
    core, runner = eng.core, eng.runner
    for i, ids in enumerate(batch[:2]):
        assert core.submit(TokenizedRequest(rid=f"a{i}", input_ids=pack_ids(ids), params=params)) is None
    aborted = False
    while (step := core.plan()) is not None:  # one step at a time: abort between a tree's send and answer
        victim = core.reqs.get("a0")
        if not aborted and step.forward is not None and step.forward.drafts is not None \
                and step.forward.drafts.parents and victim is not None and victim.inflight:
            assert core.abort("a0") is not None
            aborted = True
        core.on_done(runner.run_step(step))
    assert aborted and core.idle
    core.plan()  # publishes the last FreeReq
    assert core.leak_free()


def test_worker_draft_trees_equal_plain_and_accept_at_least_the_chain(model, plain: LocalEngine) -> None:  # noqa: ANN001
    """STANDALONE's self-draft (8 of 30 layers) proposes a chain and, beside each of its nodes, its
    next best tokens (leaves): the tokens stay plain decoding's and, the chain being in the tree,
    at least as many drafts are accepted as with the chain alone."""
    path, prompts = model
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    want = _ids(plain.generate(prompts[1:3], params))
    draft = dict(speculative_algorithm="STANDALONE", speculative_draft_layers=8, speculative_num_steps=2)
    stats = []
    for kw in ({}, dict(speculative_eagle_topk=3, speculative_num_draft_tokens=7)):
        eng = _engine(path, **draft, **kw)
        assert _ids(eng.generate(prompts[1:3], params)) == want
        assert eng.core.leak_free()
        stats.append(eng.core.state.spec_stats)
    chain, tree = stats
    print(f"\nself-draft accept length: chain {chain.accept_length:.2f}, tree {tree.accept_length:.2f}")
    assert tree.drafted > chain.drafted and tree.accept_length >= chain.accept_length


def test_eagle_head_trees_equal_plain(model, plain: LocalEngine, tmp_path: Path) -> None:  # noqa: ANN001
    """A random EAGLE head drafts a chain and its next best tokens beside it (`propose` with
    alternatives); the accepted path is compacted in the target's KV, the head's KV and its hidden
    pool: greedy tokens stay plain decoding's, fresh and from the prefix cache, no leak."""
    path, prompts = model
    params = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    want = _ids(plain.generate(prompts[:2], params))
    head = write_head(tmp_path / "eagle", json.loads((Path(path) / "config.json").read_text()), "EAGLE")
    eng = _engine(path, speculative_algorithm="EAGLE", speculative_draft_model_path=str(head), max_prefill_tokens=32,
                  speculative_eagle_topk=2, speculative_num_draft_tokens=7)
    assert _ids(eng.generate(prompts[:2], params)) == want
    assert _ids(eng.generate(prompts[:2], params)) == want
    st = eng.core.state.spec_stats
    assert st.drafted > 3 * st.rows and 0 <= st.accepted <= st.drafted  # leaves beside the 3-chains
    assert eng.core.leak_free()
