"""Speculative decoding, the scheduler's part (docs/architecture.md, Speculative decoding):
which requests speculate, their draft tokens (NGRAM: the prefix cache's continuation of the
request's tokens, else a lookup in the request's own tokens;
STANDALONE: -1 placeholders the workers' draft model fills), and the counters of what was
accepted. Verification itself runs on every rank (engine/run/spec.py)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from engine.cache.radix import RadixCache
from engine.sched.request import Req

NGRAM_MAX = 3  # longest suffix looked up (prompt-lookup decoding's usual 3..1)
NGRAM_WINDOW = 4096  # tokens searched back from the end: bounds the host time per row
BRANCH_WINDOW = 1024  # tokens searched back for a tree's alternatives (one lookup per tree node)
CHAIN_STREAK = 4  # verify rows in a row accepting every draft before a row with drafts is chained on


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


def ngram_branches(ids: list[int], k: int, max_n: int = NGRAM_MAX, window: int = BRANCH_WINDOW) -> list[int]:
    """Up to k distinct tokens that followed earlier occurrences of a suffix of `ids`: the
    longest suffix first (max_n tokens down to 1), the latest occurrence first, so the first
    is `ngram_drafts`' next token (within the window). A pure function of the tokens."""
    out: list[int] = []
    if k <= 0 or len(ids) < 2:
        return out
    lo = max(0, len(ids) - window)
    for n in range(min(max_n, len(ids) - 1), 0, -1):
        suffix, last = ids[-n:], ids[-1]
        for i in range(len(ids) - n - 1, lo - 1, -1):
            if ids[i + n - 1] == last and ids[i : i + n] == suffix and ids[i + n] not in out:
                out.append(ids[i + n])
                if len(out) == k:
                    return out
    return out


class NgramIndex:
    """`ngram_drafts` in O(1) a call: for each n-gram (1..max_n tokens) of a request's tokens, the
    latest position it starts at, among the n-grams that end before the last token (the suffix
    itself is never its own match). Appended tokens are indexed on the next call (the tokens
    only grow; a shorter list rebuilds). The scheduler called the scan per request and step:
    with no match in a 640-token history that was ~0.6 ms, 38 ms a step at batch 64 on the H200
    (decode there is 6 ms), so speculation ran at 0.37x of plain."""

    def __init__(self, max_n: int = NGRAM_MAX, window: int = NGRAM_WINDOW) -> None:
        self.max_n, self.window = max_n, window
        self.latest: dict[tuple[int, ...], int] = {}
        self.length = 0  # tokens indexed: the n-grams ending at or before length - 2

    def _index(self, ids: list[int], upto: int, into: dict[tuple[int, ...], int]) -> None:
        """Add the n-grams of `ids` ending at positions self.length - 1 .. upto - 2."""
        for end in range(max(self.length - 1, 0), upto - 1):
            for n in range(1, self.max_n + 1):
                if end - n + 1 >= 0:
                    into[tuple(ids[end - n + 1 : end + 1])] = end - n + 1

    def drafts(self, ids: list[int], k: int, tail: list[int] | None = None) -> list[int]:
        """ngram_drafts(ids + tail, k, max_n, window), with ids indexed for the next call."""
        if len(ids) < self.length:
            self.latest, self.length = {}, 0
        self._index(ids, len(ids), self.latest)
        self.length = max(self.length, len(ids))
        seq = ids + tail if tail else ids
        newer: dict[tuple[int, ...], int] = {}  # the tail's n-grams, beside the index (a guess)
        if tail:
            self._index(seq, len(seq), newer)
        if k <= 0 or len(seq) < 2:
            return []
        lo = max(0, len(seq) - self.window)
        for n in range(min(self.max_n, len(seq) - 1), 0, -1):
            gram = tuple(seq[-n:])
            i = newer.get(gram, self.latest.get(gram))
            if i is not None and i >= lo:
                return seq[i + n : i + n + k]
        return []


