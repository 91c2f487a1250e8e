"""Randomized stress of SchedulerCore against a fake worker that checks every KV read.

The fake worker replays the Step stream exactly as ModelRunner does (ReplicaState, future
references resolved from `last_token[slot]`, all writes of a step before any read), but
its "KV" at each (page, offset) is a rolling hash of the token prefix that wrote it. Every
row then checks that the KV it attends to (positions 0 .. start+n-1 through its page
table) is exactly its own prefix: a page freed too early, reused while still needed,
shared wrongly by the prefix cache, or a -1 resolved from the wrong slot all show up as a
mismatch. Sampling is a pure function of (seed, prefix), so each request's output must
equal a reference computed alone, whatever the batching, retraction or overlap.
"""

from __future__ import annotations

import random
from collections import deque

import pytest

from engine.replica import Replica, TokenChain, rank_replica
from engine.sched.scheduler import SchedConfig, SchedulerCore
from msgs.codec import pack_ids, unpack_ids
from msgs.done import StepDone
from msgs.params import SamplingParams
from msgs.requests import TokenizedRequest
from msgs.steps import AddReq, FreeReq, Step

VOCAB = 40
EOS = 0
_M = (1 << 61) - 1


def _roll(h: int, tok: int) -> int:
    return (h * 1_000_003 + tok + 7) % _M


def _sample(seed: int, h: int) -> int:
    return (h ^ seed) * 2_654_435_761 % _M % VOCAB


