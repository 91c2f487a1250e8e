"""MLA under context parallelism: the latent pool's pages spread round robin over the cp ranks,
attention merged by log-sum-exp (docs/architecture.md, "MLA under context parallelism").

The same scheme as engine/layers/cp_attention.py's for K/V, with MLA's one latent per token and
the backend (ContextParallelAttention) only planning the step and carrying the collective:

* **Ownership and pages**: `page_owner`, one replicated page table of global ids local * cp +
  owner, each rank's latent pool holding only its own pages (`plan_step`, shared with GQA).
* **Writes**: a new token's latent [c | k_pe] is stored by its page's owner only (`store_rows`).
* **Attention**, per request on rank r: the prefix part (every new row over r's own cached
  pages, unmasked) and the self part (r's zigzag rows over the step's new latents, causal; every
  rank has them, the projections being replicated), each with its LSE, merged on the rank. In
  the form mla_attention.py takes for the row: a decode row (one new token), and every row with
  `absorb_all`, absorbed (MQA of [q_nope W_UK | q_pe] over the latents, the latent its own value,
  the output's first kv_lora_rank columns kept); a prefill row expanded (the latents through
  kv_b_proj to per-head K and V, V zero-padded to K's width for the flash kernels, a long prefix
  PREFIX_CHUNK keys at a time).
* **Merge in the value space**: an absorbed partial goes through W_UV on its rank before the
  collective. The LSE merge is a convex combination of the partials, so it commutes with W_UV
  (merge-then-W_UV = W_UV-then-merge up to rounding), and the value space is smaller: [H, v + 1]
  floats a row (129 at V3 shapes) rather than [H, kv_lora_rank + 1] (513). Both forms then
  meet in one all-gather per layer of [T, H, v + 1] (ContextParallelAttention.merge), merged in
  rank order: every rank gets the same bytes, then o_proj as at cp 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from engine.layers.cp_attention import ContextParallelAttention
from engine.layers.kv_pool import KVPool
from engine.layers.lse_attention import attend_all, causal_tail, flash_available, merge_partials
from engine.layers.mla_attention import PREFIX_CHUNK, MLAShapes, expand_latents


def mla_attend_cp(
    q_nope: torch.Tensor, q_pe: torch.Tensor, lat: torch.Tensor, cp: ContextParallelAttention, kv: KVPool,
    layer: int, w_kv_b: torch.Tensor, s: MLAShapes, absorb_all: bool = False,
) -> torch.Tensor:
    """Store this step's latents lat [T, latent] of this rank's pages, attend this rank's share,
    merge over the cp group: [T, H, v] in q's dtype, the same on every cp rank (cp.prepare(batch)
    first)."""
    return cp.merge(*mla_partial_cp(q_nope, q_pe, lat, cp, kv, layer, w_kv_b, s, absorb_all)).to(q_nope.dtype)


def mla_partial_cp(
    q_nope: torch.Tensor, q_pe: torch.Tensor, lat: torch.Tensor, cp: ContextParallelAttention, kv: KVPool,
    layer: int, w_kv_b: torch.Tensor, s: MLAShapes, absorb_all: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`mla_attend_cp` before the collective: store this rank's latents, return its partial
    (out [T, H, v], lse [T, H]) float32, already through W_UV."""
    plan = cp.plan
    cp.store_rows(layer, kv, lat[:, None])
    w = w_kv_b.view(s.heads, s.qk_nope + s.v, s.kv_lora_rank)
    w_uk, w_uv = w[:, : s.qk_nope], w[:, s.qk_nope :]
    if kv.dtype != lat.dtype:  # the self part reads what the pool gives back at cp 1 (bf16, fp8)
        lat = lat.to(kv.dtype).to(lat.dtype)
    t = q_nope.shape[0]
    o = torch.zeros(t, s.heads, s.v, dtype=torch.float32, device=q_nope.device)
    lse = torch.full((t, s.heads), float("-inf"), dtype=torch.float32, device=q_nope.device)
    for r in plan.reqs:
        rows = slice(r.row, r.row + r.n)
        prefix = None
        if r.prefix_pages is not None and r.prefix_keys > 0:
            (got,) = kv.gather_pages(layer, r.prefix_pages, q_nope.dtype)
            prefix = got[0, : r.prefix_keys, 0]  # [Lp, latent]
        if prefix is None and not r.self_rows:
            continue  # nothing of this request here: (0, -inf) weighs nothing in the merge
        part = _absorbed_part if r.n == 1 or absorb_all else _expanded_part
        o[rows], lse[rows] = part(q_nope[rows], q_pe[rows], prefix, lat[rows], r.self_rows, w_uk, w_uv, s)
    return o, lse


