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
from msgs.steps import AddReq, Flush, FreeReq, PrepareGrammar, Step, WorkerSampling

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


def _slots(default_model_dir: Path, vocab: int, grammar: Grammar | None, background: bool = True,
           helpers: int = 0) -> GrammarSlots:
    """Matchers in process (helpers=0, the CPU default) or in helper processes (the GPU's), with
    `grammar` prepared and compiled (as the scheduler's gate waits for before an AddReq)."""
    g = GrammarSlots(str(default_model_dir), vocab, 4, torch.device("cpu"), background=background, helpers=helpers)
    OPEN.append(g)
    if grammar is not None:
        _prepare(g, grammar)
    return g


def _prepare(g: GrammarSlots, grammar: Grammar) -> None:
    g.apply(PrepareGrammar(grammar))
    assert g.compiled(wait=True) == [(grammar.key, g._keys.prepared, "")]
    assert not g.compiling


def _add(slot: int, grammar: Grammar | None, output: list[int] = ()) -> AddReq:
    return AddReq(slot, f"r{slot}", SAMPLING, pack_ids([1]), pack_ids(list(output)), grammar=grammar)


def _object(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props)}


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
    g = _slots(default_model_dir, vocab, grammar, background, helpers)
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
    g = _slots(default_model_dir, vocab, grammar)
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
    live = _slots(default_model_dir, vocab, grammar, helpers=helpers)
    live.apply(_add(0, grammar))
    expected = _drive(live, 0, ids, vocab)
    expected = torch.zeros(1, vocab)
    live.mask(expected, [0])
    readded = _slots(default_model_dir, vocab, grammar, helpers=helpers)
    readded.apply(_add(2, grammar, ids))  # what the scheduler sends after a retraction
    got = torch.zeros(1, vocab)
    readded.mask(got, [2])
    assert torch.equal(got, expected)
    readded.apply(FreeReq(2))
    assert 2 not in readded.matchers


@pytest.mark.parametrize("helpers", [0, 1])
def test_an_output_the_grammar_refuses_is_fatal(default_model_dir: Path, setup, helpers: int) -> None:
    tok, vocab, grammar = setup
    g = _slots(default_model_dir, vocab, grammar, helpers=helpers)
    with pytest.raises(ReplicaError, match="refuses its own output"):  # helpers: at the step's mask
        g.apply(_add(0, grammar, tok.encode("hello", add_special_tokens=False)))
        g.mask(torch.zeros(1, vocab), [0])


def test_the_replica_drives_the_matchers(default_model_dir: Path, setup) -> None:
    """PrepareGrammar / AddReq / FreeReq through a rank's replica; a free slot is reused by a new
    grammar; the replica's GrammarKeys and the matchers' agree."""
    _tok, vocab, grammar = setup
    g = _slots(default_model_dir, vocab, None)
    replica = rank_replica([g])
    replica.apply_step(Step(1, [PrepareGrammar(grammar)]))
    assert g.compiled(wait=True) == [(grammar.key, 1, "")]
    replica.apply_step(Step(2, [_add(0, grammar), _add(1, None)]))
    assert set(g.matchers) == {0}
    replica.apply_step(Step(3, [FreeReq(0), _add(0, grammar)]))
    assert set(g.matchers) == {0}
    assert replica["grammar_keys"].encode() == g._keys.encode()


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
    g = _slots(default_model_dir, vocab, grammar, helpers=helpers)
    ref = _slots(default_model_dir, vocab, grammar, background=False)
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
    fresh = _slots(default_model_dir, vocab, grammar, background=False)
    fresh.apply(_add(0, grammar))
    expected2 = torch.zeros(1, vocab)
    fresh.mask(expected2, [0])
    assert torch.equal(logits[0], expected0[0])
    assert bool((logits[1] == 0).all())
    assert torch.equal(logits[2], expected2[0])


