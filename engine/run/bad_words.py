"""vLLM's bad_words on the worker: per slot, token sequences whose last token is masked (-inf)
wherever the request's output so far ends with the rest of the sequence (a one-token sequence:
always). Device tensors only, so a step needs no host read of the tokens it just sampled
(overlap): each slot keeps its last WINDOW output tokens in a ring that `record` advances."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from msgs.params import MAX_BAD_WORD_TOKENS

WINDOW = MAX_BAD_WORD_TOKENS - 1  # output tokens a sequence's prefix is matched against
ANY = -2  # a prefix cell left of a shorter sequence's prefix: matches every token
NONE = -1  # a history cell before the first output token (matches no prefix cell but ANY)


class BadWords:
    """words int64 [slots, W, WINDOW + 1]: a sequence's prefix right-aligned in its first WINDOW
    cells (ANY to its left), its banned token in the last (NONE: a padding sequence); recent int64
    [slots + 1, WINDOW]: a ring of the slot's last output tokens, output token p in cell p % WINDOW
    (the extra row takes the writes `record` drops); count int64 [slots]: output tokens so far.
    Allocated on the first `set` with sequences, W widened to a power of two when a slot needs more."""

    def __init__(self, max_slots: int, device: torch.device, upload: Callable[[list, torch.dtype], Tensor]) -> None:
        self.max_slots, self.device, self._upload = max_slots, device, upload
        self.words: Tensor | None = None
        self.recent = torch.full((max_slots + 1, WINDOW), NONE, dtype=torch.int64, device=device)
        self.count = torch.zeros(max_slots, dtype=torch.int64, device=device)

    def set(self, slot: int, words: Sequence[Sequence[int]], output_ids: Sequence[int]) -> None:
        """The slot's sequences, and its history: the tokens it generated before (a retraction)."""
        if not words and self.words is None:
            return
        width = 0 if self.words is None else self.words.shape[1]
        if len(words) > width:
            w = max(8, 1 << (len(words) - 1).bit_length())
            grown = torch.full((self.max_slots, w, WINDOW + 1), NONE, dtype=torch.int64, device=self.device)
            if self.words is not None:
                grown[:, :width] = self.words
            self.words, width = grown, w
        assert self.words is not None
        rows = [[ANY] * (WINDOW + 1 - len(s)) + list(s) for s in words] + [[NONE] * (WINDOW + 1)] * (width - len(words))
        self.words[slot] = self._upload(rows, torch.int64).view(width, WINDOW + 1)
        tail = list(output_ids)[-WINDOW:]
        ring = [NONE] * WINDOW
        for i, t in enumerate(tail):  # output token p (of n) in cell p % WINDOW
            ring[(len(output_ids) - len(tail) + i) % WINDOW] = int(t)
        self.recent[slot] = self._upload(ring, torch.int64)
        self.count[slot] = len(output_ids)

    def history(self, slots: Tensor) -> Tensor:
        """[B, WINDOW]: each slot's last WINDOW output tokens, oldest first (NONE before the first)."""
        pos = self.count[slots].unsqueeze(1) - WINDOW + torch.arange(WINDOW, device=self.device)
        tokens = self.recent[slots.unsqueeze(1), pos.remainder(WINDOW)]
        return torch.where(pos >= 0, tokens, NONE)

    def verify_history(self, slots: Tensor, prior: Sequence[Sequence[int]]) -> Tensor:
        """history() of verify rows whose request also holds prior[j] (the drafts before row j)."""
        longest = max((len(p) for p in prior), default=0)
        if longest == 0:
            return self.history(slots)
        drafts = self._upload([list(p) + [NONE] * (longest - len(p)) for p in prior], torch.int64)
        shift = self._upload([len(p) for p in prior], torch.int64)
        both = torch.cat([self.history(slots), drafts.view(len(prior), longest)], dim=1)
        return both.gather(1, shift.unsqueeze(1) + torch.arange(WINDOW, device=self.device))

    def ban(self, logits: Tensor, slots: Tensor, history: Tensor) -> Tensor:
        """logits [B, V] with -inf at each row's sequences whose prefix ends its history."""
        if self.words is None:
            return logits
        words = self.words[slots]
        prefix, last = words[..., :WINDOW], words[..., WINDOW]
        hit = ((prefix == ANY) | (prefix == history.unsqueeze(1))).all(dim=2) & (last >= 0)
        # -inf where hit, else an exact zero: the same logits in any order of the adds
        return logits.scatter_add(1, last.clamp(min=0), torch.where(hit, float("-inf"), 0.0))

    def record(self, slots: Tensor, tokens: Tensor) -> None:
        """Add output tokens (one slot per token, a slot's in order, repeats allowed) to the rings;
        only each slot's last WINDOW of them are written, so no two writes meet in a cell."""
        same = slots.unsqueeze(0) == slots.unsqueeze(1)
        before = torch.tril(same, diagonal=-1).sum(dim=1)  # the slot's tokens earlier in this call
        kept = before >= same.sum(dim=1) - WINDOW
        pos = self.count[slots] + before
        self.recent.index_put_((torch.where(kept, slots, self.max_slots), pos.remainder(WINDOW)), tokens)
        self.count.index_add_(0, slots, torch.ones_like(slots))
