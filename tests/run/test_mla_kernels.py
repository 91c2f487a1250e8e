"""The triton MLA decode kernel (engine/layers/mla_kernels.py) against the torch absorbed path
(engine/layers/mla_attention.py's `_absorbed` over gathered pages), run by triton's interpreter
on the CPU with tiny shapes (few heads, a 32 + 16 latent). Skipped where triton is not installed
(the CPU CI image); on a machine with triton: `TRITON_INTERPRET=1 pytest tests/run/test_mla_kernels.py`.
The compiled kernel at DeepSeek-V3's shapes is tests/gpu/test_mla_gpu.py."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels module is first imported
pytest.importorskip("triton")

from engine.layers import mla_kernels  # noqa: E402
from engine.layers.forward import ForwardBatch  # noqa: E402
from engine.layers.kv_layout import KVLayout  # noqa: E402
from engine.layers.kv_pool import KVPool  # noqa: E402
from engine.layers.mla_attention import MLABackend, MLAPlan, MLAShapes, mla_attend  # noqa: E402
from engine.run.cuda_graph import decode_table  # noqa: E402
from models.registry import kv_layout, load_model  # noqa: E402

# the kernels' own paths: an earlier module's runner may have left deterministic inference on
pytestmark = pytest.mark.usefixtures("vendor_kernels")

R, P, NOPE, V = 32, 16, 8, 12  # latent rank, rope dims, q_nope and v head dims (tiny)
FP8 = torch.float8_e4m3fn
SMALL = mla_kernels.MLAKernelConfig(block_h=4, block_n=16)  # the interpreter takes any tile


def _pool(dtype: torch.dtype, pages: int, page_size: int, seed: int) -> KVPool:
    kv = KVPool.from_layout(KVLayout.latent(R, P), 1, pages, page_size, dtype, "cpu")
    g = torch.Generator().manual_seed(seed)
    kv.latent[0].copy_(torch.randn(kv.latent[0].shape, generator=g).to(dtype))
    return kv


def _batch(lens: list[int], extend: list[int], page_size: int, pages: int, seed: int) -> ForwardBatch:
    """Requests of KV lengths `lens` feeding `extend` new tokens each, through shuffled (so
    non-contiguous) pages; one page shared by the first two (a cached prefix)."""
    free = list(range(1, pages))
    random.Random(seed).shuffle(free)
    shared = free.pop()
    reqs = []
    for i, (n, e) in enumerate(zip(lens, extend, strict=True)):
        need = -(-n // page_size)
        table = ([shared] if i < 2 and n > page_size else []) + [free.pop() for _ in range(need)]
        reqs.append(([3] * e, n - e, table[:need]))
    return ForwardBatch.from_requests(reqs, page_size, "cpu")


def _attend(batch: ForwardBatch, kv: KVPool, heads: int, dtype: torch.dtype, kernel: bool,
            seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = batch.num_tokens
    q_nope = torch.randn(t, heads, NOPE, generator=g).to(dtype)
    q_pe = torch.randn(t, heads, P, generator=g).to(dtype)
    w = (torch.randn(heads * (NOPE + V), R, generator=g) * 0.3).to(dtype)
    s = MLAShapes(heads, R, NOPE, P, V, (NOPE + P) ** -0.5)
    plan = MLAPlan.build(batch, kernel=kernel)
    assert (plan.decode_table is not None) == (kernel and 1 in batch.extend_lens_cpu)
    return mla_attend(q_nope, q_pe, plan, kv, 0, w, s)


@pytest.mark.parametrize(("dtype", "page_size", "heads", "lens"), [
    (torch.float32, 4, 4, [1, 7, 257, 530]),  # within a page, across splits, not page/split multiples
    (torch.bfloat16, 16, 5, [33, 600, 2]),  # heads not a multiple of the head block
    (FP8, 4, 3, [300, 5]),  # the fp8 pool: unscaled e4m3 widened in the kernel
])
def test_decode_kernel_matches_torch_absorbed(dtype: torch.dtype, page_size: int, heads: int, lens: list[int]) -> None:
    pages = sum(-(-n // page_size) for n in lens) + 4
    kv = _pool(dtype, pages, page_size, seed=len(lens))
    batch = _batch(lens, [1] * len(lens), page_size, pages, seed=heads)
    q_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
    want = _attend(batch, kv, heads, q_dtype, kernel=False)
    got = _attend(batch, kv, heads, q_dtype, kernel=True)
    assert got.shape == want.shape == (len(lens), heads, V) and got.dtype == q_dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: q_lat and the probabilities rounded alike
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_mixed_step_decode_rows_take_the_kernel() -> None:
    """A prefill chunk beside decode rows: the decode rows through the kernel, the chunk through
    the expanded torch path; the whole output equals the all-torch plan's."""
    ps, lens, ext = 4, [40, 9, 300, 21], [1, 6, 1, 1]
    pages = sum(-(-n // ps) for n in lens) + 4
    kv = _pool(torch.float32, pages, ps, seed=7)
    batch = _batch(lens, ext, ps, pages, seed=7)
    want = _attend(batch, kv, 4, torch.float32, kernel=False)
    got = _attend(batch, kv, 4, torch.float32, kernel=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_row_is_batch_invariant() -> None:
    """A row's output is the same bits alone and beside rows of other lengths (split lengths
    depend on the row only)."""
    ps, heads = 4, 4
    g = torch.Generator().manual_seed(3)
    kv = _pool(torch.bfloat16, 200, ps, seed=3)
    table = torch.randperm(199, generator=g)[:150].add(1).to(torch.int32).view(3, 50)
    lens = torch.tensor([190, 3, 77], dtype=torch.int32)
    q_lat = torch.randn(3, heads, R, generator=g).to(torch.bfloat16)
    q_pe = torch.randn(3, heads, P, generator=g).to(torch.bfloat16)
    args = (0.25, ps, SMALL)
    full = mla_kernels.mla_decode(q_lat, q_pe, kv.latent[0], table, lens, *args)
    for i in range(3):
        one = mla_kernels.mla_decode(q_lat[i : i + 1], q_pe[i : i + 1], kv.latent[0], table[i : i + 1],
                                     lens[i : i + 1], *args)
        assert torch.equal(one[0], full[i])


def test_deterministic_rows_through_the_kernel_keep_their_bits() -> None:
    """Deterministic inference with the kernel (CUDA's path, MLAPlan.every_row): a token's output is
    the same bits whether its request is prefilled whole, in chunks behind its cached prefix, or
    decoded beside another request (each new token is a row over its causal prefix, reading its
    request's table row), and close to the torch path's (`_invariant`)."""
    from engine.layers import batch_invariant

    ps, heads, n = 4, 4, 40
    g = torch.Generator().manual_seed(11)
    kv = _pool(torch.bfloat16, 40, ps, seed=11)
    q_nope = torch.randn(n, heads, NOPE, generator=g).to(torch.bfloat16)  # position p's query
    q_pe = torch.randn(n, heads, P, generator=g).to(torch.bfloat16)
    w = (torch.randn(heads * (NOPE + V), R, generator=g) * 0.3).to(torch.bfloat16)
    s = MLAShapes(heads, R, NOPE, P, V, (NOPE + P) ** -0.5)
    table = list(range(30, 20, -1))  # 10 pages, not in order
    other = list(range(1, 8))

    def step(reqs: list[tuple[int, int, list[int]]], kernel: bool) -> list[torch.Tensor]:
        """reqs: (cached prefix, new tokens, pages); our request first: its rows' outputs."""
        batch = ForwardBatch.from_requests([([3] * e, c, t[: -(-(c + e) // ps)]) for c, e, t in reqs], ps, "cpu")
        plan = MLAPlan.build(batch, kernel=kernel)
        assert (plan.decode_table is not None) == kernel and plan.all_decode == kernel
        c, e, _ = reqs[0]
        qn = torch.cat([q_nope[c : c + e], q_nope[: sum(r[1] for r in reqs[1:])]])
        qp = torch.cat([q_pe[c : c + e], q_pe[: sum(r[1] for r in reqs[1:])]])
        return list(mla_attend(qn, qp, plan, kv, 0, w, s)[:e])

    batch_invariant.enable(True, "cpu")
    try:
        whole = step([(0, n, table)], kernel=True)
        chunked = step([(0, 17, table)], kernel=True) + step([(17, n - 17, table), (0, 9, other)], kernel=True)
        decoded = step([(n - 1, 1, table), (20, 1, other)], kernel=True)
        reference = step([(0, n, table)], kernel=False)
    finally:
        batch_invariant.enable(False)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked, strict=True))
    assert torch.equal(whole[-1], decoded[0])
    torch.testing.assert_close(torch.stack(whole).float(), torch.stack(reference).float(), atol=2e-2, rtol=2e-2)


def test_rows_past_the_grid_limit_go_in_several_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """More rows than a launch's grid takes (CUDA: 65535; 3 here), or than PARTIAL_BYTES of split
    partials hold (2 here), are split into launches, with and without table_rows: the same bits as
    one launch (rows are independent)."""
    ps, heads = 4, 4
    g = torch.Generator().manual_seed(5)
    kv = _pool(torch.bfloat16, 40, ps, seed=5)
    table = torch.randperm(39, generator=g)[:20].add(1).to(torch.int32).view(2, 10)
    rows = torch.tensor([0, 1, 1, 0, 1, 0, 0], dtype=torch.int32)
    lens = torch.tensor([5, 40, 13, 1, 27, 33, 8], dtype=torch.int32)
    q_lat = torch.randn(7, heads, R, generator=g).to(torch.bfloat16)
    q_pe = torch.randn(7, heads, P, generator=g).to(torch.bfloat16)
    dense = table[rows.long()].contiguous()
    one = [mla_kernels.mla_decode(q_lat, q_pe, kv.latent[0], t, lens, 0.25, ps, SMALL, table_rows=r)
           for t, r in ((table, rows), (dense, None))]
    for name, value in (("MAX_ROWS", 3), ("PARTIAL_BYTES", 2 * mla_kernels.MAX_SPLITS * heads * (R * 2 + 4))):
        monkeypatch.setattr(mla_kernels, name, value)  # the grid's limit, then the partials' bytes (2 rows)
        assert mla_kernels.launch_rows(heads, R, 2) == (3 if name == "MAX_ROWS" else 2)
        for (t, r), want in zip(((table, rows), (dense, None)), one, strict=True):
            got = mla_kernels.mla_decode(q_lat, q_pe, kv.latent[0], t, lens, 0.25, ps, SMALL, table_rows=r)
            assert torch.equal(got, want)
    assert torch.equal(one[0], one[1])  # a row through table_rows = the same row in a dense table
    monkeypatch.undo()
    # DeepSeek-V3's 128 heads: at most ~1 GiB of bf16 partials a launch (8 x 1024 prefill rows asked 17 GB)
    assert mla_kernels.launch_rows(128, 512, 2) == 510


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_v_split_keeps_every_bit(dtype: torch.dtype) -> None:
    """Sharing a row's output columns over 2 or 4 programs (small batches) gives the same bits as
    one program: the batch size may choose it without breaking batch invariance."""
    from dataclasses import replace

    ps, heads = 4, 4
    g = torch.Generator().manual_seed(8)
    kv = _pool(dtype, 100, ps, seed=8)
    table = torch.randperm(99, generator=g)[:80].add(1).to(torch.int32).view(2, 40)
    lens = torch.tensor([150, 3], dtype=torch.int32)
    q_lat = torch.randn(2, heads, R, generator=g).to(torch.bfloat16)
    q_pe = torch.randn(2, heads, P, generator=g).to(torch.bfloat16)
    outs = [mla_kernels.mla_decode(q_lat, q_pe, kv.latent[0], table, lens, 0.25, ps, replace(SMALL, v_split=v))
            for v in (1, 2, 4)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert [mla_kernels.v_split(b, 2, 512) for b in (1, 8, 16, 32)] == [4, 4, 2, 1]
    assert mla_kernels.v_split(1, 1, 64) == 1  # at least 64 columns a program


def test_split_lengths_depend_on_the_row_only() -> None:
    for heads in (1, 16, 128):
        lo = mla_kernels.min_split(heads)
        assert lo % mla_kernels.MIN_SPLIT_TOKENS == 0 and lo >= 4 * heads
        for n in (1, 255, 256, 1000, 4096, 32768, 131072):
            s = mla_kernels.split_len(n, heads)
            assert s % lo == 0 and -(-n // s) <= mla_kernels.MAX_SPLITS
            assert s == lo or -(-n // (s - lo)) > mla_kernels.MAX_SPLITS  # the shortest that fits


def test_v3_latent_width_one_row() -> None:
    """DeepSeek-V3's latent (512 + 64) with 16 heads, one row over 3 splits: the kernel equals a
    float32 softmax over the same bf16 values."""
    ps, heads, n = 64, 16, 9 * 64 + 5
    g = torch.Generator().manual_seed(5)
    lat = torch.randn(12 * ps, 1, 576, generator=g).to(torch.bfloat16)
    table = torch.tensor([[7, 2, 9, 1, 11, 4, 3, 10, 5, 8]], dtype=torch.int32)
    q_lat = torch.randn(1, heads, 512, generator=g).to(torch.bfloat16)
    q_pe = torch.randn(1, heads, 64, generator=g).to(torch.bfloat16)
    got = mla_kernels.mla_decode(q_lat, q_pe, lat, table, torch.tensor([n], dtype=torch.int32), 0.07, ps,
                                 mla_kernels.MLAKernelConfig(block_h=16, block_n=64))
    pos = torch.arange(n)
    kv = lat[table[0, pos // ps].long() * ps + pos % ps, 0].float()
    probs = (torch.cat([q_lat[0], q_pe[0]], -1).float() @ kv.T * 0.07).softmax(-1)
    want = probs.to(torch.bfloat16).float() @ kv[:, :512]
    assert mla_kernels.split_len(n, heads) == 256
    torch.testing.assert_close(got[0].float(), want, atol=2e-2, rtol=2e-2)
    wide = mla_kernels.mla_decode(q_lat, q_pe, lat, table, torch.tensor([n], dtype=torch.int32), 0.07, ps,
                                  mla_kernels.MLAKernelConfig(block_h=16, block_n=64, min_split=512))
    assert mla_kernels.split_len(n, heads, 512) == 512  # 2 splits instead of 3: other bits, the same values
    torch.testing.assert_close(wide[0].float(), want, atol=2e-2, rtol=2e-2)


def test_bad_inputs_are_refused() -> None:
    lat = torch.zeros(8, 1, R + P)
    q, qp = torch.zeros(1, 2, R), torch.zeros(1, 2, P)
    table, lens = torch.ones(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="latent"):
        mla_kernels.mla_decode(q, torch.zeros(1, 2, P + 1), lat, table, lens, 1.0, 4)
    with pytest.raises(ValueError, match="int32"):
        mla_kernels.mla_decode(q, qp, lat, table.long(), lens, 1.0, 4)


TINY_V3 = {  # all dense (no MoE block): the decode step a CUDA graph captures
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "first_k_dense_replace": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "q_lora_rank": 24, "kv_lora_rank": R, "qk_nope_head_dim": NOPE,
    "qk_rope_head_dim": P, "v_head_dim": V, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
    "topk_group": 1,
    "moe_intermediate_size": 16, "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "rope_theta": 10000.0, "eos_token_id": 1, "bos_token_id": 0,
}


def test_graph_table_protocol_gives_the_eager_decode(tmp_path: Path) -> None:
    """What a captured decode step runs, without the capture: MLABackend's static table and
    lengths filled as engine/run/cuda_graph.py's run_decode fills them (a padded batch of 4 for 3
    requests, the padding row on page 0), the model's forward over the graph runner's static
    batch: the real rows' logits equal the eager step's."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_V3))
    model, cfg = load_model(tmp_path, "dummy", torch.float32, progress=False)
    model.decode_kernel = True
    ps, lens = 4, [6, 13, 2]
    kv = KVPool.from_layout(kv_layout(cfg), cfg.num_layers, 32, ps, torch.float32, "cpu")
    backend = MLABackend("cpu")
    backend.bind(num_q_heads=4, kv_pool=kv, max_batch=8, max_pages_per_req=8)
    tables = [[5, 9], [2, 7, 11, 3], [30]]
    prompts = [[7 + i] * n for i, n in enumerate(lens)]
    prefill = ForwardBatch.from_requests([(p, 0, t) for p, t in zip(prompts, tables, strict=True)], ps, "cpu")
    backend.prepare(prefill)
    model(prefill, kv, backend)
    step = ForwardBatch.from_requests([([40 + i], n, t) for i, (n, t) in enumerate(zip(lens, tables, strict=True))],
                                      ps, "cpu")
    backend.prepare(step)
    want = model(step, kv, backend)
    assert backend.graph is None
    bs = 4
    backend.graph_wrapper(bs)
    out_slots, seq, table = decode_table(lens, tables, ps)
    pad_seq = torch.ones(bs, dtype=torch.int32)
    pad_seq[:3] = torch.from_numpy(seq)
    pad_table = torch.zeros(bs, table.shape[1], dtype=torch.int32)
    pad_table[:3] = torch.from_numpy(table)
    backend.set_graph_table(bs, pad_seq, pad_table)
    static = ForwardBatch(  # as CudaGraphRunner._static_batch: a [bs, 1] padding table, lengths 1
        input_ids=torch.tensor([40, 41, 42, 0]), positions=torch.tensor([*lens, 0]),
        out_slots=torch.tensor([*out_slots.tolist(), 0]), page_table=torch.zeros(bs, 1, dtype=torch.int32),
        seq_lens=torch.ones(bs, dtype=torch.int32), extend_lens=torch.ones(bs, dtype=torch.int32),
        logit_indices=torch.arange(bs), seq_lens_cpu=[1] * bs, extend_lens_cpu=[1] * bs, page_size=ps,
        is_decode=True, page_table_cpu=torch.zeros(bs, 1, dtype=torch.int32))
    got = model(static, kv, backend)
    torch.testing.assert_close(got[:3], want, atol=1e-5, rtol=1e-5)


def test_bench_capacity_latent_vs_gqa() -> None:
    """bin/bench mla's capacity table: V3's latent costs 61 x 1152 bytes a token in bf16 (half in
    fp8), Llama-3.1-8B's K and V 32 x 2 x 8 x 128 x 2."""
    from engine.bench.mla import capacity

    rows = {r["model"]: r for r in capacity()}
    v3, llama = rows["deepseek-v3"], rows["llama-3.1-8b"]
    assert v3["layout"] == "mla" and v3["bytes_per_token"] == {"bf16": 61 * 1152, "fp8": 61 * 576}
    assert llama["layout"] == "gqa" and llama["bytes_per_token"]["bf16"] == 32 * 2 * 8 * 128 * 2
    assert llama["tokens_per_gib"]["bf16"] == 8192 and v3["tokens_per_gib"]["bf16"] == (1 << 30) // (61 * 1152)


def _reference(q_lat: torch.Tensor, q_pe: torch.Tensor, lat: torch.Tensor, table: torch.Tensor,
               lens: torch.Tensor, scale: float, ps: int) -> torch.Tensor:
    """float32 softmax attention of each row over its latents gathered through its page table."""
    r = q_lat.shape[-1]
    out = []
    for i, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        kv = lat[table[i, pos // ps].long() * ps + pos % ps, 0].float()
        probs = (torch.cat([q_lat[i], q_pe[i]], -1).float() @ kv.T * scale).softmax(-1)
        out.append(probs @ kv[:, :r])
    return torch.stack(out)


def _rows(lens: list[int], heads: int, r: int, p: int, ps: int, dtype: torch.dtype, seed: int):  # noqa: ANN202
    """Random queries, a pool with 3 spare pages and shuffled page tables for rows of `lens`."""
    g = torch.Generator().manual_seed(seed)
    per = max(-(-n // ps) for n in lens)
    pages = len(lens) * per + 3
    lat = torch.randn(pages * ps, 1, r + p, generator=g).to(dtype)
    table = (torch.randperm(pages - 1, generator=g)[: len(lens) * per] + 1).to(torch.int32).view(len(lens), per)
    q_lat = torch.randn(len(lens), heads, r, generator=g).to(dtype)
    q_pe = torch.randn(len(lens), heads, p, generator=g).to(dtype)
    return q_lat, q_pe, lat, table, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize(("r", "p"), [(32, 8), (8, 4), (24, 12)], ids=["tiny-v3", "both-small", "not-pow2"])
def test_latent_dims_below_16_are_padded(r: int, p: int) -> None:
    """tl.dot needs K >= 16: a kv_lora_rank or rope dim below 16 (the tiny DeepSeek-V3 of
    tests/models: 32 + 8), or not a power of two, runs padded with masked columns."""
    ps, lens = 4, [3, 40, 290]
    q_lat, q_pe, lat, table, n = _rows(lens, 4, r, p, ps, torch.float32, seed=r + p)
    got = mla_kernels.mla_decode(q_lat, q_pe, lat, table, n, 0.3, ps)
    assert got.shape == (3, 4, r)
    torch.testing.assert_close(got, _reference(q_lat, q_pe, lat, table, n, 0.3, ps), atol=1e-5, rtol=1e-5)
    assert mla_kernels.padded(8) == 16 and mla_kernels.padded(24) == 32 and mla_kernels.padded(512) == 512


def test_batch_8_wide_tile_v_split_several_splits() -> None:
    """The point that crashed the first H200 bench (batch 8, 64-head tiles, v_split 4, two or more
    splits a row, shuffled pages): every row against the float32 reference, and alone the same bits."""
    heads, r, p, ps = 64, 256, 16, 16
    lens = [520, 1, 30, 17, 26, 9, 25, 3]  # one row of 3 splits, the others short (the interpreter's time)
    q_lat, q_pe, lat, table, n = _rows(lens, heads, r, p, ps, torch.bfloat16, seed=9)
    cfg = mla_kernels.default_config(heads)
    assert cfg.block_h == 64 and mla_kernels.v_split(8, 1, r) == 4 and mla_kernels.split_len(520, heads) == 256
    got = mla_kernels.mla_decode(q_lat, q_pe, lat, table, n, 0.1, ps)
    want = _reference(q_lat, q_pe, lat, table, n, 0.1, ps)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    one = mla_kernels.mla_decode(q_lat[:1], q_pe[:1], lat, table[:1], n[:1], 0.1, ps)
    assert torch.equal(one[0], got[0])


def test_config_is_validated_and_sweep_fits_hopper() -> None:
    """Bad tile configs fail on construction naming the field; every config bin/bench mla --sweep
    times fits Hopper's shared memory (the first H200 run hit OutOfResources on (64, 64, 8, 2))."""
    from engine.bench.mla import _CANDIDATES, sweep_configs

    for bad, field in (({"block_n": 8}, "block_n"), ({"block_h": 48}, "block_h"), ({"min_split": 100}, "min_split"),
                       ({"v_split": 3}, "v_split"), ({"num_stages": 0}, "num_stages")):
        with pytest.raises(ValueError, match=field):
            mla_kernels.MLAKernelConfig(**bad)
    # what triton 3.9 asked for on sm_90a (scripts/mla_aot.py; the H200's refusal for the second)
    assert mla_kernels.MLAKernelConfig(64, 32, 8, 2, v_split=1).shared_bytes() == 147_456
    assert mla_kernels.MLAKernelConfig(64, 64, 8, 2, v_split=4).shared_bytes() == 253_952
    assert mla_kernels.MLAKernelConfig(16, 32, 4, 3).shared_bytes(v_split=2) == 125_952  # mma.sync tile
    fits = sweep_configs()
    assert all(mla_kernels.MLAKernelConfig(*c).shared_bytes(v_split=1) <= mla_kernels.HOPPER_SHARED for c in fits)
    assert (64, 64, 8, 3) in _CANDIDATES and (64, 64, 8, 3) not in fits and (64, 32, 8, 3) in fits
    # a v_split whose value-column buffers do not fit is halved (the same bits at any v_split)
    wide, lim = mla_kernels.default_config(128), mla_kernels.HOPPER_SHARED
    assert wide.num_stages >= 3 and wide.shared_bytes(v_split=2) > lim  # 3 stages: loads overlap the math
    assert [mla_kernels.fitting_v_split(v, wide, 512, 64, 2, lim) for v in (1, 2, 4)] == [1, 1, 4]
    assert mla_kernels.fitting_v_split(4, wide, 32, 8, 4, lim) == 4  # tiny latents fit anything


def test_bench_point_is_checked_against_float32() -> None:
    """bin/bench mla's setup (shuffled page tables over a pool of batch x pages + 1, V3's latent)
    gives the kernel's rows their float32 reference on the CPU: what each timed point now checks."""
    from engine.bench.mla import _Point

    pt = _Point(16, torch.bfloat16, 2, 70, 16, torch.device("cpu"))
    assert pt.table.shape == (2, 5) and int(pt.table.min()) >= 1 and int(pt.table.max()) < pt.pages
    assert pt.error(pt.ours()()) < 0.02


def test_compiles_for_hopper_without_a_gpu() -> None:
    """The kernel compiled for sm_90a here (scripts/mla_aot.py: triton's nvidia backend and ptxas,
    no device; a process of its own, as this one interprets the kernels): the tiny DeepSeek-V3's
    32 + 8 latent in float32 (failed tl.dot's K >= 16 on the first H200 run) and the V3 default
    tile at v_split 4: shared memory as `shared_bytes` predicts and within Hopper's, and a tile's
    copies still pending while the previous tile's math runs (num_stages 2 had none)."""
    import re
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).resolve().parents[2] / "scripts" / "mla_aot.py"

    def aot(*args: str) -> list[tuple[int, int, int]]:
        res = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        rows = re.findall(r"shared +(\d+) \(estimate +(\d+)\) fits +pending at the wait +(\d+)", res.stdout)
        return [tuple(int(x) for x in r) for r in rows]

    assert len(aot("--r", "32", "--p", "8", "--dtype", "fp32", "--config", "16", "32", "4", "3", "--v-split", "1")) == 1
    wide = mla_kernels.default_config(128)
    cfg = [str(x) for x in (wide.block_h, wide.block_n, wide.num_warps, wide.num_stages)]
    ((shared, estimate, pending),) = aot("--config", *cfg, "--v-split", "4")
    assert shared == estimate == wide.shared_bytes(v_split=4) and pending >= 3  # latents, rope keys, values