def test_a_dead_helper_fails_loudly_and_close_leaves_no_process(default_model_dir: Path, setup) -> None:
    tok, vocab, grammar = setup
    g = _slots(default_model_dir, vocab, grammar, helpers=2)
    g.wait_ready()
    g.apply(_add(1, grammar))
    procs = list(g._helpers.procs)
    procs[1].kill()  # slot 1's helper
    procs[1].wait()
    with pytest.raises(RuntimeError, match="grammar helper 1"):
        g.apply(_add(3, grammar))
    g.close()
    assert all(p.poll() is not None for p in procs)


def test_grammar_keys_hold_what_was_prepared_and_evict_the_least_recent() -> None:
    from engine.replica.components import GrammarKeys

    keys = GrammarKeys()
    keys.CAPACITY = 2
    g = {k: Grammar(k, b"data-" + k.encode(), [0]) for k in "abc"}
    assert keys.prepare(g["a"]) == [] and keys.prepare(g["b"]) == []
    keys.apply(AddReq(0, "r", SAMPLING, pack_ids([1]), pack_ids([]), grammar=Grammar("a", b"", [0])))  # a: recent
    assert keys.prepare(g["c"]) == ["b"] and list(keys.keys) == ["a", "c"] and keys.prepared == 3
    with pytest.raises(ReplicaError, match="does not hold"):
        keys.use("b")
    with pytest.raises(ReplicaError, match="without its data"):
        keys.prepare(Grammar("d", b"", [0]))
    keys.apply(Flush())
    assert not keys.keys and keys.prepared == 3  # the count goes on: a late report is told apart


def test_grammar_keys_hold_at_most_their_bytes_and_always_the_newest() -> None:
    """64 keys alone bound no memory: every grammar helper holds every grammar, and one may take
    up to 64 MiB compiled (an audit: +48 MB a helper per 150-property schema)."""
    from engine.replica.components import GrammarKeys

    keys = GrammarKeys()
    keys.BYTES = 100
    sizes = {"a": 40, "b": 40, "c": 40, "d": 500}
    assert [keys.prepare(Grammar(k, b"x", [0], sizes[k])) for k in "abcd"] == [[], [], ["a"], ["b", "c"]]
    assert list(keys.keys) == ["d"] and keys.bytes == 500  # the newest stays
    assert keys.prepare(Grammar("d", b"x", [0], 30)) == [] and keys.bytes == 30  # prepared again: its new size


@pytest.mark.parametrize("helpers", [0, 2])
def test_an_addreq_names_a_compiled_key_and_a_key_not_held_is_fatal(
    default_model_dir: Path, setup, helpers: int
) -> None:
    tok, vocab, grammar = setup
    g = _slots(default_model_dir, vocab, grammar, helpers=helpers)
    g.apply(_add(0, Grammar(grammar.key, b"", grammar.stop_ids)))  # as the scheduler names it
    g.apply(_add(1, Grammar(grammar.key, b"", grammar.stop_ids)))
    logits = torch.zeros(2, vocab)
    g.mask(logits, [0, 1])
    assert torch.equal(logits[0], logits[1]) and bool(torch.isinf(logits[1]).any())
    with pytest.raises(ReplicaError, match="does not hold"):
        g.apply(_add(2, Grammar("other", b"", grammar.stop_ids)))


@pytest.mark.parametrize("helpers", [0, 2])
def test_a_compile_runs_beside_the_steps_and_a_failed_one_is_reported(
    default_model_dir: Path, setup, helpers: int
) -> None:
    """A grammar that takes most of a second to compile (20 patterned strings) compiles while
    another slot's mask and accept go on; `compiled` reports it only when every helper has it.
    A source xgrammar refuses is reported with its error, not raised."""
    tok, vocab, grammar = setup
    g = _slots(default_model_dir, vocab, grammar, helpers=helpers)
    g.apply(_add(0, grammar))
    props = {f"p{i}": {"type": "string", "pattern": f"[a-z]{{2,{20 + i}}}"} for i in range(20)}
    slow = Grammar("slow", grammar_data(json.dumps({"type": "structural_tag", "format": json_format(_object(props))})),
                   grammar.stop_ids)
    g.apply(PrepareGrammar(slow))
    ids = tok.encode('{"n": 4', add_special_tokens=False)
    _drive(g, 0, ids, vocab)  # slot 0's steps while `slow` compiles
    assert g.compiling and g.compiled() == []
    assert g.compiled(wait=True) == [("slow", g._keys.prepared, "")]
    g.apply(_add(1, slow))
    broken = Grammar("broken", grammar_data('{"type": "structural_tag", "format": {"type": "nonsense"}}'), [0])
    g.apply(PrepareGrammar(broken))
    ((key, generation, error),) = g.compiled(wait=True)
    assert (key, generation) == ("broken", g._keys.prepared) and error


