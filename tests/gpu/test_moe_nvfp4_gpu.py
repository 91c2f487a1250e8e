"""NVFP4 MoE checkpoints on CUDA (issues 22 and 23): the fused MoE kernels read no NVFP4, so the
expert stacks are dequantized once at load (models/quant_weights.runtime_form) while every other
projection stays NVFP4 (the dequantizing triton GEMM). Tiny Qwen3-MoE, GLM-4.5 and DeepSeek-V3
checkpoints from scripts/quantize_checkpoint.py, loaded on CUDA and on the CPU in float32: the
same expert values bit for bit, the Linears' NVFP4 bits standing for the CPU's plain weights, and
a prefill's logits close (the CUDA GEMMs round differently: TF32 in the NVFP4 GEMM)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "models"))
PROMPT = [5, 17, 99, 3, 42, 7, 8, 11, 250, 1, 64, 77]


def _logits(model: torch.nn.Module, cfg: object, dev: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    from engine.layers.attention import TorchAttention
    from engine.layers.forward import ForwardBatch
    from engine.layers.kv_pool import KVPool
    from models.registry import kv_layout

    kv = KVPool.from_layout(kv_layout(cfg), cfg.num_layers, 16, 4, dtype, dev)
    backend = TorchAttention(dev)
    batch = ForwardBatch.from_requests([(PROMPT, 0, list(range(1, 5)))], 4, dev, [True])
    backend.prepare(batch)
    return model(batch, kv, backend)[0].float().cpu()


def _experts(model: torch.nn.Module) -> list:
    from engine.layers.moe import Experts

    return [m for m in model.modules() if isinstance(m, Experts)]


@pytest.mark.parametrize("arch", ["qwen3-moe", "glm4-moe", "deepseek-v3"])
def test_nvfp4_moe_on_cuda_matches_cpu(tmp_path: Path, arch: str) -> None:
    from model_harness import make_hf_dir
    from test_quant_moe import MODELS

    from engine.layers import ops, quant
    from engine.layers.parallel import Linear
    from models.registry import load_model
    from scripts.quantize_checkpoint import quantize_dir

    qdir = quantize_dir(make_hf_dir(tmp_path / "plain", MODELS[arch], seed=3), tmp_path / "q", "modelopt-nvfp4")
    cpu, cfg = load_model(qdir, dtype=torch.float32, device="cpu", progress=False)
    gpu, _ = load_model(qdir, dtype=torch.float32, device="cuda", progress=False)
    stacks = _experts(gpu)
    assert stacks and all(x.quant is None and x.w13.dtype == torch.float32 and x.w13.is_cuda for x in stacks)
    for a, b in zip(stacks, _experts(cpu), strict=True):
        assert torch.equal(a.w13.cpu(), b.w13) and torch.equal(a.w2.cpu(), b.w2)  # one dequantization
    cpu_mods = dict(cpu.named_modules())
    linears = [(n, m) for n, m in gpu.named_modules() if isinstance(m, Linear) and m.quant == "nvfp4"]
    assert linears  # the shared experts, dense MLPs (and the GQA attention) stay NVFP4 on CUDA
    for name, m in linears:
        assert torch.equal(quant.dequantize(m).cpu(), cpu_mods[name].weight), name
    ops.set_fused(False)  # torch norms and activations: no flashinfer JIT for this test
    try:
        ref, got = _logits(cpu, cfg, "cpu"), _logits(gpu, cfg, "cuda")
    finally:
        ops.set_fused(True)
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 0.02, rel
    assert int(got.argmax()) == int(ref.argmax()) or ref.topk(2).values.diff().abs() < 0.05 * ref.abs().max()


def test_dummy_nvfp4_moe_on_cuda_has_plain_experts(tmp_path: Path) -> None:
    """`--load-format dummy` with an NVFP4 config on CUDA: stacks drawn, quantized, dequantized
    to the model dtype; the Linears NVFP4; a forward runs (the fused MoE kernels)."""
    from model_harness import make_hf_dir
    from test_quant_moe import MODELS

    from models.registry import load_model
    from scripts.quantize_checkpoint import quantize_dir

    qdir = quantize_dir(make_hf_dir(tmp_path / "plain", MODELS["glm4-moe"], seed=3), tmp_path / "q", "modelopt-nvfp4")
    (qdir / "model.safetensors").unlink()
    model, cfg = load_model(qdir, load_format="dummy", dtype=torch.bfloat16, device="cuda", progress=False)
    (x,) = _experts(model)
    assert x.quant is None and x.w13.dtype == x.w2.dtype == torch.bfloat16 and x.fused
    assert model.model.layers[1].mlp.shared_experts.gate_up_proj.quant == "nvfp4"
    assert torch.isfinite(_logits(model, cfg, "cuda", torch.bfloat16)).all()
