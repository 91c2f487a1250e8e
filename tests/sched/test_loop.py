"""The scheduler loop and the worker pipeline as message-in / message-out drivers, over
in-memory pipes (the same codec as the wire; no socket, no sleep, no private method)."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from engine.config import ServerConfig
from engine.replica import StepOrderError, TokenChain
from engine.run.pipeline import WorkerPipeline
from engine.sched.digests import DigestMismatch
from engine.sched.loop import BURST_WAIT_CAP, SchedulerLoop, SchedulerPorts, WorkerFailure
from msgs import channels
from msgs.codec import pack_ids, unpack_ids
from msgs.control import Ready
from msgs.done import StepDone, WorkerReady
from msgs.outputs import SchedulerStats, TokenBatch
from msgs.params import SamplingParams
from msgs.requests import AbortRequest, TokenizedRequest
from msgs.steps import Shutdown, Step
from tests.sched.test_sched_stress import FakeWorker

PS = 4


class Wires:
    """Both ends of every channel the scheduler loop uses, for `ranks` workers."""

    def __init__(self, ranks: int) -> None:
        self.req_out, req_in = channels.pipe(channels.REQUESTS)
        self.done_out, done_in = channels.pipe(channels.DONE)
        outputs_out, self.outputs = channels.pipe(channels.OUTPUTS)
        control_out, self.control = channels.pipe(channels.CONTROL)
        pairs = [channels.pipe(channels.STEPS) for _ in range(ranks)]
        self.steps = [recv for _, recv in pairs]
        self.ports = SchedulerPorts(req_in, done_in, outputs_out, [send for send, _ in pairs], control_out)

    def outputs_seen(self) -> tuple[dict[str, list[int]], dict[str, str], list[SchedulerStats]]:
        got: dict[str, list[int]] = {}
        reasons: dict[str, str] = {}
        stats = []
        for msg in self.outputs.drain():
            if isinstance(msg, SchedulerStats):
                stats.append(msg)
            elif isinstance(msg, TokenBatch):
                for out in msg.outs:
                    got.setdefault(out.rid, []).extend(out.new_ids)
                    if out.finish_reason:
                        reasons[out.rid] = out.finish_reason
        return got, reasons, stats


class FakeRank:
    """A pure-Python rank (tests/sched/test_sched_stress.FakeWorker) answering as `rank`."""

    def __init__(self, rank: int, pages: int = 64) -> None:
        self.rank = rank
        self.worker = FakeWorker(PS)
        self.pages = pages
        self.tamper = None  # called with (seq, StepDone) -> StepDone, to make this rank diverge

    def ready(self) -> WorkerReady:
        return WorkerReady(rank=self.rank, num_pages=self.pages, page_size=PS, max_context=96, vocab_size=40,
                           eos_token_ids=[0])

    def answer(self, step: Step) -> StepDone:
        done = self.worker.run(step)
        done = StepDone(seq=done.seq, rank=self.rank, token_ids=done.token_ids, digest=done.digest,
                        tokens_hash=done.tokens_hash)
        return self.tamper(step.seq, done) if self.tamper else done


def cfg(**kw) -> ServerConfig:
    return ServerConfig(max_running_requests=4, max_prefill_tokens=16, page_size=PS, **kw)


def start(ranks: list[FakeRank], **kw) -> tuple[SchedulerLoop, Wires]:
    wires = Wires(len(ranks))
    loop = SchedulerLoop(cfg(**kw), wires.ports, stats_interval_s=0.0)
    for r in ranks:
        wires.done_out.send(r.ready())
    loop.pump()
    assert loop.core is not None
    want = Ready(proc="scheduler", info={"pages": str(min(r.pages for r in ranks)), "max_context": "96"})
    assert list(wires.control.drain()) == [want]
    loop.core.state.cfg = dataclasses.replace(loop.core.cfg, digest_every=1)
    return loop, wires


def run_until_idle(loop: SchedulerLoop, wires: Wires, ranks: list[FakeRank], max_pumps: int = 500) -> None:
    for _ in range(max_pumps):
        loop.pump()
        moved = False
        for rank, inbox in zip(ranks, wires.steps, strict=True):
            for step in inbox.drain():
                assert isinstance(step, Step)
                wires.done_out.send(rank.answer(step))
                moved = True
        assert loop.core is not None
        if not moved and loop.core.idle and not loop.inflight and not loop.core.pending_ops:
            return
    raise AssertionError("the loop did not go idle")


def submit(wires: Wires, n: int = 6, max_new: int = 5) -> None:
    for i in range(n):
        ids = [1 + (i * 7 + k) % 30 for k in range(5 + i)]
        params = SamplingParams(max_new_tokens=max_new, seed=i, ignore_eos=True)
        wires.req_out.send(TokenizedRequest(rid=f"r{i}", input_ids=pack_ids(ids), params=params))


@pytest.mark.parametrize("overlap", [True, False])
def test_two_ranks_agree_and_every_request_finishes(overlap: bool) -> None:
    ranks = [FakeRank(0), FakeRank(1, pages=48)]
    loop, wires = start(ranks, disable_overlap=not overlap)
    assert loop.core.alloc.capacity == 48 - 1  # the pool agreed as the minimum over ranks (page 0 is padding)
    submit(wires)
    run_until_idle(loop, wires, ranks)
    got, reasons, stats = wires.outputs_seen()
    assert reasons == {f"r{i}": "length" for i in range(6)}
    assert all(len(v) == 5 for v in got.values())
    assert stats[-1].leak_free and stats[-1].running == 0
    assert ranks[0].worker.replica.digest() == ranks[1].worker.replica.digest() == loop.core.replica.digest()


def test_a_step_done_is_answered_by_the_next_step_in_the_same_pump() -> None:
    """With overlap the worker must always hold two steps: the pass that takes a StepDone
    plans and sends the next Step before it waits for input (a regression cost 18% of
    offline throughput on the H200: the next Step waited for the following StepDone)."""
    ranks = [FakeRank(0)]
    loop, wires = start(ranks)
    submit(wires, n=2, max_new=8)
    loop.pump()
    sent = list(wires.steps[0].drain())
    assert [s.seq for s in sent] == [1, 2] and list(loop.inflight) == [1, 2]
    for _ in range(4):
        wires.done_out.send(ranks[0].answer(sent.pop(0)))
        loop.pump()  # one pass: the done in, the next step out
        sent.extend(wires.steps[0].drain())
        assert len(loop.inflight) == 2 and len(sent) == 2


def test_a_rank_with_a_different_replica_stops_the_engine_naming_rank_and_seq() -> None:
    ranks = [FakeRank(0), FakeRank(1)]
    loop, wires = start(ranks)
    target = {}

    def diverge(seq: int, done: StepDone) -> StepDone:
        if done.digest is not None and not target:
            target["seq"] = seq
            ranks[1].worker.replica["prefix_cache"].pages.add(999)  # a page it thinks is cached
            return StepDone(seq=seq, rank=1, digest=ranks[1].worker.replica.digest(), tokens_hash=done.tokens_hash)
        return done

    ranks[1].tamper = diverge
    submit(wires, n=2)
    with pytest.raises(DigestMismatch) as err:
        run_until_idle(loop, wires, ranks)
    assert f"rank 1 diverged at or before step {target['seq']}" in str(err.value)


def test_a_rank_that_samples_other_tokens_stops_the_engine() -> None:
    ranks = [FakeRank(0), FakeRank(1)]
    loop, wires = start(ranks)

    def resample(seq: int, done: StepDone) -> StepDone:
        if done.digest is None:
            return done
        ranks[1].worker.chain.update(b"\x01\x00\x00\x00")  # one token the others did not sample
        return StepDone(seq=seq, rank=1, digest=done.digest, tokens_hash=ranks[1].worker.chain.hexdigest())

    ranks[1].tamper = resample
    submit(wires, n=1)
    with pytest.raises(DigestMismatch, match=r"rank 1 sampled different tokens at or before step \d+"):
        run_until_idle(loop, wires, ranks)


def test_ranks_that_disagree_on_the_model_cannot_start() -> None:
    ranks = [FakeRank(0), FakeRank(1)]
    wires = Wires(2)
    loop = SchedulerLoop(cfg(), wires.ports)
    wires.done_out.send(ranks[0].ready())
    other = ranks[1].ready()
    wires.done_out.send(WorkerReady(1, other.num_pages, PS, other.max_context, 41, other.eos_token_ids))
    with pytest.raises(WorkerFailure, match="worker 1 disagrees"):
        loop.pump()


def test_malformed_request_frame_is_dropped_and_the_loop_goes_on() -> None:
    ranks = [FakeRank(0)]
    loop, wires = start(ranks)
    wires.ports.requests.push_raw(b"\xc1not msgpack")  # type: ignore[attr-defined]
    submit(wires, n=1)
    run_until_idle(loop, wires, ranks)
    _, reasons, stats = wires.outputs_seen()
    assert reasons == {"r0": "length"}
    assert stats[-1].dropped_frames.get("requests", 0) >= 1


# ---- the worker pipeline, with the real ModelRunner ----------------------------------------


@pytest.fixture
def runner(tiny_model: str):  # noqa: ANN201
    from engine.run.runner import ModelRunner

    return ModelRunner(ServerConfig(model=tiny_model, device="cpu", page_size=PS, max_total_tokens=128,
                                    max_running_requests=4, max_prefill_tokens=16))


def _pipeline(runner) -> tuple[WorkerPipeline, channels.MemorySender, channels.MemoryReceiver]:  # noqa: ANN001
    step_out, step_in = channels.pipe(channels.STEPS)
    done_out, done_in = channels.pipe(channels.DONE)
    pipeline = WorkerPipeline(runner, step_in, done_out)
    pipeline.start()
    (ready,) = list(done_in.drain())
    assert isinstance(ready, WorkerReady)
    return pipeline, step_out, done_in


def _steps(n: int) -> list[Step]:
    """A real Step stream from a SchedulerCore: one request, greedy."""
    from engine.sched.scheduler import SchedConfig, SchedulerCore

    core = SchedulerCore(SchedConfig(num_pages=32, page_size=PS, max_running=4, max_prefill_tokens=16,
                                     max_context=96, eos_token_ids=(63,), vocab_size=64, digest_every=2))
    core.submit(TokenizedRequest(rid="a", input_ids=pack_ids([5, 6, 7]), params=SamplingParams(
        max_new_tokens=n, temperature=0, ignore_eos=True)))
    steps, chain = [], TokenChain()
    while (step := core.plan()) is not None and len(steps) < n:
        steps.append(step)
        chain.update(pack_ids([9]))
        want = core.digests.expected.get(step.seq)
        digest, tokens = (want[0], chain.hexdigest()) if want else (None, None)
        core.on_done(StepDone(seq=step.seq, rank=0, token_ids=pack_ids([9]), digest=digest, tokens_hash=tokens))
    return steps


def test_worker_pipeline_runs_the_stream_and_overlaps(runner) -> None:  # noqa: ANN001
    pipeline, step_out, done_in = _pipeline(runner)
    steps = _steps(4)
    for step in steps:
        step_out.send(step)
    step_out.send(Shutdown())
    while pipeline.pump():
        pass
    assert pipeline.stopped and not pipeline.pending
    dones = list(done_in.drain())
    assert [d.seq for d in dones] == [s.seq for s in steps]
    assert all(len(unpack_ids(d.token_ids)) == 1 for d in dones)
    assert [d.digest is not None for d in dones] == [any(type(o).__name__ == "DigestCheck" for o in s.ops)
                                                     for s in steps]


def test_deferred_sampling_answers_the_previous_step_first(runner, tiny_model: str) -> None:  # noqa: ANN001
    """A step with grammar rows is launched without its sampling; the pipeline answers the
    step before it, then completes it (so the scheduler plans while masks are filled). The
    tokens are those of the plain path. (Forced here on every step, without a grammar.)"""
    from engine.run.runner import ModelRunner

    steps = _steps(5)
    plain = ModelRunner(ServerConfig(model=tiny_model, device="cpu", page_size=PS, max_total_tokens=128,
                                     max_running_requests=4, max_prefill_tokens=16))
    want = [plain.run_step(s).token_ids for s in steps]
    runner.grammar.constrained = lambda slots: True
    pipeline, step_out, done_in = _pipeline(runner)
    order: list[tuple[str, int]] = []
    complete, send = runner.complete, pipeline.done.send
    runner.complete = lambda launched: (order.append(("complete", launched.seq)), complete(launched))[1]
    pipeline.done.send = lambda msg: (order.append(("done", msg.seq)), send(msg))[1]
    for step in steps:
        step_out.send(step)
    step_out.send(Shutdown())
    while pipeline.pump():
        pass
    assert [d.token_ids for d in done_in.drain()] == want
    for seq in range(2, len(steps) + 1):  # step seq-1 answered before step seq samples
        assert order.index(("done", seq - 1)) < order.index(("complete", seq)) < order.index(("done", seq))


def test_worker_fails_loudly_on_a_seq_gap_and_skips_a_malformed_frame(runner) -> None:  # noqa: ANN001
    pipeline, step_out, done_in = _pipeline(runner)
    steps = _steps(3)
    step_out.send(steps[0])
    step_out.queue.append(b"\x93garbage")  # a malformed frame: dropped and counted, no crash
    while pipeline.pump():
        pass
    assert [d.seq for d in done_in.drain()] == [steps[0].seq]
    step_out.send(steps[2])  # steps[1] was lost
    with pytest.raises(StepOrderError, match=f"expected step {steps[1].seq}, got {steps[2].seq}"):
        while pipeline.pump():
            pass
    assert pipeline.last_seq == steps[2].seq


def test_runner_is_warm_and_clean_before_ready(runner) -> None:  # noqa: ANN001
    """The warm-up ran the prefill, decode and sampling paths, then left no trace: every
    sampler slot free, the replica at its initial digest."""
    from engine.replica import rank_replica

    assert set(runner.startup) == {"load_s", "warmup_s", "capture_s"}
    assert runner.startup["warmup_s"] > 0
    assert runner.sampler.active_slots == []
    assert runner.replica.digest() == rank_replica().digest() and runner.replica.seq == 0


def test_flush_cache_empties_every_replica_when_idle_and_is_refused_while_busy() -> None:
    from engine.replica import rank_replica
    from msgs.outputs import FlushDone
    from msgs.requests import FlushCache

    ranks = [FakeRank(0), FakeRank(1)]
    loop, wires = start(ranks)
    submit(wires, n=3)
    loop.pump()  # admitted: requests run
    wires.req_out.send(FlushCache(id=1))
    loop.pump()
    refused = [m for m in wires.outputs.drain() if isinstance(m, FlushDone)]
    assert refused == [FlushDone(id=1, ok=False, message=refused[0].message)] and "running" in refused[0].message
    run_until_idle(loop, wires, ranks)
    assert loop.core.cache.total_pages > 0  # the finished prompts are cached
    wires.req_out.send(FlushCache(id=2))
    run_until_idle(loop, wires, ranks)
    assert [m for m in wires.outputs.drain() if isinstance(m, FlushDone)] == [FlushDone(id=2, ok=True)]
    fresh = rank_replica().digest()
    assert loop.core.replica.digest() == fresh
    assert all(r.worker.replica.digest() == fresh for r in ranks)
    assert loop.core.cache.total_pages == 0 and loop.core.leak_free()
    assert loop.core.alloc.num_free == loop.core.alloc.capacity


def test_a_flush_right_after_the_last_answer_waits_for_the_steps_in_flight() -> None:
    """Issue 21: /flush_cache sent as soon as the last request's answer arrived found the
    overlap step after its last token still in flight and answered 409. It now waits for
    what is in flight (no request runs) and succeeds."""
    from msgs.outputs import FlushDone
    from msgs.requests import FlushCache

    ranks = [FakeRank(0)]
    loop, wires = start(ranks)
    submit(wires, n=1, max_new=3)
    finished = False
    for _ in range(100):  # answer steps one by one until the request's finish is out
        loop.pump()
        msgs = list(wires.outputs.drain())
        finished |= any(isinstance(m, TokenBatch) and any(o.finish_reason for o in m.outs) for m in msgs)
        if finished:
            break
        for step in wires.steps[0].drain():
            wires.done_out.send(ranks[0].answer(step))
    assert finished and loop.core.settling and not loop.core.busy  # the overlap step is in flight
    wires.req_out.send(FlushCache(id=7))
    loop.pump()
    assert [m for m in wires.outputs.drain() if isinstance(m, FlushDone)] == []  # waiting, not refused
    run_until_idle(loop, wires, ranks)
    loop.pump()
    assert [m for m in wires.outputs.drain() if isinstance(m, FlushDone)] == [FlushDone(id=7, ok=True)]
    assert loop.core.cache.total_pages == 0


def test_ready_waits_for_the_host_tier_set_up_step() -> None:
    """With the host tier on, HostInit (every worker maps and pins the slab: seconds per
    10 GB on a GPU) goes out in a Step of its own at start, and ready (to the supervisor,
    and the stats the tokenizer's /health reads) waits for every rank's StepDone of it."""
    ranks = [FakeRank(0), FakeRank(1)]
    wires = Wires(len(ranks))
    loop = SchedulerLoop(cfg(enable_hierarchical_cache=True, hicache_size=0.001), wires.ports, stats_interval_s=0.0)
    for r in ranks:
        wires.done_out.send(msgspec.structs.replace(r.ready(), page_bytes=4096))
    loop.pump()
    assert loop.core is not None and list(wires.control.drain()) == []
    setup = [list(inbox.drain()) for inbox in wires.steps]
    assert [[type(op).__name__ for op in s.ops] for [s] in setup] == [["HostInit"], ["HostInit"]]
    assert setup[0][0].forward is None
    wires.done_out.send(ranks[0].answer(setup[0][0]))
    loop.pump()
    assert list(wires.control.drain()) == [] and wires.outputs_seen()[2] == []  # one rank is not enough
    wires.done_out.send(ranks[1].answer(setup[1][0]))
    loop.pump()
    assert list(wires.control.drain()) == [Ready(proc="scheduler", info={"pages": "64", "max_context": "96"})]
    assert [s.ready for s in wires.outputs_seen()[2]] == [True]
    submit(wires, n=2)
    run_until_idle(loop, wires, ranks)
    got, reasons, _ = wires.outputs_seen()
    assert sorted(reasons) == ["r0", "r1"] and all(len(v) == 5 for v in got.values())


def _send(wires: Wires, rid: str, n: int = 5) -> None:
    first = 1 + sum(map(ord, rid)) % 20  # prompts that share no page
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    wires.req_out.send(TokenizedRequest(rid=rid, input_ids=pack_ids(list(range(first, first + n))), params=params))


def held_start() -> tuple[list[FakeRank], SchedulerLoop, Wires, list[float]]:
    """One rank, a 2 ms burst wait and a clock the test steps by hand (now[0], seconds)."""
    ranks = [FakeRank(0)]
    loop, wires = start(ranks, batch_wait_ms=2.0)
    now = [100.0]
    loop.clock = lambda: now[0]
    return ranks, loop, wires, now


def test_an_idle_engine_waits_for_a_bursts_stragglers_and_prefills_them_together() -> None:
    """Requests sent at once reach the scheduler spread over milliseconds: an idle engine's first
    step waits until none has come for --batch-wait-ms (at most BURST_WAIT_CAP times it), so it
    prefills the whole burst; a request that comes while steps run is never held."""
    ranks, loop, wires, now = held_start()
    _send(wires, "a")
    loop.pump()
    assert not list(wires.steps[0].drain()) and loop.held_s == pytest.approx(0.002)
    now[0] += 0.0015
    _send(wires, "b")
    loop.pump()  # the wait restarts at each arrival
    assert not list(wires.steps[0].drain()) and loop.held_s == pytest.approx(0.002)
    now[0] += 0.0019
    loop.pump()
    assert not list(wires.steps[0].drain())
    now[0] += 0.0002
    loop.pump()  # quiet for 2 ms: both in one prefill
    sent = list(wires.steps[0].drain())
    assert sent[0].forward is not None and unpack_ids(sent[0].forward.extend_lens) == [5, 5]
    _send(wires, "c")  # steps in flight: not a burst at an idle engine, never held
    loop.pump()
    assert loop.held_s == 0 and loop.burst is None
    for step in sent:
        wires.done_out.send(ranks[0].answer(step))
    run_until_idle(loop, wires, ranks)
    assert set(wires.outputs_seen()[1]) == {"a", "b", "c"}


def test_a_request_aborted_while_held_is_answered_and_nothing_is_planned() -> None:
    ranks, loop, wires, now = held_start()
    _send(wires, "a")
    loop.pump()
    wires.req_out.send(AbortRequest(rid="a"))
    now[0] += 0.003
    loop.pump()  # the wait is over, nothing is left to plan
    assert not list(wires.steps[0].drain()) and not loop.inflight
    assert wires.outputs_seen()[1] == {"a": "abort"}
    run_until_idle(loop, wires, ranks)
    assert loop.core.leak_free()


def test_a_steady_trickle_into_an_idle_engine_is_held_at_most_the_cap() -> None:
    ranks, loop, wires, now = held_start()
    for i in range(12):  # one every 1.8 ms: never quiet for 2 ms
        _send(wires, f"r{i}", n=1)
        loop.pump()
        if list(wires.steps[0].drain()):
            break
        now[0] += 0.0018
    assert now[0] - 100.0 == pytest.approx(BURST_WAIT_CAP * 0.002, abs=0.002)


def test_batch_wait_defaults_by_device_and_is_validated() -> None:
    assert ServerConfig().batch_wait_s("cpu") == 0.002 and ServerConfig().batch_wait_s("cuda") == 0.0
    assert ServerConfig(batch_wait_ms=0).batch_wait_s("cpu") == 0.0
    with pytest.raises(ValueError, match="--batch-wait-ms"):
        ServerConfig(batch_wait_ms=-3)


def test_the_watchdog_names_the_rank_that_has_not_answered() -> None:
    """A step that rank 1 never answers (rank 0 did) past --watchdog-timeout: the failure names
    rank 1 (the supervisor then names worker-1, not the scheduler); a step no rank answered names
    none, since a stuck rank may be holding the others in a collective; a lone rank is named."""
    from engine.sched.loop import WorkerFailure

    now = [0.0]
    for ranks, answering, rank, says in (([FakeRank(0), FakeRank(1)], [0], 1, r"ranks \[1\] have not answered"),
                                         ([FakeRank(0), FakeRank(1)], [], None, "no rank of 2 has answered"),
                                         ([FakeRank(0)], [], 0, "no rank of 1 has answered")):
        loop, wires = start(ranks, watchdog_timeout=5.0)
        loop.clock = lambda: now[0]
        loop.progress_at = now[0]
        submit(wires, n=1)
        loop.pump()
        for r in (ranks[i] for i in answering):
            for step in wires.steps[r.rank].drain():
                wires.done_out.send(r.answer(step))
        loop.pump()
        assert loop.inflight
        now[0] += 6.0
        with pytest.raises(WorkerFailure, match=says) as failure:
            loop.pump()
        assert failure.value.rank == rank


def test_arrivals_reach_the_stats_and_running_requests_without_a_step_are_logged() -> None:
    """A request that comes to an idle engine moves /metrics' running / waiting even when no step
    follows; and running requests that get no step (a scheduling bug: one always has a row to plan)
    are an error line, not a silent hang. The bug is injected: the planner stops planning."""
    from structlog.testing import capture_logs

    from engine.sched.loop import STALL_LOG_S

    ranks, loop, wires, now = held_start()
    run_until_idle(loop, wires, ranks)
    wires.outputs_seen()
    _send(wires, "a", n=9)
    loop.pump()  # held for the rest of a burst
    assert wires.outputs_seen()[2][-1].waiting == 1
    now[0] += 0.003
    loop.pump()  # planned: its first chunk in flight
    assert loop.inflight and wires.outputs_seen()[2][-1].running == 1
    real_plan, loop.core.plan = loop.core.plan, lambda: None
    for step in wires.steps[0].drain():
        wires.done_out.send(ranks[0].answer(step))
    _send(wires, "b")
    with capture_logs() as logs:
        loop.pump()  # "a" runs, "b" waits, nothing in flight and nothing planned
        assert not loop.inflight and wires.outputs_seen()[2][-1].waiting == 1
        now[0] += STALL_LOG_S / 2
        loop.pump()
        assert not [e for e in logs if e["event"].startswith("scheduler stalled")]
        now[0] += STALL_LOG_S / 2
        loop.pump()
    stalls = [e for e in logs if e["event"].startswith("scheduler stalled")]
    assert len(stalls) == 1 and stalls[0]["running"] == ["a"] and stalls[0]["waiting"] == 1
    loop.core.plan = real_plan
    run_until_idle(loop, wires, ranks)
    assert set(wires.outputs_seen()[1]) == {"a", "b"} and loop.stalled_at is None


def test_retractions_reach_metrics() -> None:
    """A pool too small for the batch retracts running requests; /metrics counts them."""
    from engine.serve.metrics import Metrics

    ranks = [FakeRank(0, pages=9)]
    loop, wires = start(ranks)
    submit(wires, n=6, max_new=8)
    run_until_idle(loop, wires, ranks)
    _, reasons, stats = wires.outputs_seen()
    assert set(reasons.values()) == {"length"} and len(reasons) == 6
    assert loop.core.retractions > 0 and stats[-1].retractions == loop.core.retractions
    m = Metrics()
    for s in stats:
        m.on_stats(s)
    assert m.registry.get_sample_value("strata_retractions_total") == loop.core.retractions
