"""Admission and chunked prefill: requests in (checked), waiting requests admitted in
arrival order with their cached prefix, prompts prefilled in chunks within the budget."""

from __future__ import annotations

import bisect
import heapq
from collections import OrderedDict
from collections.abc import Sequence

import msgspec
import structlog

from engine.sched.grammars import GrammarGate
from engine.sched.growth import DecodeGrowth, Row
from engine.sched.request import Req, Status
from engine.sched.state import RequestKV, SchedState
from msgs.codec import pack_ids, unpack_ids
from msgs.params import PROMPT_SCORE_CHUNK, Grammar
from msgs.requests import TokenizedRequest
from msgs.steps import AddReq, ExtendPages, Op, WorkerSampling

log = structlog.get_logger()

INTERNED_GRAMMARS = 256  # distinct grammars whose data waiting requests share (by key)


class Admission:
    def __init__(self, state: SchedState, kv: RequestKV, growth: DecodeGrowth, gate: GrammarGate) -> None:
        self.s = state
        self.kv = kv
        self.growth = growth
        self.gate = gate
        self.grammars: OrderedDict[str, Grammar] = OrderedDict()  # key -> the one copy requests hold
        self.named: dict[str, Grammar] = {}  # key -> the grammar as AddReqs name it (no data)

    def accept(self, msg: TokenizedRequest) -> Req | str:
        """A new request, or why it can never run (the edge checked it; this is defence
        in depth: what concerns one request fails that request)."""
        if len(msg.input_ids) % 4:
            return "input_ids: not packed int32"
        ids = unpack_ids(msg.input_ids)
        problem = self._reject_reason(msg.rid, ids) or msg.params.validate(self.s.cfg.vocab_size,
                                                                            self.s.cfg.eos_token_ids)
        if problem:
            return problem
        p, s = msg.params, self.s
        if p.grammar is not None:  # one copy per key: a schema's data is ~0.5 MB, per request it adds up
            p = msgspec.structs.replace(p, grammar=self._interned(p.grammar))
        seed = p.seed if p.seed is not None else s.rng.getrandbits(63)
        max_new = min(p.max_new_tokens, s.cfg.max_context - len(ids))
        req = Req(msg.rid, ids, p, seed, max_new, s.arrivals)
        s.arrivals += 1
        s.reqs[req.rid] = req
        return req

    def _interned(self, grammar: Grammar) -> Grammar:
        """The copy of this grammar other requests already hold (a key names its data: the
        SHA-256 of what was compiled, as GrammarKeys relies on too), or this one, kept."""
        held = self.grammars.setdefault(grammar.key, grammar)
        self.grammars.move_to_end(grammar.key)
        while len(self.grammars) > INTERNED_GRAMMARS:
            self.named.pop(self.grammars.popitem(last=False)[0], None)
        return held

    def _reject_reason(self, rid: str, ids: list[int]) -> str | None:
        cfg = self.s.cfg
        if rid in self.s.reqs:
            return f"request id {rid!r} is already in flight"
        if not ids:
            return "the prompt is empty"
        if len(ids) >= cfg.max_context:
            return f"prompt has {len(ids)} tokens; the context holds {cfg.max_context}"
        if not 0 <= min(ids) <= max(ids) < cfg.vocab_size:
            return f"prompt token ids must be in [0, {cfg.vocab_size})"
        return None

    def plan_prefill_chunks(self, rows: list[Row], ops: list[Op], budget: int) -> int:
        """Continue running prefills within the budget; the budget left."""
        for req in self.s.running:
            if budget <= 0:
                break
            if req.status == Status.RUNNING and req.in_prefill:
                budget -= self.chunk(req, rows, ops, budget)
        return budget

    def admit(self, rows: list[Row], ops: list[Op], budget: int) -> None:
        """Admit waiting requests in their order (Req.order: arrival, or priority first) while the
        budget, a slot and pages last (pages for the first chunk only when every running decode can
        also get one)."""
        s = self.s
        if not (s.waiting and budget > 0 and s.free_slots):  # the usual decode step: a pass over running spared
            return
        decoding = sum(1 for r in s.running if not r.in_prefill)  # each may need a page soon
        while s.waiting and budget > 0 and s.free_slots:
            req = s.waiting[0]
            if req.inflight:  # retracted while a step with its token is in flight
                break
            if not self.gate.passes(req):  # its grammar left the ranks since (evicted, flushed)
                self.gate.hold(s.waiting.popleft())
                continue
            if not self._fits(req, budget, decoding):
                break
            s.waiting.popleft()
            self._start(req, ops)
            budget -= self.chunk(req, rows, ops, budget)

    def _fits(self, req: Req, budget: int, decoding: int) -> bool:
        s = self.s
        ids = req.all_ids
        if s.cfg.enable_radix and not req.scores_prompt:  # (a scored prompt needs every token's logits)
            # no hit counted until the request is admitted: a blocked head of the queue
            # re-matches every step and must not promote its prefix to the protected tier
            match = s.cache.match_prefix(ids[: len(ids) - 1], touch=False)
            s.cache.lock(match.node)
            if match.host_nodes and s.tiers is not None:  # the rest is in the host tier: load it back
                match, l2, l3 = s.tiers.load_back(match)
                req.hit_l2, req.hit_l3 = req.hit_l2 + l2, req.hit_l3 + l3
            req.node, req.pages, req.kv_len = match.node, list(match.pages), match.num_tokens
            if s.tiers is not None and s.tiers.l3_wait(req, match, ids[: len(ids) - 1]):
                self.kv.release(req)  # an L3 load of its next pages is in flight: wait at the head
                return False
        first = min(len(ids) - req.kv_len, budget)
        if self.kv.pages_for(req, first) + decoding > s.alloc.num_free + s.cache.evictable_pages:
            self.kv.release(req)
            return False
        return True

    def _start(self, req: Req, ops: list[Op]) -> None:
        s = self.s
        if req.node is not None:
            s.cache.touch(req.node)
        if not req.admitted_once:
            req.admitted_once, req.cached_tokens = True, req.kv_len
            s.cache_hit_tokens += req.kv_len
            l2 = l3 = 0
            if s.tiers is not None:  # by tier: what L2/L3 loaded for it and it still uses
                l3 = min(req.hit_l3, req.kv_len)
                l2 = min(req.hit_l2, req.kv_len - l3)
                s.tiers.count_hits(l2, l3)
            if req.kv_len:  # bin/analyze's TTFT by tier reads it
                log.info("admitted", rid=req.rid, cached_tokens=req.kv_len, l2_tokens=l2, l3_tokens=l3)
        req.slot = heapq.heappop(s.free_slots)
        req.status = Status.RUNNING
        # in Req.order, as DecodeGrowth's victim rule needs (the last is planned last): a request the
        # grammar gate held, or re-admitted after a retraction, may start after later ones
        bisect.insort(s.running, req, key=_order)
        ops.append(
            AddReq(
                req.slot, req.rid, worker_sampling(req, s.cfg.eos_token_ids),
                pack_ids(req.prompt_ids), pack_ids(req.output_ids),
                grammar=self._named(req.params.grammar),
            )
        )
        if req.pages:
            ops.append(ExtendPages(req.slot, pack_ids(req.pages)))

    def _named(self, grammar: Grammar | None) -> Grammar | None:
        """The grammar as an AddReq names it: its key, held by every rank (the gate let it
        through), without the data PrepareGrammar brought; it becomes the most recent key."""
        if grammar is None:
            return None
        self.s.grammar_keys.use(grammar.key)
        named = self.named.get(grammar.key)
        if named is None:
            named = self.named[grammar.key] = msgspec.structs.replace(grammar, data=b"")
        return named

    def chunk(self, req: Req, rows: list[Row], ops: list[Op], budget: int) -> int:
        """Schedule up to `budget` prompt tokens of req; returns how many were scheduled."""
        ids = req.all_ids
        if req.scores_prompt:  # its chunk's logits are all kept (msgs.params.PROMPT_SCORE_CHUNK)
            budget = min(budget, PROMPT_SCORE_CHUNK)
        n = min(len(ids) - req.kv_len, budget)
        if n <= 0 or not self.growth.grow(req, n, ops, may_retract=False):
            return 0
        final = req.kv_len + n == len(ids)  # decided now, from the live request
        rows.append(Row(req, ids[req.kv_len : req.kv_len + n], req.kv_len, final))
        req.kv_len += n
        if final:
            req.inflight += 1
        # a scored prompt was prefilled whole, beside the tree's copy of its prefix: publishing
        # would lock that copy as well as its own, 2x the prompt, and a pool under 2x would stall
        # its next chunk for good; its pages enter the tree when it finishes (outputs.finish)
        if not req.scores_prompt:
            self.kv.publish(req, req.kv_len)
        return n


def _order(req: Req) -> tuple[int, int]:
    return req.order


def worker_sampling(req: Req, eos_ids: Sequence[int]) -> WorkerSampling:
    """The request's sampling fields, with the seed the scheduler settled on and, under
    min_new_tokens, the tokens the sampler masks until then: what would stop the request
    (outputs._stop_reason) except a grammar's ending, which the grammar alone allows then."""
    p = req.params
    fields = {f: getattr(p, f) for f in WorkerSampling.__struct_fields__
              if f not in ("seed", "min_stop_ids", "allowed_token_ids")}
    stops: list[int] = []
    if p.min_new_tokens:
        ends = set(p.grammar.stop_ids) if p.grammar is not None else set()
        stops = sorted((({*eos_ids} if not p.ignore_eos else set()) | set(p.stop_token_ids)) - ends)
    return WorkerSampling(**fields, seed=req.seed, min_stop_ids=stops,
                          allowed_token_ids=sorted(set(p.allowed_token_ids or ())))
