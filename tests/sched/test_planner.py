"""SchedulerCore planning: budget, chunked prefill, prefix reuse, overlap, retraction, abort.

The core is driven directly; StepDone results carry tokens chosen by the test (the
worker's forward is covered by the engine and integration tests)."""

from __future__ import annotations

import weakref

import pytest

from engine.replica import TokenChain
from engine.sched.scheduler import SchedConfig, SchedulerCore
from msgs.codec import pack_ids, unpack_ids
from msgs.done import StepDone
from msgs.params import SamplingParams
from msgs.requests import TokenizedRequest
from msgs.steps import AddReq, ExtendPages, FreeReq, Step

PS = 4


def make(num_pages: int = 64, budget: int = 32, max_running: int = 8, radix: bool = True) -> SchedulerCore:
    cfg = SchedConfig(
        num_pages=num_pages,
        page_size=PS,
        max_running=max_running,
        max_prefill_tokens=budget,
        max_context=256,
        eos_token_ids=(0,),
        vocab_size=1000,
        enable_radix=radix,
        digest_every=1,
    )
    return SchedulerCore(cfg)


def submit(core: SchedulerCore, rid: str, ids: list[int], max_new: int = 4, **kw) -> None:
    params = SamplingParams(max_new_tokens=max_new, **kw)
    assert core.submit(TokenizedRequest(rid=rid, input_ids=pack_ids(ids), params=params)) is None


def rows(step: Step) -> list[tuple[int, list[int], int, int, int]]:
    f = step.forward
    assert f is not None
    slots, starts, lens, sample = (unpack_ids(x) for x in (f.slots, f.start_pos, f.extend_lens, f.sample))
    ids, out, i = unpack_ids(f.input_ids), [], 0
    for s, st, n, smp in zip(slots, starts, lens, sample, strict=True):
        out.append((s, ids[i : i + n], st, n, smp))
        i += n
    return out


def flush(core: SchedulerCore) -> None:
    """Publish pending FreeReq ops and complete that step."""
    step = core.plan()
    if step is not None:
        finish_step(core, step)


def finish_step(core: SchedulerCore, step: Step, token: int = 7):
    """Rank 0 answers as a faithful replica: the mirror's digest and the token chain."""
    n = len(core.sampled_by_step[step.seq])
    tokens = pack_ids([token] * n)
    CHAINS.setdefault(core, TokenChain()).update(tokens)
    expected = core.digests.expected.get(step.seq)
    digest, chain = (expected[0], CHAINS[core].hexdigest()) if expected else (None, None)
    return core.on_done(StepDone(seq=step.seq, rank=0, token_ids=tokens, digest=digest, tokens_hash=chain))


CHAINS: weakref.WeakKeyDictionary[SchedulerCore, TokenChain] = weakref.WeakKeyDictionary()


def test_chunked_prefill_respects_budget_and_samples_only_final_chunk():
    core = make(budget=8)
    submit(core, "a", list(range(1, 21)))  # 20 tokens -> chunks 8, 8, 4
    seen = []
    for _ in range(3):
        step = core.plan()
        assert step is not None
        ((slot, ids, start, n, smp),) = rows(step)
        seen.append((start, n, smp))
        finish_step(core, step)
    assert seen == [(0, 8, 0), (8, 8, 0), (16, 4, 1)]


def test_decode_rows_use_future_reference_under_overlap():
    core = make()
    submit(core, "a", [1, 2, 3, 4, 5])
    s1 = core.plan()
    s2 = core.plan()  # planned before s1's result: the input is a future reference
    assert rows(s2)[0][1] == [-1] and rows(s2)[0][2] == 5
    outs = finish_step(core, s1, token=9)
    assert outs[0].new_ids == [9]
    finish_step(core, s2, token=10)
    s3 = core.plan()  # now the last token is known: no future reference needed
    assert rows(s3)[0][1] == [10] and rows(s3)[0][2] == 6


def test_max_tokens_stop_and_overlap_token_discarded():
    core = make()
    submit(core, "a", [1, 2, 3], max_new=2)
    s1, s2 = core.plan(), core.plan()
    assert core.plan() is None  # both output tokens are already being sampled
    finish_step(core, s1)
    outs = finish_step(core, s2)
    assert outs[-1].finish_reason == "length" and outs[-1].completion_tokens == 2
    free = core.plan()
    assert free is not None and any(isinstance(op, FreeReq) for op in free.ops)
    finish_step(core, free)
    assert core.idle and core.leak_free()