def test_a_compile_not_started_is_cancelled_when_its_key_goes(default_model_dir: Path, setup) -> None:
    """Flushed or evicted keys' compiles that have not started are cancelled: one compile thread
    a rank, and they would hold up the next grammars (an audit: a 10 ms schema waited 10 s
    behind ten slow ones whose clients had left)."""
    tok, vocab, grammar = setup
    g = _slots(default_model_dir, vocab, None)
    props = {f"p{i}": {"type": "string", "pattern": f"[a-z]{{2,{20 + i}}}"} for i in range(20)}
    slow = grammar_data(json.dumps({"type": "structural_tag", "format": json_format(_object(props))}))
    g.apply(PrepareGrammar(Grammar("s1", slow, grammar.stop_ids)))
    g.apply(PrepareGrammar(Grammar("s2", slow, grammar.stop_ids)))
    queued = g._compiling["s2"][1]
    g.apply(Flush())
    assert queued is not None and queued.cancelled() and not g.compiling and g.compiled() == []
    _prepare(g, grammar)  # after s1's compile, which had started: nothing reports the flushed keys


@pytest.mark.parametrize("helpers", [0, 2])
def test_a_flush_drops_the_held_grammars_everywhere(default_model_dir: Path, setup, helpers: int) -> None:
    """After Flush (every replica back to its fresh state) no key is held: an AddReq naming one
    is fatal until it is prepared again; a matcher made before keeps working."""
    tok, vocab, grammar = setup
    g = _slots(default_model_dir, vocab, grammar, helpers=helpers)
    g.apply(_add(0, grammar))
    g.apply(Flush())
    with pytest.raises(ReplicaError, match="does not hold"):
        g.apply(_add(1, grammar))
    _prepare(g, grammar)
    g.apply(_add(2, grammar))
    logits = torch.zeros(2, vocab)
    g.mask(logits, [0, 2])  # slot 0's matcher predates the flush
    assert torch.equal(logits[0], logits[1]) and bool(torch.isinf(logits[0]).any())


def test_a_warm_rank_builds_its_compiler_from_ready_on(default_model_dir: Path, tmp_path: Path) -> None:
    """warm (the served worker's): wait_ready starts building the in-process compiler on the compile
    thread, where a grammar queues behind it; a model without tokenizer files is fine (its first
    grammar fails, as before)."""
    g = GrammarSlots(str(default_model_dir), 49152, 4, torch.device("cpu"), helpers=0, warm=True)
    OPEN.append(g)
    assert g._warming is None and g._compiler is None  # nothing beside the model's warm-up
    g.wait_ready()
    assert g._warming is not None
    g._warming.result(timeout=120)
    assert g._compiler is not None
    cold = GrammarSlots(str(default_model_dir), 49152, 4, torch.device("cpu"), helpers=0)
    OPEN.append(cold)
    cold.wait_ready()
    assert cold._warming is None and cold._compiler is None  # lazy: the first grammar builds it
    bare = GrammarSlots(str(tmp_path), 49152, 4, torch.device("cpu"), helpers=0, warm=True)
    OPEN.append(bare)
    bare.wait_ready()
    bare._warming.result(timeout=120)
    assert bare._compiler is None


def test_the_worker_imports_xgrammar_only_for_a_grammar() -> None:
    """engine/run/grammar.py does not import xgrammar (nor transformers through it) until a
    grammar needs it: a worker without constrained requests starts without it."""
    import subprocess
    import sys

    code = ("import sys; import engine.run.grammar as g; assert 'xgrammar' not in sys.modules; "
            "g.xgr.GrammarCompiler; assert 'xgrammar' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2], timeout=120)
