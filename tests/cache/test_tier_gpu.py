"""The host tier on a GPU (marker gpu; skipped without CUDA): random-weight Qwen3-0.6B in
bf16, the real runner, the cache controller driver and a cudaHostRegister'ed slab. A
prefix loaded back from L2 must give the same greedy tokens as the same prefix hit in L1
(the KV bytes round-trip exactly), with every step digest-checked.

    python3 -m pytest -m gpu tests/cache/test_tier_gpu.py
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from test_tier_differential import Engine  # tests/cache is on sys.path (no __init__)

from engine.cache.slab import create_slab, remove_slab
from engine.config import ServerConfig

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_l2_load_back_gives_the_l1_tokens_on_gpu() -> None:
    slab = create_slab("strata-gpu-test")
    try:
        cfg = ServerConfig(
            model=str(ROOT / "configs" / "qwen3-0.6b"), load_format="dummy", device="cuda",
            max_total_tokens=12 * 16, max_running_requests=4, max_prefill_tokens=256,
            enable_hierarchical_cache=True, hicache_path=slab, **_backend(),
        )
        eng = Engine(cfg)
        rng = random.Random(2)
        convs = [[rng.randrange(200, 20000) for _ in range(80)] for _ in range(3)]
        eng.run([convs[0]])
        l1 = eng.run([convs[0] + [7, 8]])[0]  # its history is an L1 hit
        eng.run([convs[1]])
        eng.run([convs[2]])  # the pool holds about two conversations: 0 went to L2
        before = eng.core.state.tiers.stats()["load_backs"]
        l2 = eng.run([convs[0] + [7, 8]])[0]
        assert eng.core.state.tiers.stats()["load_backs"] > before
        assert l2 == l1
    finally:
        remove_slab(slab)


def _backend() -> dict:
    """The torch reference backend without graphs: this checks the copies, not the kernels."""
    return {"attention_backend": "torch", "disable_cuda_graph": True}
