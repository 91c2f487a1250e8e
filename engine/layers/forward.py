"""ForwardBatch: everything one model forward needs, built once per step by the worker.

Tokens are laid out request-major: request 0's new tokens, then request 1's, ... .
Index tensors are built on the CPU from python lists (one non-blocking copy each to the
device: building a step never waits for the device), and the CPU copies ride along so
backends never have to sync to read lengths or page tables.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.layers.kv_pool import PAD_PAGE

ReqSpec = tuple[Sequence[int], int, Sequence[int]]  # (new token ids, start_pos, page table)


@dataclass
class ForwardBatch:
    """One step's batch. T = new tokens, B = requests, S = rows whose logits are wanted.

    input_ids    int64[T]   new tokens of all requests, request-major
    positions    int64[T]   position of each new token in its sequence
    out_slots    int64[T]   KV slot each new token's K/V is written to
    page_table   int32[B, max_pages]  pages covering seq_lens, padded with page 0
    seq_lens     int32[B]   KV length after this step (prefix + new)
    extend_lens  int32[B]   new tokens per request (>= 1)
    logit_indices int64[S]  rows of T whose logits the model returns, in request order
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    extend_lens: torch.Tensor
    logit_indices: torch.Tensor
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    page_size: int
    is_decode: bool
    page_table_cpu: torch.Tensor | None = None  # the CPU twin of page_table (for kernel plans)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens_cpu)

    @property
    def start_pos_cpu(self) -> list[int]:
        """Tokens already in the KV cache before this step, per request."""
        return [s - e for s, e in zip(self.seq_lens_cpu, self.extend_lens_cpu, strict=True)]

    @classmethod
    def build(
        cls,
        input_ids: torch.Tensor | Sequence[int],
        start_pos: Sequence[int],
        extend_lens: Sequence[int],
        page_tables: Sequence[Sequence[int]],
        sample: Sequence[int | bool],
        page_size: int,
        device: torch.device | str,
        every_logit: Sequence[bool] | None = None,
    ) -> ForwardBatch:
        """Build a batch from flat per-step inputs (the worker's form).

        `input_ids` holds sum(extend_lens) tokens (a tensor may already live on `device`,
        e.g. after future references were resolved there). Request i writes positions
        start_pos[i] .. start_pos[i]+extend_lens[i]-1 through page_tables[i], which must
        cover them and must not use page 0 there. `sample[i]` true asks for the logits of
        request i's last new token (false for an intermediate prefill chunk); `every_logit[i]` true
        asks for the logits of all its new tokens (a prompt scored, engine/run/prompt_scores.py).
        Raises ValueError on inconsistent inputs.
        """
        device = torch.device(device)
        starts, lens = [int(s) for s in start_pos], [int(n) for n in extend_lens]
        _check_lengths(starts, lens, page_tables, sample, page_size)
        seq_lens = [s + n for s, n in zip(starts, lens, strict=True)]
        table = _page_table(page_tables, seq_lens, page_size)
        req_idx = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens, dtype=torch.int64))
        positions = torch.cat([torch.arange(s, s + n, dtype=torch.int64) for s, n in zip(starts, lens, strict=True)])
        out_slots = table[req_idx, positions // page_size].to(torch.int64) * page_size + positions % page_size
        ends = torch.tensor(lens, dtype=torch.int64).cumsum(0) - 1
        logit_idx = ends[torch.tensor([bool(x) for x in sample], dtype=torch.bool)]
        if every_logit is not None and any(every_logit):
            logit_idx = torch.cat([torch.arange(e - n + 1, e + 1) if full else e.view(1)[:int(bool(smp))]
                                   for e, n, full, smp in zip(ends, lens, every_logit, sample, strict=True)])
        ids = _ids_tensor(input_ids, sum(lens), device)
        return cls(
            input_ids=ids,
            positions=_to(positions, device),
            out_slots=_to(out_slots, device),
            page_table=_to(table, device),
            seq_lens=_to(torch.tensor(seq_lens, dtype=torch.int32), device),
            extend_lens=_to(torch.tensor(lens, dtype=torch.int32), device),
            logit_indices=_to(logit_idx, device),
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=lens,
            page_size=page_size,
            is_decode=all(n == 1 for n in lens),
            page_table_cpu=table,
        )

    @classmethod
    def from_requests(
        cls,
        reqs: Sequence[ReqSpec],
        page_size: int,
        device: torch.device | str,
        sample_mask: Sequence[bool] | None = None,
    ) -> ForwardBatch:
        """Convenience form: one (new_token_ids, start_pos, pages) tuple per request.

        `sample_mask` defaults to all true (every request wants its last token's logits).
        """
        ids = [int(t) for r in reqs for t in r[0]]
        sample = list(sample_mask) if sample_mask is not None else [True] * len(reqs)
        return cls.build(
            ids, [r[1] for r in reqs], [len(r[0]) for r in reqs], [r[2] for r in reqs], sample, page_size, device
        )


def _check_lengths(
    starts: list[int],
    lens: list[int],
    page_tables: Sequence[Sequence[int]],
    sample: Sequence[int | bool],
    page_size: int,
) -> None:
    if not lens:
        raise ValueError("empty forward batch")
    if not len(starts) == len(lens) == len(page_tables) == len(sample):
        raise ValueError(
            f"per-request lists differ in length: start_pos {len(starts)}, extend_lens {len(lens)}, "
            f"page_tables {len(page_tables)}, sample {len(sample)}"
        )
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    for i, (s, n, pages) in enumerate(zip(starts, lens, page_tables, strict=True)):
        if s < 0 or n < 1:
            raise ValueError(f"request {i}: start_pos {s} must be >= 0 and extend_len {n} >= 1")
        if len(pages) * page_size < s + n:
            raise ValueError(f"request {i}: {len(pages)} pages of {page_size} cannot hold {s + n} tokens")


def gather_pages(page_tables: Sequence[Sequence[int]], counts: Sequence[int]) -> np.ndarray:
    """The first counts[i] pages of each table, flattened (int32, gathered by numpy: ~6k pages of
    a mixed step took 10.8 ms as per-row Python lists); a ValueError naming the request where one
    is the padding page (writing real KV there corrupts other requests)."""
    pages = np.fromiter(itertools.chain.from_iterable(t[:k] for t, k in zip(page_tables, counts, strict=True)),
                        dtype=np.int32, count=sum(counts))
    if (pages == PAD_PAGE).any():
        i = next(i for i, (t, k) in enumerate(zip(page_tables, counts, strict=True)) if PAD_PAGE in t[:k])
        raise ValueError(f"request {i}: page table uses the reserved padding page {PAD_PAGE}")
    return pages


def _page_table(page_tables: Sequence[Sequence[int]], seq_lens: list[int], page_size: int) -> torch.Tensor:
    """int32 [B, max_pages]: the pages covering each seq_len, padded with PAD_PAGE."""
    needed = [-(-n // page_size) for n in seq_lens]
    table = np.full((len(needed), max(needed)), PAD_PAGE, dtype=np.int32)
    table[np.arange(table.shape[1])[None, :] < np.asarray(needed)[:, None]] = gather_pages(page_tables, needed)
    return torch.from_numpy(table)  # (row-major: the gathered pages in request order)


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor -> device without waiting for the device (a no-op on CPU).

    A blocking host-to-device copy synchronises the stream; from pageable memory a
    non-blocking one is staged by the driver before it returns, so the host tensor may be
    dropped right away."""
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


def _ids_tensor(input_ids: torch.Tensor | Sequence[int], total: int, device: torch.device) -> torch.Tensor:
    if isinstance(input_ids, torch.Tensor):
        ids = input_ids.to(dtype=torch.int64)
        ids = ids if ids.device == device else _to(ids, device)
    else:
        ids = _to(torch.tensor(list(input_ids), dtype=torch.int64), device)
    if ids.dim() != 1 or ids.numel() != total:
        raise ValueError(f"input_ids has shape {tuple(ids.shape)}, want [{total}] (sum of extend_lens)")
    return ids
