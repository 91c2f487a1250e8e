"""The triton decode kernel with a GQA group in two programs (triton_ops.decode_parts) on CUDA:
each row the one-program kernel's bits, and both against SDPA over the same pool."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

BF = torch.bfloat16


@pytest.mark.parametrize("ctx", [1080, 8192])
def test_group_in_two_programs_keeps_the_bits(ctx: int) -> None:
    from engine.layers import ops, triton_ops

    dev = torch.device("cuda")
    hq, hkv, d, ps = 32, 4, 128, 16  # Qwen3-30B-A3B's attention
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    splits = triton_ops.decode_splits(1, hkv, sms)
    assert triton_ops.decode_parts(1, hq, hkv, splits, sms) == 2
    g = torch.Generator(device=dev).manual_seed(ctx)
    pages = -(-ctx // ps)
    table = (torch.randperm(pages, generator=g, device=dev) + 1).to(torch.int32)[None]
    kc = torch.randn((pages + 1) * ps, hkv, d, generator=g, device=dev).to(BF)
    vc = torch.randn((pages + 1) * ps, hkv, d, generator=g, device=dev).to(BF)
    qkv = torch.randn(1, (hq + 2 * hkv) * d, generator=g, device=dev).to(BF)
    pos = torch.tensor([ctx - 1], device=dev)
    cache = ops.Rotary(1.0 / (1e4 ** (torch.arange(0, d, 2).float() / d)), d, 16384).cos_sin_cache(dev)
    nw = (torch.rand(d, generator=g, device=dev) + 0.5).to(BF)
    ws = triton_ops.decode_workspace(1, hkv, d, sms, dev)
    outs, pools = {}, {}
    for parts in (1, 2):
        pools[parts] = kc.clone(), vc.clone()
        outs[parts] = triton_ops.decode_attention(qkv, hq, hkv, d, pos, table, *pools[parts], ps, ws, splits, cache,
                                                  nw, nw, 1e-6, parts=parts)
        torch.cuda.synchronize()
        assert not ws[2].any()  # the merge counters are back to zero
    assert torch.equal(outs[2], outs[1])
    kept_k, kept_v = pools[2]
    assert torch.equal(kept_k, pools[1][0]) and torch.equal(kept_v, pools[1][1])  # the new K/V, the same bits
    # SDPA over the pool the kernel wrote (the new token's K/V included)
    q = triton_ops.qk_norm_rope_store(qkv, hq, hkv, d, pos, cache, torch.zeros(1, dtype=torch.int64, device=dev),
                                      torch.empty_like(kc), torch.empty_like(vc), nw, nw, 1e-6)
    t = torch.arange(ctx, device=dev)
    slots = table[0, t // ps].long() * ps + t % ps
    ref = F.scaled_dot_product_attention(q[0].float()[:, None], kept_k[slots].transpose(0, 1).float(),
                                         kept_v[slots].transpose(0, 1).float(), enable_gqa=True)[:, 0]
    torch.testing.assert_close(outs[2][0].float(), ref, atol=0.02, rtol=0.02)
