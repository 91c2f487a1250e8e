"""Deterministic inference's CPU shortcuts (engine/layers/batch_invariant.py), each against the
plain form it replaces, bit for bit: GEMMs in the larger row blocks that block_sizes proved on
this machine equal 16-row blocks; the torch attention path's one-token decode blocks, its groups
of blocks and its padding to the group's chunks give a token the bits of its prefill; and the
attention is the attention (float64 reference)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from engine.layers import batch_invariant as bi
from engine.layers.cpu_gemm import cpu_pack, packed_linear
from engine.layers.kv_pool import KVPool

PS, HQ, HKV, D = 16, 6, 2, 32
L = 300  # five 64-position chunks, the last partial
POSITIONS = [0, 63, 64, 65, 200, L - 1]


@pytest.fixture(autouse=True)
def _mode_on() -> Iterator[None]:
    was = bi.enabled()
    bi.enable(True, "cpu")
    yield
    bi.enable(was)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [True, False])
def test_gemm_in_proved_blocks_equals_16_row_blocks(dtype: torch.dtype, packed: bool) -> None:
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(192, 160, generator=g) / 13).to(dtype)
    pw = cpu_pack(w) if packed else None
    if packed and pw is None:
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU")

    def f(a: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(a, w) if pw is None else packed_linear(a, pw)

    key = ("test", packed, *w.shape, dtype)
    sizes = bi.block_sizes(f, w.shape[1], dtype)
    assert sizes[-1] == bi.ROWS and list(sizes) == sorted(sizes, reverse=True)
    x = torch.randn(1200, w.shape[1], generator=g).to(dtype)
    for m in (1, 5, 16, 17, 40, 100, 300, 1100):
        assert torch.equal(bi.rows_of(x[:m], f, key), bi.in_blocks(f, bi.ROWS, x[:m])), (m, sizes)
    assert bi._sizes[(*key, torch.get_num_threads())] == sizes


@pytest.fixture(scope="module")
def pool_q() -> tuple[KVPool, torch.Tensor, torch.Tensor]:
    """One request's L positions on shuffled pages, float32, and its queries."""
    g = torch.Generator().manual_seed(5)
    pool = KVPool(1, 40, PS, HKV, D, torch.float32, "cpu")
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=g))
    table = (torch.randperm(39, generator=g)[: -(-L // PS)] + 1).to(torch.int32)[None, :]
    return pool, table, torch.randn(L, HQ, D, generator=g)


def _reference(q: torch.Tensor, pool: KVPool, table: torch.Tensor, pos: int) -> torch.Tensor:
    """Token `pos` over keys 0..pos, float64: [HQ, D]."""
    slots = (table[0].long()[:, None] * PS + torch.arange(PS)).flatten()[: pos + 1]
    k = pool.k[0].view(-1, HKV, D)[slots].double().repeat_interleave(HQ // HKV, 1)
    v = pool.v[0].view(-1, HKV, D)[slots].double().repeat_interleave(HQ // HKV, 1)
    p = (torch.einsum("hd,khd->hk", q[pos].double(), k) / math.sqrt(D)).softmax(-1)
    return torch.einsum("hk,khd->hd", p, v)


def test_decode_blocks_groups_and_padding_give_the_prefill_bits(pool_q) -> None:  # noqa: ANN001
    pool, table, q = pool_q
    full = bi.attend(q, bi.plan(table, [L], [L], PS), pool, 0)  # a fresh prefill, 16-token blocks
    for pos in POSITIONS:
        torch.testing.assert_close(full[pos].double(), _reference(q, pool, table, pos), rtol=1e-5, atol=1e-5)
    chunked = bi.attend(q[130:], bi.plan(table, [L], [L - 130], PS), pool, 0)  # behind a cached prefix
    assert torch.equal(chunked, full[130:])
    tables, lens = table.expand(len(POSITIONS), -1), [p + 1 for p in POSITIONS]
    tokens = bi.decode_tokens(HQ // HKV, D, D, bi.kv_chunk(PS), torch.device("cpu"))
    for t in {tokens, bi.TOKENS}:  # decode rows of mixed lengths in one group (padded to 5 chunks)
        batch = bi.attend(q[POSITIONS], bi.plan(tables, lens, [1] * len(POSITIONS), PS, tokens=t), pool, 0)
        assert torch.equal(batch, full[POSITIONS]), t
    plan = bi.plan(tables, lens, [1] * len(POSITIONS), PS, tokens=tokens, group_chunks=1)  # a block a group
    assert len(plan.groups) == len(POSITIONS)
    assert torch.equal(bi.attend(q[POSITIONS], plan, pool, 0), full[POSITIONS])
    small = bi.plan(table, [L], [L], PS, group_chunks=4)  # prefill blocks in groups of up to 4 pairs
    assert len(small.groups) > 1
    assert torch.equal(bi.attend(q, small, pool, 0), full)


def test_in_order_sum_ignores_trailing_zero_terms() -> None:
    x = torch.randn(4, 7, 5, generator=torch.Generator().manual_seed(2)) * 1e3
    padded = torch.cat([x, torch.zeros(4, 9, 5)], dim=1)
    assert torch.equal(bi._in_order(x, 1), bi._in_order(padded, 1))
    torch.testing.assert_close(bi._in_order(x, 1).double(), x.double().sum(1), rtol=1e-6, atol=1e-3)


def test_a_step_of_decodes_and_prefills_takes_two_plans_with_the_same_bits(pool_q) -> None:  # noqa: ANN001
    """A mixed step on the torch path: the decode rows in blocks of decode_tokens' few tokens, the
    prefill chunk in 16-token blocks, into one output: each row has its fresh-prefill bits."""
    pool, table, q = pool_q
    full = bi.attend(q, bi.plan(table, [L], [L], PS), pool, 0)
    seqs, lens = [201, L, 65], [1, 40, 1]  # a decode, a chunk behind a cached prefix, a decode
    rows = torch.cat([q[200:201], q[L - 40 :], q[64:65]])
    want = torch.cat([full[200:201], full[L - 40 :], full[64:65]])
    tables = table.expand(3, -1)
    tokens = bi.decode_tokens(HQ // HKV, D, D, bi.kv_chunk(PS), torch.device("cpu"))
    prefill = bi.plan(tables, seqs, lens, PS, decodes=False)
    decode = bi.plan(tables, seqs, lens, PS, tokens=tokens, decodes=True)
    assert decode.decode and not prefill.decode and decode.rows.shape == (2, tokens)
    out = bi.attend(rows, decode, pool, 0, bi.attend(rows, prefill, pool, 0))
    assert torch.equal(out, want)
    assert torch.equal(bi.attend(rows, bi.plan(tables, seqs, lens, PS), pool, 0), want)  # one plan of 16-token blocks


def test_block_rows_pads_a_remainder_where_that_costs_less_than_many_small_blocks() -> None:
    """The rows split into the proved sizes only, each row once; a remainder is padded up to the next
    proved size when that costs less (bi.CALL_ROWS a call, plus rows) than the small blocks it fills:
    262 rows past 1024 of a sparse bf16 ladder as one padded 768, not eight 32s and a 16."""
    ladder = (1024, 768, 32, 16)
    for m in (1, 6, 16, 17, 100, 262, 1286, 2048, 8191):
        split = bi.block_rows(ladder, m)
        assert sum(r for _, r in split) == m and all(0 < r <= s and s in ladder for s, r in split)
    assert bi.block_rows(ladder, 1286) == [(1024, 1024), (768, 262)]
    assert bi.block_rows(ladder, 100) == [(32, 32), (32, 32), (32, 32), (16, 4)]  # 768 would cost more
    assert bi.block_rows((2048, 512, 32, 16), 8191)[-1] == (2048, 2047)
    seen: list[int] = []
    x = torch.randn(1286, 8)
    out = bi._in_sizes(lambda a: seen.append(a.shape[0]) or a * 2, ladder, x)  # row-wise: exact
    assert seen == [1024, 768] and torch.equal(out, x * 2)  # the padding's rows cut off
