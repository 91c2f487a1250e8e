"""The CPU worker's policies: thread count, OpenMP wait policy, freed memory kept, KV pool size, and the torch
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
from engine.run.memory import (
    CPU_POOL_RAM_FRACTION,
    OutOfMemory,
    cpu_pool_tokens,
    kv_bytes_per_token,
    plan_pool,
)
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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_step_sized_tensor_comes_from_the_heap_and_stays_there_when_freed() -> None:
    """In a fresh process (malloc's settings are process-wide), glibc's own accounting (mallinfo2):
    before keep_freed_memory a 64 MiB tensor is a mapping of its own (given back when freed, so
    faulted in afresh next time); after it, the tensor comes from the heap, and the heap keeps the
    memory when it is freed."""
    code = """if True:
        import ctypes, torch
        from engine.run.assembly import keep_freed_memory
        class Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                        "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = Info
        mib = lambda v: v >> 20
        x = torch.empty(64 << 20, dtype=torch.uint8)
        mapped = mib(libc.mallinfo2().hblkhd)
        del x
        kept = keep_freed_memory()
        x = torch.empty(64 << 20, dtype=torch.uint8)
        mapped_after, heap = mib(libc.mallinfo2().hblkhd), mib(libc.mallinfo2().arena)
        del x
        print(mapped, kept, mapped_after, heap, mib(libc.mallinfo2().fordblks))"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    mapped, kept, mapped_after, heap, free_kept = out.stdout.split()
    assert int(mapped) >= 64 and kept == "True"
    assert int(mapped_after) < 64 and int(heap) >= 64  # from the heap, not a mapping
    assert int(free_kept) >= 64  # freed into the heap, not trimmed off


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
    assert plan.context_capped and plan.wanted_context == tiny.max_position_embeddings  # the start-up warns
    # cp ranks: a request's pages round robin over every rank's pool, so its context may span them all
    cp2 = plan_pool(ServerConfig(max_total_tokens=1000, page_size=16, cp_size=2), tiny, torch.float32,
                    torch.device("cpu"))
    assert (cp2.num_pages, cp2.max_context) == (plan.num_pages, min(2 * 992, tiny.max_position_embeddings))
    assert not plan_pool(ServerConfig(max_total_tokens=1000, page_size=16, context_length=500), tiny, torch.float32,
                         torch.device("cpu")).context_capped
    plan = plan_pool(ServerConfig(max_running_requests=2), tiny, torch.float32, torch.device("cpu"))
    assert plan.num_pages - 1 <= 2 * 2048 // 16 and plan.sized_by.startswith("cpu:")
    # an explicit pool larger than the free RAM is refused, naming the flag (not an OOM kill under load)
    with pytest.raises(OutOfMemory, match="--max-total-tokens: its KV cache needs"):
        plan_pool(ServerConfig(max_total_tokens=10**12), tiny, torch.float32, torch.device("cpu"))


@pytest.mark.skipif(_CPU_FLASH_LSE is None, reason="this torch has no CPU flash attention with LSE")
@pytest.mark.parametrize(("hq", "hkv", "start", "lq"), [(4, 2, 5, 7), (9, 3, 64, 33), (2, 2, 1, 1), (6, 1, 100, 2)])
def test_prefix_then_causal_matches_a_shifted_causal_mask(hq: int, hkv: int, start: int, lq: int) -> None:
    gen = torch.Generator().manual_seed(hq * 1000 + start)
    q = torch.randn(hq, lq, 16, generator=gen)
    k, v = torch.randn(2, hkv, start + lq, 16, generator=gen)
    mask = torch.arange(start + lq)[None, :] <= torch.arange(start, start + lq)[:, None]
    ref = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=True)[0]
    torch.testing.assert_close(_prefix_then_causal(q, k, v, start), ref, atol=1e-5, rtol=1e-5)


def test_cpu_default_is_deterministic_and_bf16_where_native() -> None:
    """Issue 21: the CPU default is deterministic inference (a few percent there with
    cpu_attention's kernel), in bf16 where the CPU has native bf16 (1.4-1.6x deterministic
    float32's throughput), else float32; float32 too with the mode turned off (bf16's answers move
    with the batch and the cache then). The mode stays a flag on a GPU, and turns off by default
    for what it does not take: draft trees, context parallelism, another attention backend."""
    import torch

    from engine.config import ServerConfig
    from engine.run import assembly

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    native = assembly.cpu_has_bf16()
    assert assembly.resolve_dtype("auto", cpu, True) == (torch.bfloat16 if native else torch.float32)
    assert assembly.resolve_dtype("auto", cpu, False) == torch.float32
    assert assembly.resolve_dtype("auto", cuda, False) == torch.bfloat16
    assert assembly.resolve_dtype("float32", cpu, True) == torch.float32
    default = ServerConfig()
    assert default.deterministic("cpu") and not default.deterministic("cuda")
    assert ServerConfig(enable_deterministic_inference=True).deterministic("cuda")
    for off in (dict(disable_deterministic_inference=True), dict(cp_size=2), dict(attention_backend="flashinfer"),
                dict(speculative_algorithm="NGRAM", speculative_eagle_topk=2, speculative_num_steps=2,
                     speculative_num_draft_tokens=5)):
        assert not ServerConfig(**off).deterministic("cpu"), off
    with pytest.raises(ValueError, match="choose one"):
        ServerConfig(enable_deterministic_inference=True, disable_deterministic_inference=True)


def test_weights_a_cpu_host_cannot_hold_are_refused_at_start() -> None:
    """The workers' shares of the weights together beyond the host's memory: a clear error before
    loading, not minutes of loading and then the kernel's OOM killer (an audit: a 30B MoE at 24 GB)."""
    import psutil

    from engine.run.memory import check_weights_fit, weight_bytes

    cpu, total = torch.device("cpu"), psutil.virtual_memory().total
    check_weights_fit(str(ROOT / "configs" / "tiny-llama"), torch.float32, cpu)
    big = ROOT / "configs" / "llama-3.1-70b"
    need = weight_bytes(ModelConfig.from_dir(big), torch.float32)
    ranks = -(-total // need) + 1  # this many workers' shares do not fit, at any host size
    with pytest.raises(OutOfMemory, match="the model does not fit: its weights need .* on this host"):
        check_weights_fit(str(big), torch.float32, cpu, tp_size=1, host_ranks=ranks)
