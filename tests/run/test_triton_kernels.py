"""The triton kernels (engine/run/triton_kernels.py) against torch references, run by triton's
interpreter on the CPU. Skipped where triton is not installed (the CPU CI image); on a machine
with triton: `TRITON_INTERPRET=1 pytest tests/run/test_triton_kernels.py`. The GPU check
(scripts/gpu_check.py) covers the compiled kernels inside the model."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels module is first imported
pytest.importorskip("triton")

from engine.run import ops, triton_ops  # noqa: E402

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
                                             (64, 512, (16, 256, 4, 4))])
def test_gemv_matches_matmul(n: int, k: int, cfg: tuple) -> None:
    g = torch.Generator().manual_seed(n)
    w, x = torch.randn(n, k, generator=g).to(BF), torch.randn(1, k, generator=g).to(BF)
    ref = x.float() @ w.float().T
    y = triton_ops.gemv(x, w, *cfg)
    assert y.shape == (1, n) and y.dtype == BF
    torch.testing.assert_close(y.float(), ref, atol=0.01 * ref.abs().max().item(), rtol=0)
    with pytest.raises(ValueError, match="gemv"):
        triton_ops.gemv(x[:, :-1], w[:, :-1], *cfg)  # K not a multiple of block_k


def test_gemv_with_silu_mul_folded() -> None:
    g = torch.Generator().manual_seed(1)
    n, k = 48, 1024
    w, h = torch.randn(n, k, generator=g).to(BF), torch.randn(1, 2 * k, generator=g).to(BF)
    gate, up = h.chunk(2, -1)
    ref = (F.silu(gate.float()) * up.float()).to(BF).float() @ w.float().T
    y = triton_ops.gemv(h, w, 8, 512, 4, 3, silu_mul=True)
    torch.testing.assert_close(y.float(), ref, atol=0.01 * ref.abs().max().item(), rtol=0)


@pytest.mark.parametrize("with_residual", [True, False])
def test_add_norm_gemv(with_residual: bool) -> None:
    g = torch.Generator().manual_seed(2)
    n, k = 40, 1024
    w = torch.randn(n, k, generator=g).to(BF)
    x, r = torch.randn(1, k, generator=g).to(BF), torch.randn(1, k, generator=g).to(BF)
    nw = torch.rand(k, generator=g).to(BF) + 0.5
    y, r_out = triton_ops.add_norm_gemv(x, r if with_residual else None, nw, 1e-6, w, 8, 512, 4, 3)
    s = x.float() + (r.float() if with_residual else 0)
    ref = _rms(s.to(BF), nw).float() @ w.float().T
    torch.testing.assert_close(y.float(), ref, atol=0.01 * ref.abs().max().item(), rtol=0)
    if with_residual:
        torch.testing.assert_close(r_out.float(), s.to(BF).float(), atol=1e-3, rtol=2**-7)  # <= 1 bf16 ulp
        assert r_out is not x and r_out is not r
    else:
        assert r_out is x  # layer 0: the input is the residual stream


def test_gemv_config_is_none_off_cuda() -> None:
    assert triton_ops.gemv_config(torch.zeros(64, 1024, dtype=BF)) is None  # CPU: cuBLAS/torch stays
