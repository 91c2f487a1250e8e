"""The grammar gate (engine/sched/grammars.py): a request whose grammar is not compiled on every
rank waits outside the steps; the grammar crosses the Step stream once, in a PrepareGrammar; its
requests are admitted once every rank reported it. Driven through SchedulerCore with the mirror
check on (digest_every=1), answering as two faithful ranks."""

from __future__ import annotations

from engine.replica import TokenChain, rank_replica
from engine.sched import grammars
from engine.sched.scheduler import SchedConfig, SchedulerCore
from msgs.codec import pack_ids
from msgs.done import GrammarReady, StepDone
from msgs.params import Grammar, SamplingParams
from msgs.requests import TokenizedRequest
from msgs.steps import AddReq, PrepareGrammar, Step

RANKS = 2
G = Grammar("g" * 64, bytes(range(256)) * 4, [0], compiled_bytes=1000)


def make(max_running: int = 8) -> SchedulerCore:
    cfg = SchedConfig(num_pages=64, page_size=4, max_running=max_running, max_prefill_tokens=64, max_context=256,
                      eos_token_ids=(0,), vocab_size=1000, digest_every=1, num_ranks=RANKS)
    core = SchedulerCore(cfg)
    core.chain = TokenChain()  # type: ignore[attr-defined]
    return core


def submit(core: SchedulerCore, rid: str, grammar: Grammar | None = G, max_new: int = 2) -> None:
    params = SamplingParams(max_new_tokens=max_new, grammar=grammar)
    assert core.submit(TokenizedRequest(rid=rid, input_ids=pack_ids([5, 6, 7]), params=params)) is None


def step(core: SchedulerCore) -> Step:
    """Plan a step and answer it on every rank (token 7 for each sampled row)."""
    s = core.plan()
    assert s is not None
    tokens = pack_ids([7] * len(core.sampled_by_step[s.seq]))
    core.chain.update(tokens)  # type: ignore[attr-defined]
    digest = core.digests.expected[s.seq][0]
    for rank in range(RANKS):
        core.on_done(StepDone(seq=s.seq, rank=rank, token_ids=tokens if rank == 0 else b"", digest=digest,
                              tokens_hash=core.chain.hexdigest()))  # type: ignore[attr-defined]
    return s


def of(s: Step, kind: type) -> list:
    return [op for op in s.ops if isinstance(op, kind)]


def ready(core: SchedulerCore, grammar: Grammar = G, ranks: range = range(RANKS), error: str = "",
          generation: int | None = None) -> list:
    gen = core.state.grammar_keys.prepared if generation is None else generation
    return [out for r in ranks for out in core.on_grammar_ready(GrammarReady(r, grammar.key, gen, error))]


def test_a_grammar_crosses_once_and_its_requests_wait_for_every_rank_while_others_run() -> None:
    core = make()
    submit(core, "a")
    submit(core, "b")  # the same grammar: one PrepareGrammar for both
    submit(core, "plain", grammar=None)
    s = step(core)
    (prep,) = of(s, PrepareGrammar)
    assert prep.grammar.data == G.data and prep.grammar.key == G.key
    assert [op.rid for op in of(s, AddReq)] == ["plain"]  # not held up by the compile
    assert core.busy and list(core.replica["grammar_keys"].keys) == [G.key]
    assert ready(core, ranks=range(1)) == []  # rank 0 alone: not yet
    assert not of(step(core), AddReq)
    assert ready(core, ranks=range(1, 2)) == []
    s = step(core)
    adds = of(s, AddReq)
    assert [op.rid for op in adds] == ["a", "b"] and not of(s, PrepareGrammar)
    assert all(op.grammar.key == G.key and op.grammar.data == b"" for op in adds)  # named by key only
    while core.busy or core.settling:
        step(core)
    assert core.leak_free()
    submit(core, "c")  # held and compiled: straight in, no second PrepareGrammar
    s = step(core)
    assert [op.rid for op in of(s, AddReq)] == ["c"] and not of(s, PrepareGrammar)


