"""Constrained sampling at temperature 1 over random logits biased towards the tokenizer's
single-byte tokens and the vocabulary tail (the ids past the tokenizer's, which a model's
logits have and the tokenizer has not): the rows most likely to leak past a grammar mask.
Every answer that ends in a stop token must be JSON valid under its schema. Used by the CPU
test (tests/run/test_grammar_json.py) and the CUDA one (tests/gpu/test_grammar_gpu.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.run.grammar import GrammarSlots
from engine.run.sample_params import SampleParams
from engine.run.sampler import Sampler
from engine.serve.grammar import compilable, json_format
from engine.tokenizer import grammar_data, load_tokenizer, tokenizer_info
from msgs.codec import pack_ids
from msgs.params import Grammar
from msgs.steps import AddReq, FreeReq, PrepareGrammar, WorkerSampling

TAIL = 1024  # logits past the tokenizer's vocabulary
BIAS = 6.0  # added to the logits of byte tokens and of the tail: most draws pick one unless masked
WORKER_SAMPLING = WorkerSampling(1.0, 1.0, -1, 0.0, 1.0, 0.0, 0.0, 7, False, 0)


@dataclass
class Answers:
    stopped: list[tuple[str, list[int]]]  # (text, token ids) of the answers that ended with a stop token
    unfinished: int  # answers that ran out of steps
    rejected: int  # sampled tokens a matcher refused (the mask let them through)


def prepare(g: GrammarSlots, grammar: Grammar) -> None:
    """What the scheduler's gate waits for before an AddReq: the grammar prepared on the rank and
    compiled (in process, or in every helper)."""
    g.apply(PrepareGrammar(grammar))
    assert g.compiled(wait=True) == [(grammar.key, g._keys.prepared, "")]


def sample_json(tokenizer_dir: Path, schema: dict[str, Any], device: torch.device, requests: int,
                max_steps: int, helpers: int = 0) -> Answers:
    tok = load_tokenizer(str(tokenizer_dir))
    assert tok is not None
    vocab = len(tok.hf) + TAIL
    info = tokenizer_info(tok.hf, vocab)
    tag = {"type": "structural_tag", "format": json_format(schema)}
    stops = [int(t) for t in info.stop_token_ids]
    grammar = Grammar("k", grammar_data(compilable(json.dumps(tag))), stops)
    bias = torch.zeros(vocab)
    bias[len(tok.hf):] = BIAS
    for t, piece in enumerate(tok.hf.convert_ids_to_tokens(list(range(len(tok.hf))))):
        if piece is not None and len(piece) == 1:  # a byte-level token: one byte
            bias[t] = BIAS
    bias = bias.to(device)
    slots_g = GrammarSlots(str(tokenizer_dir), vocab, requests, device, helpers=helpers)
    sampler = Sampler(vocab, requests, device)
    gen = torch.Generator(device=device).manual_seed(0)
    out: dict[int, list[int]] = {s: [] for s in range(requests)}
    stopped: list[tuple[str, list[int]]] = []
    try:
        slots_g.wait_ready()
        prepare(slots_g, grammar)
        for s in range(requests):
            slots_g.apply(AddReq(s, f"r{s}", WORKER_SAMPLING, pack_ids([1]), pack_ids([]), grammar=grammar))
            sampler.add(s, SampleParams(seed=1000 + s, temperature=1.0))
        for _ in range(max_steps):
            live = sorted(out)
            if not live:
                break
            logits = torch.randn(len(live), vocab, generator=gen, device=device) * 2 + bias
            slots_g.mask(logits, live)
            positions = torch.tensor([len(out[s]) + 1 for s in live], device=device)
            tokens = sampler.sample(logits, live, positions).token_ids
            slots_g.sampled(live, tokens)
            for s, t in zip(live, tokens.tolist(), strict=True):
                if t in stops:  # the scheduler ends a request on its grammar's stop token
                    ids = out.pop(s)
                    stopped.append((tok.hf.decode(ids), ids))
                    slots_g.apply(FreeReq(s))
                    sampler.remove(s)
                else:
                    out[s].append(t)
        slots_g.mask(torch.zeros(1, vocab, device=device), [0])  # joins the last step's job
        return Answers(stopped, len(out), slots_g.rejected)
    finally:
        slots_g.close()


def check_answers(answers: Answers, schema: dict[str, Any], requests: int) -> None:
    import jsonschema

    assert answers.rejected == 0, f"{answers.rejected} sampled tokens were refused by their matcher"
    assert len(answers.stopped) >= requests // 2, f"only {len(answers.stopped)} of {requests} stopped"
    for text, ids in answers.stopped:
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise AssertionError(f"a 'stop' answer is not JSON ({exc}): {text!r} {ids}") from None
        jsonschema.validate(doc, schema)
