"""MoE models at run time: whether the runner captures their decode in CUDA graphs (it must
not while the MoE blocks take the torch path, which reads per-expert counts on the host), and
the per-expert token counts a served MoE model reports in /metrics and to bin/analyze."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest
from test_mla import TINY_V3
from test_moe import QWEN3_MOE, make_moe_dir

from engine.run.assembly import cuda_graph_blocker
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


def _routed(m: dict[str, float], layer: int) -> float:
    return m.get(f'strata_moe_routed_tokens_total{{layer="{layer}"}}', 0.0)


def test_served_moe_counts_expert_tokens(tmp_path: Path) -> None:
    """bin/serve on a tiny Qwen3-MoE (MoE layers 0 and 2): once the batch drains, /metrics holds
    top_k routed (token, expert) pairs per forwarded token in every MoE layer (a prompt's
    tokens plus its outputs but the last; the warm-up not counted), and bin/analyze's expert-load
    table, from the worker's log, the same per layer."""
    import httpx

    from engine.analyze import analyze, print_text
    from tests.integration.conftest import start_server, stop_server

    path = make_moe_dir(tmp_path / "m", QWEN3_MOE)
    prompts, n = [[5, 17, 99, 3, 42, 7, 8], [200, 11, 64, 9, 9, 30, 31, 32, 33, 34, 35]], 8
    want = QWEN3_MOE["num_experts_per_tok"] * sum(len(p) + n - 1 for p in prompts)
    srv = start_server(tmp_path / "logs", "--model", str(path), "--max-total-tokens", "2048", "--page-size", "4")
    try:
        for ids in prompts:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
            assert len(httpx.post(f"{srv.http}/generate", json=body, timeout=60).json()["output_ids"]) == n
        m = srv.wait_idle()
        deadline = time.monotonic() + 10
        while _routed(m, 2) < want and time.monotonic() < deadline:  # the drained step's report
            time.sleep(0.1)
            m = srv.metrics()
    finally:
        assert stop_server(srv) == 0
    assert _routed(m, 0) == _routed(m, 2) == want and _routed(m, 1) == 0  # layer 1 is dense
    experts = [m.get(f'strata_moe_expert_tokens_total{{expert="{e}"}}', 0.0) for e in range(QWEN3_MOE["num_experts"])]
    assert sum(experts) == 2 * want
    for layer in (0, 2):
        assert 1.0 <= m[f'strata_moe_load_imbalance{{layer="{layer}"}}'] <= QWEN3_MOE["num_experts"]
    rep = analyze(tmp_path / "logs")
    (layers,) = rep.moe.values()
    assert sorted(layers) == ["0", "2"] and all(d["tokens"] == want and d["experts"] == 5 for d in layers.values())
    out = io.StringIO()
    print_text(rep, timelines=False, out=out)
    assert "moe expert load" in out.getvalue()


def test_metrics_turn_cumulative_counts_into_counters() -> None:
    """The scheduler's cumulative per-layer counts become counter increments (a smaller total:
    the worker restarted, counted from zero again), and the imbalance is max over mean."""
    from engine.serve.metrics import Metrics
    from msgs.outputs import SchedulerStats

    m = Metrics()

    def stats(counts: dict[int, list[int]] | None) -> SchedulerStats:
        return SchedulerStats(ready=True, max_context=64, vocab_size=256, kv_pages_total=8, kv_pages_used=0,
                              cache_pages=0, running=0, waiting=0, cache_hit_tokens=0, step_seconds=[],
                              expert_tokens=counts)

    def value(name: str, **labels: str) -> float:
        return m.registry.get_sample_value(name, labels) or 0.0

    m.on_stats(stats({0: [4, 0, 2, 2], 3: [1, 1, 1, 1]}))
    m.on_stats(stats(None))  # no news: nothing changes
    m.on_stats(stats({0: [6, 1, 3, 2], 3: [2, 2, 1, 1]}))
    assert [value("strata_moe_expert_tokens_total", expert=str(e)) for e in range(4)] == [8, 3, 4, 3]
    assert value("strata_moe_routed_tokens_total", layer="0") == 12
    assert value("strata_moe_load_imbalance", layer="0") == 2.0  # 6 of a mean 3
    assert value("strata_moe_load_imbalance", layer="3") == 4 / 3
    m.on_stats(stats({0: [1, 0, 0, 1], 3: [0, 0, 0, 0]}))  # a restart
    assert value("strata_moe_routed_tokens_total", layer="0") == 14
    assert value("strata_moe_expert_tokens_total", expert="3") == 4
