"""The GEMV after attention asking the L2 for its weight (triton_ops.gemv's prefetch) on the GPU: a
prefetch moves no value, so the outputs keep their bits with it on and off, at o_proj's shapes
(Llama-3.1-8B, Qwen3-30B-A3B), bf16 and fp8 weights, alone and with the split norm (linear_add_norm)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from engine.layers import triton_ops  # noqa: E402
from engine.layers.tuning import kernel_tuning  # noqa: E402


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("shape", [(4096, 4096), (2048, 4096)])
def test_prefetch_keeps_the_bits(shape: tuple[int, int], fp8: bool) -> None:
    n, k = shape
    dev = torch.device("cuda")
    cfg = kernel_tuning(dev).gemv_config(n, k, fp8=fp8)
    if cfg is None or triton_ops.l2_prefetch_programs(torch.empty(16, device=dev), 64) == 0:
        pytest.skip("no triton GEMV or no bulk prefetch on this GPU")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16, generator=g)
    w = (torch.randn(n, k, device=dev, generator=g) / k**0.5).to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
    scale = torch.rand(n, device=dev, generator=g) + 0.5 if fp8 else None
    base = triton_ops.gemv(x, w, *cfg, scale=scale)
    on = triton_ops.gemv(x, w, *cfg, scale=scale, prefetch=True)
    assert torch.equal(base, on)
    ref = (x.float() @ w.float().T) * (scale if fp8 else 1.0)
    torch.testing.assert_close(on.float(), ref, rtol=2e-2, atol=2e-2)
    r0 = torch.randn(1, n, device=dev, dtype=torch.bfloat16, generator=g)
    nw = torch.rand(n, device=dev, dtype=torch.bfloat16, generator=g)
    outs = []
    for prefetch in (False, True):
        r = r0.clone()
        pre = triton_ops.gemv(x, w, *cfg, scale=scale, norm_out=(r, nw, 1e-6), prefetch=prefetch)
        outs.append((pre.u, pre.ss, r))
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


@pytest.mark.parametrize("shape", [(4096, 4096), (2048, 4096)])
def test_cuda_gemv_prefetch_keeps_the_bits(shape: tuple[int, int]) -> None:
    """Deterministic inference's CUDA GEMV (invariant_gemv.cu) with its first blocks' bulk prefetch:
    the same bits as without, 1 and 8 rows, PDL on."""
    from engine.layers import invariant_gemm, invariant_gemv

    n, k = shape
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    w = (torch.randn(n, k, device=dev, generator=g) / k**0.5).to(torch.bfloat16)
    if invariant_gemv.library(invariant_gemv.arch(dev)) is None:
        pytest.skip("the CUDA GEMV is not built here")
    slices = invariant_gemm.split(n, k)
    for m in (1, 8):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
        outs = []
        for prefetch in (False, True):
            out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            assert invariant_gemv.gemv(x, w, None, out, slices, invariant_gemv.stages_for(slices, k), True,
                                       prefetch=prefetch)
            outs.append(out)
        torch.cuda.synchronize()
        assert torch.equal(*outs)
        torch.testing.assert_close(outs[1].float(), x.float() @ w.float().T, rtol=2e-2, atol=2e-2)
