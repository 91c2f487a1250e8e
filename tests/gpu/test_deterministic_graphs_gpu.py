"""Deterministic inference's decode in CUDA graphs (engine/layers/attention.py's torch backend,
batch_invariant.DecodeBlocks): Qwen3-0.6B and Llama-3.2-1B shapes with random weights in bfloat16,
in process. With graphs a request's greedy tokens and logprobs are the bits of the same engine
without them, in a batch of several prompts (padded to a captured size) and alone; decode
positions cross the attention's 64-position chunks and its 256-position partitions. The graphs'
split-KV decode takes the RoPE prologue in its split kernel where the model has no q/k norm
(Llama), eager decode the separate launch."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import ServerConfig
from engine.layers.attention import TorchAttention
from engine.local import LocalEngine, Result
from msgs.params import SamplingParams

REPO = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True, logprobs=True)
PROMPTS = [[(29 * i + 11 * s) % 30000 + 500 for i in range(n)] for s, n in enumerate((1, 50, 63, 64, 130, 230, 7), 1)]


def _engine(model: str, graphs: bool) -> LocalEngine:
    return LocalEngine(ServerConfig(model=str(REPO / "configs" / model), load_format="dummy", device="cuda",
                                    dtype="bfloat16", enable_deterministic_inference=True, max_total_tokens=32768,
                                    max_running_requests=32, disable_cuda_graph=not graphs))


def _keys(results: list[Result]) -> list[tuple[list[int], list[float]]]:
    for r in results:
        assert r.finish_reason == "length", r
    return [(r.output_ids, r.logprobs) for r in results]


@pytest.mark.parametrize("model", ["qwen3-0.6b", "llama-3.2-1b"])
def test_graphs_give_the_eager_bits(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    folded = []
    attend_qkv = TorchAttention.attend_qkv
    monkeypatch.setattr(TorchAttention, "attend_qkv", lambda *a: folded.append(attend_qkv(*a)) or folded[-1])
    eager = _engine(model, False)
    assert eager.runner.graphs is None
    want = _keys(eager.generate(PROMPTS, GREEDY))
    want_alone = [_keys(eager.generate([p], GREEDY))[0] for p in PROMPTS]
    assert not any(o is not None for o in folded), "eager decode: the separate RoPE launch"
    del eager
    eng = _engine(model, True)
    backend = eng.runner.backend
    assert isinstance(backend, TorchAttention) and backend.supports_cuda_graph
    graphs = eng.runner.graphs
    assert graphs is not None, "deterministic decode is captured"
    batched = _keys(eng.generate(PROMPTS, GREEDY))
    replays = graphs.replays
    assert replays >= GREEDY.max_new_tokens - 2, "the batch's decode steps replayed the graphs"
    alone = [_keys(eng.generate([p], GREEDY))[0] for p in PROMPTS]
    assert graphs.replays >= replays + len(PROMPTS) * (GREEDY.max_new_tokens - 2)
    # captured split-KV decode folds the RoPE where the model has no q/k norm
    assert any(o is not None for o in folded) == (model == "llama-3.2-1b")
    assert want_alone == want, "eager: alone = batched"
    for i, (b, a, w) in enumerate(zip(batched, alone, want, strict=True)):
        assert b == w, f"prompt {i} batched: graphs vs eager"
        assert a == w, f"prompt {i} alone: graphs vs eager"
