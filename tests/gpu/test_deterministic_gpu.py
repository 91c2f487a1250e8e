"""Deterministic inference on CUDA (engine/layers/batch_invariant.py): Qwen3-0.6B shapes with
random weights in bfloat16, in process: a prompt's tokens and logprobs are the same bits
alone, in mixed batches, behind cached prefixes of several lengths, at several prefill chunk
sizes and with overlap off. Also the default model's shapes (SmolLM2-135M, 9 query / 3 KV heads: a
group of 3, which the triton kernel does not take, so the torch attention path's deterministic
chunks and decode probe on CUDA), cut to 4 layers. Also mixtures of experts (the fused MoE kernels at their one
config, moe_kernels.DET_CONFIG): Qwen3-30B-A3B and DeepSeek-V3 (MLA too) cut to a few layers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config import ServerConfig
from engine.local import LocalEngine, Result
from msgs.params import SamplingParams

REPO = Path(__file__).resolve().parents[2]
SAMPLED = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5, ignore_eos=True, logprobs=True)
PROMPT = [(31 * i) % 30000 + 500 for i in range(300)]
OTHERS = [[(17 * i + 7 * s) % 30000 + 500 for i in range(n)] for s, n in enumerate((1, 37, 130, 600, 5, 64), 1)]


# the default model's shapes cut to 4 layers; a few layers of each MoE model, fewer DeepSeek experts
# (each is 44M parameters): MoE layers all but DeepSeek's first (dense)
CUTS = {"smollm2-135m": {"base": "llama-3.2-1b", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 4,
                         "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152},
        "qwen3-30b-a3b": {"num_hidden_layers": 3},
        "deepseek-v3-5l": {"num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 32}}


@pytest.fixture(params=["qwen3-0.6b", *CUTS])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    name = request.param
    if name not in CUTS:
        return str(REPO / "configs" / name)
    cut = dict(CUTS[name])
    cfg = json.loads((REPO / "configs" / cut.pop("base", name) / "config.json").read_text()) | cut
    path = tmp_path_factory.mktemp(name)
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def _engine(model: str, det: bool, **kw) -> LocalEngine:  # noqa: ANN003
    return LocalEngine(ServerConfig(model=model, load_format="dummy", device="cuda", dtype="bfloat16",
                                    enable_deterministic_inference=det, max_total_tokens=32768,
                                    max_running_requests=32, **kw))


def _key(r: Result) -> tuple[list[int], list[float]]:
    return r.output_ids, r.logprobs


def test_one_request_one_answer_on_cuda(model: str) -> None:
    eng = _engine(model, True)
    want = _key(eng.generate([PROMPT], SAMPLED)[0])
    answers = {str(want)}
    answers.add(str(_key(eng.generate([PROMPT], SAMPLED)[0])))  # cached
    for k in range(1, len(OTHERS) + 1):  # batches of 1..6 others, mixed lengths
        answers.add(str(_key(eng.generate([*OTHERS[:k], PROMPT], SAMPLED)[-1])))
    for k in range(2, 12, 3):  # copies of itself (bin/bench deterministic's single mode), with others
        answers |= {str(_key(r)) for r in eng.generate([PROMPT] * k + OTHERS[: k % 4], SAMPLED)[:k]}
    for cut in (16, 100, 256):
        fresh = _engine(model, True, disable_overlap=cut == 100, max_prefill_tokens=64 if cut == 256 else 2048)
        fresh.generate([PROMPT[:cut]], SamplingParams(max_new_tokens=1))
        answers.add(str(_key(fresh.generate([OTHERS[2], PROMPT], SAMPLED)[-1])))
    assert answers == {str(want)}


def test_decoded_and_prefilled_tokens_agree(tmp_path: Path) -> None:
    """A token's K/V written by the captured split decode (its RoPE prologue: Llama has no q/k
    norm) and by a prefill (qk_norm_rope_store) carry the same bits: a prompt extended by its own
    greedy continuation and prefilled by a fresh engine continues with the same tokens and
    logprobs. Llama-3.2-1B shapes cut to 4 layers; decode positions cross a 256-position partition."""
    cfg = json.loads((REPO / "configs" / "llama-3.2-1b" / "config.json").read_text()) | {"num_hidden_layers": 4}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, logprobs=True)
    prompt = PROMPT[:250]
    eng = _engine(str(tmp_path), True)
    assert eng.runner.graphs is not None
    first = eng.generate([prompt], greedy)[0]
    assert eng.runner.graphs.replays >= greedy.max_new_tokens - 2, "decoded in the graphs"
    del eng
    fresh = _engine(str(tmp_path), True)  # nothing cached: the continuation's K/V come from a prefill
    rest = fresh.generate([prompt + first.output_ids[:6]], SamplingParams(
        max_new_tokens=6, temperature=0, ignore_eos=True, logprobs=True))[0]
    assert rest.output_ids == first.output_ids[6:]
    assert rest.logprobs == first.logprobs[6:]
