"""MLA (DeepSeek-V3) under context parallelism (engine/layers/mla_cp.py), CPU.

* A tiny random DeepSeek-V3 with MoE layers at cp = 2 (two spawned ranks over gloo, cp_harness's
  scenario: prompts of 83 / 61 / 5 tokens in chunks of 24 next to a decoding one, 6 to 11 pages
  per rank at page 4, none a multiple of cp x page; then a suffix over a cached 40-token prefix
  and a fresh 45-token prompt in chunks of 16) gives cp = 1's greedy tokens and logits (float32,
  1e-4); both ranks' logits are equal bit for bit; each rank's latent pool has 1/2 of cp = 1's
  pages, the pages it never owned stay zero, the owners' pages add up to cp = 1's. tp = 2 x cp = 2
  on 4 ranks gives the same tokens.
* Served (bin/serve --cp-size 2, one start): batched chunked long prompts and a cached-prefix
  suffix give cp = 1's tokens, each rank holding about half the latent pages; the shared host tier
  reloads latent pages from L2 and reads them from L3 after a flush, cp = 1's tokens again.
* Deterministic inference with MLA at cp > 1 is refused naming the flags.
* The pieces alone: two simulated ranks (no collective) each with its own half-size latent pool,
  their partials merged by LSE equal cp = 1's mla_attend, in the expanded and the absorbed form,
  float32 and bf16, with the prefix attended in chunks too.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from cp_harness import run_cp, run_reference
from test_cp import OwnedPages
from test_mla import TINY_V3, make_v3_dir

from engine.layers import mla_cp
from engine.layers.cp_attention import ContextParallelAttention
from engine.layers.forward import ForwardBatch
from engine.layers.kv_layout import KVLayout
from engine.layers.kv_pool import KVPool
from engine.layers.lse_attention import merge_partials
from engine.layers.mla_attention import MLAPlan, MLAShapes, mla_attend
from engine.layers.parallel import TPGroup
from tests.integration.test_cp_serve import ARGS, CP_POOL, MAX_NEW, cp_prompts, flush_after_l3_writes, generate

POOL = 81  # cp = 1's pages (page 0 padding); a cp = 2 rank gets 1 + 80 / 2


@pytest.fixture(scope="module")
def v3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random DeepSeek-V3: q_lora, YaRN, 3 layers of which 2 MoE (grouped routing, a shared expert)."""
    return make_v3_dir(tmp_path_factory.mktemp("cp-v3"), {**TINY_V3, "num_hidden_layers": 3,
                                                          "first_k_dense_replace": 1})


@pytest.fixture(scope="module")
def cp1(v3_moe_dir: Path) -> dict:
    """cp = 1's run of cp_harness's scenario, in this process: the reference."""
    return run_reference(v3_moe_dir, POOL)


def test_cp2_tiny_deepseek_v3_equals_cp1(v3_moe_dir: Path, cp1: dict) -> None:
    ref = cp1
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


