"""The test harness itself: bin/test's pytest-xdist workers each run on their own share of the cores."""

from __future__ import annotations

import os

import pytest


def test_an_xdist_worker_runs_on_its_share_of_the_cores() -> None:
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not count:
        pytest.skip("not under pytest-xdist (bin/test runs two workers)")
    import torch

    share = len(os.sched_getaffinity(0))
    assert share <= -(-(os.cpu_count() or 1) // int(count))  # pinned by tests/conftest.py
    assert torch.get_num_threads() == share  # torch sized its pool after the pinning
