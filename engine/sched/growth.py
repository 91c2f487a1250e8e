"""Decode growth and retraction: one token per running request per step, a new page at
each page boundary, and when pages run out the newest request gives its KV back."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sched.request import Req, Status, VerifyRow, insort_by_order
from engine.sched.state import RequestKV, SchedState
from msgs.steps import Op


@dataclass
class Row:
    """One request's part of a Step's forward."""

    req: Req
    ids: list[int]
    start: int
    sample: bool
    drafts: int = 0  # speculative decoding: the last `drafts` ids are drafts to verify
    verify: bool = False  # a speculating request's decode row (its step carries Drafts)
    chained: bool = False  # planned before its previous verify row answered (Drafts.chained)
    parents: list[int] | None = None  # a draft tree: each draft's parent (-1: ids[0]); None: a chain


class DecodeGrowth:
    def __init__(self, state: SchedState, kv: RequestKV) -> None:
        self.s = state
        self.kv = kv

    def plan_decodes(self, rows: list[Row], ops: list[Op]) -> int:
        """A decode row for every running request whose prompt is done; tokens used. With
        speculation, the batch-size rules cap every row's drafts by the step's decode rows; a cap
        of 0 makes this an ordinary decode step (docs/architecture.md, Speculation by batch size)."""
        used = 0
        decoding = [r for r in self.s.running if r.status == Status.RUNNING and not r.in_prefill
                    and r.pending_tokens < r.max_new_tokens]  # (its last token not already being sampled)
        spec = self.s.spec
        cap = spec.cap(len(decoding)) if spec is not None else 0
        for req in decoding:
            if req.status != Status.RUNNING:
                continue  # retracted by an earlier row's growth
            if spec is not None and cap > 0 and spec.eligible(req):
                used += self._plan_verify(req, rows, ops, cap)
                continue
            if req.verifies:
                continue  # a verify row in flight: its accepted length, so this row's position, is not known yet
            if req.kv_len % self.s.cfg.page_size == 0 and not self.grow(req, 1, ops, may_retract=True):
                continue  # req itself was retracted
            token = -1 if req.inflight else req.last_token  # -1: sampled by the step in flight
            rows.append(Row(req, [token], req.kv_len, True))
            self.s.spec_stats.plain += spec is not None
            req.kv_len += 1
            req.inflight += 1
            used += 1
        return used

    def _plan_verify(self, req: Req, rows: list[Row], ops: list[Op], cap: int) -> int:
        """A speculating request's row: its last token and its drafts; tokens used. With its
        previous verify row still in flight, the row is chained on it: planned as if that row
        accepted all its drafts (its first token that row's bonus, resolved on the worker; its
        drafts looked up after the previous drafts), answering nothing if a draft was rejected
        (docs/architecture.md, Speculative decoding, Overlap). Otherwise it waits. `cap`: the
        most drafts the step's batch size allows (SpecPolicy.cap)."""
        spec = self.s.spec
        assert spec is not None
        live = [v for v in req.verifies if not v.void]
        if req.inflight > len(req.verifies) or len(live) > 1:
            return 0  # a prefill's first token in flight, or already two rows ahead
        chained = bool(live)
        if chained and (live[0].parents is not None or not spec.chains(req, live[0].drafts)):
            return 0  # (never chained on a tree row: its accepted path is not known ahead)
        ahead = 1 + len(live[0].drafts) if chained else 0  # tokens the previous row answers at most
        room = min(req.max_new_tokens - len(req.output_ids) - ahead, self.s.cfg.max_context - req.kv_len) - 1
        if room < 0:
            return 0  # the previous row may already end it
        drafts, parents = spec.row(req, min(room, cap), live[0].drafts if chained else None)
        if not self.grow(req, 1 + len(drafts), ops, may_retract=True):
            return 0  # req itself was retracted
        self.s.spec_stats.capped += cap < min(max(spec.num_steps, spec.nodes), room)
        first = -1 if chained else req.last_token  # -1: the previous row's bonus, on the worker
        rows.append(Row(req, [first, *drafts], req.kv_len, True, len(drafts), verify=True, chained=chained,
                        parents=parents))
        req.verifies.append(VerifyRow(req.kv_len, drafts, chained, parents=parents))
        self.s.spec_stats.chained += chained
        req.kv_len += 1 + len(drafts)
        req.inflight += 1
        return 1 + len(drafts)

    def grow(self, req: Req, new_tokens: int, ops: list[Op], may_retract: bool) -> bool:
        """Give req pages for new_tokens more tokens, evicting cache and (for decode)
        retracting the newest other request when needed. False when req cannot grow now."""
        need = self.kv.pages_for(req, new_tokens)
        if need == 0:
            return True
        while (pages := self.kv.alloc(need, len(req.pages))) is None:
            victim = self._victim() if may_retract else None
            if victim is None:
                return False
            self.retract(victim, ops)
            if victim is req:
                return False
        self.kv.extend(req, pages, ops)
        return True

    def _victim(self) -> Req | None:
        """The last running request in `Req.order` (the newest of the lowest priority). `running` is
        in that order (Admission._start), so a victim other than the request growing has no row
        planned in this step yet."""
        live = [r for r in self.s.running if r.status == Status.RUNNING]
        return max(live, key=lambda r: r.order) if live else None

    def retract(self, req: Req, ops: list[Op]) -> None:
        """Free req's KV and queue it again; it re-prefills prompt + output when readmitted."""
        self.s.retractions += 1
        self.kv.release(req)
        self.kv.release_slot(req, ops)
        req.status = Status.WAITING
        self.s.running.remove(req)
        insort_by_order(self.s.waiting, req)  # (the last running: usually the head)
