"""Quantized projections on CUDA (issue 23): each GEMM against float32 x @ dequantized W^T on
the same weights, and whole models loaded from each on-disk format against the same checkpoint
dequantized on the CPU in float32."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "models"))


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


@pytest.mark.parametrize("fmt", ["fp8_row", "fp8_block", "nvfp4"])
@pytest.mark.parametrize("m", [1, 3, 17, 300])
@pytest.mark.parametrize(("n", "k"), [(384, 256), (1024, 4096), (200, 272), (16384, 4096)])
def test_quantized_gemm_matches_dequantized(fmt: str, m: int, n: int, k: int) -> None:
    from engine.layers import quant
    from engine.layers.parallel import Linear

    torch.manual_seed(m * 7 + n)
    lin = Linear(k, n, False, torch.bfloat16).cuda()
    lin.weight.data.normal_(0, 0.02)
    quant.quantize(lin, fmt)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ quant.dequantize(lin).t()
    y = lin(x)
    # weight-only kernels (GEMV, NVFP4) keep x in bf16; W8A8 adds e4m3 rounding of x (~2^-4 relative)
    weight_only = fmt == "nvfp4" or (fmt == "fp8_row" and lin._local_gemv(x) is not None)
    if fmt == "fp8_row" and n == 16384 and m <= 3 and "H200" in torch.cuda.get_device_name():
        assert weight_only == (m == 1), "the H200's one 4 x 4096 tile rule: a GEMV at one row only"
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert _rel(y, ref) < (0.01 if weight_only else 0.05), (fmt, m, n, k)


def test_fp8_gemv_folds_silu_and_mul() -> None:
    from engine.layers import ops, quant
    from engine.layers.parallel import Linear

    torch.manual_seed(1)
    lin = Linear(4096, 1024, False, torch.bfloat16).cuda()
    lin.weight.data.normal_(0, 0.02)
    quant.quantize(lin, "fp8_row")
    h = torch.randn(1, 8192, device="cuda", dtype=torch.bfloat16)
    assert lin._local_gemv(h[:, :4096]) is not None, "the H200 tuning turns the GEMV on at this shape"
    ref = ops.silu_and_mul(h).float() @ quant.dequantize(lin).t()
    assert _rel(lin.forward_silu_mul(h), ref) < 0.01


@pytest.mark.parametrize("fmt", ["fp8-block", "ct-channel", "modelopt-fp8", "modelopt-nvfp4"])
def test_checkpoint_on_cuda_matches_cpu_dequantized(tmp_path: Path, fmt: str) -> None:
    from model_harness import make_hf_dir
    from test_quant import MODELS

    from engine.layers.attention import TorchAttention
    from engine.layers.forward import ForwardBatch
    from engine.layers.kv_pool import KVPool
    from models.registry import load_model
    from scripts.quantize_checkpoint import quantize_dir

    qdir = quantize_dir(make_hf_dir(tmp_path / "plain", MODELS["llama"], seed=5), tmp_path / "q", fmt)
    prompt = [5, 17, 99, 3, 42, 7, 8, 11, 250, 1, 64, 77]
    logits = {}
    for dev, dtype in (("cpu", torch.float32), ("cuda", torch.bfloat16)):
        model, cfg = load_model(qdir, dtype=dtype, device=dev, progress=False)
        assert (model.model.layers[0].mlp.down_proj.quant is None) == (dev == "cpu")
        kv = KVPool(cfg.num_layers, 16, 4, cfg.num_kv_heads, cfg.head_dim, dtype, dev)
        backend = TorchAttention(dev)
        batch = ForwardBatch.from_requests([(prompt, 0, list(range(1, 5)))], 4, dev, [True])
        backend.prepare(batch)
        logits[dev] = model(batch, kv, backend)[0].float().cpu()
    ref, got = logits["cpu"], logits["cuda"]
    # the same weights: what differs is bf16 arithmetic and, for fp8, each GEMM's e4m3 activations
    # (2.6% relative per GEMM, bin/bench quant's err_kernel; measured 10% over these 2 layers of 4 GEMMs)
    assert _rel(got, ref) < (0.02 if fmt == "modelopt-nvfp4" else 0.15), fmt
    assert int(got.argmax()) == int(ref.argmax()) or ref.topk(2).values.diff().abs() < 0.05 * ref.abs().max()
