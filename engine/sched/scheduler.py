"""SchedulerCore: every policy decision, made once, published as the Step stream.

The loop (engine/sched/loop.py) only moves messages; this class is what tests drive:
`submit` / `abort` requests, `plan()` the next Step, `on_done()` a rank's StepDone.
It is made of parts with one job each, sharing one SchedState (engine/sched/state.py):

* Admission (admission.py): requests in, waiting requests admitted, chunked prefill;
* DecodeGrowth (growth.py): one decode token per running request, pages, retraction;
* OutputProcessor (outputs.py): sampled tokens -> outputs, stop conditions, finishing;
* DigestTracker (digests.py): every rank's replica digest and token chain;
* GrammarGate (grammars.py): requests wait there until every rank compiled their grammar.

Replicated state changes only through the ops of the Steps it returns; it applies each
op to its own mirror (engine/replica, the same code the workers run) so DigestCheck can
compare replicas (docs/architecture.md: The Step stream and the replica; Replica rules).
"""

from __future__ import annotations

import msgspec

from engine.cache.allocator import PageAllocator
from engine.cache.radix import RadixCache
from engine.replica import rank_replica
from engine.sched.admission import Admission
from engine.sched.digests import DigestMismatch, DigestTracker
from engine.sched.grammars import GrammarGate
from engine.sched.growth import DecodeGrowth, Row
from engine.sched.outputs import OutputProcessor
from engine.sched.request import Req, Status, insort_by_order
from engine.sched.state import RequestKV, SchedConfig, SchedState
from msgs.codec import pack_ids
from msgs.done import Committed, ControllerDigest, GrammarReady, L3Loaded, L3Stats, StepDone
from msgs.outputs import ReqOutput
from msgs.requests import TokenizedRequest
from msgs.steps import DigestCheck, Drafts, Flush, Forward, PromptRows, Step

__all__ = ["DigestMismatch", "SchedConfig", "SchedulerCore"]