def test_tp2_cp2_tiny_deepseek_v3_equals_cp1(v3_moe_dir: Path, cp1: dict) -> None:
    """4 ranks: tp groups {0, 1}, {2, 3} (2 of the 4 heads each, the latent replicated), cp groups
    {0, 2}, {1, 3}: cp = 1's tokens (logits to 1e-3: the tp all-reduces sum in another order)."""
    ref = cp1
    (ranks,) = run_cp([v3_moe_dir], 2, 1 + (POOL - 1) // 2, tp=2)
    for r, res in enumerate(ranks):
        assert res["tokens"] == ref["tokens"], f"rank {r}'s greedy tokens differ from cp = 1's"
        for got, want in zip(res["logits"], ref["logits"], strict=True):
            torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
        assert res["untouched_zero"]


def test_deterministic_mla_under_cp_is_refused_naming_the_flag() -> None:
    """Deterministic inference at cp > 1 is built for GQA on the CPU kernel only: MLA, a GPU or a
    KV dtype the kernel does not take are refused at start."""
    from engine.layers import cpu_attention
    from engine.run.assembly import check_context_parallel

    latent, gqa = KVLayout.latent(32, 8), KVLayout.gqa(2, 16)
    cpu, cuda, f32 = torch.device("cpu"), torch.device("cuda"), torch.float32
    for layout, device, dtype in ((latent, cpu, f32), (gqa, cuda, f32), (gqa, cpu, torch.float8_e4m3fn)):
        with pytest.raises(ValueError, match="--cp-size 2 with --enable-deterministic-inference"):
            check_context_parallel(2, layout, True, device, dtype)
    for args in ((2, latent, False, cuda, f32), (1, latent, True, cpu, f32), (2, gqa, False, cuda, f32)):
        check_context_parallel(*args)  # not deterministic, or cp 1: built
    if cpu_attention.library() is not None:
        check_context_parallel(2, gqa, True, cpu, f32)  # GQA on the CPU kernel: built



S = MLAShapes(heads=4, kv_lora_rank=32, qk_nope=16, rope=8, v=16, scale=24**-0.5 * 1.1)


@pytest.mark.parametrize("absorb", [False, True])
@pytest.mark.parametrize(("dtype", "kv_dtype", "atol"), [(torch.float32, torch.float32, 1e-5),
                                                         (torch.bfloat16, torch.bfloat16, 3e-2),
                                                         (torch.float32, torch.float8_e4m3fn, 1e-5)])
def test_rank_partials_merged_equal_mla_attend(dtype: torch.dtype, kv_dtype: torch.dtype, atol: float, absorb: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 1 fresh prefills; step 2 a chunk over a cached 13-token prefix (its last page shared
    with new tokens), a decode, a fresh prefill. The prefix is attended 4 keys at a time (a
    PREFIX_CHUNK of one page). Each rank's merged partials = mla_attend over cp = 1's pool (an fp8
    pool too: the new latents' self part reads them rounded as cp = 1 reads them back)."""
    monkeypatch.setattr(mla_cp, "PREFIX_CHUNK", 4)
    g = torch.Generator().manual_seed(3)
    cp, latent = 2, S.kv_lora_rank + S.rope
    lengths = {"a": 24, "b": 10, "c": 7}
    one, two = OwnedPages(1), OwnedPages(cp)
    tables = {n: (one.pages(t), two.pages(t)) for n, t in lengths.items()}
    steps = [[("a", 0, 13), ("b", 0, 9)], [("a", 13, 11), ("b", 9, 1), ("c", 0, 7)]]
    layout = KVLayout.latent(S.kv_lora_rank, S.rope)
    ref_pool = KVPool.from_layout(layout, 1, 40, 4, kv_dtype, "cpu")
    pools = [KVPool.from_layout(layout, 1, 40, 4, kv_dtype, "cpu") for _ in range(cp)]
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


# ---- served: bin/serve --cp-size 2 on the tiny V3 (one server start for these tests) ----

LONG, CONVS, SUFFIX = cp_prompts(12, 3, 256)  # the tiny V3's vocabulary


@pytest.fixture(scope="module")
def served(v3_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    """(cp = 2 server with L2 and L3, cp = 1 greedy tokens of every prompt computed in this process)."""
    from engine.config import ServerConfig
    from engine.local import LocalEngine
    from msgs.params import SamplingParams
    from tests.integration.conftest import start_server, stop_server

    eng = LocalEngine(ServerConfig(model=str(v3_moe_dir), device="cpu", dtype="float32", max_total_tokens=4096))
    prompts = [*LONG, *CONVS, SUFFIX]
    res = eng.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    ref = {tuple(p): r.output_ids for p, r in zip(prompts, res, strict=True)}
    srv = start_server(tmp_path_factory.mktemp("cp-v3-logs"), "--model", str(v3_moe_dir), "--cp-size", "2",
                       "--max-total-tokens", str(CP_POOL), *ARGS, "--l3-dir", str(tmp_path_factory.mktemp("l3")))
    yield srv, ref
    if srv.proc.poll() is None:
        assert stop_server(srv) == 0



def test_served_cp2_v3_batched_chunked_cached_prefix(served: tuple) -> None:
    """Three long prompts batched in 64-token chunks (overlap on), then a suffix behind 96 cached
    tokens: cp = 1's tokens; each rank's latent pool holds about half the pages in use."""
    srv, ref = served
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda ids: generate(srv, ids), LONG))
    assert [o for o, _ in outs] == [ref[tuple(p)] for p in LONG]
    got, cached = generate(srv, SUFFIX)
    assert cached == 96 and got == ref[tuple(SUFFIX)]
    m = srv.wait_idle()
    used = [m[f'strata_kv_pages_used_by_cp_rank{{cp_rank="{r}"}}'] for r in (0, 1)]
    assert sum(used) == m["strata_kv_pages_used"] > 0 and abs(used[0] - used[1]) <= 3
    assert m["strata_kv_pages_total"] == 2 * (CP_POOL // 16) and m["strata_kv_leak_free"] == 1


def test_served_cp2_v3_host_tier_l2_reload_and_l3(served: tuple) -> None:
    """Five 150-token conversations push each other out of the 32-page L1; four come back from
    the slab both ranks share (each rank loads its own latent pages), one from L3 after a flush:
    cp = 1's tokens."""
    srv, ref = served
    for c in CONVS:
        assert generate(srv, c)[0] == ref[tuple(c)]
    for c in CONVS[:4]:
        got, cached = generate(srv, c)
        assert got == ref[tuple(c)] and cached >= 144
    m = srv.wait_idle()
    assert m['strata_cache_hit_tokens_total{tier="l2"}'] > 0 and m["strata_l2_load_backs_total"] > 0
    assert m["strata_kv_leak_free"] == 1
    flush_after_l3_writes(srv, 9 * 5)
    got, cached = generate(srv, CONVS[0])  # L1 and L2 empty: from the files
    assert got == ref[tuple(CONVS[0])] and cached == 144
