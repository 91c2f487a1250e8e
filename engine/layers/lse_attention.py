"""Attention partials with their log-sum-exp, and their merge: the arithmetic of context
parallelism (engine/layers/cp_attention.py, engine/layers/mla_cp.py) and of MLA's prefill over a
cached prefix (engine/layers/mla_attention.py), docs/architecture.md "Context parallelism".

* `partial_attention`: the exact float32 path (the tests' reference), any mask.
* `sdpa_lse` / `attend_all` / `causal_tail`: a flash kernel that returns the LSE (O(L) memory): on
  CPU torch's, in float32; on CUDA FlashAttention-2 (bf16/fp16) or the memory-efficient kernel
  (float32).
* `merge_partials`: partials over disjoint key sets merged by LSE, in index order (deterministic):
  exactly the attention over the union.
"""

from __future__ import annotations

import torch

from engine.layers.attention import _CPU_FLASH_LSE


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None = None,
                      scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [Lq, Hq, D] over k, v [Lk, Hkv, D] (GQA: Hq a multiple of Hkv), mask
    [Lq, Lk] bool (True: attend) or None, in float32: (out [Lq, Hq, D], lse [Lq, Hq]). A row with
    no key gets out 0 and lse -inf, which the merge weighs by 0. `scale`: of the scores (None:
    D^-0.5; MLA's differs)."""
    lq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    # a GQA group's query heads become rows of their K/V head: [Hkv, g * Lq, D], K read once
    qf = q.float().view(lq, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * lq, d)
    kf, vf = k.float().transpose(0, 1), v.float().transpose(0, 1)
    s = torch.matmul(qf, kf.transpose(1, 2)) * (d**-0.5 if scale is None else scale)
    if mask is not None:
        s = s.masked_fill(~mask.repeat(g, 1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    shift = torch.where(torch.isinf(lse), 0.0, lse)  # a row with no key: exp(-inf) = 0, not NaN
    o = torch.matmul(torch.exp(s - shift[..., None]), vf)  # already normalized by the LSE
    o = o.view(hkv, g, lq, d).permute(2, 0, 1, 3).reshape(lq, hq, d)
    return o, lse.view(hkv, g, lq).permute(2, 0, 1).reshape(lq, hq)


def flash_available(device: torch.device) -> bool:
    """A kernel that returns the LSE exists here: CUDA's flash / memory-efficient SDPA, or the CPU
    flash kernel (not in every torch build)."""
    return device.type == "cuda" or (device.type == "cpu" and _CPU_FLASH_LSE is not None)


def sdpa_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
             scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, H, Lq, D] over [1, H, Lk, D] (causal: Lq == Lk) -> (out [1, H, Lq, D], lse [1, H, Lq]),
    both float32, O(L) memory. CPU: torch's flash kernel in float32. CUDA: FlashAttention-2 in
    bf16/fp16 (its softmax LSE), the memory-efficient kernel for float32 (its LSE is padded to a
    multiple of 32 rows: cut). `scale`: of the scores (None: D^-0.5)."""
    if q.device.type == "cpu":
        return _CPU_FLASH_LSE(q.float(), k.float(), v.float(), is_causal=causal, scale=scale)[:2]
    if q.dtype in (torch.float16, torch.bfloat16):
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)
    else:
        out = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return out[0].float(), out[1][..., : q.shape[2]].float()


def _flash_all(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """partial_attention without a mask by a flash kernel (`sdpa_lse`: O(L) memory, the LSE
    returned): a GQA group's query heads as rows of their K/V head, K/V read once."""
    lq, hq, d = q.shape
    hkv = k.shape[1]
    qh = q.transpose(0, 1).reshape(hkv, hq // hkv * lq, d)
    o, lse = sdpa_lse(qh[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=scale)
    return o[0].reshape(hq, lq, d).transpose(0, 1), lse[0].reshape(hq, lq).T


def _flash_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row i of q [L, Hq, D] over keys 0..i of k, v [L, Hkv, D] by a flash kernel (`sdpa_lse`);
    the causal mask differs per row, so K/V are repeated per query head here."""
    g = q.shape[1] // k.shape[1]
    kr, vr = (x.transpose(0, 1).repeat_interleave(g, 0) for x in (k, v))
    o, lse = sdpa_lse(q.transpose(0, 1)[None], kr[None], vr[None], causal=True, scale=scale)
    return o[0].transpose(0, 1), lse[0].T


def attend_all(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flash: bool,
               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """partial_attention without a mask: by a flash kernel (`_flash_all`) or the exact path."""
    return _flash_all(q, k, v, scale) if flash else partial_attention(q, k, v, scale=scale)


def causal_tail(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flash: bool,
                scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Lq, Hq, D] being the last Lq of the L keys k, v [L, Hkv, D], causal: row i attends keys
    0..L-Lq+i. By flash: the keys before the rows unmasked, the square causal, merged by LSE."""
    a = k.shape[0] - q.shape[0]
    if not flash:
        pos = torch.arange(k.shape[0], device=q.device)
        return partial_attention(q, k, v, pos[None, :] <= pos[a:, None], scale)
    o, lse = _flash_causal(q, k[a:], v[a:], scale)
    if a == 0:
        return o, lse
    o0, l0 = _flash_all(q, k[:a], v[:a], scale)
    return merge_partials(torch.stack([o0, o]), torch.stack([l0, lse]))


def merge_partials(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge k partial attentions of the same queries over disjoint key sets: o [k, ..., D], lse
    [k, ...] -> (o [..., D], lse [...]), exactly the attention over the union of the key sets.
    Summed in index order (deterministic); rows empty everywhere stay (0, -inf)."""
    m = lse.max(0).values
    m = torch.where(torch.isinf(m), 0.0, m)
    w = torch.exp(lse - m)  # -inf -> 0
    den = w.sum(0)
    out = (w[..., None] * o).sum(0) / den.clamp_min(torch.finfo(den.dtype).tiny)[..., None]
    return out, m + torch.log(den)
