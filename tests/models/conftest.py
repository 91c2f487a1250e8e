"""Fixtures for model tests: tiny random HF checkpoints and the converted default model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from model_harness import make_hf_dir, tiny_config

from models.default_model import ensure_default_model


@pytest.fixture(autouse=True, scope="package")
def _one_thread() -> Iterator[None]:
    """Tiny matmuls: OpenMP thread hand-offs cost more than they save (and a busy CI host
    makes 2-thread barriers stall by milliseconds), so run these tests single-threaded."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", params=["tiny-llama", "tiny-qwen3", "tiny-qwen2"])
def tiny_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF checkpoint dir with random weights, saved by transformers itself."""
    return make_hf_dir(tmp_path_factory.mktemp(request.param), tiny_config(request.param))


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """The converted default model (converted on first use, ~45 s; cached afterwards)."""
    return ensure_default_model()
