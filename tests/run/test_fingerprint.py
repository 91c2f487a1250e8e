"""engine/run/fingerprint.py: the L3 fingerprint names the arithmetic that wrote a page, so a
deterministic engine never serves pages a non-deterministic one (or another CPU's kernels) wrote:
its answers from L3 stay its recompute's, bit for bit."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from engine.config import ServerConfig
from engine.run.fingerprint import KERNEL_DIRS, REPO, arithmetic_identity, kernel_sources, worker_fingerprint
from models.default_model import ensure_default_model


def test_the_arithmetic_is_part_of_the_fingerprint() -> None:
    cpu = torch.device("cpu")
    det, nondet = arithmetic_identity(True, cpu), arithmetic_identity(False, cpu)
    assert det != nondet and det == arithmetic_identity(True, cpu)
    assert nondet == "nondeterministic"  # shared by every non-deterministic engine
    # an audit: a deterministic cp=1 engine served a deterministic cp=2 engine's L3 pages, whose
    # bits are not its own (attention merged over ranks), and its answers changed
    assert arithmetic_identity(True, cpu, cp_size=2) != det == arithmetic_identity(True, cpu, cp_size=1)
    assert arithmetic_identity(False, cpu, cp_size=2) == nondet
    cfg = ServerConfig(model=str(ensure_default_model()), device="cpu")
    args = (cfg, torch.bfloat16, torch.bfloat16, 3 * 64 * 16 * 2 * 2 * 30, 30, "k:3x64,v:3x64")
    assert worker_fingerprint(*args, arithmetic=det) == worker_fingerprint(*args, arithmetic=det)
    assert worker_fingerprint(*args, arithmetic=det) != worker_fingerprint(*args, arithmetic=nondet)


def test_a_kernel_source_change_is_another_arithmetic(tmp_path: Path) -> None:
    """Deterministic pages written by other kernel code (a sum in a new order) are not this code's:
    the identity carries the kernels' source digest, which any edit to them changes."""
    det = arithmetic_identity(True, torch.device("cpu"))
    assert det.endswith("/src:" + kernel_sources())
    for d in KERNEL_DIRS:
        shutil.copytree(REPO / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    assert kernel_sources.__wrapped__(tmp_path) == kernel_sources()  # uncached
    f = tmp_path / "engine/layers/triton_kernels.py"
    f.write_text(f.read_text() + "\n# an edit\n")
    assert kernel_sources.__wrapped__(tmp_path) != kernel_sources()
