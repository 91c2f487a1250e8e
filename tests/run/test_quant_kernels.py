"""The quantized projections' triton kernels (engine/layers/quant_kernels.py, the fp8 GEMV in
triton_kernels.py) against float32 x @ dequantized W^T, run by triton's interpreter on the CPU.
The kernels that round to e4m3 (activation quantization) are checked on the GPU only
(tests/gpu/test_quant_gpu.py): the interpreter's float-to-fp8 conversion does not round as the
hardware does. Skipped where triton is not installed."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels module is first imported
pytest.importorskip("triton")

from engine.layers import ops, quant, quant_ops, triton_ops  # noqa: E402
from engine.layers.parallel import Linear  # noqa: E402


def _linear(n: int, k: int, fmt: str, seed: int) -> Linear:
    torch.manual_seed(seed)
    lin = Linear(k, n, False, torch.float32)
    lin.weight.data.normal_(0, 0.05)
    quant.quantize(lin, fmt)
    return lin


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


@pytest.mark.parametrize(("rows", "block_k", "silu_mul"), [(1, 128, False), (3, 512, False), (1, 128, True)])
def test_fp8_gemv_scales_each_row(rows: int, block_k: int, silu_mul: bool) -> None:
    lin = _linear(40, 512, "fp8_row", rows)
    x = torch.randn(rows, 1024 if silu_mul else 512)
    ref = (ops.silu_and_mul(x) if silu_mul else x) @ quant.dequantize(lin).t()
    y = triton_ops.gemv(x, lin.weight, 16, block_k, 4, 1, silu_mul=silu_mul, scale=lin.weight_scale)
    assert _rel(y, ref) < 1e-5


@pytest.mark.parametrize(("m", "n", "k"), [(1, 64, 128), (5, 70, 96), (33, 64, 256)])
def test_nvfp4_gemm_dequantizes_in_registers(m: int, n: int, k: int) -> None:
    lin = _linear(n, k, "nvfp4", m)
    x = torch.randn(m, k)
    assert _rel(quant_ops.nvfp4_gemm(x, lin.weight, lin.weight_scale, lin.weight_scale_2),
                x @ quant.dequantize(lin).t()) < 1e-5


@pytest.mark.parametrize(("fmt", "m"), [("fp8_row", 1), ("fp8_row", 20), ("fp8_block", 7), ("fp8_block", 40)])
def test_fp8_weight_only_gemm_scales_rows_or_blocks(fmt: str, m: int) -> None:
    lin = _linear(200, 384, fmt, m)
    x = torch.randn(m, 384)
    y = quant_ops.fp8_weight_only_gemm(x, lin.weight, lin.weight_scale)
    assert _rel(y, x @ quant.dequantize(lin).t()) < 1e-5


@pytest.mark.parametrize(("m", "n", "k", "config"),
                         [(5, 70, 256, (16, 32, 64, 4, 1)), (40, 64, 128, (32, 64, 128, 4, 1))])
def test_fp8_row_gemm_kernel_scales_rows_of_both(m: int, n: int, k: int, config: tuple) -> None:
    """The triton row-scaled fp8 GEMM (the H200 tuning's choice at 17-256 rows for some shapes)
    on already-quantized x: (q * s) @ (w * scale)^T, partial tiles at both edges."""
    lin = _linear(n, k, "fp8_row", m)
    q = (torch.randn(m, k) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(m, 1) * 0.01 + 1e-3
    ref = (q.float() * s) @ quant.dequantize(lin).t()
    assert _rel(quant_ops.fp8_row_mm(q, s, lin.weight, lin.weight_scale, torch.float32, config), ref) < 1e-5
    with pytest.raises(ValueError, match="block_k"):
        quant_ops.fp8_row_mm(q[:, :96].contiguous(), s, lin.weight[:, :96].contiguous(), lin.weight_scale,
                             torch.float32, (16, 32, 64, 4, 1))


@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_quant_scales_and_residual(with_residual: bool) -> None:
    """The norm that quantizes (fp8 row-scaled linears from 17 rows): its scale is amax / 448 of
    RMSNorm(x + r) * w and the residual is updated in place. The e4m3 values themselves are
    checked on the GPU (tests/gpu/test_quant_gpu.py): the interpreter's fp8 conversion is not the
    hardware's."""
    torch.manual_seed(8)
    m, k = 5, 1000
    x, r = torch.randn(m, k).to(torch.bfloat16), torch.randn(m, k).to(torch.bfloat16)
    nw = (torch.rand(k) + 0.5).to(torch.bfloat16)
    res = r.clone() if with_residual else None
    q, s = quant_ops.add_rms_norm_quant(x, res, nw, 1e-6)
    stream = (x.float() + r.float()).to(torch.bfloat16) if with_residual else x
    ref = ops._rms_norm_torch(stream, nw, 1e-6).float()
    assert q.dtype == torch.float8_e4m3fn and q.shape == (m, k) and s.shape == (m, 1)
    torch.testing.assert_close(s, ref.abs().amax(1, keepdim=True) / 448, rtol=2e-2, atol=0)
    if with_residual:  # within one bf16 rounding (the interpreter rounds bf16 its own way too)
        torch.testing.assert_close(res.float(), stream.float(), rtol=2**-7, atol=0)
    with pytest.raises(ValueError, match="residual"):
        quant_ops.add_rms_norm_quant(x, r[:, :-1].contiguous(), nw, 1e-6)


def test_silu_mul_quant_scales() -> None:
    torch.manual_seed(9)
    m, k = 3, 5000  # two column blocks of 4096, the second partial
    h = torch.randn(m, 2 * k).to(torch.bfloat16)
    q, s = quant_ops.silu_mul_quant(h)
    ref = ops.silu_and_mul(h).float()
    assert q.dtype == torch.float8_e4m3fn and q.shape == (m, k)
    torch.testing.assert_close(s, ref.abs().amax(1, keepdim=True) / 448, rtol=2e-2, atol=0)


@pytest.mark.parametrize("mn_major", [False, True])
@pytest.mark.parametrize(("m", "k"), [(1, 256), (5, 300), (37, 384)])  # one row a program, 16-row tiles with a tail
def test_group_quant_scales_each_row_group_in_either_layout(m: int, k: int, mn_major: bool) -> None:
    torch.manual_seed(m)
    x = torch.randn(m, k).to(torch.bfloat16)
    q, s = quant_ops.group_quant(x, mn_major=mn_major)
    g = -(-k // 128)
    amax = torch.nn.functional.pad(x.float(), (0, g * 128 - k)).view(m, g, 128).abs().amax(2)
    assert q.shape == (m, k) and s.shape == (m, g)
    torch.testing.assert_close(s, amax / 448, rtol=1e-6, atol=0)
    if mn_major:  # the GEMMs' layout: tokens contiguous, each group's column padded to 4 rows
        assert s.stride() == (1, -(-m // 4) * 4)
    deq = q.float() * s.repeat_interleave(128, 1)[:, :k]
    assert _rel(deq, x.float()) < 0.08
