"""engine/layers/cpu_kernels: the CPU's elementwise C kernels (add + RMSNorm, SiLU-and-mul, rotary).

Close to a float64 reference (within one rounding of the dtype), the residual sum exactly torch's,
and a row's bits the same whatever rows are beside it and however the rows are split between threads."""

from __future__ import annotations

import pytest
import torch

from engine.layers import cpu_kernels, ops

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler builds the CPU kernels")

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1e-2, 1e-2)}  # (rtol, atol): one rounding of the dtype


def _rand(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


def _norm_ref(total: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = total.double()
    return w.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [576, 45])  # 45: not a multiple of the 16 lanes
def test_add_rms_norm_close_to_float64_and_sum_exact(dtype: torch.dtype, dim: int) -> None:
    wide = _rand(37, dim + 7, dtype=dtype, seed=1)
    x = wide[:, :dim]  # rows strided: the kernel reads a row stride
    res, w = _rand(37, dim, dtype=dtype, seed=2), _rand(dim, dtype=dtype, seed=3)
    out, total = cpu_kernels.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(total, x + res)  # torch's add, bit for bit
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.double(), _norm_ref(total, w, 1e-5), rtol=rtol, atol=atol)
    alone, same = cpu_kernels.add_rms_norm(x, None, w, 1e-5)
    assert same is x
    torch.testing.assert_close(alone.double(), _norm_ref(x, w, 1e-5), rtol=rtol, atol=atol)
    heads = wide[:, : 4 * 9].view(37, 4, 9)  # [T, heads, dim], rows and heads strided (a q/k norm)
    hw = w[:9].contiguous()
    torch.testing.assert_close(cpu_kernels.add_rms_norm(heads, None, hw, 1e-5)[0].double(), _norm_ref(heads, hw, 1e-5),
                               rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_bits_do_not_depend_on_its_batch_or_the_split(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """Each kernel on 300 rows (split between threads) and on each row alone: equal bits."""
    x, res, w = _rand(300, 576, dtype=dtype, seed=4), _rand(300, 576, dtype=dtype, seed=5), _rand(576, dtype=dtype,
                                                                                                seed=6)
    gu = _rand(300, 2 * 384 + 5, dtype=dtype, seed=7)[:, : 2 * 384]  # rows strided
    cos, sin = ops.rope_cos_sin(torch.arange(300) * 3, 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)), dtype)
    qkv = _rand(300, 5 * 64, dtype=dtype, seed=8)
    monkeypatch.setattr(cpu_kernels, "SPLIT_VALUES", 1)  # every call split between the threads
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert len(cpu_kernels._row_ranges(300, 576)) == 3
    norm, silu, rot = cpu_kernels.add_rms_norm(x, res, w, 1e-6)[0], cpu_kernels.silu_mul(gu), qkv.clone()
    qn = cpu_kernels.add_rms_norm(qkv[:, :192].view(300, 3, 64), None, w[:64], 1e-6)[0]
    cpu_kernels.rope_(rot, 4, 64, cos, sin)
    for i in (0, 1, 150, 299):
        assert torch.equal(cpu_kernels.add_rms_norm(x[i : i + 1], res[i : i + 1], w, 1e-6)[0][0], norm[i])
        assert torch.equal(ops.rms_norm(qkv[i : i + 1, :192].view(1, 3, 64), w[:64], 1e-6)[0], qn[i])
        assert torch.equal(cpu_kernels.silu_mul(gu[i : i + 1])[0], silu[i])
        one = qkv[i : i + 1].clone()
        cpu_kernels.rope_(one, 4, 64, cos[i : i + 1].contiguous(), sin[i : i + 1].contiguous())
        assert torch.equal(one[0], rot[i])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_close_to_float64(dtype: torch.dtype) -> None:
    x = _rand(33, 2 * 200, dtype=dtype, seed=9)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamp, both ends, and zeros
    g, u = x[:, :200].double(), x[:, 200:].double()
    want = g * torch.sigmoid(g) * u
    rtol, atol = TOL[dtype]
    got = cpu_kernels.silu_mul(x)
    torch.testing.assert_close(got.double(), want, rtol=2 * rtol, atol=atol)
    torch.testing.assert_close(got, ops.F.silu(x[:, :200]) * x[:, 200:], rtol=2 * rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_close_to_float64_and_other_heads_untouched(dtype: torch.dtype) -> None:
    t, d, heads = 9, 32, 3
    x = _rand(t, 5 * d, dtype=dtype, seed=10)
    cos, sin = ops.rope_cos_sin(torch.arange(t) + 11, 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), dtype)
    got = x.clone()
    cpu_kernels.rope_(got, heads, d, cos, sin)
    assert torch.equal(got[:, heads * d :], x[:, heads * d :])
    want = ops.apply_rope(x[:, : heads * d].view(t, heads, d).double(), cos.double(), sin.double())
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got[:, : heads * d].view(t, heads, d).double(), want, rtol=rtol, atol=2 * atol)


