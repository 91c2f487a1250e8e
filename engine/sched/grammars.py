"""The grammar gate: a request whose grammar no rank holds compiled waits here, not in a step.

A new grammar can take seconds to compile (the tokenizer's check allows 10 s). Compiled inside
a step (an AddReq's matcher), it stalled every running request on every rank for that long. So
a grammar goes to the ranks first, in a PrepareGrammar op; each rank compiles it on a
background thread (in process or in each grammar helper) and answers GrammarReady; the requests
that use it join the waiting queue once every rank did (SGLang's grammar queue). The decision
is the scheduler's, made once and published: when the reports arrive does not change what any
replica computes.

What every rank holds is GrammarKeys (the scheduler's own instance, `SchedState.grammar_keys`,
updated by the same ops): a key it evicts or a Flush drops is not ready any more, and a request
that reaches the head of the queue with such a key comes back here (prepared again, then back at
its place by arrival). At most MAX_PREPARING keys compile at once, and a key is prepared only if
that evicts no key still compiling nor the key of a request that arrived before its own and waits
for a slot (else it waits for them to start): the prepares of waiting requests do not evict the
keys of the requests ahead of them (an audit's 200 distinct schemas on 4 slots had compiled some
keys 13 times), and newer requests with hot keys cannot hold a new schema back forever (a
re-audit starved one for 3,000 steps while 749 later requests ran). A report names
its PrepareGrammar by GrammarKeys.prepared (`generation`): a late report on a key prepared again
is ignored. A grammar that fails on any rank (it compiled in the tokenizer's check: a rank's
resources) fails the requests waiting on it, nothing else.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import structlog

from engine.sched.request import Req, Status
from engine.sched.state import SchedState
from msgs.done import GrammarReady
from msgs.params import Grammar
from msgs.steps import Flush, Op, PrepareGrammar

log = structlog.get_logger()

MAX_PREPARING = 8  # keys compiling on the ranks at once


@dataclass
class _Preparing:
    generation: int
    grammar: Grammar
    seq: int  # the step that carried its PrepareGrammar
    at: float  # when it was planned (time.monotonic)
    ranks: set[int] = field(default_factory=set)  # ranks that reported it compiled


class GrammarGate:
    def __init__(self, state: SchedState) -> None:
        self.s = state
        self.keys = state.grammar_keys
        self.num_ranks = state.cfg.num_ranks
        self.held: OrderedDict[str, list[Req]] = OrderedDict()  # key -> requests waiting, first arrival first
        self.preparing: dict[str, _Preparing] = {}
        self.ready: set[str] = set()  # compiled on every rank and still held

    def __len__(self) -> int:
        return sum(1 for reqs in self.held.values() for r in reqs if r.status != Status.FINISHED)

    def passes(self, req: Req) -> bool:
        """The request may be admitted now (no grammar, or its grammar is ready everywhere)."""
        g = req.params.grammar
        return g is None or (g.key in self.ready and g.key in self.keys.keys)

    def hold(self, req: Req) -> None:
        """Wait until every rank compiled the request's grammar (`plan` prepares it)."""
        assert req.params.grammar is not None
        self.ready.discard(req.params.grammar.key)  # not held any more, if it was
        self.held.setdefault(req.params.grammar.key, []).append(req)

    def plan(self, ops: list[Op], seq: int) -> None:
        """PrepareGrammar ops for waiting keys, in arrival order, while MAX_PREPARING and the
        keys in use allow (seq: the step they go out in)."""
        first_waiting: dict[str, int] | None = None  # key -> the first arrival waiting on it (made once needed)
        for key in list(self.held):
            reqs = [r for r in self.held[key] if r.status != Status.FINISHED]  # aborted meanwhile: gone
            if not reqs:  # (its compile goes on; its report is ignored: no slot here is kept for it)
                del self.held[key]
                self.preparing.pop(key, None)
                continue
            self.held[key] = reqs
            if key in self.preparing:
                continue
            grammar = reqs[0].params.grammar
            assert grammar is not None
            if len(self.preparing) >= MAX_PREPARING:
                break  # in arrival order: a later key does not overtake this one
            if first_waiting is None:
                first_waiting = {}
                for r in self.s.waiting:
                    if r.params.grammar is not None:
                        first_waiting.setdefault(r.params.grammar.key, r.arrival)
            first = min(r.arrival for r in reqs)
            # keys it must not evict: those compiling, and those of requests that came before it
            # (newer ones do not hold it up: theirs are prepared again when they reach the head)
            if any(k in self.preparing or first_waiting.get(k, first) < first for k in self.keys.evicts(grammar)):
                break  # wait for them to start; a later key does not overtake this one
            ops.append(PrepareGrammar(grammar))
            for gone in self.keys.prepare(grammar):
                self.ready.discard(gone)
            self.preparing[key] = _Preparing(self.keys.prepared, grammar, seq, time.monotonic())

    def on_ready(self, msg: GrammarReady, seq: int) -> tuple[list[Req], list[tuple[Req, str]]]:
        """A rank's report: the requests now admissible (in arrival order), and those that fail
        (with why); both empty until every rank reported, or for a stale report. seq: the last
        step planned (the `grammar ready` line says how many went out while the ranks compiled)."""
        p = self.preparing.get(msg.key)
        if p is None or p.generation != msg.generation:
            return [], []
        if msg.error:  # one rank failed: the requests fail, the key is prepared anew by the next one
            del self.preparing[msg.key]
            log.warning("grammar failed on a rank", key=msg.key[:12], rank=msg.rank, error=msg.error)
            why = f"the grammar did not compile on rank {msg.rank}: {msg.error}"
            return [], [(r, why) for r in self.held.pop(msg.key, []) if r.status != Status.FINISHED]
        p.ranks.add(msg.rank)
        if len(p.ranks) < self.num_ranks:
            return [], []
        del self.preparing[msg.key]
        if msg.key not in self.keys.keys:  # (defence: no prepare evicts a key compiling) again
            return [], []
        # from its PrepareGrammar to the last rank's report: queued behind other compiles included
        log.info("grammar ready", key=msg.key[:12], ready_ms=round((time.monotonic() - p.at) * 1e3, 1),
                 steps_meanwhile=seq - p.seq, requests=len(self.held.get(msg.key, ())))
        self.ready.add(msg.key)
        return [r for r in self.held.pop(msg.key, []) if r.status != Status.FINISHED], []

    def apply(self, op: Flush) -> None:
        """A Flush (GrammarKeys empties on every replica): nothing is ready or compiling."""
        self.keys.apply(op)
        self.ready.clear()
        self.preparing.clear()
