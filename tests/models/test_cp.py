"""Context parallelism at the model level (engine/layers/cp_attention.py), CPU, float32.

* cp = 2 (two spawned ranks over gloo, cp_harness) gives cp = 1's greedy tokens and logits for
  the default model and a random Qwen3: prompts of 83 / 61 / 45 tokens (6 to 11 pages per
  rank, none a multiple of cp x page), prefilled in chunks next to a decoding request, and a
  second wave reusing a cached prefix; both ranks hold the same logits bit for bit, each rank's
  pool is 1/cp of cp = 1's and holds only the pages it owns.
* The pieces alone: round-robin ownership, the zigzag split's balance, the LSE merge of partial
  attentions over disjoint page sets equals full attention, and the backend's per-rank partials
  (two simulated ranks in this process, no collective) merged equal TorchAttention (float32, bf16).
* tp=2 x cp=2 on 4 ranks gives cp=1's tokens; a cp rank that dies mid-step fails its peer's
  all-gather at once (gloo), no hang.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from cp_harness import run_cp, run_reference, spawn_ranks
from model_harness import make_hf_dir, tiny_config

from engine.layers.attention import TorchAttention
from engine.layers.cp_attention import (
    ContextParallelAttention,
    context_parallel,
    local_decode_metadata,
    page_owner,
    zigzag_rows,
)
from engine.layers.forward import ForwardBatch
from engine.layers.kv_pool import KVPool
from engine.layers.lse_attention import causal_tail, merge_partials, partial_attention
from engine.layers.parallel import ParallelState, TPGroup, set_parallel_state

POOL = 81  # cp = 1's pages (page 0 padding); a cp = 2 rank gets 1 + 80 / 2


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen3: 6 q heads over 2 K/V heads (GQA groups of 3), an odd vocabulary."""
    cfg = tiny_config("tiny-qwen3") | {"num_key_value_heads": 2, "num_attention_heads": 6, "vocab_size": 251}
    return make_hf_dir(tmp_path_factory.mktemp("cp-qwen3"), cfg)


