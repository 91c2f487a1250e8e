"""MLA under context parallelism on the GPU (engine/layers/mla_cp.py): two simulated cp ranks, each
with its own latent pool holding only its pages (round robin, global ids local * 2 + owner), attend
their share (a prefill chunk in the expanded form by FlashAttention with its LSE; a decode row in
the absorbed form, exact float32 over the latents) at DeepSeek-V3's latent shapes (16 heads of
the 128: the per-head arithmetic is V3's) and a 32k context, bf16; their partials merged by LSE
equal cp = 1's mla_attend on the same device (the triton decode kernel, the chunked expanded
prefill). Correctness only: no speed is measured or claimed here."""

from __future__ import annotations

import pytest
import torch

from engine.layers.cp_attention import ContextParallelAttention
from engine.layers.forward import ForwardBatch
from engine.layers.kv_layout import KVLayout
from engine.layers.kv_pool import KVPool
from engine.layers.lse_attention import merge_partials
from engine.layers.mla_attention import MLAPlan, MLAShapes, mla_attend
from engine.layers.mla_cp import mla_partial_cp
from engine.layers.parallel import TPGroup

L, PAGE, CP = 32768, 16, 2
S = MLAShapes(heads=16, kv_lora_rank=512, qk_nope=128, rope=64, v=128, scale=192**-0.5)


def _global(i: int) -> int:
    """The global id of request page i: local id i // CP + 1 (page 0 is padding) in rank i % CP's pool."""
    return (i // CP + 1) * CP + i % CP


@pytest.mark.parametrize("new", [4096, 1])
def test_cp2_mla_partials_merged_equal_mla_attend_at_32k(new: int) -> None:
    dev, dtype = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(new)
    lat = torch.randn(L, S.kv_lora_rank + S.rope, device=dev, generator=g).to(dtype)
    q_nope = (2 * torch.randn(new, S.heads, S.qk_nope, device=dev, generator=g)).to(dtype)
    q_pe = (2 * torch.randn(new, S.heads, S.rope, device=dev, generator=g)).to(dtype)
    w_kv_b = (0.05 * torch.randn(S.heads * (S.qk_nope + S.v), S.kv_lora_rank, device=dev, generator=g)).to(dtype)
    start, layout = L - new, KVLayout.latent(S.kv_lora_rank, S.rope)
    # cp = 1: one pool, pages 1 .. L / PAGE in order
    ref_pool = KVPool.from_layout(layout, 1, L // PAGE + 1, PAGE, dtype, dev)
    ref_pool.store(0, torch.arange(L, device=dev) + PAGE, lat[:, None])
    ref_batch = ForwardBatch.from_requests([([0] * new, start, list(range(1, L // PAGE + 1)))], PAGE, dev)
    want = mla_attend(q_nope, q_pe, MLAPlan.build(ref_batch), ref_pool, 0, w_kv_b, S).float()
    # cp = 2: the cached prefix in its owners' pools, the new latents stored by the ranks
    pools = [KVPool.from_layout(layout, 1, L // PAGE // CP + 2, PAGE, dtype, dev) for _ in range(CP)]
    pos = torch.arange(start, device=dev)
    for r, pool in enumerate(pools):
        mine = pos[(pos // PAGE) % CP == r]
        pool.store(0, (mine // PAGE // CP + 1) * PAGE + mine % PAGE, lat[mine][:, None])
    batch = ForwardBatch.from_requests([([0] * new, start, [_global(i) for i in range(L // PAGE)])], PAGE, dev)
    parts = []
    for r, pool in enumerate(pools):
        be = ContextParallelAttention(TPGroup(r, CP))
        be.prepare(batch)
        parts.append(mla_partial_cp(q_nope, q_pe, lat[start:], be, pool, 0, w_kv_b, S))
    got, _ = merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    assert sum(int(p.page_view(0)[0].flatten(1).ne(0).any(-1).sum()) for p in pools) == L // PAGE
    err = (got - want).norm() / want.norm()
    assert err < 1e-2, f"relative error {err:.2e}"
