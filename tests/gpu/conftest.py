"""GPU tests: the CUDA path against the torch reference. Every test here is marked `gpu` and is
skipped without a CUDA device. On the GPU machine: `python3 -m pytest -m gpu tests/gpu`."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.fixture(scope="session")
def flashinfer_built() -> None:
    """Build the flashinfer JIT modules the engine uses up front, in parallel (each in its own
    build dir, as build_and_load does, so first use finds them up to date): one at a time inside
    the tests they would take minutes."""
    from concurrent.futures import ThreadPoolExecutor

    os.environ.setdefault("FLASHINFER_USE_CUDA_NORM", "1")
    from flashinfer.jit.activation import gen_act_and_mul_module
    from flashinfer.jit.attention import gen_batch_prefill_module
    from flashinfer.jit.norm import gen_norm_module
    from flashinfer.jit.rope import gen_rope_module

    t = time.perf_counter()
    bf16 = torch.bfloat16
    specs = [
        gen_batch_prefill_module("fa2", bf16, bf16, bf16, torch.int32, 128, 128, 0, False, False, False),
        gen_norm_module(), gen_act_and_mul_module("silu"), gen_rope_module(),
    ]
    todo = [s for s in specs if not s.is_aot]
    with ThreadPoolExecutor(len(todo) or 1) as pool:
        list(pool.map(lambda s: s.build(verbose=False), todo))
    print(f"flashinfer JIT: {len(todo)} of {len(specs)} modules built in {time.perf_counter() - t:.1f}s")


def _write(root: Path, name: str, cfg: dict) -> Path:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="session")
def dummy_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Qwen3-0.6B shapes with 4 layers, a small Llama with llama3 RoPE scaling and head_dim 128, and a
    3-layer Qwen3 with a GQA group of 8."""
    root = tmp_path_factory.mktemp("models")
    qwen = json.loads((REPO / "configs" / "qwen3-0.6b" / "config.json").read_text())
    qwen["num_hidden_layers"] = 4
    llama = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
        "intermediate_size": 1024, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3,
        "vocab_size": 2048, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 256, "rope_type": "llama3"},
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    }
    # Qwen3-30B-A3B's attention (32 query heads on 4 KV heads: the triton decode kernel's group of 8
    # in two programs at batch 1, triton_ops.decode_parts) on a small dense Qwen3
    g8 = {**qwen, "num_hidden_layers": 3, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128}
    return {"qwen3-0.6b-4L": _write(root, "qwen3-4l", qwen), "llama-h128": _write(root, "llama-h128", llama),
            "qwen3-g8": _write(root, "qwen3-g8", g8)}
