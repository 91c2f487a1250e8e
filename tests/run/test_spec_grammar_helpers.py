"""Speculative verify rows of constrained requests with grammar helper processes
(engine/run/grammar_helper.py HDraft): each drafted position's mask equals the in-process
matchers' (`GrammarSlots._mask_drafted`) for the same drafts: after d1..dj, a refused draft
masked out one position earlier and nothing past it, nothing past a stop token; the helpers'
matchers are rolled back and advance by the answered tokens only."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from engine.config import ServerConfig
from engine.run.grammar import GrammarSlots
from engine.run.grammar_helper import MAX_DRAFTS
from engine.serve.grammar import json_format
from engine.tokenizer import grammar_data, load_tokenizer, tokenizer_info
from msgs.codec import pack_ids
from msgs.params import Grammar
from msgs.steps import AddReq, WorkerSampling
from tests.grammar_sampling import prepare

EXTRA = 64  # the model's logits are wider than the tokenizer's vocabulary: those ids are masked too
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
SAMPLING = WorkerSampling(1.0, 1.0, -1, 0.0, 1.0, 0.0, 0.0, 7, False, 0)


@pytest.fixture(scope="module")
def setup(default_model_dir: Path):  # noqa: ANN201
    tok = load_tokenizer(str(default_model_dir))
    assert tok is not None
    vocab = len(tok.hf) + EXTRA
    info = tokenizer_info(tok.hf, vocab)
    tag = {"type": "structural_tag", "format": json_format(SCHEMA)}
    grammar = Grammar("k", grammar_data(json.dumps(tag)), [int(t) for t in info.stop_token_ids])
    ref = GrammarSlots(str(default_model_dir), vocab, 4, torch.device("cpu"), background=False, helpers=0)
    helped = GrammarSlots(str(default_model_dir), vocab, 4, torch.device("cpu"), helpers=2)
    yield tok.encode('{"n": 12}', add_special_tokens=False), vocab, grammar, ref, helped
    ref.close()
    helped.close()


def _verify(g: GrammarSlots, drafts: dict[int, list[int]], vocab: int, announce: bool) -> torch.Tensor:
    """Mask a verify step's logits (one row per logit position, request-major); `announce`: the
    drafts are given before the forward (`drafting`, the helpers' job), else asked for in mask."""
    row_slots = [s for s, d in drafts.items() for _ in range(len(d) + 1)]
    if announce:
        g.drafting(list(drafts), list(drafts.values()))
    logits = torch.zeros(len(row_slots), vocab)
    g.mask(logits, row_slots, drafts)
    return logits


def test_helpers_mask_drafted_positions_as_in_process_matchers(setup) -> None:  # noqa: ANN001
    ids, vocab, grammar, ref, helped = setup
    stop = grammar.stop_ids[0]
    assert helped.verifies_drafts and helped._helpers is not None and helped._helpers.n == 2
    for g in (ref, helped):
        prepare(g, grammar)
        for slot in range(3):  # slots 0 and 2 in helper 0, slot 1 in helper 1
            g.apply(AddReq(slot, f"r{slot}", SAMPLING, pack_ids([1]), grammar=grammar))
    first = torch.zeros(1, vocab)
    ref.mask(first, [0])
    bad = int((first[0] == -math.inf).nonzero()[0])  # a token the grammar refuses at the start
    after = _verify(ref, {0: ids[:1]}, vocab, False)[1]
    bad1 = int((after == -math.inf).nonzero()[0])  # ... and after ids[0]
    drafts = {0: ids[:3], 1: [ids[0], bad1, ids[1]], 2: [*ids, stop, ids[0]]}  # refused; past a stop token
    want = _verify(ref, drafts, vocab, False)
    for announce in (True, False):
        got = _verify(helped, drafts, vocab, announce)
        assert torch.equal(got, want)
    masked = (want == -math.inf).any(dim=1)
    assert masked.sum() >= 4 + 2 + len(ids) + 1  # slot 0's, 1's up to its refused draft, 2's up to its stop
    assert (want[masked, vocab - EXTRA:] == -math.inf).all()  # ids past the tokenizer's vocabulary
    r1 = 4  # slot 1's first row: d2 = bad1 refused at its position 1, never reached past it
    assert want[r1 + 1, bad1] == -math.inf and (want[r1 + 2:r1 + 4] == 0).all()
    r2 = 8 + len(ids)  # slot 2's position after its stop token: never reached
    assert (want[r2] == -math.inf).sum() > 0 and (want[r2 + 1:] == 0).all()
    assert (_verify(helped, {0: [bad, ids[0]]}, vocab, True)[1:] == 0).all()  # d1 refused: no position filled
    # rolled back: a verify step answered ids[0], ids[1] (slot 0) and ids[0] (slot 1)
    for g in (ref, helped):
        g.sampled([0, 0, 1], torch.tensor([ids[0], ids[1], ids[0]]))
    drafts = {0: ids[2:5], 1: ids[1:3], 2: ids[:2]}
    assert torch.equal(_verify(helped, drafts, vocab, True), _verify(ref, drafts, vocab, False))
    assert helped.rejected == ref.rejected == 0


def test_the_drafted_region_holds_as_many_positions_as_the_flag_allows(default_model_dir: Path) -> None:
    ServerConfig(model=str(default_model_dir), speculative_algorithm="NGRAM", speculative_num_steps=MAX_DRAFTS)
    with pytest.raises(ValueError, match="--speculative-num-steps"):
        ServerConfig(model=str(default_model_dir), speculative_algorithm="NGRAM", speculative_num_steps=MAX_DRAFTS + 1)
