"""A request as the scheduler sees it: tokens, KV pages, and where it stands."""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from msgs.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class VerifyRow:
    """A speculating request's verify row in flight (engine/sched/growth.py)."""

    start: int  # KV position of its first token
    drafts: list[int]  # its draft tokens (-1: proposed on the workers)
    chained: bool  # planned before the previous row answered, assuming all its drafts accepted
    void: bool = False  # the previous row rejected a draft: this one answers nothing
    parents: list[int] | None = None  # a draft tree's parents (Drafts.parents); None: a chain


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_new_tokens: int  # already clamped to the context length
    arrival: int  # admission order, a total order tie-break
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    slot: int | None = None
    pages: list[int] = field(default_factory=list)  # page table as sent to the workers
    private: set[int] = field(default_factory=set)  # pages this request must free itself
    node: Any = None  # deepest radix node it has locked
    kv_len: int = 0  # tokens whose KV is written, or will be by a step already sent
    inflight: int = 0  # sent steps that will return a sampled token for this request
    cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    admitted_once: bool = False
    l3_probed: bool = False  # its prompt was looked up in the disk tier (once per request)
    hit_l2: int = 0  # prompt tokens loaded back for it from L2 before its first admission (not L3)
    hit_l3: int = 0  # ... and from L3 files (read into L2 for it)
    spec: tuple[int, int, int] = (0, 0, 0)  # speculative decoding: verify rows, drafts, accepted
    verifies: list[VerifyRow] = field(default_factory=list)  # its verify rows in flight, oldest first
    full_streak: int = 0  # its last verify rows in a row that accepted every draft
    ngram: Any = None  # NGRAM: its tokens' n-gram index (engine/sched/spec.py NgramIndex), made on first use
    finish_reason: str | None = None
    # prompt_logprobs: entry i scores prompt token i + 1 as (logprob, top alternatives), by position
    # (a re-prefill after a retraction overwrites); sent whole with the first output
    prompt_scores: list[tuple[float, list[tuple[int, float]]] | None] | None = None

    @property
    def scores_prompt(self) -> bool:
        """Its prefill rows must score the prompt (not yet answered: after that a re-prefill need not)."""
        return self.params.prompt_logprobs is not None and not self.output_ids

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_known(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def seq_len(self) -> int:
        """Tokens known so far plus tokens being sampled by steps in flight."""
        return len(self.prompt_ids) + len(self.output_ids) + self.inflight

    @property
    def in_prefill(self) -> bool:
        """Prompt tokens left to prefill, but the last: a decode row feeds it. A request that asks
        for no token (max_tokens 0: it only scores its prompt) has no decode row, so it prefills
        that one too (a chunk ending one token short left it waiting for good)."""
        return self.kv_len < self.seq_len - (self.max_new_tokens > 0)

    @property
    def order(self) -> tuple[int, int]:
        """The scheduling order, a total one: (priority, arrival). Lower first: admitted first,
        retracted last (the priority is 0 for every request unless --scheduling-policy priority)."""
        return self.params.priority, self.arrival

    @property
    def pending_tokens(self) -> int:
        """Output tokens already sampled or being sampled."""
        return len(self.output_ids) + self.inflight


def insort_by_order(queue: deque[Req], req: Req) -> None:
    """Put req in a waiting queue before the first request after it in `Req.order` (the queue is
    in that order: new arrivals, requests released by the grammar gate and retracted ones take
    their place; a new arrival of the lowest priority goes last without a scan)."""
    if not queue or queue[-1].order <= req.order:
        queue.append(req)
        return
    at = next((i for i, r in enumerate(queue) if r.order > req.order), len(queue))
    queue.insert(at, req)
