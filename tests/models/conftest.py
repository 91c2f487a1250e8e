"""Fixtures for model tests: tiny random HF checkpoints and the converted default model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from model_harness import make_hf_dir

from models.default_model import ensure_default_model

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"

TINY_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
}


def tiny_config(name: str) -> dict:
    """A tiny config from configs/ (tiny-llama, tiny-qwen3) or the inline Qwen2 one."""
    if name == "tiny-qwen2":
        return dict(TINY_QWEN2)
    cfg = json.loads((CONFIGS / name / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    return cfg


@pytest.fixture(scope="session", params=["tiny-llama", "tiny-qwen3", "tiny-qwen2"])
def tiny_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF checkpoint dir with random weights, saved by transformers itself."""
    return make_hf_dir(tmp_path_factory.mktemp(request.param), tiny_config(request.param))


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """The converted default model (converted on first use, ~45 s; cached afterwards)."""
    return ensure_default_model()