class SchedulerCore:
    def __init__(self, cfg: SchedConfig) -> None:
        self.state = SchedState(cfg)
        kv = RequestKV(self.state)
        self.growth = DecodeGrowth(self.state, kv)
        self.grammars = GrammarGate(self.state)
        self.admission = Admission(self.state, kv, self.growth, self.grammars)
        self.outputs = OutputProcessor(self.state, kv)
        self.digests = DigestTracker(cfg.num_ranks)
        self.replica = rank_replica()  # the mirror of every rank's replica
        self.seq = 0
        self.sampled_by_step: dict[int, list[Req]] = {}  # seq -> requests that sample in it
        # seq -> drafts of each sampled row of a verify step (-1: a row that is not a verify row)
        self.drafts_by_step: dict[int, list[int]] = {}
        self.scored_by_step: dict[int, list[tuple[Req, int, int]]] = {}  # seq -> (req, start, tokens scored)
        self.done_ranks: dict[int, int] = {}  # seq -> ranks that finished it

    # the shared state, read-only from outside
    cfg = property(lambda self: self.state.cfg)
    alloc: PageAllocator = property(lambda self: self.state.alloc)  # type: ignore[assignment]
    cache: RadixCache = property(lambda self: self.state.cache)  # type: ignore[assignment]
    reqs = property(lambda self: self.state.reqs)
    waiting = property(lambda self: self.state.waiting)
    running = property(lambda self: self.state.running)
    pending_ops = property(lambda self: self.state.pending_ops)
    retractions = property(lambda self: self.state.retractions)
    cache_hit_tokens = property(lambda self: self.state.cache_hit_tokens)

    # ---- requests in -------------------------------------------------------------------

    def submit(self, msg: TokenizedRequest) -> ReqOutput | None:
        """Queue a request; returns an error output when it can never run."""
        req = self.admission.accept(msg)
        if isinstance(req, str):
            return ReqOutput(rid=msg.rid, new_ids=[], finish_reason="error", error=req)
        if req.max_new_tokens == 0 and req.params.prompt_logprobs is None:  # nothing to compute
            return self.outputs.finish(req, "length")
        if self.grammars.passes(req):
            insort_by_order(self.state.waiting, req)
        else:
            self.grammars.hold(req)
        return None

    def abort(self, rid: str) -> ReqOutput | None:
        req = self.state.reqs.get(rid)
        if req is None or req.status == Status.FINISHED:
            return None
        return self.outputs.finish(req, "abort")

    def flush(self) -> str | None:
        """Empty the prefix cache (and the host tier): only when nothing runs, waits or is in
        flight, so no request holds a page. The Flush op goes out with the next Step, which
        every replica applies; None when done, else why not (`settling`: only what ended the
        last requests is still on its way, so the caller may wait rather than refuse)."""
        if self.busy:
            return "requests are running; retry when the server is idle"
        if self.settling:
            return "steps or cache backups are in flight; retry when the server is idle"
        self.state.cache.reset()
        return None

    @property
    def busy(self) -> bool:
        """Requests run or wait (for a slot, or for their grammar)."""
        return bool(self.state.running or self.state.waiting or len(self.grammars))

    @property
    def settling(self) -> bool:
        """No request runs or waits, but steps are in flight (overlap's step after a request's
        last token), their ops unpublished, or cache backups uncommitted: all end by themselves."""
        return bool(self.sampled_by_step or self.done_ranks or self.state.pending_ops
                    or not self.state.cache.flushable)

    # ---- planning ----------------------------------------------------------------------

    def plan(self) -> Step | None:
        """Decide the next Step, or None when there is nothing to send."""
        s = self.state
        s.cache.tick()
        ops, s.pending_ops = s.pending_ops, []
        rows: list[Row] = []
        budget = s.cfg.max_prefill_tokens
        budget -= self.growth.plan_decodes(rows, ops)
        budget = self.admission.plan_prefill_chunks(rows, ops, budget)
        self.admission.admit(rows, ops, budget)
        self.grammars.plan(ops, self.seq + 1)  # after admission: a request it sent back to the gate is prepared now
        if not ops and not rows and not s.cache.changes:  # (changes: e.g. commits to publish)
            return None
        self.seq += 1
        changes = s.cache.take_changes()
        if any(isinstance(op, Flush) for op in changes):  # after this step's AddReqs, as replicas apply it
            self.grammars.apply(Flush())
        ops.extend(changes)
        if s.cfg.digest_every and self.seq % s.cfg.digest_every == 0:
            ops.append(DigestCheck())
        step = Step(seq=self.seq, ops=ops, forward=_forward(rows, s.cfg.spec_algorithm) if rows else None)
        if self.replica.apply_step(step):
            self._check_mirror()
            digest = self.replica.digest()
            self.digests.expect(self.seq, digest)
            if s.tiers is not None:  # the cache controller reports this step's digest too
                s.tiers.expect(self.seq, digest)
        self.sampled_by_step[self.seq] = [r.req for r in rows if r.sample]
        scored = [(r.req, r.start, len(r.ids) - r.sample) for r in rows if _scores(r)]
        if scored:
            self.scored_by_step[self.seq] = scored
        if step.forward is not None and step.forward.drafts is not None:  # a verify step: drafts per sampled row
            self.drafts_by_step[self.seq] = [r.drafts if r.verify else -1 for r in rows if r.sample]  # -1: not verify
        self.done_ranks[self.seq] = 0
        return step

    def _check_mirror(self) -> None:
        """The scheduler's own state must equal the mirror it publishes: live page tables
        and the radix tree's pages (a scheduler bug is caught here, not only transport)."""
        live = {r.slot: r.pages for r in self.state.reqs.values() if r.slot is not None}
        if live != self.replica["page_tables"].tables:
            raise DigestMismatch(f"step {self.seq}: the scheduler's page tables differ from its mirror")
        if self.state.cache.pages_in_tree() != self.replica["prefix_cache"].pages:
            raise DigestMismatch(f"step {self.seq}: the radix tree's pages differ from the mirror")
        tiers = self.state.tiers
        if tiers is not None and tiers.cache.host.encode() != self.replica["host_tier"].alloc.encode():
            raise DigestMismatch(f"step {self.seq}: the host tier's allocator differs from the mirror")
        if self.state.grammar_keys.keys != self.replica["grammar_keys"].keys:
            raise DigestMismatch(f"step {self.seq}: the grammars the scheduler strips by differ from the mirror")

    # ---- results -----------------------------------------------------------------------

    def on_done(self, done: StepDone) -> list[ReqOutput]:
        """A rank finished a step: check its digests; rank 0's tokens are the output
        (appended, stop conditions checked)."""
        if done.seq not in self.done_ranks:
            raise DigestMismatch(f"rank {done.rank} finished step {done.seq}, which is not in flight")
        if done.rank == 0:
            self.digests.on_tokens(done.seq, done.token_ids)
        self.digests.on_report(done.seq, done.rank, done.digest, done.tokens_hash)
        self.done_ranks[done.seq] += 1
        if self.done_ranks[done.seq] == self.state.cfg.num_ranks:
            del self.done_ranks[done.seq]
            self.digests.forget_done(done.seq)
        if done.rank != 0:
            return []
        scored = self.scored_by_step.pop(done.seq, None)
        if scored:
            self.outputs.on_prompt_scores(done, scored)
        return self.outputs.on_tokens(done, self.sampled_by_step.pop(done.seq), self.drafts_by_step.pop(done.seq, None))

    def on_grammar_ready(self, msg: GrammarReady) -> list[ReqOutput]:
        """A rank compiled (or failed) a prepared grammar: once every rank did, its requests join
        the waiting queue; a failure ends them (error outputs)."""
        admissible, failed = self.grammars.on_ready(msg, self.seq)
        for req in admissible:  # at their place in order: one sent back from the head goes back there
            insort_by_order(self.state.waiting, req)
        return [msgspec.structs.replace(self.outputs.finish(r, "error"), error=why) for r, why in failed]

    def on_committed(self, obj: int) -> None:
        """The cache controller's Committed: ApplyCommit ops go out with the next Step."""
        if self.state.tiers is None:
            raise DigestMismatch(f"Committed({obj}) without a host tier")
        self.state.tiers.on_committed(obj)

    def on_l3_loaded(self, obj: int, ok: bool) -> None:
        """The cache controller's L3Loaded: ApplyCommit (or HostEvict) ops go out with the next Step."""
        if self.state.tiers is None:
            raise DigestMismatch(f"L3Loaded({obj}) without a host tier")
        self.state.tiers.on_l3_loaded(obj, ok)

    def on_controller(self, msg: Committed | L3Loaded | L3Stats | ControllerDigest) -> None:
        """One message of the cache controller that changes the scheduler's state (its
        ControllerFailed is the loop's: it stops the process)."""
        match msg:
            case Committed(obj=obj):
                self.on_committed(obj)
            case L3Loaded(obj=obj, ok=ok):
                self.on_l3_loaded(obj, ok)
            case L3Stats() | ControllerDigest() if self.state.tiers is None:
                raise DigestMismatch(f"{type(msg).__name__} without a host tier")
            case L3Stats():
                self.state.tiers.l3_stats = msg
            case ControllerDigest(seq=seq, digest=digest):
                self.state.tiers.on_controller_digest(seq, digest)

    # ---- introspection -----------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return not self.busy and not self.sampled_by_step

    def leak_free(self) -> bool:
        """When idle and every FreeReq is published, every page is either free or held by the
        prefix cache, unlocked, and no slot holds a page table. (Callers check only then.)"""
        s = self.state
        tree = s.cache.pages_in_tree()
        return (
            s.cache.locked_pages == 0
            and s.alloc.num_free + len(tree) == s.alloc.capacity
            and not self.replica["page_tables"].tables
            and (s.tiers is None or s.tiers.leak_free())
        )


