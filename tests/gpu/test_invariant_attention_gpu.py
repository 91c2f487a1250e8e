"""Split-KV of deterministic inference's attention kernel, compiled (engine/layers/triton_kernels.py):
in bfloat16 with Llama-3.1-8B (32 q / 8 KV heads) and Qwen3-0.6B (16 / 8) heads of dim 128, a
token's output has the same bits decoded alone (split-KV), in a batch, replayed in CUDA graphs
(split and serial sizes), with any split count, and computed by the serial kernel in a prefill or
a chunked prefill, at contexts 1, 255, 256, 257, 1024 and 4097. Plus a timing print (not an
assertion): the kernel at batch 1 / 8 / 32 / 64, context 1024, 32 q / 8 KV heads, serial vs split; and
the candidate of smaller decode blocks (bits and batch-256 time)."""

from __future__ import annotations

import pytest
import torch

from engine.bench.roofline import graph_us
from engine.layers import batch_invariant as bi
from engine.layers import triton_ops
from engine.layers.attention import TorchAttention
from engine.layers.kv_pool import PAD_PAGE, KVPool
from tests.engine.test_deterministic_graph_blocks import staged

PS = 16
CONTEXTS = [1, 255, 256, 257, 1024, 4097]
BF = torch.bfloat16


def _pool(hkv: int, d: int, tokens: int, seed: int) -> KVPool:
    pool = KVPool(1, tokens // PS + 8, PS, hkv, d, BF, "cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    for t in (pool.k[0], pool.v[0]):
        t.copy_(torch.randn(t.shape, generator=g, device="cuda").to(BF))
    return pool


def _tables(lens: list[int], seed: int) -> list[list[int]]:
    """Disjoint shuffled pages off the padding page, one list per request."""
    need = [-(-n // PS) for n in lens]
    perm = (torch.randperm(sum(need), generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    out, at = [], 0
    for n in need:
        out.append(perm[at : at + n])
        at += n
    return out


def _dense(tables: list[list[int]]) -> torch.Tensor:
    w = max(len(t) for t in tables)
    return torch.tensor([t + [PAD_PAGE] * (w - len(t)) for t in tables], dtype=torch.int32, device="cuda")


def _graph_decode(backend: TorchAttention, pool: KVPool, bs: int, qd: torch.Tensor, tables: list[list[int]],
                  ) -> torch.Tensor:
    """The decode rows (KV lengths CONTEXTS) replayed in a CUDA graph of size bs captured on padding."""
    hq, d = qd.shape[1:]
    q = torch.zeros(bs, hq, d, dtype=BF, device="cuda")
    backend.graph_wrapper(bs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.attend(q, 0, None, pool)  # warm-up: compiles
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.attend(q, 0, None, pool)
    seqs, dense = staged([n - 1 for n in CONTEXTS], tables, PS, bs)
    backend.set_graph_table(bs, seqs.cuda(), dense.cuda())
    q[: len(CONTEXTS)].copy_(qd)
    graph.replay()
    torch.cuda.synchronize()
    return out[: len(CONTEXTS)].clone()


@pytest.mark.parametrize(("hq", "hkv"), [(32, 8), (16, 8), (32, 4), (64, 4)])
def test_split_batched_graph_and_prefill_bits(hq: int, hkv: int) -> None:
    """In the model's kernel blocks (kernel_tokens: 16 // G tokens), a decode token's output has
    its prefill's bits: alone (split-KV), batched, at any split count, in CUDA graphs."""
    d = 128
    small = bi.kernel_tokens(hq // hkv)
    bi.enable(True, "cuda")
    pool = _pool(hkv, d, sum(CONTEXTS) + 64, seed=hq)
    tables = _tables(CONTEXTS, seed=hq)
    dense = _dense(tables)
    g = torch.Generator(device="cuda").manual_seed(1)
    qs = [torch.randn(n, hq, d, generator=g, device="cuda").to(BF) for n in CONTEXTS]
    last = []
    for r, n in enumerate(CONTEXTS):  # the serial kernel: the whole prompt, then a chunk behind a prefix
        p = bi.plan(dense[r : r + 1], [n], [n], PS, kernel=True, tokens=small)
        full = bi.attend(qs[r], p, pool, 0)
        cut = n // 2 + 3 if n > 8 else 0
        behind = bi.plan(dense[r : r + 1], [n], [n - cut], PS, kernel=True, tokens=small)
        chunk = bi.attend(qs[r][cut:], behind, pool, 0)
        assert torch.equal(chunk, full[cut:]), (n, "chunked prefill")
        alone = bi.plan(dense[r : r + 1], [n], [1], PS, kernel=True, tokens=small)
        assert alone.decode and alone.blocks[1].shape[1] == small
        assert alone.parts == 1 or bi.splits(1, hkv, alone.parts) > 1  # split wherever > 1 partition
        assert torch.equal(bi.attend(qs[r][-1:], alone, pool, 0)[0], full[-1]), (n, "split decode alone")
        last.append(full[-1])
    want = torch.stack(last)
    qd = torch.stack([q[-1] for q in qs])
    batch = bi.plan(dense, CONTEXTS, [1] * len(CONTEXTS), PS, kernel=True, tokens=small)
    assert torch.equal(bi.attend(qd, batch, pool, 0), want), "batched decode"
    scratch = bi.split_scratch(len(CONTEXTS), batch.parts, hq, d, "cuda")
    for n in (1, 2, 3, 8, 17):
        got = triton_ops.invariant_attention(qd, pool.k[0], pool.v[0], PS, dense, batch.blocks,
                                             batch.chunk, bi.kv_part(PS), n, scratch)
        assert torch.equal(got, want), f"{n} splits"
    backend = TorchAttention("cuda")
    backend.bind(num_q_heads=hq, kv_pool=pool, max_batch=64, max_pages_per_req=dense.shape[1] + 1)
    assert backend.supports_cuda_graph and backend._g_scratch is not None and backend._block_tokens == small
    for bs in (8, 64):  # 8: split-KV inside the graph; 64: the serial kernel
        assert torch.equal(_graph_decode(backend, pool, bs, qd, tables), want), f"graph of {bs}"
        assert (backend._g_splits > 1) == (bs == 8)


@pytest.mark.parametrize(("hq", "hkv"), [(32, 8), (16, 8)])
def test_rope_prologue_bits(hq: int, hkv: int) -> None:
    """The split kernel's RoPE prologue (cos_sin_cache) against qk_norm_rope_store and the split
    kernel: the same outputs and the same pool (the new K/V stored by the program that reads the
    token's position), compiled, in the model's kernel blocks, at every split count; and its
    timing against the two launches (printed, not asserted)."""
    d = 128
    small = bi.kernel_tokens(hq // hkv)
    bi.enable(True, "cuda")
    base = _pool(hkv, d, sum(CONTEXTS) + 64, seed=hq)
    dense = _dense(_tables(CONTEXTS, seed=hq))
    g = torch.Generator(device="cuda").manual_seed(3)
    qkv = torch.randn(len(CONTEXTS), hq + 2 * hkv, d, generator=g, device="cuda").to(BF)
    inv = 500000.0 ** (-torch.arange(d // 2, dtype=torch.float32, device="cuda") / (d // 2))
    freqs = torch.arange(8192, dtype=torch.float32, device="cuda")[:, None] * inv[None, :]
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()
    pos = torch.tensor([n - 1 for n in CONTEXTS], device="cuda")
    slots = dense[torch.arange(len(CONTEXTS), device="cuda"), pos // PS].long() * PS + pos % PS
    batch = bi.plan(dense, CONTEXTS, [1] * len(CONTEXTS), PS, kernel=True, tokens=small)
    scratch = bi.split_scratch(len(CONTEXTS), batch.parts, hq, d, "cuda")
    pools = {}
    for n in (max(2, bi.splits(len(CONTEXTS), hkv, batch.parts)), 3, 17):
        a, b = (_pool(hkv, d, sum(CONTEXTS) + 64, seed=hq) for _ in range(2))
        q = triton_ops.qk_norm_rope_store(qkv.view(len(CONTEXTS), -1), hq, hkv, d, pos, cos_sin, slots, a.k[0], a.v[0])
        want = bi.attend_blocks(q, batch.blocks, dense, a, 0, n, scratch)
        got = bi.attend_blocks(qkv, batch.blocks, dense, b, 0, n, scratch, cos_sin)
        assert torch.equal(got, want), f"{n} splits"
        assert torch.equal(b.k[0], a.k[0]) and torch.equal(b.v[0], a.v[0]), f"{n} splits: the pool"
        assert not torch.equal(b.k[0], base.k[0])
        pools[n] = (a, b)
    one = bi.plan(dense[:1].clone(), [1024], [1], PS, kernel=True, tokens=small)  # batch 1, ctx 1024
    one_pos, s1 = torch.tensor([1023], device="cuda"), bi.splits(1, hkv, one.parts)
    one_slot = dense[0, 1023 // PS].long().view(1) * PS + 1023 % PS
    a, b = pools[3]
    two = lambda: bi.attend_blocks(triton_ops.qk_norm_rope_store(  # noqa: E731
        qkv[:1].view(1, -1), hq, hkv, d, one_pos, cos_sin, one_slot, a.k[0], a.v[0]), one.blocks, dense[:1], a, 0, s1,
        scratch)
    fused = lambda: bi.attend_blocks(qkv[:1], one.blocks, dense[:1], b, 0, s1, scratch, cos_sin)  # noqa: E731
    print(f"\nrope prologue, {hq}/{hkv} heads, batch 1 ctx 1024, {s1} splits: "
          f"two launches {_time_us(two):.2f} us, fused {_time_us(fused):.2f} us")


def _time_us(f, n: int = 50) -> float:  # noqa: ANN001
    """Mean device time of f() replayed from a CUDA graph of n calls (no launch overhead)."""
    return graph_us(f, ops=n, replays=5)


def test_timing_print() -> None:
    hq, hkv, d, ctx = 32, 8, 128, 1024
    bi.enable(True, "cuda")
    pool = _pool(hkv, d, 64 * ctx, seed=3)
    dense = _dense(_tables([ctx] * 64, seed=3))
    q = torch.randn(64, hq, d, device="cuda").to(BF)
    for b in (1, 8, 32, 64):
        p = bi.plan(dense[:b], [ctx] * b, [1] * b, PS, kernel=True, tokens=bi.kernel_tokens(hq // hkv))
        scratch = bi.split_scratch(b, p.parts, hq, d, "cuda")

        def run(n: int, b: int = b, p: bi.Plan = p, scratch: tuple = scratch) -> torch.Tensor:
            return triton_ops.invariant_attention(q[:b], pool.k[0], pool.v[0], PS, dense[:b], p.blocks,
                                                  p.chunk, bi.kv_part(PS), n, scratch)

        auto = bi.splits(b, hkv, p.parts)
        times = {n: _time_us(lambda n=n: run(n)) for n in sorted({1, 2, p.parts, auto})}
        kv_mb = b * ctx * hkv * d * 2 * 2 / 1e6
        print(f"invariant attention timing: batch {b} ctx {ctx} heads {hq}/{hkv}: "
              + ", ".join(f"splits {n} {t:.1f} us" for n, t in times.items())
              + f"; the engine picks {auto}; KV {kv_mb:.1f} MB = {kv_mb / 4.8e3 * 1e3:.1f} us at 4.8 TB/s")
    # the static scratch a CUDA-graph decode holds: Llama-3.1-8B at 128k context, 64 graph rows
    parts = -(-(-(-131072 // PS) + 1) * PS // bi.kv_part(PS))
    rows = min(64, bi.split_rows(8))
    mib = sum(t.numel() * 4 for t in bi.split_scratch(rows, parts, 32, 128, "meta")) / 2**20
    print(f"invariant attention timing: graph scratch Llama-3.1-8B 128k x 64 rows: {rows} split rows x {parts} "
          f"partitions = {mib:.1f} MiB")


@pytest.mark.parametrize(("hq", "hkv"), [(32, 8), (16, 8)])
def test_block_size_timing_print(hq: int, hkv: int) -> None:
    """Blocks of TOKENS against kernel_tokens (printed): a decode batch of 256 at ctx 1024 (a
    16-token block computes 16 x G rows for its one token) and one 4096-token prefill."""
    d, ctx, batch = 128, 1024, 256
    bi.enable(True, "cuda")
    big = _pool(hkv, d, batch * ctx, seed=5)
    bdense = _dense(_tables([ctx] * batch, seed=5))
    qb = torch.randn(batch, hq, d, device="cuda").to(BF)
    n = 4096
    qp = torch.randn(n, hq, d, device="cuda").to(BF)
    times = {}
    for t in (bi.TOKENS, bi.kernel_tokens(hq // hkv)):
        p = bi.plan(bdense, [ctx] * batch, [1] * batch, PS, kernel=True, tokens=t)
        assert bi.splits(batch, hkv, p.parts) == 1
        pre = bi.plan(bdense[:1], [n], [n], PS, kernel=True, tokens=t)
        times[t] = (_time_us(lambda p=p: bi.attend(qb, p, big, 0), n=10),
                    _time_us(lambda pre=pre: bi.attend(qp, pre, big, 0), n=5))
    kv_us = batch * ctx * hkv * d * 2 * 2 / 4.8e12 * 1e6
    print(f"invariant attention blocks: heads {hq}/{hkv}: " + ", ".join(
        f"{t} tokens: decode b{batch} ctx {ctx} {dec:.1f} us, prefill {n} {pre:.1f} us"
        for t, (dec, pre) in times.items())
        + f" (decode KV at 4.8 TB/s: {kv_us:.1f} us)")
