"""Per-slot (token id, value) rows that the sampler scatters onto a row's logits (logit_bias,
min_new_tokens' stop ids) or keeps of them (allowed_token_ids): small and sparse, so not a
[slots, vocab] table."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor


class SlotRows:
    """ids int64 [slots, W] and values float32 [slots, W], padded with (0, 0.0), which adds an
    exact zero, so a row's result does not depend on W. Allocated on the first `set` that has
    entries, widened to a power of two when a row needs more; a slot set with no entries after
    that is cleared (a reused slot keeps nothing of its last request)."""

    def __init__(self, max_slots: int, vocab_size: int, device: torch.device,
                 upload: Callable[[list, torch.dtype], Tensor]) -> None:
        self.max_slots, self.vocab_size, self.device, self._upload = max_slots, vocab_size, device, upload
        self.ids: Tensor | None = None
        self.vals: Tensor | None = None

    def set(self, slot: int, ids: Sequence[int], vals: Sequence[float], what: str) -> None:
        if any(t >= self.vocab_size for t in ids):
            raise ValueError(f"{what} token ids must be < {self.vocab_size}")
        if not ids and self.ids is None:
            return
        width = 0 if self.ids is None else self.ids.shape[1]
        if len(ids) > width:
            w = max(16, 1 << (len(ids) - 1).bit_length())
            grown = torch.zeros(self.max_slots, w, dtype=torch.int64, device=self.device)
            values = torch.zeros(self.max_slots, w, dtype=torch.float32, device=self.device)
            if self.ids is not None and self.vals is not None:
                grown[:, :width], values[:, :width] = self.ids, self.vals
            self.ids, self.vals, width = grown, values, w
        assert self.ids is not None and self.vals is not None
        pad = width - len(ids)
        self.ids[slot] = self._upload(list(ids) + [0] * pad, torch.int64)
        self.vals[slot] = self._upload(list(vals) + [0.0] * pad, torch.float32)

    def add_to(self, logits: Tensor, slots: Tensor, where: Tensor | None = None) -> Tensor:
        """logits [B, V] plus each row's entries (only rows where `where` [B, 1] holds)."""
        if self.ids is None or self.vals is None:
            return logits
        vals = self.vals[slots]
        return logits.scatter_add(1, self.ids[slots], vals if where is None else torch.where(where, vals, 0.0))

    def keep_only(self, logits: Tensor, slots: Tensor) -> Tensor:
        """logits [B, V] with every token but each row's entries at -inf, for the rows whose slot was
        set with entries (of value 1: the padding's 0 marks no entry); other rows as they are. The
        entries are scattered by max, so a padding id that is also an entry keeps its logit in any order."""
        if self.ids is None or self.vals is None:
            return logits
        ids, real = self.ids[slots], self.vals[slots] > 0
        kept = torch.full_like(logits, float("-inf")).scatter_reduce(
            1, ids, torch.where(real, logits.gather(1, ids), float("-inf")), reduce="amax")
        return torch.where(real[:, :1], kept, logits)
