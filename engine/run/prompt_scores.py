"""Prompt logprobs (SamplingParams.prompt_logprobs): the logprob of every prompt token after the
first under the model, from the logits of all of a prefill row's tokens (Forward.prompt).

The batch asks for every logit of a scored row (ForwardBatch.build's `every_logit`), so the
model returns, in request order, all of a scored row's tokens and only the last token of a
sampled one; `split` says which of those rows are sampled and which score what."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.run.ranking import ranked_topk


@dataclass
class PromptScores:
    """logprobs float32 [N] (the scored tokens, row after row); top_ids int64 / top_logprobs
    float32 [N, k] when k > 0."""

    logprobs: Tensor
    top_ids: Tensor | None = None
    top_logprobs: Tensor | None = None


@dataclass(frozen=True)
class LogitRows:
    """Where a batch's logits rows go: `sampled` the row of each sampled request; `scored`
    (first row, rows scored) of each scored request; `targets` the scored tokens' next ids."""

    sampled: list[int]
    scored: list[tuple[int, int]]
    targets: list[int]


def split(ids: list[int], lens: list[int], sample: list[int], scored_rows: list[int],
          next_ids: list[int], widths: list[int] | None = None) -> LogitRows:
    """The logits rows of a batch whose requests `scored_rows` return every token's logits;
    `widths` (a verify step's, engine/run/spec.py): the logit rows of each row that samples and
    does not score (its drafts + 1; one without), all of them `sampled`, in order."""
    nxt = dict(zip(scored_rows, next_ids, strict=True))
    sampled, scored, targets = [], [], []
    row = tok = 0
    for i, (n, smp) in enumerate(zip(lens, sample, strict=True)):
        if i in nxt:
            chunk = ids[tok : tok + n]
            follow = [nxt[i]] if nxt[i] >= 0 else []
            scored.append((row, n - (not follow)))
            targets.extend(chunk[1:] + follow)
            row += n
            if smp:
                sampled.append(row - 1)
        elif smp:
            w = widths[i] if widths is not None else 1
            sampled.extend(range(row, row + w))
            row += w
        tok += n
    return LogitRows(sampled, scored, targets)


def token_rows(lens: list[int], sample: list[int], scored_rows: list[int], widths: list[int]) -> list[int]:
    """The token rows whose logits a verify forward takes when rows score their prompt, in `split`'s
    layout: every token of a scored row, the last widths[i] tokens of another row that samples."""
    scored, out, end = set(scored_rows), [], 0
    for i, (n, smp) in enumerate(zip(lens, sample, strict=True)):
        end += n
        if i in scored:
            out.extend(range(end - n, end))
        elif smp:
            out.extend(range(end - widths[i], end))
    return out


def score(logits: Tensor, rows: LogitRows, top_k: int) -> PromptScores:
    """The scored tokens' logprobs (log_softmax in float32 of the raw logits) and top_k."""
    picked = [torch.arange(a, a + n) for a, n in rows.scored]
    idx = torch.cat(picked).to(logits.device) if picked else torch.zeros(0, dtype=torch.int64, device=logits.device)
    logp = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1)
    targets = torch.tensor(rows.targets, dtype=torch.int64).to(logits.device)
    chosen = logp.gather(1, targets.unsqueeze(1)).squeeze(1)
    if top_k <= 0:
        return PromptScores(chosen)
    top_lp, top_ids = ranked_topk(logp, top_k)  # equal logprobs by id, whatever the step's largest k
    return PromptScores(chosen, top_ids, top_lp)
