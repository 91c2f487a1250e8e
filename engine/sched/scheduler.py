"""SchedulerCore: every policy decision, made once, published as the Step stream.

The proc (procs/scheduler.py) only moves messages; this class is what tests drive:
`submit` / `abort` requests, `plan()` the next Step, `on_done()` a worker's StepDone.
Replicated state changes only through the ops of the Steps it returns; it applies each
op to its own mirror (engine/replica, the same code the workers run) so DigestCheck can
compare replicas (DESIGN.md 4-5); engine/sched/digests.py tracks what the ranks report.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from dataclasses import dataclass

from engine.cache.allocator import PageAllocator
from engine.cache.radix import RadixCache
from engine.replica import rank_replica
from engine.sched.digests import DigestMismatch, DigestTracker
from engine.sched.request import Req, Status
from msgs.codec import pack_ids, unpack_f32, unpack_ids
from msgs.done import StepDone
from msgs.outputs import ReqOutput
from msgs.requests import TokenizedRequest
from msgs.steps import AddReq, DigestCheck, ExtendPages, Forward, FreeReq, Op, Step, WorkerSampling


@dataclass(frozen=True)
class SchedConfig:
    num_pages: int  # including the reserved padding page 0
    page_size: int
    max_running: int
    max_prefill_tokens: int  # token budget per step (decode tokens count one each)
    max_context: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int  # prompt ids and stop ids are checked against it (defence in depth)
    enable_radix: bool = True
    seed: int = 0
    digest_every: int = 64
    num_ranks: int = 1  # workers replaying the stream; each reports every DigestCheck

    def __post_init__(self) -> None:
        if self.num_pages < 2 or self.max_context < 2 or self.max_prefill_tokens < 1 or self.vocab_size < 1:
            raise ValueError(f"bad scheduler config {self}")


@dataclass
class _Row:
    req: Req
    ids: list[int]
    start: int
    sample: bool


class SchedulerCore:
    def __init__(self, cfg: SchedConfig) -> None:
        self.cfg = cfg
        self.alloc = PageAllocator(cfg.num_pages)
        self.cache = RadixCache(cfg.page_size, self.alloc)
        self.replica = rank_replica()
        self.reqs: dict[str, Req] = {}
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.free_slots = list(range(cfg.max_running))
        self.seq = 0
        self.sampled_by_step: dict[int, list[Req]] = {}
        self.digests = DigestTracker(cfg.num_ranks)
        self.done_ranks: dict[int, int] = {}  # seq -> ranks that finished it
        self.pending_ops: list[Op] = []
        self.rng = random.Random(cfg.seed)
        self.arrivals = 0
        self.cache_hit_tokens = 0
        self.retractions = 0

    # ---- requests in -------------------------------------------------------------------

    def submit(self, msg: TokenizedRequest) -> ReqOutput | None:
        """Queue a request; returns an error output when it can never run."""
        if len(msg.input_ids) % 4:
            return ReqOutput(rid=msg.rid, new_ids=[], finish_reason="error", error="input_ids: not packed int32")
        ids = unpack_ids(msg.input_ids)
        problem = self._reject_reason(msg.rid, ids) or msg.params.validate(self.cfg.vocab_size)
        if problem:
            return ReqOutput(rid=msg.rid, new_ids=[], finish_reason="error", error=problem)
        p = msg.params
        seed = p.seed if p.seed is not None else self.rng.getrandbits(63)
        max_new = min(p.max_new_tokens, self.cfg.max_context - len(ids))
        req = Req(msg.rid, ids, p, seed, max_new, self.arrivals)
        self.arrivals += 1
        self.reqs[req.rid] = req
        if max_new == 0:
            return self._finish(req, "length")
        self.waiting.append(req)
        return None

    def _reject_reason(self, rid: str, ids: list[int]) -> str | None:
        if rid in self.reqs:
            return f"request id {rid!r} is already in flight"
        if not ids:
            return "the prompt is empty"
        if len(ids) >= self.cfg.max_context:
            return f"prompt has {len(ids)} tokens; the context holds {self.cfg.max_context}"
        if not 0 <= min(ids) <= max(ids) < self.cfg.vocab_size:
            return f"prompt token ids must be in [0, {self.cfg.vocab_size})"
        return None

    def abort(self, rid: str) -> ReqOutput | None:
        req = self.reqs.get(rid)
        if req is None or req.status == Status.FINISHED:
            return None
        return self._finish(req, "abort")

    # ---- planning ----------------------------------------------------------------------

    def plan(self) -> Step | None:
        """Decide the next Step, or None when there is nothing to send."""
        self.cache.tick()
        ops, self.pending_ops = self.pending_ops, []
        rows: list[_Row] = []
        budget = self.cfg.max_prefill_tokens
        budget -= self._plan_decodes(rows, ops)
        budget = self._plan_prefill_chunks(rows, ops, budget)
        self._admit(rows, ops, budget)
        if not ops and not rows:
            return None
        self.seq += 1
        ops.extend(self.cache.take_changes())
        if self.cfg.digest_every and self.seq % self.cfg.digest_every == 0:
            ops.append(DigestCheck())
        step = Step(seq=self.seq, ops=ops, forward=self._forward(rows) if rows else None)
        if self.replica.apply_step(step):
            self._check_mirror()
            self.digests.expect(self.seq, self.replica.digest())
        self.sampled_by_step[self.seq] = [r.req for r in rows if r.sample]
        self.done_ranks[self.seq] = 0
        return step

    def _check_mirror(self) -> None:
        """The scheduler's own state must equal the mirror it publishes: live page tables
        and the radix tree's pages (a scheduler bug is caught here, not only transport)."""
        live = {r.slot: r.pages for r in self.reqs.values() if r.slot is not None}
        if live != self.replica["page_tables"].tables:
            raise DigestMismatch(f"step {self.seq}: the scheduler's page tables differ from its mirror")
        if self.cache.pages_in_tree() != self.replica["prefix_cache"].pages:
            raise DigestMismatch(f"step {self.seq}: the radix tree's pages differ from the mirror")

    def _plan_decodes(self, rows: list[_Row], ops: list[Op]) -> int:
        used = 0
        for req in list(self.running):
            if req.status != Status.RUNNING or req.in_prefill:
                continue
            if req.pending_tokens >= req.max_new_tokens:
                continue  # its last token is already being sampled (max_new fits the context)
            if req.kv_len % self.cfg.page_size == 0 and not self._grow(req, 1, ops, may_retract=True):
                continue  # req itself was retracted
            token = -1 if req.inflight else req.last_token  # -1: sampled by the step in flight
            rows.append(_Row(req, [token], req.kv_len, True))
            req.kv_len += 1
            req.inflight += 1
            used += 1
        return used

    def _plan_prefill_chunks(self, rows: list[_Row], ops: list[Op], budget: int) -> int:
        for req in self.running:
            if budget <= 0:
                break
            if req.status == Status.RUNNING and req.in_prefill:
                budget -= self._chunk(req, rows, ops, budget)
        return budget

    def _admit(self, rows: list[_Row], ops: list[Op], budget: int) -> None:
        decoding = sum(1 for r in self.running if not r.in_prefill)  # each may need a page soon
        while self.waiting and budget > 0 and self.free_slots:
            req = self.waiting[0]
            if req.inflight:  # retracted while a step with its token is in flight
                break
            ids = req.all_ids
            if self.cfg.enable_radix:
                # no hit counted until the request is admitted: a blocked head of the queue
                # re-matches every step and must not promote its prefix to the protected tier
                match = self.cache.match_prefix(ids[: len(ids) - 1], touch=False)
                self.cache.lock(match.node)
                req.node, req.pages, req.kv_len = match.node, list(match.pages), match.num_tokens
            first = min(len(ids) - req.kv_len, budget)
            need = self._pages_for(req, first) + decoding
            if need > self.alloc.num_free + self.cache.evictable_pages:
                self._release_kv(req)
                break
            self.waiting.popleft()
            if req.node is not None:
                self.cache.touch(req.node)
            if not req.admitted_once:
                req.admitted_once, req.cached_tokens = True, req.kv_len
                self.cache_hit_tokens += req.kv_len
            req.slot = heapq.heappop(self.free_slots)
            req.status = Status.RUNNING
            self.running.append(req)
            ops.append(
                AddReq(req.slot, req.rid, _worker_sampling(req), pack_ids(req.prompt_ids), pack_ids(req.output_ids))
            )
            if req.pages:
                ops.append(ExtendPages(req.slot, pack_ids(req.pages)))
            budget -= self._chunk(req, rows, ops, budget)

    def _chunk(self, req: Req, rows: list[_Row], ops: list[Op], budget: int) -> int:
        """Schedule up to `budget` prompt tokens of req; returns how many were scheduled."""
        ids = req.all_ids
        n = min(len(ids) - req.kv_len, budget)
        if n <= 0 or not self._grow(req, n, ops, may_retract=False):
            return 0
        final = req.kv_len + n == len(ids)  # decided now, from the live request
        rows.append(_Row(req, ids[req.kv_len : req.kv_len + n], req.kv_len, final))
        req.kv_len += n
        if final:
            req.inflight += 1
        self._cache_pages(req, req.kv_len)
        return n

    def _pages_for(self, req: Req, new_tokens: int) -> int:
        total = -(-(req.kv_len + new_tokens) // self.cfg.page_size)
        return max(0, total - len(req.pages))

    def _grow(self, req: Req, new_tokens: int, ops: list[Op], may_retract: bool) -> bool:
        """Give req pages for new_tokens more tokens, evicting cache and (for decode) retracting
        the newest other request when needed. False when req cannot grow now."""
        need = self._pages_for(req, new_tokens)
        if need == 0:
            return True
        while (pages := self._alloc(need)) is None:
            victim = self._retract_victim() if may_retract else None
            if victim is None:
                return False
            self._retract(victim, ops)
            if victim is req:
                return False
        req.pages.extend(pages)
        req.private.update(pages)
        ops.append(ExtendPages(req.slot, pack_ids(pages)))
        return True

    def _alloc(self, n: int) -> list[int] | None:
        short = n - self.alloc.num_free
        if short > 0:
            self.cache.evict(short)
        return self.alloc.alloc(n)

    def _retract_victim(self) -> Req | None:
        live = [r for r in self.running if r.status == Status.RUNNING]
        return max(live, key=lambda r: r.arrival) if live else None

    def _retract(self, req: Req, ops: list[Op]) -> None:
        """Free req's KV and queue it again; it re-prefills prompt + output when readmitted."""
        self.retractions += 1
        self._release_kv(req)
        self._release_slot(req, ops)
        req.status = Status.WAITING
        self.running.remove(req)
        self.waiting.appendleft(req)

    def _cache_pages(self, req: Req, kv_tokens: int) -> None:
        """Publish req's full pages (KV written by now or by a step already sent) in the tree."""
        if not self.cfg.enable_radix:
            return
        full = min(kv_tokens, req.num_known) // self.cfg.page_size
        if full == 0:
            return
        tokens = req.all_ids[: full * self.cfg.page_size]
        present, node = self.cache.insert_node(tokens, req.pages[:full])
        req.private.difference_update(req.pages[present // self.cfg.page_size : full])
        self.cache.lock(node)
        if req.node is not None:
            self.cache.unlock(req.node)
        req.node = node

    def _forward(self, rows: list[_Row]) -> Forward:
        ids: list[int] = []
        for r in rows:
            ids.extend(r.ids)
        return Forward(
            slots=pack_ids(r.req.slot for r in rows),  # type: ignore[misc]
            input_ids=pack_ids(ids),
            start_pos=pack_ids(r.start for r in rows),
            extend_lens=pack_ids(len(r.ids) for r in rows),
            sample=pack_ids(int(r.sample) for r in rows),
        )

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
        if self.done_ranks[done.seq] == self.cfg.num_ranks:
            del self.done_ranks[done.seq]
            self.digests.forget_done(done.seq)
        return self._outputs(done) if done.rank == 0 else []

    def _outputs(self, done: StepDone) -> list[ReqOutput]:
        reqs = self.sampled_by_step.pop(done.seq)
        tokens = unpack_ids(done.token_ids)
        if len(tokens) != len(reqs):
            raise RuntimeError(f"step {done.seq}: {len(tokens)} tokens for {len(reqs)} requests")
        logprobs = unpack_f32(done.logprobs) if done.logprobs is not None else None
        top = _top_rows(done)
        outs = []
        for i, (req, tok) in enumerate(zip(reqs, tokens, strict=True)):
            req.inflight -= 1
            if req.status == Status.FINISHED:
                continue  # finished at an earlier step; this overlap token is discarded
            req.output_ids.append(tok)
            reason = self._stop_reason(req, tok)
            out = ReqOutput(
                rid=req.rid,
                new_ids=[tok],
                prompt_tokens=len(req.prompt_ids),
                cached_tokens=req.cached_tokens,
                completion_tokens=len(req.output_ids),
                logprobs=[logprobs[i]] if logprobs is not None and req.params.logprobs else None,
                top_logprobs=[top[i][: req.params.top_logprobs]] if top and req.params.top_logprobs else None,
            )
            outs.append(out)
            if reason:
                self._finish(req, reason)
                outs[-1] = _with_finish(out, reason)
        return outs

    def _stop_reason(self, req: Req, tok: int) -> str | None:
        p = req.params
        if not p.ignore_eos and tok in self.cfg.eos_token_ids:
            return "stop"
        if tok in p.stop_token_ids:
            return "stop"
        if len(req.output_ids) >= req.max_new_tokens:
            return "length"
        return None

    def _finish(self, req: Req, reason: str) -> ReqOutput:
        if req.status == Status.RUNNING:
            self._cache_pages(req, req.kv_len)
            self._release_kv(req)
            self._release_slot(req, self.pending_ops)
            self.running.remove(req)
        elif req.status == Status.WAITING and req in self.waiting:
            self.waiting.remove(req)
        req.status, req.finish_reason = Status.FINISHED, reason
        del self.reqs[req.rid]
        return ReqOutput(
            rid=req.rid,
            new_ids=[],
            finish_reason=reason,
            prompt_tokens=len(req.prompt_ids),
            cached_tokens=req.cached_tokens,
            completion_tokens=len(req.output_ids),
        )

    def _release_kv(self, req: Req) -> None:
        if req.private:
            self.alloc.free(sorted(req.private))
        if req.node is not None:
            self.cache.unlock(req.node)
        req.private, req.pages, req.node, req.kv_len = set(), [], None, 0

    def _release_slot(self, req: Req, ops: list[Op]) -> None:
        if req.slot is not None:
            ops.append(FreeReq(req.slot))
            heapq.heappush(self.free_slots, req.slot)
            req.slot = None

    # ---- introspection -----------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting and not self.sampled_by_step

    def leak_free(self) -> bool:
        """When idle and every FreeReq is published, every page is either free or held by the
        prefix cache, unlocked, and no slot holds a page table. (Callers check only then.)"""
        tree = self.cache.pages_in_tree()
        return (
            self.cache.locked_pages == 0
            and self.alloc.num_free + len(tree) == self.alloc.capacity
            and not self.replica["page_tables"].tables
        )


def _worker_sampling(req: Req) -> WorkerSampling:
    """The request's sampling fields, with the seed the scheduler settled on."""
    p = req.params
    return WorkerSampling(**{f: getattr(p, f) for f in WorkerSampling.__struct_fields__ if f != "seed"}, seed=req.seed)


def _top_rows(done: StepDone) -> list[list[tuple[int, float]]] | None:
    if done.top_ids is None or done.top_logprobs is None or done.top_k == 0:
        return None
    ids, lps, k = unpack_ids(done.top_ids), unpack_f32(done.top_logprobs), done.top_k
    return [list(zip(ids[i : i + k], lps[i : i + k], strict=True)) for i in range(0, len(ids), k)]


def _with_finish(out: ReqOutput, reason: str) -> ReqOutput:
    import msgspec

    return msgspec.structs.replace(out, finish_reason=reason)
