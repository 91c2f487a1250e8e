"""The masks of a speculative verify row's drafted positions (docs/architecture.md, Speculative
decoding), a part of GrammarSlots (engine/run/grammar.py) kept apart for length.

Logit position j + 1 of a constrained verify row is masked with its matcher's state after drafts
d1..d(j+1); a draft the grammar refuses is masked out one position earlier (so never accepted)
and the positions past it are never reached, nor those past a stop token; the matcher is rolled
back and advances by the answered tokens only (GrammarSlots.sampled). In process (CPU),
`_mask_drafted` does it inside `mask`. With grammar helpers, `drafting` (before the verify
forward) queues a job behind the one accepting the previous step's tokens: the helpers fill
those positions' rows in their shared memory while the forward runs (HDraft,
engine/run/grammar_helper.py); `mask` joins it and masks them with the slots' rows.
"""

from __future__ import annotations

import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from engine.layers import triton_ops
from engine.run.grammar_helper import GrammarHelpers, xgr
from engine.run.pinning import register_host

Live = list[tuple[int, int, Any]]  # (first logits row, slot, matcher) of each live constrained row


class DraftMasks:
    """GrammarSlots' drafted positions (its attributes below are GrammarSlots')."""

    matchers: dict[int, Any]
    vocab_size: int
    timing: Any
    _helpers: GrammarHelpers | None
    _pool: ThreadPoolExecutor | None
    _guard: torch.Tensor | None
    _bitmask: torch.Tensor
    _pairs: torch.Tensor
    _pairs_np: Any

    def _init_drafts(self, max_slots: int) -> None:
        # helpers: the job filling drafted positions (or its rows, without a thread), and its
        # answer, matcher id -> (drafts, positions filled), taken by this step's mask
        self._draft_job: Future[dict[int, tuple[list[int], int]]] | None = None
        self._draft_rows: list[tuple[Any, int, list[int]]] | None = None
        self._filled: dict[int, tuple[list[int], int]] = {}
        self._max_slots = max_slots
        self._drafted_reg: weakref.finalize | None = None  # CUDA: the drafted rows registered, up to
        self._registered = 0  # ... this many positions

    def _join_drafts(self) -> None:
        """After the previous step's accepts (the pool's order): this step's drafted positions."""
        drafting, self._draft_job = self._draft_job, None
        rows, self._draft_rows = self._draft_rows, None
        self._filled = drafting.result() if drafting is not None else self._draft(rows) if rows else {}

    def drafting(self, slots: list[int], drafts: list[list[int]]) -> None:
        """A verify step's sampled slots and their drafts, before its forward. With helpers: start
        the job that has them fill the drafted positions' rows, queued behind the job accepting
        the previous step's tokens, while the forward runs; this step's `mask` joins it. In
        process: nothing (`mask` calls `_mask_drafted`)."""
        if self._helpers is None or not self.matchers:
            return
        rows = [(self.matchers[s], s, d) for s, d in zip(slots, drafts, strict=True) if d and s in self.matchers]
        if not rows:
            return
        if self._pool is None:
            self._draft_rows = rows
        else:
            self._draft_job = self._pool.submit(self._draft, rows)

    def _draft(self, rows: list[tuple[Any, int, list[int]]]) -> dict[int, tuple[list[int], int]]:
        """The helpers fill these rows' drafted positions (matchers not terminated by now: the
        previous step's tokens are accepted); matcher id -> (drafts, positions filled)."""
        assert self._helpers is not None
        live = [(m, s, d) for m, s, d in rows if not m.is_terminated()]
        if not live:
            return {}
        t0 = time.perf_counter()
        filled = self._helpers.draft([(m.id, s, d) for m, s, d in live])
        self.timing.sums["drafts"] += time.perf_counter() - t0
        return {m.id: (d, f) for (m, _, d), f in zip(live, filled, strict=True)}

    def _drafted(self, live: Live, drafts: dict[int, list[int]]) -> dict[int, int]:
        """Per live slot with drafts: how many drafted positions have their rows (1..f) in the
        helpers' drafted region. From this step's job; rows it did not cover (no `drafting`
        call, other drafts) are filled now."""
        assert self._helpers is not None
        got, self._filled = self._filled, {}
        out: dict[int, int] = {}
        missing: list[tuple[int, int, list[int]]] = []
        for _, s, m in live:
            d = drafts.get(s)
            if not d:
                continue
            entry = got.get(m.id)
            if entry is not None and entry[0] == d:
                out[s] = entry[1]
            else:
                missing.append((m.id, s, list(d)))
        if missing:
            out.update(zip([s for _, s, _ in missing], self._helpers.draft(missing), strict=True))
        return {s: f for s, f in out.items() if f}

    def _drafted_pairs(self, live: Live, filled: dict[int, int]) -> tuple[list[int], list[int]]:
        """The logits rows of the filled drafted positions and their rows in the drafted region."""
        dst: list[int] = []
        src: list[int] = []
        for i, s, _ in live:
            for j in range(1, filled.get(s, 0) + 1):
                dst.append(i + j)
                src.append((j - 1) * self._max_slots + s)
        return dst, src

    def _mask_drafted_cuda(self, logits: torch.Tensor, live: list[tuple[int, int, Any]],
                           filled: dict[int, int]) -> None:
        """The drafted positions' masks: one more `mask_by_slot` over the drafted region, its
        pairs after the slots' in the pinned buffer."""
        assert self._helpers is not None
        self._register_drafted(max(filled.values()))
        dst, src = self._drafted_pairs(live, filled)
        base, pairs = len(live), self._pairs_np
        for n, (r, b) in enumerate(zip(dst, src, strict=True), base):
            pairs[2 * n], pairs[2 * n + 1] = r, b
        triton_ops.mask_by_slot(logits, self._drafted_ptr, self._bitmask.shape[1],
                                triton_ops.HostPointer(self._pairs[2 * base:]), len(dst), self.vocab_size)

    def _register_drafted(self, k: int) -> None:
        """Register the drafted region's first k positions with CUDA (once, re-done when a row
        has more drafts). Called after `_join`: the last kernel that read the region belongs to
        a step whose tokens, which come after it, are on the host; so it is not in use."""
        if k <= self._registered:
            return
        assert self._helpers is not None
        if self._drafted_reg is not None:
            self._drafted_reg()
        rows = self._helpers.drafted[: k * self._max_slots]
        self._drafted_reg = register_host(self, rows, self._helpers, "the grammar drafted bitmask")
        self._drafted_ptr = triton_ops.HostPointer(rows)
        self._registered = k

    def _mask_drafted(self, logits: torch.Tensor, live: list[tuple[int, int, Any]],
                      drafts: dict[int, list[int]]) -> None:
        """A verify row's logit position j + 1 is masked with its matcher's state after drafts
        d1..d(j+1), then the matcher is rolled back. A draft the grammar refuses ends it: the
        position before it masks it out, so it is never accepted, and the rows past it are
        never reached; so are the rows past a stop token (the scheduler ends the request there)."""
        bitmask = None
        rows: list[int] = []
        for i, s, m in live:
            n = 0
            for j, tok in enumerate(drafts.get(s, ())):
                if not m.accept_token(int(tok)):
                    break
                n += 1
                if m.is_terminated():
                    break
                if bitmask is None:
                    bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
                m.fill_next_token_bitmask(bitmask, i + 1 + j)
                rows.append(i + 1 + j)
            if n:
                m.rollback(n)
        if bitmask is not None:
            bitmask[rows] &= self._guard
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows, backend="cpu")
