"""The CPU worker's policies: thread count, OpenMP wait policy, KV pool size, and the torch
backend's prefix + causal split (CPU flash attention merged by log-sum-exp) against a dense
masked reference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.config import ServerConfig
from engine.layers.attention import _CPU_FLASH_LSE, _prefix_then_causal
from engine.run.assembly import cpu_threads
from engine.run.memory import CPU_POOL_RAM_FRACTION, cpu_pool_tokens, kv_bytes_per_token, plan_pool
from models.config import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return ModelConfig.from_dir(ROOT / "configs" / "tiny-llama")  # context 2048


def test_threads_default_to_every_core_this_process_may_use() -> None:
    assert cpu_threads(0) == len(os.sched_getaffinity(0))
    assert cpu_threads(3) == 3


def test_engine_run_sets_passive_waits_before_torch_loads() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    code = "import os, engine.run as r; print(os.environ['OMP_WAIT_POLICY'], r.TORCH_PREIMPORTED)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["PASSIVE", "False"]
    env["OMP_WAIT_POLICY"] = "ACTIVE"  # an explicit choice wins
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == "ACTIVE"


def test_cpu_pool_is_the_workload_capped_by_a_fraction_of_ram(tiny: ModelConfig) -> None:
    per = kv_bytes_per_token(tiny, torch.float32)
    cfg = ServerConfig(max_running_requests=4)
    # plenty of RAM: exactly max_running x context
    assert cpu_pool_tokens(cfg, tiny, per, 1 << 50, 1 << 50) == 4 * 2048
    # RAM-bound: the fraction of total RAM, and never more than half of what is available
    total = 256 * 2048 * per
    assert cpu_pool_tokens(ServerConfig(), tiny, per, total, total) == int(total * CPU_POOL_RAM_FRACTION) // per
    assert cpu_pool_tokens(ServerConfig(), tiny, per, total, 2 * 1000 * per) == 1000
    # a small machine still gets one full context when half its free memory holds it
    small = 2048 * per
    assert cpu_pool_tokens(ServerConfig(), tiny, per, small, 4 * small) == 2048
    # --context-length bounds the per-request need
    assert cpu_pool_tokens(ServerConfig(max_running_requests=2, context_length=100), tiny, per, 1 << 50, 1 << 50) == 200


def test_plan_pool_on_cpu(tiny: ModelConfig) -> None:
    plan = plan_pool(ServerConfig(max_total_tokens=1000, page_size=16), tiny, torch.float32, torch.device("cpu"))
    assert (plan.num_pages, plan.max_context, plan.sized_by) == (1000 // 16 + 1, 992, "--max-total-tokens")
    plan = plan_pool(ServerConfig(max_running_requests=2), tiny, torch.float32, torch.device("cpu"))
    assert plan.num_pages - 1 <= 2 * 2048 // 16 and plan.sized_by.startswith("cpu:")


@pytest.mark.skipif(_CPU_FLASH_LSE is None, reason="this torch has no CPU flash attention with LSE")
@pytest.mark.parametrize(("hq", "hkv", "start", "lq"), [(4, 2, 5, 7), (9, 3, 64, 33), (2, 2, 1, 1), (6, 1, 100, 2)])
def test_prefix_then_causal_matches_a_shifted_causal_mask(hq: int, hkv: int, start: int, lq: int) -> None:
    gen = torch.Generator().manual_seed(hq * 1000 + start)
    q = torch.randn(hq, lq, 16, generator=gen)
    k, v = torch.randn(2, hkv, start + lq, 16, generator=gen)
    mask = torch.arange(start + lq)[None, :] <= torch.arange(start, start + lq)[:, None]
    ref = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=True)[0]
    torch.testing.assert_close(_prefix_then_causal(q, k, v, start), ref, atol=1e-5, rtol=1e-5)


def test_auto_dtype_is_float32_on_cpu_and_bf16_on_cuda() -> None:
    """The CPU default is float32 whatever the CPU (issue 21: deterministic bf16 costs 3.2x,
    float32 is faster and its answers agree across batch and cache paths)."""
    import torch

    from engine.run import assembly

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert assembly.resolve_dtype("auto", cpu) == torch.float32
    assert assembly.resolve_dtype("auto", cuda) == torch.bfloat16
    assert assembly.resolve_dtype("bfloat16", cpu) == torch.bfloat16
