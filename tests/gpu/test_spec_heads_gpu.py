"""EAGLE, EAGLE3 and NEXTN heads and a separate draft model on CUDA (float32): the engine-level
tests of tests/models/test_draft_heads.py with the engine on the GPU. The target then runs its CUDA
path (flashinfer attention for Llama, its decode and chain verify rows replaying the decode CUDA
graphs, the heads' hidden states as graph outputs; for DeepSeek-V3 the triton MLA decode kernel and
the fused MoE blocks), the drafts their own, eagerly: torch attention for EAGLE / EAGLE3 and the
draft model, the MLA plan and the fused MoE for the MTP layer. Greedy tokens equal the plain
engine's and the constructed drafts keep their acceptance (every EAGLE chain accepted; the MTP layer
>= 95%; EAGLE3 all but once a prompt; the target as its own draft >= 90%)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # model_harness, test_mla
import test_draft_heads as heads  # noqa: E402

TESTS: list[Callable[[Path], None]] = [
    heads.test_eagle_reproducing_an_attention_free_target_has_every_draft_accepted,
    heads.test_eagle3_with_a_draft_vocabulary_and_d2t_proposes_token_p_plus_2,
    heads.test_the_target_as_its_own_separate_draft_model_has_its_drafts_accepted,
    heads.test_nextn_random_mtp_greedy_equals_plain_batched_cached_chunked,
    heads.test_nextn_copying_an_attention_free_target_has_its_drafts_accepted,
]


@pytest.mark.parametrize("test", TESTS, ids=[t.__name__.removeprefix("test_")[:40] for t in TESTS])
def test_heads_on_cuda(test: Callable[[Path], None], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                       flashinfer_built: None) -> None:
    monkeypatch.setattr(heads, "DEVICE", "cuda")
    test(tmp_path)


# bf16 under deterministic inference: the target's decode and chain verify rows replay the decode
# graphs (the torch backend's invariant kernel is capturable), and every bit is batch-invariant, so
# graphs and eager give the same tokens and the same drafts; a head fed wrong hidden states by a
# replay (stale or misplaced rows of the graph's outputs) would draft otherwise.
MID = {**heads.TINY, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
       "intermediate_size": 512, "num_hidden_layers": 4, "vocab_size": 512}
DET_GREEDY = heads.SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)


def _det_engine(model: Path, graphs: bool, **kw: object) -> heads.LocalEngine:
    return heads.LocalEngine(heads.ServerConfig(
        model=str(model), dtype="bfloat16", enable_deterministic_inference=True, max_total_tokens=4096,
        max_running_requests=4, page_size=16, max_prefill_tokens=32, disable_cuda_graph=not graphs,
        device="cuda", **kw))  # type: ignore[arg-type]


def _drafted(eng: heads.LocalEngine, monkeypatch: pytest.MonkeyPatch) -> list[list[list[int]]]:
    """Every verify step's rows as drafted (first token, then its drafts), recorded around the
    Speculator's own fill."""
    spec = eng.runner.spec
    assert spec is not None
    seen: list[list[list[int]]] = []
    fill = spec._fill

    def recorded(ids: list[int], num: list[int], ends: list[int], *rest: object) -> None:
        fill(ids, num, ends, *rest)  # type: ignore[arg-type]
        seen.append([ids[e - k - 1 : e] for k, e in zip(num, ends, strict=True) if k])

    monkeypatch.setattr(spec, "_fill", recorded)
    return seen


@pytest.mark.parametrize("draft", ["EAGLE3", "STANDALONE"])
def test_bf16_deterministic_drafts_follow_graph_replays(draft: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    target = heads._llama(tmp_path / "t", MID, attention_free=False)
    if draft == "EAGLE3":
        path = heads.write_head(tmp_path / "h", MID, "EAGLE3", draft_vocab=128, std=0.2,
                                eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]})
    else:
        path = target  # the target as its own draft: its drafts accepted where its KV followed every forward
    spec = {"speculative_algorithm": draft, "speculative_num_steps": 3, "speculative_draft_model_path": str(path)}
    prompts = heads._prompts([40, 17, 70], seed=5, vocab=MID["vocab_size"])
    plain = heads._ids(_det_engine(target, True).generate(prompts, DET_GREEDY))
    runs = {}
    for graphs in (False, True):
        eng = _det_engine(target, graphs, **spec)
        drafted = _drafted(eng, monkeypatch)
        got = heads._ids(eng.generate(prompts, DET_GREEDY))
        assert eng.core.leak_free()
        assert got == plain, f"graphs={graphs}: speculation changed the tokens"
        assert (eng.runner.graphs is not None) == graphs
        if graphs:
            assert eng.runner.spec is not None and eng.runner.spec.replayed > 0, "no verify step replayed the graphs"
            # the draft's own graphs (the head's, the draft model's: their torch backend is capturable
            # under the mode)
            own = eng.runner.spec.draft.graphs
            assert own is not None and own.replays > 0
        runs[graphs] = drafted, eng.core.state.spec_stats
    (eager, st_eager), (replayed, st) = runs[False], runs[True]
    assert replayed and replayed == eager, "the drafts depend on the CUDA graphs"
    assert st.drafted == st_eager.drafted > 0 and st.accepted == st_eager.accepted
    if draft == "STANDALONE":
        assert st.accepted >= 0.9 * st.drafted, st


def test_bf16_separate_draft_model_in_its_own_graphs(tmp_path: Path) -> None:
    """bf16 without the mode: flashinfer for the target and for a separate draft model (the
    target itself), each replaying its own decode graphs: the draft's KV follows the target's
    replayed decode and verify rows, so its drafts are the target's greedy tokens, but for bf16
    near ties (the draft's rows and the target's verify rows run at other batch shapes, and this
    tiny random model's top logits are close): 43 of 65 drafts accepted on an H200 (afc49a6),
    against >= 90% with deterministic inference above; drafts from a KV that did not follow would
    be accepted at random (1 in 512)."""
    target = heads._llama(tmp_path / "t", MID, attention_free=False)
    eng = heads.LocalEngine(heads.ServerConfig(
        model=str(target), dtype="bfloat16", max_total_tokens=4096, max_running_requests=4, page_size=16,
        max_prefill_tokens=32, device="cuda", speculative_algorithm="STANDALONE", speculative_num_steps=3,
        speculative_draft_model_path=str(target)))
    prompts = heads._prompts([40, 17, 70], seed=6, vocab=MID["vocab_size"])
    out = eng.generate(prompts, DET_GREEDY)
    assert all(len(r.output_ids) == DET_GREEDY.max_new_tokens for r in out)
    assert eng.core.leak_free()
    spec = eng.runner.spec
    assert spec is not None and eng.runner.graphs is not None and spec.replayed > 0
    draft_graphs = spec.draft.graphs
    assert draft_graphs is not None and draft_graphs.replays > 0, "the draft model's graphs were not replayed"
    st = eng.core.state.spec_stats
    assert st.drafted > 0 and st.accepted >= 0.5 * st.drafted, st