def test_eos_stop_discards_the_step_already_sent():
    core = make()
    submit(core, "a", [1, 2, 3], max_new=10)
    s1, s2 = core.plan(), core.plan()
    outs = finish_step(core, s1, token=0)  # EOS
    assert outs[-1].finish_reason == "stop"
    assert finish_step(core, s2, token=5) == []  # the overlap step's token is dropped
    flush(core)
    assert core.idle and core.leak_free()


def test_prefix_cache_reuse_and_hit_accounting():
    core = make()
    prompt = list(range(1, 19))  # 18 tokens: 4 full pages
    submit(core, "a", prompt, max_new=1)
    finish_step(core, core.plan())
    submit(core, "b", prompt + [50, 51], max_new=1)
    step = core.plan()
    ((slot, ids, start, n, smp),) = rows(step)
    assert start == 16 and ids == [17, 18, 50, 51]
    assert core.reqs["b"].cached_tokens == 16 and core.cache_hit_tokens == 16
    add = [op for op in step.ops if isinstance(op, AddReq)][0]
    assert add.slot == slot
    ext = [unpack_ids(op.pages) for op in step.ops if isinstance(op, ExtendPages)]
    assert len(ext[0]) == 4  # the cached pages come first


def run_until_retraction(core: SchedulerCore, steps: int = 12) -> None:
    """Plan and finish steps (token 3) until a request is back in the waiting queue."""
    for _ in range(steps):
        step = core.plan()
        if step is None:
            break
        finish_step(core, step, token=3)
        if core.waiting:
            break


def test_retraction_when_pages_run_out_then_readmission():
    core = make(num_pages=7, budget=64)  # 6 usable pages of 4 tokens
    submit(core, "a", list(range(1, 9)), max_new=12)  # 8 tokens: 2 pages
    submit(core, "b", list(range(20, 28)), max_new=12)
    run_until_retraction(core)
    assert [r.rid for r in core.waiting] == ["b"], "the newest request is retracted"
    assert core.reqs["b"].output_ids, "its generated tokens are kept for re-prefill"
    # drain: a finishes, b re-prefills prompt + output and finishes
    done = set()
    for _ in range(60):
        step = core.plan()
        if step is None and core.idle:
            break
        if step is not None and step.seq in core.sampled_by_step:
            for o in finish_step(core, step, token=3):
                if o.finish_reason:
                    done.add(o.rid)
    assert done == {"a", "b"}
    flush(core)
    assert core.leak_free()


def test_priority_orders_admission_and_the_retraction_victim():
    """--scheduling-policy priority (vLLM's): waiting requests are admitted by (priority, arrival),
    lower first, and when pages run out the last of that order is retracted, not the newest; a
    retracted request goes back to its place by that order. (fcfs sends every priority as 0.)"""
    core = make(max_running=1)
    for rid, prio in (("a", 5), ("b", 0), ("c", 1), ("d", 0)):
        submit(core, rid, [10 + len(rid)] * 6, max_new=1, priority=prio)
    admitted = []
    for _ in range(40):
        step = core.plan()
        if step is None and core.idle:
            break
        if step is not None:
            admitted += [op.rid for op in step.ops if isinstance(op, AddReq)]
            finish_step(core, step, token=3)
    assert admitted == ["b", "d", "c", "a"]
    flush(core)
    assert core.leak_free()

    core = make(num_pages=7, budget=64)  # 6 usable pages: one of the two must go back
    submit(core, "old", list(range(1, 9)), max_new=12, priority=3)  # lower priority, older
    submit(core, "new", list(range(20, 28)), max_new=12, priority=1)
    run_until_retraction(core)
    assert [r.rid for r in core.waiting] == ["old"], "the lowest priority is retracted, though older"


def test_abort_frees_everything_and_unknown_rid_is_ignored():
    core = make()
    submit(core, "a", list(range(1, 30)), max_new=50)
    step = core.plan()
    out = core.abort("a")
    assert out is not None and out.finish_reason == "abort"
    assert core.abort("a") is None and core.abort("nope") is None
    assert finish_step(core, step) == []
    flush(core)
    assert core.idle and core.leak_free()


def test_rejects_empty_too_long_and_duplicate():
    core = make()
    bad = core.submit(TokenizedRequest(rid="x", input_ids=b"", params=SamplingParams()))
    assert bad is not None and bad.finish_reason == "error"
    long = core.submit(TokenizedRequest(rid="y", input_ids=pack_ids([1] * 300), params=SamplingParams()))
    assert long is not None and "context" in (long.error or "")
    submit(core, "z", [1, 2])
    dup = core.submit(TokenizedRequest(rid="z", input_ids=pack_ids([1]), params=SamplingParams()))
    assert dup is not None and "already" in (dup.error or "")


