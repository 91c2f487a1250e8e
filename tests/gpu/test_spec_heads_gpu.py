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
