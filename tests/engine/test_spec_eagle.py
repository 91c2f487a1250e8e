"""EAGLE and EAGLE3 heads on the default model (float32, LocalEngine: the served Step stream,
overlap on, digests checked every step): with random heads in the HF formats (EAGLE: fc over
[embedding | final hidden state] and a Llama layer, the model's LM head; EAGLE3: fc over three
residual streams, the midlayer, a 4096-token draft vocabulary with d2t) greedy tokens equal the
tokens without speculation, batched, in prefill chunks and from the prefix cache; every row
drafts 3 tokens and never accepts more; EAGLE3's drafts are in its draft vocabulary; no page
leaks. High acceptance by construction is tests/models/test_draft_heads.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.config import ServerConfig
from engine.local import LocalEngine, Result
from engine.tokenizer import load_tokenizer
from msgs.params import SamplingParams
from tests.models.draft_heads import write_head

TEXTS = ["def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
         "The capital of France is", "Once upon a time, in a small village"]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


def float32_engine(model: str, **kw: object) -> LocalEngine:
    # one thread: a small batch on a busy CI host stalls in OpenMP barriers more than it gains
    return LocalEngine(ServerConfig(model=model, dtype="float32", max_total_tokens=4096, max_running_requests=8,
                                    cpu_threads=1, **kw))  # type: ignore[arg-type]


@pytest.fixture(autouse=True, scope="module")
def threads_back() -> Iterator[None]:
    """The engines set torch's thread count process-wide: give the next module the one it had."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _ids(results: list[Result]) -> list[list[int]]:
    assert all(r.finish_reason == "length" for r in results), results
    return [r.output_ids for r in results]


@pytest.fixture(scope="module")
def plain(default_model_dir: Path) -> tuple[str, list[list[int]], list[list[int]]]:
    """The model, the prompts and their greedy tokens without speculation."""
    tok = load_tokenizer(str(default_model_dir))
    assert tok is not None
    prompts = [tok.encode(t) for t in TEXTS]
    return str(default_model_dir), prompts, _ids(float32_engine(str(default_model_dir)).generate(prompts, GREEDY))


@pytest.mark.parametrize("kind", ["EAGLE", "EAGLE3"])
def test_random_head_greedy_equals_plain_batched_chunked_cached(kind: str, plain, tmp_path: Path) -> None:  # noqa: ANN001
    model, prompts, want = plain
    target = json.loads((Path(model) / "config.json").read_text())
    head = write_head(tmp_path / kind, target, kind, draft_vocab=4096 if kind == "EAGLE3" else 0)
    eng = float32_engine(model, speculative_algorithm=kind, speculative_draft_model_path=str(head),
                         max_prefill_tokens=32)
    draft = eng.runner.spec.draft
    proposed: list[list[int]] = []
    propose = draft.propose

    def record(ids: list[int], rows: list, *rest: object) -> None:  # noqa: ANN001
        propose(ids, rows, *rest)
        proposed.extend(ids[first + 1 : first + 1 + k] for first, k, _, _ in rows)

    draft.propose = record
    assert _ids(eng.generate(prompts, GREEDY)) == want  # 3 prompts in one batch, prefilled in 32-token chunks
    again = eng.generate(prompts, GREEDY)  # their prompts' pages (and the head's KV, hidden states) cached
    assert _ids(again) == want and again[0].cached_tokens >= 32
    st = eng.core.state.spec_stats
    # 3 drafts a row, fewer where max_new_tokens leaves less room
    assert st.rows > 0 and st.rows < st.drafted <= 3 * st.rows and 0 <= st.accepted <= st.drafted, st
    assert len(proposed) == st.rows and sum(map(len, proposed)) == st.drafted and min(map(min, proposed)) >= 0
    if kind == "EAGLE3":  # draft ids mapped into the model's vocabulary by d2t
        hot = set((draft.head.d2t + torch.arange(4096)).tolist())
        assert all(t in hot for d in proposed for t in d)
    assert eng.core.leak_free()


@pytest.mark.parametrize(("kw", "flag"), [
    (dict(speculative_algorithm="EAGLE3"), "--speculative-algorithm EAGLE3 needs --speculative-draft-model-path"),
    (dict(speculative_algorithm="EAGLE", speculative_draft_layers=4), "--speculative-draft-layers N: self-drafts need"),
    (dict(speculative_algorithm="NEXTN", speculative_draft_model_path="/tmp"),
     "--speculative-draft-model-path needs --speculative-algorithm STANDALONE, EAGLE or EAGLE3"),
    (dict(speculative_algorithm="NEXTN"), "--speculative-algorithm NEXTN: .* has no MTP layer"),
    (dict(speculative_algorithm="EAGLE", speculative_eagle_topk=4), "--speculative-eagle-topk"),
])
def test_head_flags_fail_at_start_naming_the_flag(kw: dict, flag: str, default_model_dir: Path) -> None:
    with pytest.raises(ValueError, match=flag):
        ServerConfig(model=str(default_model_dir), **kw)


def test_head_of_another_width_or_vocabulary_fails_at_start(default_model_dir: Path, tmp_path: Path) -> None:
    target = json.loads((default_model_dir / "config.json").read_text())
    wide = write_head(tmp_path / "wide", {**target, "hidden_size": 64, "num_attention_heads": 4,
                                          "num_key_value_heads": 2}, "EAGLE")
    with pytest.raises(ValueError, match="--speculative-draft-model-path .* hidden states of 64 values, the model's"):
        ServerConfig(model=str(default_model_dir), speculative_algorithm="EAGLE",
                     speculative_draft_model_path=str(wide))
    other = tmp_path / "other"
    write_head(other, {**target, "vocab_size": 1000}, "EAGLE3")
    with pytest.raises(ValueError, match="--speculative-draft-model-path .* vocabulary has 1000 tokens"):
        ServerConfig(model=str(default_model_dir), speculative_algorithm="EAGLE3",
                     speculative_draft_model_path=str(other))