def test_a_stale_report_is_ignored_and_a_failed_compile_fails_only_its_requests() -> None:
    core = make()
    submit(core, "a")
    step(core)
    assert ready(core, generation=core.state.grammar_keys.prepared - 1) == []  # another prepare's report
    assert core.plan() is None
    outs = ready(core, ranks=range(1), error="MemoryError: no")
    assert [(o.rid, o.finish_reason) for o in outs] == [("a", "error")] and "rank 0" in outs[0].error
    assert "a" not in core.reqs and not core.busy
    assert ready(core, ranks=range(1, 2)) == []  # the other rank's report on it: nothing left
    submit(core, "b")  # the same grammar again: prepared anew
    s = step(core)
    assert len(of(s, PrepareGrammar)) == 1 and list(core.state.grammar_keys.keys) == [G.key]
    ready(core)
    assert [op.rid for op in of(step(core), AddReq)] == ["b"]


def test_an_aborted_request_leaves_the_gate() -> None:
    core = make()
    submit(core, "a")
    step(core)
    out = core.abort("a")
    assert out is not None and out.finish_reason == "abort"
    assert not core.busy and ready(core) == []
    assert core.plan() is None  # nothing to admit


def test_after_a_flush_a_grammar_is_prepared_again() -> None:
    core = make()
    submit(core, "a")
    step(core)
    ready(core)
    while core.busy or core.settling:
        step(core)
    assert core.flush() is None
    submit(core, "b")  # still held when planned: its AddReq, then the Flush drops the key
    s = step(core)
    assert [op.rid for op in of(s, AddReq)] == ["b"] and not of(s, PrepareGrammar)
    assert not core.state.grammar_keys.keys and not core.replica["grammar_keys"].keys
    fresh = rank_replica()["grammar_keys"]
    fresh.prepared = core.state.grammar_keys.prepared  # (the count goes on across a Flush)
    assert core.replica["grammar_keys"].encode() == fresh.encode()
    while core.busy or core.settling:
        step(core)
    submit(core, "c")
    s = step(core)
    assert len(of(s, PrepareGrammar)) == 1 and not of(s, AddReq)


def test_no_prepare_evicts_a_key_that_a_waiting_request_needs() -> None:
    """Capacity 2, one slot: b's key is ready but b waits for the slot; c's grammar is prepared,
    d's would evict b's key, so it waits (an audit's 200 schemas on 4 slots had compiled some
    keys 13 times, each evicted before its request started)."""
    core = make(max_running=1)
    core.state.grammar_keys.CAPACITY = core.replica["grammar_keys"].CAPACITY = 2
    g2, g3 = (Grammar(k * 64, b"x", [0]) for k in "23")
    submit(core, "a", max_new=8)
    step(core)
    ready(core)
    step(core)  # a runs
    submit(core, "b", max_new=8)  # the key is ready: b waits for the slot only
    submit(core, "c", grammar=g2)
    submit(core, "d", grammar=g3)
    s = step(core)
    assert [op.grammar.key for op in of(s, PrepareGrammar)] == [g2.key]
    assert list(core.state.grammar_keys.keys) == [G.key, g2.key]
    ready(core, g2, generation=2)
    assert [r.rid for r in core.waiting] == ["b", "c"]
    assert not of(step(core), PrepareGrammar)  # g3 would evict a waiting request's key


