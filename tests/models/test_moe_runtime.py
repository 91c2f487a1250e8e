"""MoE models at run time: whether the runner captures their decode in CUDA graphs (it must
not while the MoE blocks take the torch path, which reads per-expert counts on the host)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_mla import TINY_V3
from test_moe import QWEN3_MOE

from engine.run.runner import cuda_graph_blocker
from models.registry import load_model


def _dummy(tmp_path: Path, config: dict) -> object:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return load_model(tmp_path, load_format="dummy", progress=False)[0]


@pytest.mark.parametrize(("config", "reason"), [
    (QWEN3_MOE, "MoeForCausalLM.supports_cuda_graph is False"),
    (TINY_V3 | {"num_hidden_layers": 2, "first_k_dense_replace": 1}, "MoE layers are not capturable"),
    (QWEN3_MOE | {"mlp_only_layers": [0, 1, 2]}, None),  # every layer dense: captured
    (TINY_V3, None),  # DeepSeek-V3 with dense layers only: no MoE block stops it
])
def test_cuda_graph_blocker(tmp_path: Path, config: dict, reason: str | None) -> None:
    blocker = cuda_graph_blocker(_dummy(tmp_path, config))
    assert blocker == reason if reason is None else reason in blocker
