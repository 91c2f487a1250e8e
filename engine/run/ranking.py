"""Top-k in one total order: value descending, equal values by the lower id.

torch.topk and torch.sort order equal values arbitrarily, and topk differently for each k; bf16
logits tie often. What a request sees (its top_logprobs; under deterministic inference, which
tokens its top_k keeps) must not depend on the k or the mode its batch needed
(docs/architecture.md, "Deterministic inference").
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.layers import triton_ops

# canonical_topk takes this many candidates past k, so that a tie at k rarely reaches the last one
_TIE_MARGIN = 8


def ranked_topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """x.topk(k) (last dim) with equal values ordered by the lower id: a prefix of one total
    order, so a row's top k do not depend on k. torch.topk orders equal values arbitrarily, and
    differently for different k, which made a request's top_logprobs depend on the largest k of
    its batch. Ranks an int64 key: the value's bits made monotonic, then the id reversed (about 6x a
    float topk on a CPU, where `canonical_topk` serves top_k's candidates)."""
    y = x.float()  # (bf16 and fp16 values convert exactly)
    if y.is_cuda and y.dim() == 2 and triton_ops.available():  # one launch for rank_keys' ~10 passes
        keys = triton_ops.rank_keys(y.contiguous())
    else:
        keys = rank_keys(y)
    idx = keys.topk(k, dim=-1).indices
    return x.gather(-1, idx), idx


def rank_keys(y: Tensor) -> Tensor:
    """The int64 keys of ranked_topk in torch ops (triton_ops.rank_keys is their one-launch twin)."""
    # as topk and sort see them: -0.0 equal to +0.0 (adding +0.0 makes it +0.0), every NaN the largest
    y = torch.where(torch.isnan(y), float("nan"), y + 0.0)
    bits = y.contiguous().view(torch.int32)
    order = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    ids = torch.arange(y.shape[-1], device=y.device, dtype=torch.int64)
    return order * (1 << 32) + (0xFFFFFFFF - ids)


def canonical_topk(x: Tensor, k: int, row_k: Tensor) -> tuple[Tensor, Tensor]:
    """[B, k] candidates whose first row_k[b] equal ranked_topk's, at about a float topk's cost.

    A float topk of k + _TIE_MARGIN is put in ranked order (value descending, equal values by id).
    Its first row_k are ranked_topk's unless the row's row_k-th value t ties the last candidate: the
    float topk may have cut that tie at other ids than the lowest. Every value above t is then
    among the candidates, so such a row's tail is refilled with the lowest ids of value t. Reads
    the host (which rows), so it is for the CPU: sampling 16 rows x 49k costs 1.2x a plain topk's
    (the ranked order and the refills; 64 rows 1.15x), against ~5x for ranked_topk."""
    n = min(k + _TIE_MARGIN, x.shape[-1])
    vals, ids = x.topk(n, dim=-1)
    ids, perm = ids.sort(dim=-1)
    vals, perm = vals.gather(1, perm).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, perm)
    if n < x.shape[-1]:  # the topk cut the row
        kth = vals.gather(1, (row_k.clamp(1, k) - 1).unsqueeze(1)).squeeze(1)
        for r in (kth == vals[:, -1]).nonzero().squeeze(1).tolist():
            t = vals[r, -1]
            above = int((vals[r, :k] != t).sum())  # above t (NaN included: sorted first)
            ids[r, above:k] = (x[r] == t).nonzero().squeeze(1)[: k - above]
    return vals[:, :k], ids[:, :k]