def test_digest_mismatch_is_fatal():
    from engine.sched.digests import DigestMismatch

    core = make()
    submit(core, "a", [1, 2, 3])
    step = core.plan()
    with pytest.raises(DigestMismatch):
        core.on_done(StepDone(seq=step.seq, rank=0, token_ids=pack_ids([1]), digest="0" * 64))


@pytest.mark.parametrize("radix", [True, False])
def test_many_requests_drain_without_leaks(radix: bool):
    import random

    rng = random.Random(0)
    core = make(num_pages=40, budget=24, max_running=5, radix=radix)
    base = [rng.randrange(1, 50) for _ in range(12)]
    for i in range(20):
        tail = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 20))]
        submit(core, f"r{i}", base + tail, max_new=rng.randrange(1, 15))
    finished = set()
    pending: list[Step] = []
    for _ in range(2000):
        step = core.plan()
        if step is not None:
            pending.append(step)
        if pending and (len(pending) == 2 or step is None):
            s = pending.pop(0)
            for o in finish_step(core, s, token=rng.choice([0, 5, 6, 7, 8])):
                if o.finish_reason:
                    finished.add(o.rid)
        if core.idle and not pending:
            break
    core.plan()
    assert finished == {f"r{i}" for i in range(20)}
    assert core.leak_free()
    core.cache.check_invariants()


def test_siblings_in_one_step_share_prompt_pages():
    """n > 1: sub-requests admitted in the same step reuse the first one's prompt pages
    (they are in the tree from plan time; backends store a layer's K/V before attending)."""
    core = make(budget=64)
    prompt = list(range(1, 15))  # 14 tokens: 3 full pages
    for i in range(3):
        submit(core, f"p-{i}", prompt, max_new=2)
    step = core.plan()
    r = rows(step)
    assert [n for _, _, _, n, _ in r] == [14, 2, 2]
    assert [core.reqs[f"p-{i}"].cached_tokens for i in range(3)] == [0, 12, 12]
    tables = list(core.replica["page_tables"].tables.values())
    assert tables[0][:3] == tables[1][:3] == tables[2][:3]


def test_digest_checked_for_every_rank():
    """The expected digest stays until every rank reported it: a rank that diverges after rank 0
    reported is still caught."""
    from dataclasses import replace

    from engine.sched.digests import DigestMismatch

    core = make()
    core.state.cfg = replace(core.cfg, num_ranks=2)
    submit(core, "a", [1, 2, 3])
    core.digests.num_ranks = 2
    step = core.plan()
    want = core.digests.expected[step.seq][0]
    core.on_done(StepDone(seq=step.seq, rank=0, token_ids=pack_ids([1]), digest=want, tokens_hash=_chain([1])))
    with pytest.raises(DigestMismatch, match="rank 1"):
        core.on_done(StepDone(seq=step.seq, rank=1, digest="0" * 64, tokens_hash=_chain([1])))
    core.on_done(StepDone(seq=step.seq, rank=1, digest=want, tokens_hash=_chain([1])))
    assert step.seq not in core.digests.expected


def _chain(tokens: list[int]) -> str:
    chain = TokenChain()
    chain.update(pack_ids(tokens))
    return chain.hexdigest()


@pytest.mark.parametrize(
    ("ids", "params", "problem"),
    [
        (pack_ids([1, 2, 3]), SamplingParams(temperature=float("inf")), "temperature"),
        (pack_ids([1, 2, 3]), SamplingParams(stop_token_ids=[5000]), "stop_token_ids"),
        (pack_ids([1, 5000]), SamplingParams(), "token ids"),
        (pack_ids([1, -3]), SamplingParams(), "token ids"),
        (b"\x01\x02\x03", SamplingParams(), "int32"),
    ],
)
def test_scheduler_fails_a_bad_request_without_queueing_it(ids: bytes, params: SamplingParams, problem: str) -> None:
    """Defence in depth: what the tokenizer should have refused fails only that request."""
    core = make()
    out = core.submit(TokenizedRequest(rid="bad", input_ids=ids, params=params))
    assert out is not None and out.finish_reason == "error" and problem in out.error
    assert not core.reqs and not core.waiting and core.plan() is None
