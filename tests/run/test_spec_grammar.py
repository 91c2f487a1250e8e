"""Speculative verify rows of a constrained request (engine/run/grammar.py, GrammarSlots with
in-process matchers, the CPU path): logit position j is masked as a one-token step would be after
drafts d1..dj; a draft the grammar refuses is masked out one position earlier (so it is never
accepted) and the rows past it stay unmasked; the matcher is rolled back, and advances by the
answered tokens only."""

from __future__ import annotations

import json
import math
from pathlib import Path

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


def test_drafted_positions_are_masked_after_their_drafts(default_model_dir: Path) -> None:
    tok = load_tokenizer(str(default_model_dir))
    assert tok is not None
    vocab = len(tok.hf)
    info = tokenizer_info(tok.hf, vocab)
    tag = {"type": "structural_tag", "format": json_format(SCHEMA)}
    grammar = Grammar("k", grammar_data(json.dumps(tag)), [int(t) for t in info.stop_token_ids])
    ids = tok.encode('{"n": 12}', add_special_tokens=False)
    slots = [GrammarSlots(str(default_model_dir), vocab, 2, torch.device("cpu"), background=False, helpers=0)
             for _ in range(2)]
    ref, g = slots
    try:
        for s in slots:
            prepare(s, grammar)
            s.apply(AddReq(0, "r", SAMPLING, pack_ids([1]), grammar=grammar))
        masks = []  # one-token steps: the mask before each of ids[:4]
        for t in ids[:4]:
            row = torch.zeros(1, vocab)
            ref.mask(row, [0])
            masks.append(row[0])
            ref.sampled([0], torch.tensor([t]))
        logits = torch.zeros(4, vocab)
        g.mask(logits, [0, 0, 0, 0], {0: ids[:3]})
        for j in range(4):
            assert torch.equal(logits[j], masks[j]), f"logit position {j}"
        bad = int((masks[1] == -math.inf).nonzero()[0])  # a token the grammar refuses after ids[0]
        logits = torch.zeros(3, vocab)
        g.mask(logits, [0, 0, 0], {0: [ids[0], bad]})
        assert torch.equal(logits[1], masks[1]) and logits[1, bad] == -math.inf  # never accepted there
        assert (logits[2] == 0).all()  # past the refused draft: never reached
        row = torch.zeros(1, vocab)
        g.mask(row, [0])
        assert torch.equal(row[0], masks[0])  # rolled back: still at the start
        g.sampled([0, 0], torch.tensor(ids[:2]))  # a verify answered two tokens
        row = torch.zeros(1, vocab)
        g.mask(row, [0])
        assert torch.equal(row[0], masks[2]) and g.rejected == 0
    finally:
        for s in slots:
            s.close()