def _parts(q: torch.Tensor, prefix: Iterable[tuple[torch.Tensor, torch.Tensor]],
           new: tuple[torch.Tensor, torch.Tensor], self_rows: list[tuple[int, int]], flash: bool,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, H, D] over the prefix's (K, V) chunks (unmasked; made one at a time, so a long prefix
    is never expanded whole) and, for the rows `self_rows`, the new keys (causal): this rank's
    partial (out [n, H, D], lse [n, H]) float32."""
    n, h, d = q.shape
    o = torch.zeros(n, h, d, dtype=torch.float32, device=q.device)
    lse = torch.full((n, h), float("-inf"), dtype=torch.float32, device=q.device)
    parts = [attend_all(q, k, v, flash, scale) for k, v in prefix]
    if parts:
        o, lse = merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    k, v = new
    for a, b in self_rows:
        o_s, l_s = causal_tail(q[a:b], k[:b], v[:b], flash, scale)
        o[a:b], lse[a:b] = merge_partials(torch.stack([o[a:b], o_s]), torch.stack([lse[a:b], l_s]))
    return o, lse


def _absorbed_part(q_nope: torch.Tensor, q_pe: torch.Tensor, prefix: torch.Tensor | None, new: torch.Tensor,
                   self_rows: list[tuple[int, int]], w_uk: torch.Tensor, w_uv: torch.Tensor,
                   s: MLAShapes) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed: MQA of [q_nope W_UK | q_pe] over the latents (one 'K/V head', the latent its own
    value: the output's first kv_lora_rank columns are o_lat), then W_UV: ([n, H, v], lse)."""
    q = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_pe], dim=-1)  # [n, H, latent]
    # the CPU flash kernel takes the 576-wide latent; CUDA's FlashAttention-2 stops at 256: exact
    flash = q.device.type == "cpu" and flash_available(q.device)
    chunks = ((c[:, None], c[:, None]) for c in _chunks(prefix))
    o, lse = _parts(q, chunks, (new[:, None], new[:, None]), self_rows, flash, s.scale)
    o_v = torch.einsum("thr,hvr->thv", o[..., : s.kv_lora_rank], w_uv.float())  # the merge commutes with W_UV
    return o_v, lse


def _expanded_part(q_nope: torch.Tensor, q_pe: torch.Tensor, prefix: torch.Tensor | None, new: torch.Tensor,
                   self_rows: list[tuple[int, int]], w_uk: torch.Tensor, w_uv: torch.Tensor,
                   s: MLAShapes) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-absorbed: the latents expanded through kv_b_proj to K [qk_nope + rope] and V (zero-padded
    to K's width), PREFIX_CHUNK prefix keys at a time: ([n, H, v], lse)."""
    q = torch.cat([q_nope, q_pe], dim=-1)  # [n, H, qk_nope + rope]
    width = s.qk_nope + s.rope

    def expand(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = expand_latents(x, w_uk, w_uv, s, width)  # [H, L, width]
        return k.transpose(0, 1), v.transpose(0, 1)

    chunks = (expand(c) for c in _chunks(prefix))
    last = max((b for _, b in self_rows), default=0)  # the self part reads keys 0 .. last - 1
    o, lse = _parts(q, chunks, expand(new[:last]), self_rows, flash_available(q.device), s.scale)
    return o[..., : s.v], lse


def _chunks(prefix: torch.Tensor | None) -> Iterator[torch.Tensor]:
    """The prefix's latents PREFIX_CHUNK keys at a time (none without a prefix)."""
    if prefix is not None:
        for a in range(0, prefix.shape[0], PREFIX_CHUNK):
            yield prefix[a : a + PREFIX_CHUNK]