def _scores(row: Row) -> bool:
    """A prefill row of a request that scores its prompt (its first decode row, planned before
    the first token is known, is not one)."""
    return row.req.scores_prompt and row.start < len(row.req.prompt_ids)


def _forward(rows: list[Row], spec_algorithm: str = "") -> Forward:
    ids: list[int] = []
    for r in rows:
        ids.extend(r.ids)
    drafts = None  # only a step that verifies drafts carries them: otherwise the bytes of a plain step
    if any(r.verify for r in rows):  # every verify row goes through the workers' verify path
        chained = pack_ids(int(r.chained) for r in rows) if any(r.chained for r in rows) else b""
        parents = b""  # a tree in the step: every row's parents (a chain's: i - 1), else none
        if any(r.parents for r in rows):
            parents = pack_ids(p for r in rows for p in (r.parents or range(-1, r.drafts - 1)))
        drafts = Drafts(num_drafts=pack_ids(r.drafts for r in rows), on_worker=spec_algorithm != "NGRAM",
                        chained=chained, parents=parents)
    scored = [i for i, r in enumerate(rows) if _scores(r)]
    prompt = None
    if scored:  # the token after each scored row's chunk, when the prompt goes on
        nxt = [rows[i].req.prompt_ids[e] if (e := rows[i].start + len(rows[i].ids)) < len(rows[i].req.prompt_ids)
               else -1 for i in scored]
        top = max(rows[i].req.params.prompt_logprobs or 0 for i in scored)
        prompt = PromptRows(rows=pack_ids(scored), next_ids=pack_ids(nxt), top_k=top)
    return Forward(
        slots=pack_ids(r.req.slot for r in rows),  # type: ignore[misc]
        input_ids=pack_ids(ids),
        start_pos=pack_ids(r.start for r in rows),
        extend_lens=pack_ids(len(r.ids) for r in rows),
        sample=pack_ids(int(r.sample) for r in rows),
        drafts=drafts,
        prompt=prompt,
    )
