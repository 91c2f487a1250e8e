"""GrammarSlots (engine/run/grammar.py): the per-slot matchers a rank replicates, on CPU with
the default model's tokenizer and real xgrammar grammars compiled the way the tokenizer
process compiles them (engine/serve/grammar.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import xgrammar as xgr

from engine.replica import ReplicaError, rank_replica
from engine.run.grammar import GrammarSlots
from engine.serve.grammar import json_format, with_reasoning
from engine.tokenizer import grammar_data, load_tokenizer, tokenizer_info
from msgs.codec import pack_ids
from msgs.params import Grammar
from msgs.steps import AddReq, Flush, FreeReq, Step, WorkerSampling

EXTRA = 64  # the model's logits are wider than the tokenizer's vocabulary by this much
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
SAMPLING = WorkerSampling(1.0, 1.0, -1, 0.0, 1.0, 0.0, 0.0, 7, False, 0)


@pytest.fixture(scope="module")
def setup(default_model_dir: Path) -> tuple[object, int, Grammar]:
    tok = load_tokenizer(str(default_model_dir))
    assert tok is not None
    vocab = len(tok.hf) + EXTRA
    info = tokenizer_info(tok.hf, vocab)
    tag = {"type": "structural_tag", "format": json_format(SCHEMA)}
    grammar = Grammar("k1", grammar_data(json.dumps(tag)), [int(t) for t in info.stop_token_ids])
    return tok, vocab, grammar


OPEN: list[GrammarSlots] = []


@pytest.fixture(autouse=True)
def _close_helpers():  # noqa: ANN202
    yield
    while OPEN:
        OPEN.pop().close()


def _slots(default_model_dir: Path, vocab: int, background: bool = True, helpers: int = 0) -> GrammarSlots:
    """Matchers in process (helpers=0, the CPU default) or in helper processes (the GPU's)."""
    g = GrammarSlots(str(default_model_dir), vocab, 4, torch.device("cpu"), background=background, helpers=helpers)
    OPEN.append(g)
    return g


def _add(slot: int, grammar: Grammar | None, output: list[int] = ()) -> AddReq:
    return AddReq(slot, f"r{slot}", SAMPLING, pack_ids([1]), pack_ids(list(output)), grammar=grammar)


def _drive(g: GrammarSlots, slot: int, tokens: list[int], vocab: int) -> torch.Tensor:
    """Sample `tokens` for `slot` step by step through mask/sampled; return the last mask."""
    logits = torch.zeros(1, vocab)
    for t in tokens:
        logits = torch.zeros(1, vocab)
        g.mask(logits, [slot])
        assert logits[0, t] == 0, f"token {t} was masked"
        g.sampled([slot], torch.tensor([t]))
    return logits


@pytest.mark.parametrize(("background", "helpers"), [(True, 0), (False, 0), (True, 2)])
def test_mask_follows_the_tokens_until_the_grammar_terminates(
    default_model_dir: Path, setup, background: bool, helpers: int
) -> None:
    tok, vocab, grammar = setup
    g = _slots(default_model_dir, vocab, background, helpers)
    g.apply(_add(0, grammar))
    ids = tok.encode('{"n": 42}', add_special_tokens=False)
    _drive(g, 0, ids, vocab)
    logits = torch.zeros(1, vocab)
    g.mask(logits, [0])  # the document is complete: only the stop token is left
    allowed = (logits[0] == 0).nonzero().flatten().tolist()
    assert allowed == grammar.stop_ids
    g.sampled([0], torch.tensor([grammar.stop_ids[0]]))
    logits = torch.zeros(1, vocab)
    g.mask(logits, [0])  # the overlap step after termination: left unmasked, its token is dropped
    assert g.matchers[0].is_terminated()
    assert bool((logits == 0).all())


def test_the_vocabulary_tail_is_masked(default_model_dir: Path, setup) -> None:
    tok, vocab, grammar = setup
    g = _slots(default_model_dir, vocab)
    g.apply(_add(1, grammar))
    logits = torch.zeros(2, vocab)
    g.mask(logits, [3, 1])  # slot 3 is not constrained: its row stays as it was
    assert bool((logits[0] == 0).all())
    assert bool(torch.isinf(logits[1, len(tok.hf) :]).all())  # ids past the tokenizer's vocabulary
    assert 0 < int((logits[1] == 0).sum()) < len(tok.hf)


@pytest.mark.parametrize("helpers", [0, 2])
def test_retraction_re_advances_over_the_output_so_far(default_model_dir: Path, setup, helpers: int) -> None:
    tok, vocab, grammar = setup
    ids = tok.encode('{"n": 12', add_special_tokens=False)
    live = _slots(default_model_dir, vocab, helpers=helpers)
    live.apply(_add(0, grammar))
    expected = _drive(live, 0, ids, vocab)
    expected = torch.zeros(1, vocab)
    live.mask(expected, [0])
    readded = _slots(default_model_dir, vocab, helpers=helpers)
    readded.apply(_add(2, grammar, ids))  # what the scheduler sends after a retraction
    got = torch.zeros(1, vocab)
    readded.mask(got, [2])
    assert torch.equal(got, expected)
    readded.apply(FreeReq(2))
    assert 2 not in readded.matchers


@pytest.mark.parametrize("helpers", [0, 1])
def test_an_output_the_grammar_refuses_is_fatal(default_model_dir: Path, setup, helpers: int) -> None:
    tok, vocab, grammar = setup
    g = _slots(default_model_dir, vocab, helpers=helpers)
    with pytest.raises(ReplicaError, match="refuses its own output"):  # helpers: at the step's mask
        g.apply(_add(0, grammar, tok.encode("hello", add_special_tokens=False)))
        g.mask(torch.zeros(1, vocab), [0])


def test_the_replica_drives_the_matchers(default_model_dir: Path, setup) -> None:
    """AddReq / FreeReq through a rank's replica; a free slot is reused by a new grammar."""
    _tok, vocab, grammar = setup
    g = _slots(default_model_dir, vocab)
    replica = rank_replica([g])
    replica.apply_step(Step(1, [_add(0, grammar), _add(1, None)]))
    assert set(g.matchers) == {0}
    replica.apply_step(Step(2, [FreeReq(0), _add(0, grammar)]))
    assert set(g.matchers) == {0}


def test_reasoning_comes_before_the_constraint(default_model_dir: Path, setup) -> None:
    from engine.serve.grammar import Reasoning

    tok, vocab, _ = setup
    info = tokenizer_info(tok.hf, vocab)
    fmt = with_reasoning(json_format(SCHEMA), Reasoning("<think>", "</think>", starts_inside=True))
    compiled = xgr.GrammarCompiler(info).compile_structural_tag(json.dumps({"type": "structural_tag", "format": fmt}))
    m = xgr.GrammarMatcher(compiled)
    assert m.accept_string("free text, even { and ]</think>\n")
    assert not m.accept_string("no json")
    assert m.accept_string('{"n": 1}')


@pytest.mark.parametrize("helpers", [0, 2])
def test_rows_by_slot_with_requests_coming_and_going(default_model_dir: Path, setup, helpers: int) -> None:
    """Two constrained slots at different points of the document, an unconstrained row
    between them, and a slot freed and reused by a new grammar while a job is in flight:
    each row gets its own slot's mask (with 2 helpers, slots 0 and 2 share one)."""
    tok, vocab, grammar = setup
    g = _slots(default_model_dir, vocab, helpers=helpers)
    ref = _slots(default_model_dir, vocab, background=False)
    a = tok.encode('{"n": 4', add_special_tokens=False)
    g.apply(_add(0, grammar))
    g.apply(_add(2, grammar))
    ref.apply(_add(0, grammar, a))
    for t in a:  # slot 0 advances, slot 2 stays at the start (it samples the same token: '{' first)
        logits = torch.zeros(3, vocab)
        g.mask(logits, [0, 1, 2] if t == a[0] else [0, 1])
        g.sampled([0, 1, 2] if t == a[0] else [0, 1], torch.tensor([t, 5, t]) if t == a[0] else torch.tensor([t, 5]))
    g.apply(FreeReq(2))  # freed while the last job may still run; its slot takes a fresh grammar
    g.apply(_add(2, grammar))
    logits = torch.zeros(3, vocab)
    g.mask(logits, [0, 1, 2])
    expected0 = torch.zeros(1, vocab)
    ref.mask(expected0, [0])
    fresh = _slots(default_model_dir, vocab, background=False)
    fresh.apply(_add(0, grammar))
    expected2 = torch.zeros(1, vocab)
    fresh.mask(expected2, [0])
    assert torch.equal(logits[0], expected0[0])
    assert bool((logits[1] == 0).all())
    assert torch.equal(logits[2], expected2[0])


def test_a_dead_helper_fails_loudly_and_close_leaves_no_process(default_model_dir: Path, setup) -> None:
    tok, vocab, grammar = setup
    g = _slots(default_model_dir, vocab, helpers=2)
    g.wait_ready()
    g.apply(_add(1, grammar))
    procs = list(g._helpers.procs)
    procs[1].kill()  # slot 1's helper
    procs[1].wait()
    with pytest.raises(RuntimeError, match="grammar helper 1"):
        g.apply(_add(3, grammar))
    g.close()
    assert all(p.poll() is not None for p in procs)


def test_grammar_keys_strip_what_is_held_and_evict_the_least_recent() -> None:
    from engine.replica.components import GrammarKeys

    live, mirror = GrammarKeys(), GrammarKeys()
    live.CAPACITY = mirror.CAPACITY = 2
    g = {k: Grammar(k, b"data-" + k.encode(), [0]) for k in "abc"}
    sent = [live.strip(g[k]) for k in "abac"]  # what four AddReqs carry
    assert [s.data for s in sent] == [b"data-a", b"data-b", b"", b"data-c"]  # a: held the second time
    for s in sent:
        mirror.apply(AddReq(0, "r", SAMPLING, pack_ids([1]), pack_ids([]), grammar=s))
    assert list(live.keys) == list(mirror.keys) == ["a", "c"]  # b was the least recent
    assert mirror.encode() == live.encode()
    with pytest.raises(ReplicaError, match="without its data"):
        mirror.use(Grammar("b", b"", [0]))


def test_grammar_keys_hold_at_most_their_bytes_and_always_the_newest() -> None:
    """64 keys alone bound no memory: every grammar helper holds every grammar, and one may take
    up to 64 MiB compiled (an audit: +48 MB a helper per 150-property schema)."""
    from engine.replica.components import GrammarKeys

    live, mirror = GrammarKeys(), GrammarKeys()
    live.BYTES = mirror.BYTES = 100
    sizes = {"a": 40, "b": 40, "c": 40, "d": 500}
    sent = [live.strip(Grammar(k, b"x", [0], sizes[k])) for k in "abcd"]
    for s in sent:
        mirror.apply(AddReq(0, "r", SAMPLING, pack_ids([1]), pack_ids([]), grammar=s))
    assert list(live.keys) == list(mirror.keys) == ["d"] and mirror.bytes == live.bytes == 500  # the newest stays
    live.apply(Flush())
    assert live.bytes == 0 and live.encode() == GrammarKeys().encode()
    assert [live.use(Grammar(k, b"x", [0], sizes[k])) for k in "abc"] == [[], [], ["a"]]  # 120 > 100


@pytest.mark.parametrize("helpers", [0, 2])
def test_a_stripped_grammar_is_served_from_what_the_rank_holds(default_model_dir: Path, setup, helpers: int) -> None:
    tok, vocab, grammar = setup
    g = _slots(default_model_dir, vocab, helpers=helpers)
    g.apply(_add(0, grammar))
    g.apply(_add(1, Grammar(grammar.key, b"", grammar.stop_ids)))  # the scheduler strips a held key
    logits = torch.zeros(2, vocab)
    g.mask(logits, [0, 1])
    assert torch.equal(logits[0], logits[1]) and bool(torch.isinf(logits[1]).any())
    with pytest.raises(ReplicaError, match="without its data"):
        g.apply(_add(2, Grammar("other", b"", grammar.stop_ids)))


@pytest.mark.parametrize("helpers", [0, 2])
def test_a_flush_drops_the_held_grammars_everywhere(default_model_dir: Path, setup, helpers: int) -> None:
    """After Flush (every replica back to its fresh state) a key is no longer held: an AddReq
    must bring its data again; a matcher made before keeps working."""
    from engine.replica.components import GrammarKeys

    tok, vocab, grammar = setup
    keys = GrammarKeys()
    keys.apply(_add(0, grammar))
    keys.apply(Flush())
    assert not keys.keys and keys.encode() == GrammarKeys().encode()
    g = _slots(default_model_dir, vocab, helpers=helpers)
    g.apply(_add(0, grammar))
    g.apply(Flush())
    with pytest.raises(ReplicaError, match="without its data"):
        g.apply(_add(1, Grammar(grammar.key, b"", grammar.stop_ids)))
    g.apply(_add(2, grammar))  # with its data: held again
    logits = torch.zeros(2, vocab)
    g.mask(logits, [0, 2])  # slot 0's matcher predates the flush
    assert torch.equal(logits[0], logits[1]) and bool(torch.isinf(logits[0]).any())


def test_the_worker_imports_xgrammar_only_for_a_grammar() -> None:
    """engine/run/grammar.py does not import xgrammar (nor transformers through it) until a
    grammar needs it: a worker without constrained requests starts without it."""
    import subprocess
    import sys

    code = ("import sys; import engine.run.grammar as g; assert 'xgrammar' not in sys.modules; "
            "g.xgr.GrammarCompiler; assert 'xgrammar' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2], timeout=120)