class FakeWorker:
    def __init__(self, page_size: int) -> None:
        self.ps = page_size
        self.replica = rank_replica()
        self.chain = TokenChain()
        self.kv: dict[tuple[int, int], int] = {}
        self.hist: dict[int, list[int]] = {}  # slot -> prefix hashes, one per known position
        self.toks: dict[int, list[int]] = {}
        self.seed: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.seq = 0

    def _known(self, slot: int, pos: int, tok: int) -> int:
        toks, hist = self.toks[slot], self.hist[slot]
        if pos < len(toks):
            assert toks[pos] == tok, f"slot {slot} pos {pos}: input {tok} != history {toks[pos]}"
        else:
            assert pos == len(toks), f"slot {slot}: gap at {pos} (history {len(toks)})"
            toks.append(tok)
            hist.append(_roll(hist[-1] if hist else 0, tok))
        return hist[pos]

    def run(self, step: Step) -> StepDone:
        digest = self.replica.digest() if self.replica.apply_step(step) else None
        for op in step.ops:
            if isinstance(op, AddReq):
                self.toks[op.slot] = []
                self.hist[op.slot] = []
                for p, t in enumerate(unpack_ids(op.prompt_ids) + unpack_ids(op.output_ids)):
                    self._known(op.slot, p, t)
                self.seed[op.slot] = op.sampling.seed
            elif isinstance(op, FreeReq):
                del self.toks[op.slot], self.hist[op.slot], self.seed[op.slot]
        out: list[int] = []
        f = step.forward
        if f is not None:
            slots, starts, lens, sample = (unpack_ids(x) for x in (f.slots, f.start_pos, f.extend_lens, f.sample))
            ids = unpack_ids(f.input_ids)
            assert len(set(slots)) == len(slots), "a slot appears twice in one forward"
            rows, i = [], 0
            for s, n in zip(slots, lens, strict=True):
                rows.append([self.last[s] if t == -1 else t for t in ids[i : i + n]])
                assert -1 not in ids[i : i + n] or n == 1
                i += n
            for s, st, row in zip(slots, starts, rows, strict=True):  # every write first
                table = self.replica["page_tables"].tables[s]
                for k, t in enumerate(row):
                    pos = st + k
                    assert pos // self.ps < len(table), f"slot {s}: no page for position {pos}"
                    page = table[pos // self.ps]
                    assert page != 0
                    self.kv[(page, pos % self.ps)] = self._known(s, pos, t)
            for s, st, n, smp in zip(slots, starts, lens, sample, strict=True):  # then reads
                table, hist = self.replica["page_tables"].tables[s], self.hist[s]
                for pos in range(st + n):
                    got = self.kv.get((table[pos // self.ps], pos % self.ps))
                    assert got == hist[pos], f"step {step.seq} slot {s}: stale KV at position {pos}"
                if smp:
                    tok = _sample(self.seed[s], hist[st + n - 1])
                    self.last[s] = tok
                    out.append(tok)
        self.chain.update(pack_ids(out))
        tokens_hash = self.chain.hexdigest() if digest else None
        return StepDone(seq=step.seq, rank=0, token_ids=pack_ids(out), digest=digest, tokens_hash=tokens_hash)


def reference(prompt: list[int], seed: int, max_new: int) -> list[int]:
    h = 0
    for t in prompt:
        h = _roll(h, t)
    out: list[int] = []
    while len(out) < max_new:
        tok = _sample(seed, h)
        out.append(tok)
        if tok == EOS:
            break
        h = _roll(h, tok)
    return out


def make_requests(rng: random.Random, n_req: int, max_context: int, vocab: int, tail: int) -> list[tuple]:
    """(rid, prompt, max_new, seed): prompts often share one of a few prefixes."""
    bases = [[rng.randrange(1, vocab) for _ in range(rng.randrange(1, 24))] for _ in range(3)]
    todo = []
    for i in range(n_req):
        prompt = list(rng.choice(bases)) if rng.random() < 0.6 else []
        prompt = (prompt + [rng.randrange(1, vocab) for _ in range(rng.randrange(0, tail))])[: max_context - 1] or [1]
        todo.append((f"r{i}", prompt, rng.randrange(1, 30), rng.randrange(1 << 40)))
    return todo


def drive(
    core: SchedulerCore,
    worker: object,
    todo: list[tuple],
    rng: random.Random,
    *,
    overlap: bool,
    abort_p: float,
    greedy: bool = False,
) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Submit `todo` over time, abort at random moments (also between a plan() and its
    StepDone), run every Step on `worker` in order, up to two in flight with overlap."""
    got: dict[str, list[int]] = {rid: [] for rid, *_ in todo}
    reason: dict[str, str] = {}
    todo = todo[::-1]
    ahead = 2 if overlap else 1
    inflight: deque[Step] = deque()

    def take(outs) -> None:  # noqa: ANN001
        for o in outs:
            if o is None:
                continue
            assert o.rid not in reason, f"{o.rid}: output after finish"
            got[o.rid].extend(o.new_ids)
            if o.finish_reason:
                reason[o.rid] = o.finish_reason

    def maybe_abort() -> None:
        if rng.random() < abort_p and core.reqs:
            take([core.abort(rng.choice(sorted(core.reqs)))])

    for _ in range(20_000):
        while todo and rng.random() < 0.3:
            rid, p, m, s = todo.pop()
            params = SamplingParams(max_new_tokens=m, seed=s, temperature=0.0 if greedy else 1.0)
            take([core.submit(TokenizedRequest(rid=rid, input_ids=pack_ids(p), params=params))])
        maybe_abort()
        while len(inflight) < ahead and (step := core.plan()) is not None:
            inflight.append(step)
            maybe_abort()  # right after plan(), before its StepDone
        if not inflight:
            if not todo and core.idle:
                break
            continue
        take(core.on_done(worker.run(inflight.popleft())))  # type: ignore[attr-defined]
        maybe_abort()
    else:
        raise AssertionError(
            f"no progress: running={[r.rid for r in core.running]} "
            f"waiting={[r.rid for r in core.waiting]} free={core.alloc.num_free}"
        )
    while (step := core.plan()) is not None:  # publish the last FreeReqs
        take(core.on_done(worker.run(step)))  # type: ignore[attr-defined]
    assert set(reason) == set(got), f"unfinished: {set(got) - set(reason)}"
    return got, reason


def check_drained(core: SchedulerCore, worker_replica: Replica) -> None:
    assert core.idle and not core.pending_ops
    assert core.leak_free()
    assert core.cache.locked_pages == 0
    core.cache.check_invariants()
    assert core.alloc.num_free + len(core.cache.pages_in_tree()) == core.alloc.capacity
    assert worker_replica.digest() == core.replica.digest()
    assert not worker_replica["page_tables"].tables


def check_outputs(want: dict[str, list[int]], got: dict[str, list[int]], reason: dict[str, str], eos: int) -> None:
    for rid, w in want.items():
        if reason[rid] == "abort":
            assert got[rid] == w[: len(got[rid])], rid
        else:
            assert got[rid] == w, (rid, reason[rid])
            assert reason[rid] == ("stop" if w[-1] == eos else "length")


def stress(
    seed: int,
    *,
    radix: bool,
    overlap: bool,
    num_pages: int,
    budget: int,
    ps: int = 4,
    max_running: int = 6,
    n_req: int = 40,
    abort_p: float = 0.08,
    max_context: int = 96,
    tail: int = 20,
) -> SchedulerCore:
    rng = random.Random(seed)
    core = SchedulerCore(
        SchedConfig(
            num_pages=num_pages,
            page_size=ps,
            max_running=max_running,
            max_prefill_tokens=budget,
            max_context=max_context,
            eos_token_ids=(EOS,),
            vocab_size=VOCAB,
            enable_radix=radix,
            digest_every=rng.choice([1, 3]),
        )
    )
    worker = FakeWorker(ps)
    todo = make_requests(rng, n_req, max_context, VOCAB, tail)
    want = {rid: reference(p, s, min(m, max_context - len(p))) for rid, p, m, s in todo}
    got, reason = drive(core, worker, todo, rng, overlap=overlap, abort_p=abort_p)
    check_drained(core, worker.replica)
    check_outputs(want, got, reason, EOS)
    return core


@pytest.mark.parametrize("radix", [True, False])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_stress_tight_pool(seed: int, radix: bool, overlap: bool) -> None:
    rng = random.Random(1000 + seed)
    stress(seed, radix=radix, overlap=overlap, num_pages=rng.randrange(26, 40), budget=rng.choice([3, 8, 16, 40]))


@pytest.mark.parametrize("radix", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_stress_roomy_pool(seed: int, radix: bool) -> None:
    stress(100 + seed, radix=radix, overlap=True, num_pages=400, budget=32, max_running=8)


# ---- the real ModelRunner (tiny random Llama on CPU) --------------------------------------


class _RunnerWorker:
    def __init__(self, runner) -> None:  # noqa: ANN001
        self.runner = runner
        self.replica = runner.replica

    def run(self, step: Step) -> StepDone:
        return self.runner.run_step(step)


def _engine(model: str, **kw):  # noqa: ANN202
    from engine.config import ServerConfig
    from engine.local import LocalEngine

    base = dict(
        model=model, device="cpu", page_size=4, max_total_tokens=2048, max_prefill_tokens=32, max_running_requests=6
    )
    return LocalEngine(ServerConfig(**{**base, **kw}))


@pytest.mark.parametrize(("radix", "overlap", "seed"), [(True, True, 0), (False, True, 1), (True, False, 2)])
def test_stress_local_engine(tiny_model: str, radix: bool, overlap: bool, seed: int) -> None:
    """Tight pool (retraction), random aborts: completed requests equal a roomy run's greedy
    tokens; after draining nothing leaks and the runner's replica equals the scheduler's."""
    rng = random.Random(seed)
    todo = make_requests(rng, 24, 60, 60, 40)  # prompt + output < 96: no clamp in either engine
    roomy = _engine(tiny_model)
    ref = roomy.generate(
        [p for _, p, _, _ in todo], [SamplingParams(max_new_tokens=m, temperature=0.0) for _, _, m, _ in todo]
    )
    want = {rid: r.output_ids for (rid, *_), r in zip(todo, ref, strict=True)}
    eng = _engine(
        tiny_model,
        max_total_tokens=96,
        max_prefill_tokens=rng.choice([8, 16]),
        disable_radix_cache=not radix,
        disable_overlap=not overlap,
    )
    got, reason = drive(eng.core, _RunnerWorker(eng.runner), todo, rng, overlap=overlap, abort_p=0.05, greedy=True)
    check_drained(eng.core, eng.runner.replica)
    check_outputs(want, got, reason, 63)
    assert eng.core.retractions > 0