def test_ops_take_the_kernels_on_cpu_and_torch_without_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """ops.* on CPU bf16 go through the C kernels; with the library absent, through torch: close."""
    x, res, w = _rand(8, 96, dtype=torch.bfloat16, seed=11), _rand(8, 96, dtype=torch.bfloat16, seed=12), \
        _rand(96, dtype=torch.bfloat16, seed=13)
    fused = ops.fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(fused[0], cpu_kernels.add_rms_norm(x, res, w, 1e-6)[0])
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    plain = ops.fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(fused[1], plain[1])
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-2, atol=1e-2)


def test_rotary_apply_rotates_fresh_heads_in_place() -> None:
    """Rotary.apply on CPU (Qwen3's path: q and k fresh from their norms) takes the C kernel, in place."""
    t, d = 7, 32
    rotary = ops.Rotary(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), d, 64)
    state = rotary.prepare(torch.arange(t) + 3, torch.bfloat16)
    q, k = _rand(t, 4, d, dtype=torch.bfloat16, seed=14), _rand(t, 2, d, dtype=torch.bfloat16, seed=15)
    qi, ki = q.clone(), k.clone()
    qo, ko = rotary.apply(qi, ki, state)
    assert qo.data_ptr() == qi.data_ptr() and ko.data_ptr() == ki.data_ptr()
    for got, x in ((qo, q), (ko, k)):
        torch.testing.assert_close(got, ops.apply_rope(x, state.cos, state.sin), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_rows_is_index_copy_from_a_strided_view(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    qkv = _rand(300, 5 * 16, dtype=dtype, seed=16)
    k = qkv[:, 2 * 16 : 4 * 16].view(300, 2, 16)  # heads adjacent, rows 80 apart
    slots = torch.randperm(700, generator=torch.Generator().manual_seed(17))[:300]
    want = torch.zeros(700, 2, 16, dtype=dtype).index_copy_(0, slots, k)
    monkeypatch.setattr(cpu_kernels, "SPLIT_VALUES", 1)  # split between threads too
    got = torch.zeros(700, 2, 16, dtype=dtype)
    cpu_kernels.scatter_rows_(got, slots, k)
    assert torch.equal(got, want)
    with pytest.raises(IndexError, match="1 of 300 slots"):
        cpu_kernels.scatter_rows_(got, torch.cat([slots[:299], torch.tensor([700])]), k)


def test_race_noise_is_the_torch_noise_within_rounding_and_a_rows_bits_its_own(monkeypatch: pytest.MonkeyPatch
                                                                                ) -> None:
    """The sampler's race noise in C: the torch ops' log(-log u) within a few ulps, over whole rows
    and over candidate ids (an id's noise is the same in both), each row's bits the same alone as
    in a batch split between threads, and the candidates' strided rows read as such."""
    from engine.run.noise import _UNIFORM_BITS
    from engine.run.sampler import Sampler

    vocab, rows = 5003, 9
    seeds = torch.tensor([3, -7, 2**62, 0, 11, 12, 13, 99, -(2**63)], dtype=torch.int64)
    positions = torch.arange(rows, dtype=torch.int64) * 1000
    ref = -Sampler(vocab, 1, "cpu")._log_exp_noise(seeds, positions, None)
    monkeypatch.setattr(cpu_kernels, "SPLIT_VALUES", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    whole = cpu_kernels.race_noise_(torch.zeros(rows, vocab), seeds, positions, None, _UNIFORM_BITS)
    torch.testing.assert_close(whole, ref, rtol=2e-6, atol=2e-6)
    ids = torch.randint(0, vocab, (rows, 64 + 3), generator=torch.Generator().manual_seed(1))[:, :64]
    wide = torch.zeros(rows, 80)
    picked = cpu_kernels.race_noise_(wide[:, :64], seeds, positions, ids, _UNIFORM_BITS)
    assert torch.equal(picked, whole.gather(1, ids)) and not wide[:, 64:].any()
    for i in (0, 4, 8):
        alone = cpu_kernels.race_noise_(torch.zeros(1, vocab), seeds[i : i + 1], positions[i : i + 1], None,
                                        _UNIFORM_BITS)
        assert torch.equal(alone[0], whole[i])
    assert not cpu_kernels.race_noise_ok(torch.zeros(2, 4, dtype=torch.float64), None)
    assert not cpu_kernels.race_noise_ok(torch.zeros(4, 2).t(), None)