@pytest.fixture(scope="module")
def cp2_runs(default_model_dir: Path, qwen3_dir: Path) -> dict[str, tuple]:
    """Both models' scenario at cp = 1 (here) and cp = 2 (one spawned pair of ranks for both)."""
    dirs = {"default": default_model_dir, "qwen3": qwen3_dir}
    cp2 = run_cp(list(dirs.values()), 2, 1 + (POOL - 1) // 2)
    return {name: (run_reference(d, POOL), ranks) for (name, d), ranks in zip(dirs.items(), cp2, strict=True)}


def _check_cp2(ref: dict, ranks: list[dict], atol: float = 1e-4) -> None:
    for r, res in enumerate(ranks):
        assert res["tokens"] == ref["tokens"], f"rank {r}'s greedy tokens differ from cp = 1's"
        for got, want in zip(res["logits"], ref["logits"], strict=True):
            torch.testing.assert_close(got, want, atol=atol, rtol=0)
        # the merge is the same arithmetic over the same gathered bytes: every rank samples alike
        assert all(torch.equal(a, b) for a, b in zip(res["logits"], ranks[0]["logits"], strict=True))
        assert res["pool_pages"] == 1 + (POOL - 1) // 2 and res["untouched_zero"]
    # every page in use exactly once over the ranks; a rank's share is its request pages i % 2 == r
    assert sum(ranks[0]["used"]) == ref["used"][0] == sum(ranks[1]["used"])
    assert ranks[0]["used"] == ranks[1]["used"]  # every rank ran every owner's allocator alike
    assert ranks[0]["pages"][3][:10] == ranks[0]["pages"][0][:10], "the second wave reuses the cached prefix"
    per_rank = ranks[0]["used"]
    assert abs(per_rank[0] - per_rank[1]) <= 5 and max(per_rank) <= (ref["used"][0] + 5) // 2


def test_cp2_default_model(cp2_runs: dict[str, tuple]) -> None:
    _check_cp2(*cp2_runs["default"])


def test_cp2_random_qwen3(cp2_runs: dict[str, tuple]) -> None:
    _check_cp2(*cp2_runs["qwen3"])


def test_tp2_cp2_random_qwen3(cp2_runs: dict[str, tuple], qwen3_dir: Path) -> None:
    """4 ranks: tp groups {0, 1}, {2, 3} (one K/V head each), cp groups {0, 2}, {1, 3}: cp = 1's
    tokens (logits to 1e-3: the tp all-reduces sum in another order), per cp rank the same pages."""
    ref, _ = cp2_runs["qwen3"]
    (ranks,) = run_cp([qwen3_dir], 2, 1 + (POOL - 1) // 2, tp=2)
    _check_cp2(ref, [ranks[0], ranks[2]], atol=1e-3)
    _check_cp2(ref, [ranks[1], ranks[3]], atol=1e-3)


def test_page_owner_is_round_robin() -> None:
    assert [page_owner(i, 2) for i in range(5)] == [0, 1, 0, 1, 0]
    assert [page_owner(i, 3) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert {page_owner(i, 1) for i in range(9)} == {0}
    with pytest.raises(ValueError, match="cp world 0"):
        page_owner(1, 0)


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("n", [1, 7, 1001, 4096])
def test_zigzag_rows_cover_once_and_balance_causal_work(cp: int, n: int) -> None:
    shares = [zigzag_rows(n, cp, r) for r in range(cp)]
    rows = sorted(i for s in shares for a, b in s for i in range(a, b))
    assert rows == list(range(n))
    work = [sum(i + 1 for a, b in s for i in range(a, b)) for s in shares]  # causal keys per row
    if n >= 1000:  # within 1% of even; a contiguous split would give (2 cp - 1) : 1
        assert max(work) / min(work) < 1.01
    assert shares[0][0][0] == 0  # a single new token (a decode) is rank 0's


def _full_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [Lq, Hq, D] at positions start.. over k, v [start + Lq, Hkv, D], causal: the reference."""
    lq, lk = q.shape[0], k.shape[0]
    mask = torch.arange(lk)[None, :] <= torch.arange(start, start + lq)[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                       enable_gqa=True)
    return o.transpose(0, 1)


@pytest.mark.parametrize("cp", [2, 3])
def test_lse_merge_of_disjoint_pages_equals_full_attention(cp: int) -> None:
    g = torch.Generator().manual_seed(0)
    page, start, lq, hq, hkv, d = 4, 37, 19, 6, 2, 16
    q = torch.randn(lq, hq, d, generator=g)
    k, v = torch.randn(start + lq, hkv, d, generator=g), torch.randn(start + lq, hkv, d, generator=g)
    pos = torch.arange(start + lq)
    q_pos = torch.arange(start, start + lq)
    parts = []
    for r in range(cp):  # each rank: its own pages' keys, causal by position
        mine = torch.tensor([page_owner(int(p) // page, cp) == r for p in pos])
        mask = pos[mine][None, :] <= q_pos[:, None]
        parts.append(partial_attention(q, k[mine], v[mine], mask))
    o, lse = merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    torch.testing.assert_close(o, _full_causal(q, k, v, start), atol=1e-5, rtol=0)
    full_scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(hq // hkv, 1)) * d**-0.5
    full_scores = full_scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(full_scores, -1).T, atol=1e-5, rtol=0)
    # a part with no key for some rows (lse -inf) weighs nothing and makes no NaN
    empty = partial_attention(q, k[:0], v[:0])
    assert torch.equal(empty[0], torch.zeros_like(q)) and bool(torch.isinf(empty[1]).all())
    o2, _ = merge_partials(torch.stack([o, empty[0]]), torch.stack([lse, empty[1]]))
    torch.testing.assert_close(o2, o, atol=1e-6, rtol=0)


@pytest.mark.parametrize("before", [0, 5])
def test_flash_causal_tail_equals_the_exact_path(before: int) -> None:
    """The rows are the last 7 of 7 + `before` keys: flash (unmasked head + causal square, merged)
    gives the masked exact path's output and LSE."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(7, 6, 8, generator=g)
    k, v = torch.randn(7 + before, 2, 8, generator=g), torch.randn(7 + before, 2, 8, generator=g)
    (o1, l1), (o2, l2) = causal_tail(q, k, v, True), causal_tail(q, k, v, False)
    torch.testing.assert_close(o1, o2, atol=1e-5, rtol=0)
    torch.testing.assert_close(l1, l2, atol=1e-5, rtol=0)
    torch.testing.assert_close(o2, _full_causal(q, k, v, before), atol=1e-5, rtol=0)


class OwnedPages:
    """Pages per owner (cp ranks), each pool's page 0 reserved, handed out shuffled (shared with test_cp_mla)."""

    def __init__(self, cp: int) -> None:
        self.cp, self.free = cp, [list(range(1, 40)) for _ in range(cp)]
        for r, f in enumerate(self.free):
            random.Random(r).shuffle(f)

    def pages(self, n_tokens: int) -> list[int]:
        owners = [page_owner(i, self.cp) for i in range(-(-n_tokens // 4))]
        return [self.free[o].pop() * self.cp + o for o in owners]  # global ids, local * cp + owner


@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_backend_partials_merged_equal_torch_attention(dtype: torch.dtype, atol: float, flash: bool) -> None:
    """Two simulated ranks, each with its own pool of 1/2 the pages: step 1 fresh prefills, step 2
    a chunk over a cached prefix (13 tokens: the last cached page shared with new tokens), two decodes
    (one with keys on both ranks, one whose 3 keys are all rank 0's), a fresh prefill. Each rank's
    partials merged = TorchAttention over cp = 1's pool. With flash, the one-token rows go through
    the CPU kernel's batched decode (`_Decode`), its LSE merged as the flash parts' are."""
    g = torch.Generator().manual_seed(1)
    hq, hkv, d, cp = 4, 2, 8, 2
    lengths = {"a": 24, "b": 10, "c": 7, "d": 3}
    one, two = OwnedPages(1), OwnedPages(cp)
    tables = {n: (one.pages(t), two.pages(t)) for n, t in lengths.items()}
    steps = [[("a", 0, 13), ("b", 0, 9), ("d", 0, 2)], [("a", 13, 11), ("b", 9, 1), ("c", 0, 7), ("d", 2, 1)]]
    ref_pool = KVPool(1, 40, 4, hkv, d, dtype, "cpu")
    pools = [KVPool(1, 40, 4, hkv, d, dtype, "cpu") for _ in range(cp)]
    backends = [ContextParallelAttention(TPGroup(r, cp)) for r in range(cp)]
    for be in backends:  # the CPU flash kernel with its LSE, or the exact float32 path
        be.flash = flash
    ref = TorchAttention("cpu")
    for step in steps:
        def batch(which: int, step: list = step) -> ForwardBatch:
            return ForwardBatch.from_requests([([5] * n, s, tables[name][which]) for name, s, n in step], 4, "cpu")

        t = sum(n for *_, n in step)
        q, k, v = (torch.randn(t, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
        b1 = batch(0)
        ref.prepare(b1)
        want = ref.forward(q, k, v, 0, b1, ref_pool)
        parts = []
        for be, pool in zip(backends, pools, strict=True):
            be.prepare(batch(1))
            dec = be.plan.decode
            if step is steps[1]:  # the decode rows (b: 6 keys on rank 0, 4 on rank 1; d: 3 on rank 0 only)
                assert dec is not None and dec.reqs == ([1, 3] if be.cp.rank == 0 else [1])
                assert dec.lens == ([6, 3] if be.cp.rank == 0 else [4])
            be.store_rows(0, pool, k, v)
            parts.append(be.partial(q, k, v, 0, pool))
        got, _ = merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
        torch.testing.assert_close(got.to(dtype), want, atol=atol, rtol=0)  # bf16: the output's rounding
    # each rank stored only its own pages: together they hold cp = 1's tokens once
    assert sum(int(p.k_all.abs().sum(-1).sum(-1).ne(0).sum()) for p in pools) == sum(lengths.values())


@pytest.mark.parametrize("world", [2, 3])
def test_graph_decode_metadata_lists_each_ranks_own_pages(world: int) -> None:
    """The CUDA graphs' per-rank decode metadata (`local_decode_metadata`, from the Step's lists)
    names, for each request with keys on the rank, the pages and key counts of the eager plan's
    batched decode (`_Decode`); a request with no page there and the padding rows read one key of
    the padding page; the pages are the rank's own, at local ids."""
    ps, starts, rows = 4, [0, 3, 4, 9, 30], 8
    alloc = OwnedPages(world)
    tables = [alloc.pages(s + 1) for s in starts]
    batch = ForwardBatch.from_requests([([5], s, t) for s, t in zip(starts, tables, strict=True)], ps, "cpu")
    for rank in range(world):
        indptr, indices, last = local_decode_metadata(starts, tables, ps, rank, world, rows)
        assert indptr.shape == (rows + 1,) and last.shape == (rows,) and len(indices) == indptr[-1]
        dec = ContextParallelAttention(TPGroup(rank, world))
        dec.prepare(batch)
        plan = dec.plan.decode
        want_ptr, want_idx, want_last = plan.paged_metadata(ps) if plan is not None else (None, None, None)
        for i in range(rows):
            got = (indices[indptr[i] : indptr[i + 1]].tolist(), int(last[i]))
            if plan is not None and i in plan.reqs:
                j = plan.reqs.index(i)
                assert got == (want_idx[want_ptr[j] : want_ptr[j + 1]].tolist(), int(want_last[j]))
                assert [x * world + rank for x in got[0]] == tables[i][rank::world]  # its own, at local ids
            else:  # no key on this rank (a request of one page, on rank > 0), or padding
                assert got == ([0], 1) and (i >= len(starts) or starts[i] // ps < rank)


def test_cp_graphs_need_cuda_flashinfer_and_not_the_invariant_mode() -> None:
    """On the CPU the cp backend offers no CUDA graphs (its decode steps run eagerly)."""
    be = ContextParallelAttention(TPGroup(0, 2))
    be.bind(num_q_heads=4, kv_pool=KVPool(1, 8, 4, 2, 8, torch.bfloat16, "cpu"), max_batch=4, max_pages_per_req=4)
    assert not be.supports_cuda_graph


def test_cp1_keeps_the_plain_backend() -> None:
    plain = TorchAttention("cpu")
    assert context_parallel(plain) is plain  # cp world 1: the same object, no wrapper in the path
    with pytest.raises(ValueError, match="world >= 2"):
        ContextParallelAttention(TPGroup(0, 1))
    try:
        set_parallel_state(ParallelState(cp=TPGroup(1, 2)))
        be = context_parallel(plain)
        assert isinstance(be, ContextParallelAttention) and (be.cp.rank, be.cp.world) == (1, 2)
        assert be.owns_kv_writes and not plain.owns_kv_writes  # the model never stores K/V itself then
        with pytest.raises(RuntimeError, match="forward"):
            be.attend(torch.zeros(1, 2, 4), 0, None, None)  # type: ignore[arg-type]
    finally:
        set_parallel_state(ParallelState())


def test_dead_cp_rank_fails_the_peer_fast(qwen3_dir: Path) -> None:
    """Rank 1 exits in the middle of a step (its 10th merge): rank 0's all-gather fails at once
    (gloo: the connection is closed) and it reports the error instead of hanging."""
    t0 = time.monotonic()
    reports = spawn_ranks([qwen3_dir], 2, 1 + (POOL - 1) // 2, die_at=10, timeout_s=60)
    assert reports[1] == ("died", 3)
    kind, msg = reports[0]
    assert kind == "error" and "all_gather" in msg and "gloo" in msg.lower(), msg
    assert time.monotonic() - t0 < 90  # not the collective's timeout (a loaded 2-core machine starts 2 ranks slowly)
