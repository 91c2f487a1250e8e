"""The triton kernels (engine/layers/triton_kernels.py) against torch references, run by triton's
interpreter on the CPU. Skipped where triton is not installed (the CPU CI image); on a machine
with triton: `TRITON_INTERPRET=1 pytest tests/run/test_triton_kernels.py`. The GPU check
(tests/gpu, `pytest -m gpu tests/gpu` on a CUDA machine) covers the compiled kernels inside the model."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels module is first imported
pytest.importorskip("triton")

from engine.layers import ops, triton_ops  # noqa: E402
from engine.layers.tuning import load_tuning  # noqa: E402

BF = torch.bfloat16


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


@pytest.mark.parametrize(("hq", "hkv", "d", "norm", "kv_dtype"), [
    (8, 2, 64, False, BF), (4, 2, 128, True, BF), (6, 3, 32, True, BF), (4, 2, 64, False, torch.float32),
])
def test_qk_norm_rope_store_matches_torch(hq: int, hkv: int, d: int, norm: bool, kv_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(hq * d)
    t, slots_n = 5, 64
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(BF)
    pos = torch.randint(0, 100, (t,), generator=g)
    slots = torch.randperm(slots_n, generator=g)[:t]
    rot = ops.Rotary(1.0 / (1e4 ** (torch.arange(0, d, 2).float() / d)), d, 128)
    cache = rot.cos_sin_cache(torch.device("cpu"))
    qw, kw = torch.rand(d, generator=g).to(BF) + 0.5, torch.rand(d, generator=g).to(BF) + 0.5
    kc, vc = torch.zeros(slots_n, hkv, d, dtype=kv_dtype), torch.zeros(slots_n, hkv, d, dtype=kv_dtype)
    q = triton_ops.qk_norm_rope_store(qkv, hq, hkv, d, pos, cache, slots, kc, vc,
                                      qw if norm else None, kw if norm else None, 1e-6)
    qr, kr, vr = qkv.split([hq * d, hkv * d, hkv * d], -1)
    qr, kr, vr = qr.reshape(t, hq, d), kr.reshape(t, hkv, d), vr.reshape(t, hkv, d)
    if norm:
        qr, kr = _rms(qr, qw), _rms(kr, kw)
    cos, sin = ops.rope_cos_sin(pos, rot.inv_freq, torch.float32)
    qr = ops.apply_rope(qr.float(), cos, sin).to(BF)
    kr = ops.apply_rope(kr.float(), cos, sin).to(BF)
    assert q.shape == (t, hq, d) and q.is_contiguous()
    torch.testing.assert_close(q.float(), qr.float(), atol=0.07, rtol=0.02)  # a bf16 rounding apart
    torch.testing.assert_close(kc[slots].float(), kr.float(), atol=0.07, rtol=0.02)
    assert torch.equal(vc[slots], vr.to(kv_dtype))
    untouched = torch.ones(slots_n, dtype=torch.bool)
    untouched[slots] = False
    assert not kc[untouched].any() and not vc[untouched].any()


@pytest.mark.parametrize(("n", "k", "cfg"), [(100, 1024, (8, 512, 4, 3)), (37, 2048, (4, 1024, 4, 3)),
                                             (64, 512, (16, 256, 4, 4)),
                                             (30, 768, (4, 1024, 4, 1))])  # one column-masked tile
def test_gemv_matches_matmul(n: int, k: int, cfg: tuple) -> None:
    g = torch.Generator().manual_seed(n)
    w, x = torch.randn(n, k, generator=g).to(BF), torch.randn(1, k, generator=g).to(BF)
    ref = x.float() @ w.float().T
    y = triton_ops.gemv(x, w, *cfg)
    assert y.shape == (1, n) and y.dtype == BF
    torch.testing.assert_close(y.float(), ref, atol=0.01 * ref.abs().max().item(), rtol=0)
    if cfg[1] < k:
        with pytest.raises(ValueError, match="gemv"):
            triton_ops.gemv(x[:, :-1], w[:, :-1], *cfg)  # K not a multiple of block_k
    with pytest.raises(ValueError, match="gemv"):
        triton_ops.gemv(x, w, cfg[0], 3 * cfg[1], *cfg[2:])  # nor one power-of-two block over it


@pytest.mark.parametrize(("k", "block_k"), [(1024, 512), (768, 1024)])
def test_gemv_with_silu_mul_folded(k: int, block_k: int) -> None:
    g = torch.Generator().manual_seed(1)
    n = 48
    w, h = torch.randn(n, k, generator=g).to(BF), torch.randn(1, 2 * k, generator=g).to(BF)
    gate, up = h.chunk(2, -1)
    ref = (F.silu(gate.float()) * up.float()).to(BF).float() @ w.float().T
    y = triton_ops.gemv(h, w, 8, block_k, 4, 3, silu_mul=True)
    torch.testing.assert_close(y.float(), ref, atol=0.01 * ref.abs().max().item(), rtol=0)


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize(("k", "block_k"), [(1024, 512), (768, 1024)])
def test_add_norm_gemv(with_residual: bool, k: int, block_k: int) -> None:
    g = torch.Generator().manual_seed(2)
    n = 40
    w = torch.randn(n, k, generator=g).to(BF)
    x, r = torch.randn(1, k, generator=g).to(BF), torch.randn(1, k, generator=g).to(BF)
    nw = torch.rand(k, generator=g).to(BF) + 0.5
    y, r_out = triton_ops.add_norm_gemv(x, r if with_residual else None, nw, 1e-6, w, 8, block_k, 4, 3)
    s = x.float() + (r.float() if with_residual else 0)
    ref = _rms(s.to(BF), nw).float() @ w.float().T
    torch.testing.assert_close(y.float(), ref, atol=0.01 * ref.abs().max().item(), rtol=0)
    if with_residual:
        torch.testing.assert_close(r_out.float(), s.to(BF).float(), atol=1e-3, rtol=2**-7)  # <= 1 bf16 ulp
        assert r_out is not x and r_out is not r
    else:
        assert r_out is x  # layer 0: the input is the residual stream


@pytest.mark.parametrize("silu_mul", [False, True])
def test_gemv_takes_several_rows_with_one_tile(silu_mul: bool) -> None:
    g = torch.Generator().manual_seed(4)
    m, n, k = 3, 20, 768
    w = torch.randn(n, k, generator=g).to(BF)
    x = torch.randn(m, 2 * k if silu_mul else k, generator=g).to(BF)
    xin = (F.silu(x[:, :k].float()) * x[:, k:].float()).to(BF) if silu_mul else x
    ref = xin.float() @ w.float().T
    y = triton_ops.gemv(x, w, 4, 1024, 4, 1, silu_mul=silu_mul)
    assert y.shape == (m, n)
    torch.testing.assert_close(y.float(), ref, atol=0.01 * ref.abs().max().item(), rtol=0)
    with pytest.raises(ValueError, match="gemv"):  # several rows need the one-tile config
        triton_ops.gemv(x, w[:, :512], 4, 256, 4, 1, silu_mul=silu_mul)
    with pytest.raises(ValueError, match="gemv"):  # and at most GEMV_MAX_ROWS of them
        triton_ops.gemv(x.repeat(3, 1), w, 4, 1024, 4, 1, silu_mul=silu_mul)


@pytest.mark.parametrize("with_residual", [True, False])
def test_add_norm_gemv_takes_several_rows(with_residual: bool) -> None:
    g = torch.Generator().manual_seed(5)
    m, n, k = 4, 24, 640
    w = torch.randn(n, k, generator=g).to(BF)
    x, r = torch.randn(m, k, generator=g).to(BF), torch.randn(m, k, generator=g).to(BF)
    nw = torch.rand(k, generator=g).to(BF) + 0.5
    y, r_out = triton_ops.add_norm_gemv(x, r if with_residual else None, nw, 1e-6, w, 8, 1024, 4, 1)
    s = x.float() + (r.float() if with_residual else 0)
    ref = _rms(s.to(BF), nw).float() @ w.float().T
    assert y.shape == (m, n)
    torch.testing.assert_close(y.float(), ref, atol=0.01 * ref.abs().max().item(), rtol=0)
    if with_residual:
        torch.testing.assert_close(r_out.float(), s.to(BF).float(), atol=1e-3, rtol=2**-7)


@pytest.mark.parametrize(("m", "h", "producer_cfg", "consumer_cfg", "silu_mul"), [
    (1, 1024, (8, 256, 4, 3), (4, 256, 4, 3), False),  # looped tiles on both sides
    (1, 1000, (16, 256, 4, 3), (8, 1024, 4, 3), True),  # SwiGLU folded in; the last program column-masked
    (3, 1000, (4, 1024, 4, 1), (8, 1024, 4, 1), False),  # one-tile configs: several rows
])
def test_rms_norm_split_across_two_gemvs(m: int, h: int, producer_cfg: tuple, consumer_cfg: tuple,
                                         silu_mul: bool) -> None:
    """o_proj -> add + RMSNorm -> gate_up in two launches: the first GEMV adds the residual and
    leaves u = s * norm weight and its sums of squares, the second scales by the rsqrt; equal to
    the three launches up to bf16 rounding, and the residual stream updated in place."""
    g = torch.Generator().manual_seed(6)
    k_in, n = 512 if producer_cfg[1] < 1024 else 768, 72
    w1, w2 = torch.randn(h, k_in, generator=g).to(BF), torch.randn(n, h, generator=g).to(BF)
    x = torch.randn(m, 2 * k_in if silu_mul else k_in, generator=g).to(BF)
    r = torch.randn(m, h, generator=g).to(BF)
    nw = torch.rand(h, generator=g).to(BF) + 0.5
    xin = (F.silu(x[:, :k_in].float()) * x[:, k_in:].float()).to(BF) if silu_mul else x
    s = ((xin.float() @ w1.float().T).to(BF).float() + r.float()).to(BF)
    ref = _rms(s, nw).float() @ w2.float().T
    residual = r.clone()
    pre = triton_ops.gemv(x, w1, *producer_cfg, silu_mul=silu_mul, norm_out=(residual, nw, 1e-6))
    assert isinstance(pre, triton_ops.PreNormed) and pre.ss.shape == (m, -(-h // producer_cfg[0]))
    # the new residual, in place (the sum rounds to bf16 before the add, both summed in their own order)
    torch.testing.assert_close(residual.float(), s.float(), atol=0.02 * s.abs().max().item(), rtol=0)
    torch.testing.assert_close(pre.ss.sum(1), residual.float().square().sum(1), rtol=1e-4, atol=0)
    torch.testing.assert_close(pre.u.float(), residual.float() * nw.float(), rtol=2**-7, atol=0)  # one rounding
    y = triton_ops.gemv(pre, w2, *consumer_cfg)
    assert isinstance(y, torch.Tensor) and y.shape == (m, n)
    torch.testing.assert_close(y.float(), ref, atol=0.01 * ref.abs().max().item(), rtol=0)
    with pytest.raises(ValueError, match="gemv"):  # the residual must have the output's shape
        triton_ops.gemv(x, w1, *producer_cfg, silu_mul=silu_mul, norm_out=(r[:, :-1].contiguous(), nw, 1e-6))


def test_gemv_rows_rule() -> None:
    assert triton_ops.gemv_rows_ok((8, 512, 4, 3), 1024, 1)  # batch 1: any config
    assert not triton_ops.gemv_rows_ok((8, 512, 4, 3), 1024, 2)  # looped: one row only
    assert triton_ops.gemv_rows_ok((8, 1024, 4, 1), 1024, triton_ops.GEMV_MAX_ROWS)
    assert not triton_ops.gemv_rows_ok((8, 1024, 4, 1), 1024, triton_ops.GEMV_MAX_ROWS + 1)
    assert not triton_ops.gemv_rows_ok(None, 1024, 1)


def test_gemv_config_is_none_off_cuda() -> None:
    assert triton_ops.gemv_config(torch.zeros(64, 1024, dtype=BF)) is None  # CPU: cuBLAS/torch stays


def _decode_case(b: int, hq: int, hkv: int, d: int, ps: int, lens: list[int], kv_dtype: torch.dtype, seed: int):
    """A pool with random K/V, a page table per request (scattered pages, padding past the
    end) and a QKV row per request whose new token sits at position lens[i] - 1."""
    g = torch.Generator().manual_seed(seed)
    w = max(-(-n // ps) for n in lens) + 1
    pages = torch.randperm(b * w + 8, generator=g)[: b * w] + 1  # page 0 is padding
    table = pages.reshape(b, w).to(torch.int32)
    slots_n = (b * w + 9) * ps
    kc = torch.randn(slots_n, hkv, d, generator=g).to(kv_dtype)
    vc = torch.randn(slots_n, hkv, d, generator=g).to(kv_dtype)
    qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=g).to(BF)
    pos = torch.tensor([n - 1 for n in lens], dtype=torch.int64)
    return table, kc, vc, qkv, pos


def _slots_of(table: torch.Tensor, ps: int, n: int, i: int) -> torch.Tensor:
    t = torch.arange(n)
    return table[i, t // ps].long() * ps + t % ps


@pytest.mark.parametrize(("hq", "hkv", "d", "ps", "lens", "splits", "norm", "kv_dtype"), [
    (16, 8, 128, 16, [1080], 16, True, BF),  # Qwen3-0.6B's geometry, batch 1
    (32, 4, 128, 16, [1080], 32, True, BF),  # Qwen3-30B-A3B's, batch 1: the group in two programs
    (16, 2, 64, 16, [37, 300], 4, False, BF),  # two requests, a group of 8
    (8, 2, 64, 16, [1, 37, 300], 4, False, BF),  # a one-token request, splits left empty
    (4, 1, 32, 8, [5, 64], 3, True, BF),
    (4, 2, 64, 16, [33, 200], 5, True, torch.float8_e4m3fn),  # an fp8 pool: quantized new K/V
])
def test_decode_attention_matches_torch(hq: int, hkv: int, d: int, ps: int, lens: list[int], splits: int,
                                        norm: bool, kv_dtype: torch.dtype) -> None:
    b = len(lens)
    table, kc, vc, qkv, pos = _decode_case(b, hq, hkv, d, ps, lens, kv_dtype, seed=hq + d + b)
    rot = ops.Rotary(1.0 / (1e4 ** (torch.arange(0, d, 2).float() / d)), d, 2048)
    cache = rot.cos_sin_cache(torch.device("cpu"))
    g = torch.Generator().manual_seed(7)
    qw, kw = torch.rand(d, generator=g).to(BF) + 0.5, torch.rand(d, generator=g).to(BF) + 0.5
    ws = triton_ops.decode_workspace(b, hkv, d, 64, torch.device("cpu"))
    new_slots = torch.stack([_slots_of(table, ps, n, i)[-1] for i, n in enumerate(lens)])

    # reference: the tested prologue kernel stores K/V and gives q, then SDPA over each request's slots
    kr, vr = kc.clone(), vc.clone()
    q = triton_ops.qk_norm_rope_store(qkv, hq, hkv, d, pos, cache, new_slots, kr, vr,
                                      qw if norm else None, kw if norm else None, 1e-6)
    ref = torch.empty(b, hq, d)
    for i, n in enumerate(lens):
        s = _slots_of(table, ps, n, i)
        k, v = kr[s].to(BF).transpose(0, 1), vr[s].to(BF).transpose(0, 1)  # [Hkv, n, D]
        ref[i] = F.scaled_dot_product_attention(q[i].float()[:, None], k.float(), v.float(), enable_gqa=True)[:, 0]

    # fused: the prologue in the same launch, the new K/V written by the kernel
    kf, vf = kc.clone(), vc.clone()
    out = triton_ops.decode_attention(qkv, hq, hkv, d, pos, table, kf, vf, ps, ws, splits, cache,
                                      qw if norm else None, kw if norm else None, 1e-6)
    assert out.shape == (b, hq, d) and out.dtype == BF
    torch.testing.assert_close(out.float(), ref, atol=0.01, rtol=0.01)
    assert torch.equal(kf.view(torch.uint8), kr.view(torch.uint8))  # same slots, same bits
    assert torch.equal(vf.view(torch.uint8), vr.view(torch.uint8))
    assert not ws[2].any()  # the merge counters are back to zero for the next launch

    # plain: q given, K/V already in the pool (the same kernel without the prologue)
    out2 = triton_ops.decode_attention(q.reshape(b, hq * d), hq, hkv, d, pos, table, kr, vr, ps, ws, splits)
    torch.testing.assert_close(out2.float(), ref, atol=0.01, rtol=0.01)
    # a group of 8 or more in two programs: each row the one-program kernel's bits
    if hq // hkv >= 8:
        out3 = triton_ops.decode_attention(q.reshape(b, hq * d), hq, hkv, d, pos, table, kr, vr, ps, ws, splits,
                                           parts=2)
        assert torch.equal(out3, out2)
        assert not ws[2].any()


def test_decode_parts_split_only_large_groups_on_a_small_grid() -> None:
    sms = 132
    assert triton_ops.decode_parts(1, 32, 4, triton_ops.decode_splits(1, 4, sms), sms) == 2  # Qwen3-30B-A3B
    assert triton_ops.decode_parts(8, 32, 4, triton_ops.decode_splits(8, 4, sms), sms) == 1  # a fuller grid
    assert triton_ops.decode_parts(1, 32, 8, triton_ops.decode_splits(1, 8, sms), sms) == 1  # Llama's group of 4
    assert triton_ops.decode_parts(1, 36, 4, 8, sms) == 1  # a group of 9 does not halve


def test_decode_attention_rejects_bad_shapes() -> None:
    ws = triton_ops.decode_workspace(1, 2, 64, 8, torch.device("cpu"))
    table = torch.zeros(1, 4, dtype=torch.int32)
    kc = torch.zeros(64, 2, 64, dtype=BF)
    with pytest.raises(ValueError, match="decode_attention"):
        triton_ops.decode_attention(torch.zeros(1, 5 * 64, dtype=BF), 4, 2, 64, torch.zeros(1, dtype=torch.int64),
                                    table, kc, kc, 16, ws, 2)
    with pytest.raises(ValueError, match="workspace"):
        triton_ops.decode_attention(torch.zeros(3, 4 * 64, dtype=BF), 4, 2, 64, torch.zeros(3, dtype=torch.int64),
                                    torch.zeros(3, 4, dtype=torch.int32), kc, kc, 16, ws, 2)


def test_backend_runs_the_triton_decode_kernel_eager_and_in_graph_buffers() -> None:
    """FlashInferAttention's host side of the triton decode kernel (the table it passes, the
    prologue through attend_qkv, the padded graph rows) against TorchAttention."""
    from test_flashinfer_logic import make_backend, plan_padded

    from engine.layers.attention import TorchAttention
    from engine.layers.forward import ForwardBatch
    from engine.layers.kv_pool import KVPool

    hq, hkv, d, ps = 4, 2, 32, 4
    g = torch.Generator().manual_seed(3)
    pools = [KVPool(1, 32, ps, hkv, d, BF, "cpu") for _ in range(2)]
    for p in pools:
        p.k[0].copy_(torch.randn(p.k[0].shape, generator=torch.Generator().manual_seed(9)))
        p.v[0].copy_(torch.randn(p.v[0].shape, generator=torch.Generator().manual_seed(10)))
    fi = make_backend(pools[1], hq)
    fi._triton_ok, fi.tuning = True, load_tuning("NVIDIA H200")  # triton decode up to batch 16 there
    fi._init_triton()
    rot = ops.Rotary(1.0 / (1e4 ** (torch.arange(0, d, 2).float() / d)), d, 64)
    cache = rot.cos_sin_cache(torch.device("cpu"))
    qw, kw = torch.rand(d, generator=g).to(BF) + 0.5, torch.rand(d, generator=g).to(BF) + 0.5

    def reference(batch: ForwardBatch, qkv: torch.Tensor) -> torch.Tensor:
        q = triton_ops.qk_norm_rope_store(qkv, hq, hkv, d, batch.positions, cache, batch.out_slots,
                                          pools[0].k[0], pools[0].v[0], qw, kw, 1e-6)
        ref_be = TorchAttention("cpu")
        ref_be.prepare(batch)
        return ref_be.attend(q, 0, batch, pools[0]).float()

    # eager decode: the batch's own page table
    batch = ForwardBatch.from_requests([([3], 6, [3, 5]), ([4], 3, [7])], ps, "cpu")
    qkv = torch.randn(2, (hq + 2 * hkv) * d, generator=g).to(BF)
    fi.prepare(batch)
    assert fi._table_kernel == "triton" and fi._table_args[0] is batch.page_table
    got = fi.attend_qkv(qkv, 0, batch, pools[1], batch.positions, cache, qw, kw, 1e-6)
    torch.testing.assert_close(got.float(), reference(batch, qkv), atol=0.01, rtol=0.01)
    assert torch.equal(pools[0].k[0], pools[1].k[0]) and torch.equal(pools[0].v[0], pools[1].v[0])
    # attend (K/V already stored, q given): the same kernel without the prologue
    q = torch.randn(2, hq, d, generator=g).to(BF)
    ref_be = TorchAttention("cpu")
    ref_be.prepare(batch)
    torch.testing.assert_close(fi.attend(q, 0, batch, pools[1]).float(), ref_be.attend(q, 0, batch, pools[0]).float(),
                               atol=0.01, rtol=0.01)

    # graph decode of padded size 4: static positions, the table set as run_decode sets it
    assert fi.graph_wrapper(4) is None and fi._table_kernel == "triton"
    batch = ForwardBatch.from_requests([([5], 7, [3, 5]), ([6], 4, [7, 9])], ps, "cpu")
    qkv = torch.randn(4, (hq + 2 * hkv) * d, generator=g).to(BF)  # 2 real rows + 2 padding rows
    fi._g_table.fill_(-1)  # stale columns past each row's pages must not be read
    plan_padded(fi, 4, batch)
    positions = torch.tensor([7, 4, 0, 0])
    got = fi.attend_qkv(qkv, 0, batch, pools[1], positions, cache, qw, kw, 1e-6)
    torch.testing.assert_close(got[:2].float(), reference(batch, qkv[:2]), atol=0.01, rtol=0.01)
    assert torch.isfinite(got.float()).all()
    real = torch.ones(pools[0].k[0].shape[0], dtype=torch.bool)
    real[:ps] = False  # the padding rows wrote their K/V into the padding page
    assert torch.equal(pools[0].k[0][real], pools[1].k[0][real])


def test_invariant_attention_kernel_matches_the_torch_path() -> None:
    """Deterministic inference's CUDA kernel (interpreted) against its torch path on CPU, over a
    batch with a fresh prompt, a chunk behind a cached prefix and two decodes; and a token's
    output is the same bits when its request runs alone (the invariance, in the interpreter)."""
    from engine.layers import batch_invariant as bi
    from engine.layers.kv_pool import KVPool

    g = torch.Generator().manual_seed(3)
    hq, hkv, d, ps = 4, 2, 32, 16
    pool = KVPool(1, 64, ps, hkv, d, torch.float32, "cpu")
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=g))
    table = torch.randperm(63, generator=g)[:60].add(1).view(4, 15).to(torch.int32)  # 4 requests x 15 pages
    seqs, lens = [40, 150, 77, 9], [40, 30, 1, 1]
    q = torch.randn(sum(lens), hq, d, generator=g)
    want = bi.attend(q, bi.plan(table, seqs, lens, ps), pool, 0)
    blocks = bi.plan(table, seqs, lens, ps, kernel=True)
    got = triton_ops.invariant_attention(q, pool.k[0], pool.v[0], ps, table, blocks.blocks, blocks.chunk)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    alone = bi.plan(table[1:2], seqs[1:2], lens[1:2], ps, kernel=True)
    one = triton_ops.invariant_attention(q[40:70], pool.k[0], pool.v[0], ps, table[1:2], alone.blocks,
                                         alone.chunk)
    assert torch.equal(one, got[40:70])


def test_add_norm_gemv_stores_the_normalized_rows() -> None:
    """h_out (one tile): the first program also stores RMSNorm(x + residual) * weight for another
    reader (MoE.add_norm_forward's experts); a looped config refuses it."""
    g = torch.Generator().manual_seed(6)
    m, n, k = 3, 24, 640
    w = torch.randn(n, k, generator=g).to(BF)
    x, r = torch.randn(m, k, generator=g).to(BF), torch.randn(m, k, generator=g).to(BF)
    nw = torch.rand(k, generator=g).to(BF) + 0.5
    y, r_out, h = triton_ops.add_norm_gemv(x, r, nw, 1e-6, w, 8, 1024, 4, 1, h_out=True)
    want = _rms((x.float() + r.float()).to(BF), nw).float()
    torch.testing.assert_close(h.float(), want, atol=1e-2, rtol=2**-7)  # <= 1 bf16 ulp
    assert torch.equal(y, triton_ops.add_norm_gemv(x, r, nw, 1e-6, w, 8, 1024, 4, 1)[0])
    with pytest.raises(ValueError, match="add_norm_gemv"):
        triton_ops.add_norm_gemv(x[:1, :512], r[:1, :512], nw[:512], 1e-6, w[:, :512], 8, 256, 4, 3, h_out=True)


@pytest.mark.parametrize("with_ids", [False, True])
def test_race_noise_is_the_samplers_hash(with_ids: bool) -> None:
    """race_noise_ subtracts the sampler's noise (engine/run/sampler.py `_log_exp_noise`: the
    splitmix64 hash of seed, position and token id, then log(-log(u))); a wrong bit of the hash
    would move a value far off, so closeness checks the hash exactly."""
    from engine.run.noise import _UNIFORM_BITS
    from engine.run.sampler import Sampler

    g = torch.Generator().manual_seed(11)
    b, v = 5, 3000
    sampler = Sampler(v, 4, "cpu")
    seeds = torch.tensor([1, -7, 2**62 + 5, 0, 123456789], dtype=torch.int64)
    positions = torch.tensor([0, 1, 4096, 70000, 3], dtype=torch.int64)
    ids = torch.stack([torch.randperm(v, generator=g)[:700] for _ in range(b)]) if with_ids else None
    cand = torch.randn(b, v if ids is None else 700, generator=g)
    want = cand - sampler._log_exp_noise(seeds, positions, ids)
    got = triton_ops.race_noise_(cand.clone(), seeds, positions, ids, _UNIFORM_BITS)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_sampler_warms_both_race_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampler.warm (engine/run/warmup.py calls it before ready) runs the race's kernel over the
    whole vocabulary and over candidate ids, whatever --max-running-requests lets the warm-up
    batch sample; here on the CPU through triton's interpreter."""
    from engine.run.sampler import Sampler

    modes: list[bool] = []
    real = triton_ops.race_noise_
    monkeypatch.setattr(triton_ops, "race_noise_", lambda cand, s, p, ids, bits: (modes.append(ids is not None),
                                                                                   real(cand, s, p, ids, bits))[1])
    sampler = Sampler(100, 1, "cpu")
    sampler._fused_noise = True  # as on CUDA
    sampler.warm()
    assert sorted(modes) == [False, True]


def test_rank_keys_are_the_torch_keys() -> None:
    """triton_ops.rank_keys (one launch) gives ranking.rank_keys' int64 keys bit for bit: signed
    values, ties, -0.0 beside +0.0, NaNs of either sign, infinities, a row longer than a block."""
    from engine.run.ranking import rank_keys

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 2500, generator=g).bfloat16().float()  # bf16 values: many ties
    x[0, :6] = torch.tensor([0.0, -0.0, float("nan"), -float("nan"), float("inf"), -float("inf")])
    x[2, 100:200] = 1.5
    wide = torch.zeros(3, 2600)
    wide[:, :2500] = x
    for src in (x, wide[:, :2500]):  # a row stride past its width
        assert torch.equal(triton_ops.rank_keys(src), rank_keys(src))