@dataclass
class SpecStats:
    """Cumulative: verify rows, drafts proposed, drafts accepted (accept length per row =
    1 + accepted / rows: the tokens a request gains per step)."""

    rows: int = 0
    drafted: int = 0
    accepted: int = 0
    hist: list[int] = field(default_factory=list)  # rows by accepted drafts (index = accepted)
    chained: int = 0  # rows planned before the previous row of their request answered
    void: int = 0  # ... of which the previous row rejected a draft: they answered nothing
    plain: int = 0  # decode rows planned without drafts, in steps the batch-size rules turned off (by_batch)
    capped: int = 0  # verify rows whose drafts the batch-size rules cut below --speculative-num-steps
    # verify rows answered with no draft (the lookup found none): one token a step, outside `rows`
    # and the accept length, so a run whose drafts dried up shows here, not as a long accept length
    empty: int = 0

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
    topk: int = 1  # > 1: NGRAM draft trees, up to topk alternatives a position (engine/sched/spec_tree.py)
    nodes: int = 0  # a tree's drafts at most (--speculative-num-draft-tokens - 1)
    corrupt: float = 0.0  # --speculative-corrupt-drafts: the chance a looked-up draft is made wrong
    vocab_size: int = 0  # (what a wrong token wraps around)
    by_batch: tuple[tuple[int, int], ...] = ()  # --speculative-num-steps-by-batch-size: (rows, steps) ascending

    def cap(self, rows: int) -> int:
        """The most drafts a row gets in a step of `rows` decode rows: --speculative-num-steps (a
        tree's nodes), cut to the steps of the last rule whose rows it exceeds (0: a plain decode
        step; a tree is cut as a whole, its depth and its nodes). Verifying k drafts costs a row
        k + 1 tokens of compute; at small batch that is nearly free (decode reads the weights once
        for every row), at large batch it is not, and a rejected draft wastes it (docs/PERF.md,
        Speculation by batch size)."""
        k = max(self.num_steps, self.nodes)
        for limit, steps in self.by_batch:
            if rows > limit:
                k = min(k, steps)
        return k

    def eligible(self, req: Req) -> bool:
        """Requests that speculate: all of them. Each verify row is penalized with the drafts
        before it and masked by its grammar after them; only answered tokens enter a request's
        penalty history and its grammar matcher (engine/run/spec.py, grammar.py)."""
        return True

    def chains(self, req: Req, pending: list[int]) -> bool:
        """Whether req's next row may be planned before its previous verify row (with drafts
        `pending`) answers, as if that row accepted them all (overlapped speculation). Only with
        no grammar (whose matcher must know what was
        accepted before it can mask the next row); and only where the row will most likely
        count: after a row with no drafts (it cannot reject), or after CHAIN_STREAK rows in a
        row that accepted every draft. A void chained row costs a forward, the wait it hides
        is the scheduler's round trip (a small part of a step): chaining pays only when a
        rejection is rare (docs/architecture.md, Speculative decoding, Overlap). Every draft
        source chains: the scheduler's (NGRAM) and the workers' (a draft model or head drafts a
        chained row from its first token on the device, the bonus of the row in flight)."""
        if req.params.grammar is not None:
            return False
        return not pending or req.full_streak >= CHAIN_STREAK

    def drafts(self, req: Req, room: int, pending: list[int] | None = None) -> list[int]:
        """The draft tokens of req's next row (at most `room`: what max_new_tokens and the
        context leave after the bonus token). `pending`: the drafts of a verify row still in
        flight that this row is chained on: looked up as if they were accepted, the token that
        would follow them (a guess at that row's bonus) skipped."""
        k = min(self.num_steps, room)
        if k <= 0:
            return []
        if self.algorithm != "NGRAM":
            return [-1] * k  # STANDALONE: proposed on every rank by the draft model
        if req.ngram is None:
            req.ngram = NgramIndex()
        ids = req.all_ids  # (a new list of the whole history: made once a row)
        look = _with_prediction(req, ids)
        if pending is None:
            return self._corrupted(req, len(ids), self.tree_drafts(req, ids, k) or req.ngram.drafts(look, k))
        tail = list(pending)
        guess = self.tree_drafts(req, ids, k + 1, tail) or req.ngram.drafts(look, k + 1, tail)
        return self._corrupted(req, len(ids) + len(tail) + 1, guess[1:])

    def _corrupted(self, req: Req, at: int, drafts: list[int]) -> list[int]:
        """`drafts` (the first one at token position `at`), each replaced by the next token id
        with chance `corrupt`: bin/bench spec's oracle draft (the cached answer) with a per-token
        acceptance of 1 - corrupt. A pure function of the request's seed and the position, so a
        draft is the same whenever it is looked up (a chained row's guess and its later row)."""
        if not self.corrupt or not drafts:
            return drafts
        return [(t + 1) % self.vocab_size if _chance(req.rid, req.seed, at + i) < self.corrupt else t
                for i, t in enumerate(drafts)]

    def row(self, req: Req, room: int, pending: list[int] | None = None) -> tuple[list[int], list[int] | None]:
        """req's next row's drafts and, for a tree, their parents (None: a chain). Trees with
        --speculative-eagle-topk > 1, NGRAM only, never for a chained row (`pending`: it stays a
        chain) nor a constrained one (its grammar masks one path)."""
        drafts = self.drafts(req, room, pending)
        if self.topk == 1 or pending is not None or req.params.grammar is not None:
            return drafts, None
        from engine.sched.spec_tree import build_tree, is_chain, leaf_tree  # (it imports this module)

        if self.algorithm != "NGRAM":  # a draft model's or head's chain and its leaves, filled on the workers
            parents = leaf_tree(len(drafts), self.topk, min(self.nodes, room))
            return [-1] * len(parents), None if is_chain(parents) else parents
        toks, parents = build_tree(self.cache, req, drafts, self.topk, min(self.nodes, room),
                                   min(self.num_steps, room))
        return (toks, None) if is_chain(parents) else (toks, parents)

    def tree_drafts(self, req: Req, ids: list[int], k: int, tail: list[int] | None = None) -> list[int]:
        """What another cached sequence sharing req's whole token history (and `tail` after it)
        went on with (the same prompt asked again, a conversation's earlier branch): the radix
        tree's continuation from the deepest node req holds (its published pages), matched over
        its tokens past it (`ids`: req.all_ids)."""
        if self.cache is None:
            return []
        node = req.node if req.node is not None else self.cache.root
        return self.cache.continuation(node, ids[self.cache.depth(node):] + (tail or []), k)


def _with_prediction(req: Req, ids: list[int]) -> list[int]:
    """The tokens NGRAM looks drafts up in: req's history, with its predicted output (OpenAI's
    `prediction`) between the prompt and the output, where the answer is predicted to go: a suffix
    of the output is found in the output first, then in the prediction, then in the prompt (the
    latest occurrence wins), and the list only grows at its end, as NgramIndex needs."""
    pred = req.params.prediction_ids
    if not pred:
        return ids
    n = len(req.prompt_ids)
    return ids[:n] + pred + ids[n:]


def _chance(rid: str, seed: int, position: int) -> float:
    """A uniform [0, 1) draw keyed by (request, seed, position), the same in every process."""
    return zlib.crc32(f"{rid}/{seed}/{position}".encode()) / 2**32