def test_a_request_whose_key_left_while_it_ran_is_prepared_again_after_a_retraction() -> None:
    core = make(max_running=2)
    core.state.grammar_keys.CAPACITY = core.replica["grammar_keys"].CAPACITY = 1
    g2 = Grammar("2" * 64, b"x", [0])
    submit(core, "a", max_new=30)
    step(core)
    ready(core)
    assert [op.rid for op in of(step(core), AddReq)] == ["a"]
    submit(core, "c", grammar=g2, max_new=30)
    s = step(core)  # a runs: its key may go
    assert [op.grammar.key for op in of(s, PrepareGrammar)] == [g2.key]
    assert list(core.state.grammar_keys.keys) == [g2.key]
    core.growth.retract(core.reqs["a"], core.state.pending_ops)  # as when pages run out
    s = step(core)  # a at the head: its key left, back to the gate; G would evict c's key, compiling
    assert not of(s, PrepareGrammar) and not of(s, AddReq) and len(core.grammars) == 2  # a and c
    ready(core, g2, generation=2)
    s = step(core)  # c starts; then nothing needs g2 any more: G is prepared again
    assert [op.rid for op in of(s, AddReq)] == ["c"] and [op.grammar.key for op in of(s, PrepareGrammar)] == [G.key]
    ready(core)
    assert [op.rid for op in of(step(core), AddReq)] == ["a"]
    while core.busy or core.settling:
        step(core)
    assert core.leak_free()


def test_running_stays_in_arrival_order_so_a_victim_has_no_row_yet() -> None:
    """An audit's crash: a grammar request that waited in the gate started after newer requests;
    when its row needed a page, the newest request (the victim) had its row planned already,
    and the step went out with a retracted request's row (TypeError in the scheduler)."""
    cfg = SchedConfig(num_pages=64, page_size=4, max_running=8, max_prefill_tokens=64, max_context=256,
                      eos_token_ids=(0,), vocab_size=1000, digest_every=1, num_ranks=RANKS)
    core = SchedulerCore(cfg)
    core.chain = TokenChain()  # type: ignore[attr-defined]
    submit(core, "A", max_new=200)
    submit(core, "B", grammar=None, max_new=200)
    submit(core, "C", grammar=None, max_new=200)
    step(core)
    ready(core)
    while core.busy or core.settling:
        step(core)
    assert core.state.retractions > 0 and core.leak_free()


def test_at_most_max_preparing_keys_compile_at_once(monkeypatch) -> None:
    monkeypatch.setattr(grammars, "MAX_PREPARING", 2)
    core = make()
    gs = [Grammar(str(i) * 64, b"x", [0]) for i in range(4)]
    for i, g in enumerate(gs):
        submit(core, f"r{i}", grammar=g)
    assert [op.grammar.key for op in of(step(core), PrepareGrammar)] == [gs[0].key, gs[1].key]
    assert core.plan() is None  # two compiling: the others wait
    ready(core, gs[0], generation=1)
    s = step(core)
    assert [op.grammar.key for op in of(s, PrepareGrammar)] == [gs[2].key]
    assert [op.rid for op in of(s, AddReq)] == ["r0"]


def test_a_new_schema_is_not_held_back_forever_by_newer_requests_with_hot_keys() -> None:
    """A re-audit: capacity 2, one slot, keys A and B held; C brings a new key while requests
    with A and B keep waiting for the slot. Protecting every waiting request's key kept C in the
    gate for 3,000 steps while 749 later requests ran; only requests older than C protect theirs."""
    core = make(max_running=1)
    core.state.grammar_keys.CAPACITY = core.replica["grammar_keys"].CAPACITY = 2
    ga, gb, gc = (Grammar(k * 64, b"x", [0]) for k in "abc")
    for i, g in enumerate((ga, gb)):
        submit(core, f"warm{i}", grammar=g, max_new=4)
        step(core)
        ready(core, g)
    n = 0
    while core.busy or core.settling:
        step(core)
    submit(core, "C", grammar=gc, max_new=4)
    for n in range(400):
        if len(core.waiting) < 2:  # a request with A and one with B always wait for the slot
            submit(core, f"hot{n}a", grammar=ga, max_new=4)
            submit(core, f"hot{n}b", grammar=gb, max_new=4)
        s = step(core)
        if of(s, PrepareGrammar) and of(s, PrepareGrammar)[0].grammar.key == gc.key:
            ready(core, gc)
        if "C" in [op.rid for op in of(s, AddReq)]:
            break
    else:
        raise AssertionError("C never started")
    assert n < 100, n
