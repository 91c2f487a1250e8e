"""Speculative decoding, the scheduler's part (docs/architecture.md, Speculative decoding):
which requests speculate, their draft tokens (NGRAM: the prefix cache's continuation of the
request's tokens, else a lookup in the request's own tokens;
STANDALONE: -1 placeholders the workers' draft model fills), and the counters of what was
accepted. Verification itself runs on every rank (engine/run/spec.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.cache.radix import RadixCache
from engine.sched.request import Req

NGRAM_MAX = 3  # longest suffix looked up (prompt-lookup decoding's usual 3..1)
NGRAM_WINDOW = 4096  # tokens searched back from the end: bounds the host time per row


def ngram_drafts(ids: list[int], k: int, max_n: int = NGRAM_MAX, window: int = NGRAM_WINDOW) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
    `ids` (max_n tokens down to 1) within the last `window` tokens; [] when none occurs.
    A pure function of the tokens: every decision the scheduler publishes is replayable."""
    if k <= 0 or len(ids) < 2:
        return []
    lo = max(0, len(ids) - window)
    for n in range(min(max_n, len(ids) - 1), 0, -1):
        suffix = ids[-n:]
        # the latest start i < len - n with ids[i:i+n] == suffix (the suffix itself excluded)
        for i in range(len(ids) - n - 1, lo - 1, -1):
            if ids[i : i + n] == suffix:
                return ids[i + n : i + n + k]
    return []


@dataclass
class SpecStats:
    """Cumulative: verify rows, drafts proposed, drafts accepted (accept length per row =
    1 + accepted / rows: the tokens a request gains per step)."""

    rows: int = 0
    drafted: int = 0
    accepted: int = 0
    hist: list[int] = field(default_factory=list)  # rows by accepted drafts (index = accepted)

    def add(self, drafted: int, accepted: int) -> None:
        self.rows += 1
        self.drafted += drafted
        self.accepted += accepted
        if len(self.hist) <= accepted:
            self.hist.extend([0] * (accepted + 1 - len(self.hist)))
        self.hist[accepted] += 1

    @property
    def accept_length(self) -> float:
        return 1 + self.accepted / self.rows if self.rows else 0.0


@dataclass(frozen=True)
class SpecPolicy:
    algorithm: str  # NGRAM | STANDALONE
    num_steps: int  # drafts per row at most
    cache: RadixCache | None = None  # NGRAM also looks up the prefix cache (None: radix cache off)

    def eligible(self, req: Req) -> bool:
        """Requests that speculate: all of them. Each verify row is penalized with the drafts
        before it and masked by its grammar after them; only answered tokens enter a request's
        penalty history and its grammar matcher (engine/run/spec.py, grammar.py)."""
        return True

    def drafts(self, req: Req, room: int) -> list[int]:
        """The draft tokens of req's next row (at most `room`: what max_new_tokens and the
        context leave after the bonus token)."""
        k = min(self.num_steps, room)
        if k <= 0:
            return []
        if self.algorithm == "NGRAM":
            return self.tree_drafts(req, k) or ngram_drafts(req.all_ids, k)
        return [-1] * k  # STANDALONE: proposed on every rank by the draft model

    def tree_drafts(self, req: Req, k: int) -> list[int]:
        """What another cached sequence sharing req's whole token history went on with (the same
        prompt asked again, a conversation's earlier branch): the radix tree's continuation from
        the deepest node req holds (its published pages), matched over its tokens past it."""
        if self.cache is None:
            return []
        node = req.node if req.node is not None else self.cache.root
        return self.cache.continuation(node, req.all_ids[self.cache.depth(node):], k)
