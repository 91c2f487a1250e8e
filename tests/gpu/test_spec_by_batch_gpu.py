"""Speculation by batch size on the H200 (docs/architecture.md, Speculation by batch size): with
NGRAM and tiny thresholds (more than 2 decode rows: 1 draft; more than 4: none) a batch growing
from 2 to 6 requests and draining passes through every regime each way while plain steps and
verify steps both replay the decode CUDA graphs; every request answers in full, a step above
the cap verifies nothing, digests agree every step, no page is left behind. With deterministic
inference on, the tokens are plain decoding's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import ServerConfig
from engine.local import LocalEngine
from tests.engine.test_spec_by_batch import MAX_NEW, RULES, STEPS, Run, _drive, greedy

pytestmark = pytest.mark.gpu


def _engine(model: Path, **kw: object) -> LocalEngine:
    return LocalEngine(ServerConfig(model=str(model), load_format="dummy", dtype="bfloat16", max_total_tokens=4096,
                                    max_running_requests=8, **kw))  # type: ignore[arg-type]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    motifs = [torch.randint(3, 2000, (n,), generator=g).tolist() for n in (24, 16, 12, 20, 8, 10)]
    return [m * 3 for m in motifs]  # repeats: n-gram drafts exist


def check_regimes(eng: LocalEngine, run: Run) -> None:
    """What every run must show, whatever the tokens (shared with the CPU smoke check)."""
    assert [len(run.tokens[i]) for i in range(len(MAX_NEW))] == MAX_NEW
    seen = iter(run.caps)
    assert all(c in seen for c in (STEPS, 0, 1, STEPS)), run.caps
    for cap, drafts in zip(run.caps, run.drafts, strict=True):
        assert drafts is None if cap == 0 else drafts is None or max(drafts) <= cap, (cap, drafts)
    st = eng.core.state.spec_stats
    assert st.plain > 0 and st.rows > 0, st
    assert eng.core.leak_free() and eng.runner.replica.digest() == eng.core.replica.digest()


def test_regimes_mix_in_the_decode_graphs(dummy_models: dict[str, Path], flashinfer_built: None) -> None:
    eng = _engine(dummy_models["llama-h128"], speculative_algorithm="NGRAM", speculative_num_steps=STEPS,
                  speculative_num_steps_by_batch_size=RULES)
    run = _drive(eng, _prompts(), greedy())
    check_regimes(eng, run)
    spec, graphs = eng.runner.spec, eng.runner.graphs
    assert spec is not None and graphs is not None
    assert spec.replayed > 0 and graphs.replays > spec.replayed  # verify steps and plain steps in the graphs


def test_deterministic_tokens_equal_plain_across_regimes(dummy_models: dict[str, Path]) -> None:
    model, prompts = dummy_models["llama-h128"], _prompts()
    plain = _engine(model, enable_deterministic_inference=True).generate(prompts, greedy())
    eng = _engine(model, enable_deterministic_inference=True, speculative_algorithm="NGRAM",
                  speculative_num_steps=STEPS, speculative_num_steps_by_batch_size=RULES)
    run = _drive(eng, prompts, greedy())
    check_regimes(eng, run)
    assert [run.tokens[i] for i in range(len(prompts))] == [r.output_ids for r in plain]
