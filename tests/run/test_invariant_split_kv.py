"""Split-KV of deterministic inference's CUDA attention kernel (engine/layers/triton_kernels.py:
invariant_attention_kernel serial, invariant_split_kernel + invariant_merge_kernel split), run by
triton's interpreter on the CPU: a token's output has the same bits decoded alone (split),
decoded in a batch, through the CUDA-graph protocol and inside a prefill block or a chunked
prefill (serial), for contexts across several partitions (KV_PART positions) and their boundaries; and
it equals the one-partition kernel (the pre-split arithmetic) and a float64 reference closely.
The compiled kernels: tests/gpu/test_invariant_attention_gpu.py."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels module is first imported
pytest.importorskip("triton")

from engine.layers import batch_invariant as bi  # noqa: E402
from engine.layers import triton_ops  # noqa: E402
from engine.layers.attention import TorchAttention  # noqa: E402
from engine.layers.kv_pool import KVPool  # noqa: E402
from tests.engine.test_deterministic_graph_blocks import staged  # noqa: E402

PS, HQ, HKV, D = 16, 4, 2, 32
P = bi.kv_part(PS)  # positions a partition (128: five in L)
L = 600
PARTS = -(-L // P)
POSITIONS = [0, P - 1, P, P + 1, 2 * P - 1, 2 * P, L - 1]  # decoded tokens: partition edges, the last


@pytest.fixture(scope="module")
def setup() -> Iterator[tuple[KVPool, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A pool holding one request's L positions on shuffled pages, its queries, and its full
    prefill through the serial kernel (38 blocks of 16 tokens)."""
    g = torch.Generator().manual_seed(11)
    pool = KVPool(1, 48, PS, HKV, D, torch.float32, "cpu")
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=g))
    table = (torch.randperm(47, generator=g)[: -(-L // PS)] + 1).to(torch.int32)[None, :]
    q = torch.randn(L, HQ, D, generator=g)
    was = bi.enabled()
    bi.enable(True, "cpu")  # module-wide: the per-test reset in conftest.py sees it as the starting state
    p = bi.plan(table, [L], [L], PS, kernel=True)
    assert not p.decode and p.parts == PARTS
    yield pool, table, q, bi.attend(q, p, pool, 0)
    bi.enable(was)  # not left on for the modules after this one


def _decode_plan(table: torch.Tensor, positions: list[int]) -> bi.Plan:
    return bi.plan(table.expand(len(positions), -1), [p + 1 for p in positions], [1] * len(positions), PS, kernel=True)


def test_chunked_prefill_and_split_decode_give_the_prefill_bits(setup) -> None:  # noqa: ANN001
    pool, table, q, full = setup
    chunked = bi.attend(q[300:], bi.plan(table, [L], [L - 300], PS, kernel=True), pool, 0)  # other block slots
    assert torch.equal(chunked, full[300:])
    for p in POSITIONS:  # alone: split wherever the token's KV spans more than one partition
        plan = _decode_plan(table, [p])
        assert plan.decode and plan.parts == p // P + 1
        assert bi.splits(1, HKV, plan.parts) == plan.parts
        assert torch.equal(bi.attend(q[p : p + 1], plan, pool, 0)[0], full[p]), p
    batch = _decode_plan(table, POSITIONS)  # batched: one split launch for all
    assert torch.equal(bi.attend(q[POSITIONS], batch, pool, 0), full[POSITIONS])


@pytest.mark.parametrize("tokens", [1, 8])
def test_smaller_blocks_take_the_same_path(setup, tokens: int) -> None:  # noqa: ANN001
    """Plans of smaller blocks (the kernel's kernel_tokens, bit-checked on the H200:
    tests/gpu/test_invariant_attention_gpu.py) run, decode split and serial and prefill, close to
    the 16-token prefill (not its bits here: the interpreter's float32 dots are numpy matmuls,
    which sum by the matrix's shape); the torch path refuses any size but TOKENS (and 1 in a step of
    decodes: batch_invariant.decode_tokens)."""
    pool, table, q, full = setup
    plan = bi.plan(table.expand(len(POSITIONS), -1), [p + 1 for p in POSITIONS], [1] * len(POSITIONS), PS,
                   kernel=True, tokens=tokens)
    assert plan.blocks[1].shape == (len(POSITIONS), tokens) and plan.decode
    torch.testing.assert_close(bi.attend(q[POSITIONS], plan, pool, 0), full[POSITIONS], rtol=1e-5, atol=1e-6)
    prefill = bi.plan(table, [L], [40], PS, kernel=True, tokens=tokens)  # a chunk behind its prefix
    assert prefill.blocks[1].shape[1] == tokens and not prefill.decode
    torch.testing.assert_close(bi.attend(q[L - 40 :], prefill, pool, 0), full[L - 40 :], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="blocks of 16 tokens"):
        bi.plan(table, [L], [40], PS, tokens=tokens)


def test_kernel_tokens_fill_the_dot_rows() -> None:
    """16 // G tokens (at least one, at most TOKENS): a block's T x G rows are tl.dot's 16."""
    assert [bi.kernel_tokens(g) for g in (1, 2, 4, 8, 16, 32)] == [16, 8, 4, 2, 1, 1]


def test_any_split_count_gives_the_serial_bits(setup) -> None:  # noqa: ANN001
    pool, table, q, full = setup
    plan = _decode_plan(table, POSITIONS)
    qd = q[POSITIONS].contiguous()
    scratch = bi.split_scratch(len(POSITIONS), plan.parts, HQ, D, "cpu")
    for n in (1, 2, 3, 5):
        got = triton_ops.invariant_attention(qd, pool.k[0], pool.v[0], PS, plan.page_table, plan.blocks,
                                             plan.chunk, bi.kv_part(PS), n, scratch)
        assert torch.equal(got, full[POSITIONS]), n


def test_split_equals_one_partition_and_float64(setup) -> None:  # noqa: ANN001
    """Partitions change the rounding, not the value: against the kernel with one partition
    covering the whole context (the arithmetic before split-KV) and float64 softmax attention."""
    pool, table, q, full = setup
    plan = _decode_plan(table, POSITIONS)
    qd = q[POSITIONS].contiguous()
    one = triton_ops.invariant_attention(qd, pool.k[0], pool.v[0], PS, plan.page_table, plan.blocks,
                                         plan.chunk, part=1024)
    torch.testing.assert_close(full[POSITIONS], one, atol=2e-6, rtol=1e-5)
    slots = (table[0].long()[:, None] * PS + torch.arange(PS)).view(-1)[:L]
    k, v = pool.k[0][slots].double(), pool.v[0][slots].double()  # [L, Hkv, D]
    for i, p in enumerate(POSITIONS):
        kk, vv = (x[: p + 1].repeat_interleave(HQ // HKV, dim=1) for x in (k, v))  # [p + 1, Hq, D]
        w = torch.softmax(torch.einsum("hd,khd->hk", qd[i].double(), kk) * D**-0.5, dim=-1)
        want = torch.einsum("hk,khd->hd", w, vv)
        torch.testing.assert_close(full[p].double(), want, atol=2e-6, rtol=1e-5)


def test_graph_protocol_splits_with_the_prefill_bits(setup) -> None:  # noqa: ANN001
    """The torch backend's captured decode (as engine/run/cuda_graph.py drives it): a static
    scratch for the longest context, the grid's splits fixed at graph_wrapper, rows shorter
    than it (and a padding row) storing fewer partitions; the bits of the prefill."""
    pool, table, q, full = setup
    backend = TorchAttention("cpu")
    backend.bind(num_q_heads=HQ, kv_pool=pool, max_batch=4, max_pages_per_req=40)
    backend.bind_graphs(4, 40)  # what bind does on CUDA, where the kernel fits
    parts = -(-40 * PS // P)  # 640 positions
    assert backend._g_scratch is not None and backend._g_scratch[0].shape == (4, parts, HQ, D)
    backend.graph_wrapper(4)
    assert backend._g_splits == parts
    starts = [599, 256, 40]
    seqs, dense = staged(starts, [table[0].tolist()] * 3, PS, 4)
    backend.set_graph_table(4, seqs, dense)
    qg = torch.zeros(4, HQ, D)
    qg[:3] = q[starts]
    got = backend.attend(qg, 0, None, pool)
    assert torch.equal(got[:3], full[starts]) and torch.isfinite(got).all()
    backend._warm_split(pool, torch.float32)  # what bind runs on CUDA: the split pair on the padding page


def test_rope_prologue_gives_the_separate_kernels_bits(setup) -> None:  # noqa: ANN001
    """The split kernel's RoPE prologue (cos_sin_cache: q rotated in every program, the new K/V
    stored by the program that reads the token's position) against qk_norm_rope_store and then the
    split kernel: the same outputs and the same pool, for a batch of decode rows at partition
    edges on pages of their own (alone, and with more splits than partitions)."""
    g = torch.Generator().manual_seed(7)
    pool = KVPool(1, 128, PS, HKV, D, torch.float32, "cpu")
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=g))
    positions = [P - 1, P, 2 * P + 5]
    width = -(-(max(positions) + 1) // PS)
    pages = (torch.randperm(127, generator=g) + 1).to(torch.int32)
    table = torch.zeros(len(positions), width, dtype=torch.int32)  # the padding page past a row's own
    for i, p in enumerate(positions):
        n = p // PS + 1
        table[i, :n] = pages[i * width : i * width + n]
    inv = 10000.0 ** (-torch.arange(D // 2, dtype=torch.float32) / (D // 2))
    freqs = torch.arange(4 * P, dtype=torch.float32)[:, None] * inv[None, :]
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()
    qkv = torch.randn(len(positions), HQ + 2 * HKV, D, generator=g)
    for rows in ([0], [1], [2], [0, 1, 2]):
        plan = bi.plan(table[rows], [positions[i] + 1 for i in rows], [1] * len(rows), PS, kernel=True)
        pos = torch.tensor([positions[i] for i in rows])
        slots = table[rows, pos // PS].long() * PS + pos % PS
        for n in (bi.splits(len(rows), HKV, plan.parts), plan.parts + 1):
            if n <= 1:
                continue
            scratch = bi.split_scratch(len(rows), plan.parts, HQ, D, "cpu")
            a, b = (KVPool(1, 128, PS, HKV, D, torch.float32, "cpu") for _ in range(2))
            for x in (a, b):
                x.k[0].copy_(pool.k[0])
                x.v[0].copy_(pool.v[0])
            q = triton_ops.qk_norm_rope_store(qkv[rows].view(len(rows), -1), HQ, HKV, D, pos, cos_sin, slots,
                                              a.k[0], a.v[0])
            want = bi.attend_blocks(q, plan.blocks, plan.page_table, a, 0, n, scratch)
            got = bi.attend_blocks(qkv[rows], plan.blocks, plan.page_table, b, 0, n, scratch, cos_sin)
            assert torch.equal(got, want), (rows, n)
            assert torch.equal(b.k[0], a.k[0]) and torch.equal(b.v[0], a.v[0]), (rows, n)
            assert not torch.equal(b.k[0], pool.k[0])  # the new K was stored
