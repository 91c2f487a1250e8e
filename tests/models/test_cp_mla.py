"""MLA (DeepSeek-V3) under context parallelism (engine/layers/mla_cp.py), CPU.

* A tiny random DeepSeek-V3 with MoE layers at cp = 2 (two spawned ranks over gloo, cp_harness's
  scenario: prompts of 83 / 61 / 5 tokens in chunks of 24 next to a decoding one, 6 to 11 pages
  per rank at page 4, none a multiple of cp x page; then a suffix over a cached 40-token prefix
  and a fresh 45-token prompt in chunks of 16) gives cp = 1's greedy tokens and logits (float32,
  1e-4); both ranks' logits are equal bit for bit; each rank's latent pool has 1/2 of cp = 1's
  pages, the pages it never owned stay zero, the owners' pages add up to cp = 1's.
* The pieces alone: two simulated ranks (no collective) each with its own half-size latent pool,
  their partials merged by LSE equal cp = 1's mla_attend, in the expanded and the absorbed form,
  float32 and bf16, with the prefix attended in chunks too.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from cp_harness import run_cp, run_reference
from test_mla import TINY_V3, make_v3_dir

from engine.layers import mla_cp
from engine.layers.cp_attention import ContextParallelAttention, merge_partials, page_owner
from engine.layers.forward import ForwardBatch
from engine.layers.kv_layout import KVLayout
from engine.layers.kv_pool import KVPool
from engine.layers.mla_attention import MLAPlan, MLAShapes, mla_attend
from engine.layers.parallel import TPGroup

POOL = 81  # cp = 1's pages (page 0 padding); a cp = 2 rank gets 1 + 80 / 2


@pytest.fixture(scope="module")
def v3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random DeepSeek-V3: q_lora, YaRN, 3 layers of which 2 MoE (grouped routing, a shared expert)."""
    return make_v3_dir(tmp_path_factory.mktemp("cp-v3"), {**TINY_V3, "num_hidden_layers": 3,
                                                          "first_k_dense_replace": 1})


def test_cp2_tiny_deepseek_v3_equals_cp1(v3_moe_dir: Path) -> None:
    ref = run_reference(v3_moe_dir, POOL)
    (ranks,) = run_cp([v3_moe_dir], 2, 1 + (POOL - 1) // 2)
    for r, res in enumerate(ranks):
        assert res["tokens"] == ref["tokens"], f"rank {r}'s greedy tokens differ from cp = 1's"
        for got, want in zip(res["logits"], ref["logits"], strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        # the merge is the same arithmetic over the same gathered bytes: every rank samples alike
        assert all(torch.equal(a, b) for a, b in zip(res["logits"], ranks[0]["logits"], strict=True))
        assert res["pool_pages"] == 1 + (POOL - 1) // 2 and res["untouched_zero"]
    assert ranks[0]["pages"][3][:10] == ranks[0]["pages"][0][:10], "the second wave reuses the cached prefix"
    used = ranks[0]["used"]  # pages in use per owner; every rank ran every owner's allocator alike
    assert ranks[1]["used"] == used and sum(used) == ref["used"][0]
    assert abs(used[0] - used[1]) <= 5 and max(used) <= (ref["used"][0] + 5) // 2


class _Alloc:
    """Pages per owner (cp ranks), each pool's page 0 reserved, handed out shuffled."""

    def __init__(self, cp: int) -> None:
        self.cp, self.free = cp, [list(range(1, 40)) for _ in range(cp)]
        for r, f in enumerate(self.free):
            random.Random(r).shuffle(f)

    def pages(self, n_tokens: int) -> list[int]:
        owners = [page_owner(i, self.cp) for i in range(-(-n_tokens // 4))]
        return [self.free[o].pop() * self.cp + o for o in owners]  # global ids, local * cp + owner


S = MLAShapes(heads=4, kv_lora_rank=32, qk_nope=16, rope=8, v=16, scale=24**-0.5 * 1.1)


@pytest.mark.parametrize("absorb", [False, True])
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_rank_partials_merged_equal_mla_attend(dtype: torch.dtype, atol: float, absorb: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 1 fresh prefills; step 2 a chunk over a cached 13-token prefix (its last page shared
    with new tokens), a decode, a fresh prefill. The prefix is attended 4 keys at a time (a
    PREFIX_CHUNK of one page). Each rank's merged partials = mla_attend over cp = 1's pool."""
    monkeypatch.setattr(mla_cp, "PREFIX_CHUNK", 4)
    g = torch.Generator().manual_seed(3)
    cp, latent = 2, S.kv_lora_rank + S.rope
    lengths = {"a": 24, "b": 10, "c": 7}
    one, two = _Alloc(1), _Alloc(cp)
    tables = {n: (one.pages(t), two.pages(t)) for n, t in lengths.items()}
    steps = [[("a", 0, 13), ("b", 0, 9)], [("a", 13, 11), ("b", 9, 1), ("c", 0, 7)]]
    layout = KVLayout.latent(S.kv_lora_rank, S.rope)
    ref_pool = KVPool.from_layout(layout, 1, 40, 4, dtype, "cpu")
    pools = [KVPool.from_layout(layout, 1, 40, 4, dtype, "cpu") for _ in range(cp)]
    backends = [ContextParallelAttention(TPGroup(r, cp)) for r in range(cp)]
    w_kv_b = (0.2 * torch.randn(S.heads * (S.qk_nope + S.v), S.kv_lora_rank, generator=g)).to(dtype)
    for step in steps:
        def batch(which: int, step: list = step) -> ForwardBatch:
            return ForwardBatch.from_requests([([5] * n, s, tables[name][which]) for name, s, n in step], 4, "cpu")

        t = sum(n for *_, n in step)
        q_nope = torch.randn(t, S.heads, S.qk_nope, generator=g).to(dtype)
        q_pe = torch.randn(t, S.heads, S.rope, generator=g).to(dtype)
        lat = torch.randn(t, latent, generator=g).to(dtype)
        b1 = batch(0)
        ref_pool.store(0, b1.out_slots, lat[:, None])
        want = mla_attend(q_nope, q_pe, MLAPlan.build(b1, absorb_all=absorb, kernel=False), ref_pool, 0, w_kv_b, S)
        parts = []
        for be, pool in zip(backends, pools, strict=True):
            be.prepare(batch(1))
            parts.append(mla_cp.mla_partial_cp(q_nope, q_pe, lat, be, pool, 0, w_kv_b, S, absorb))
        got, _ = merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
        torch.testing.assert_close(got.to(dtype), want, atol=atol, rtol=0)
    # each rank stored only its own pages' latents: together they hold cp = 1's tokens once
    stored = sum(int(p.page_view(0)[0].flatten(2).ne(0).any(-1).sum()) for p in pools)  # token slots written
    assert stored == sum(lengths.values())
