"""Every json_schema answer that ends in "stop" is valid JSON under its schema (issue 27:
xgrammar's length-bounded strings admitted raw control characters), sampled at temperature 1
from logits that favour byte tokens and the vocabulary tail, on CPU with the real matchers,
mask and sampler."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.bench.structured import SCHEMA
from engine.serve.grammar import _BOUNDED_STRING_CLASS, _JSON_STRING_CLASS, json_format, json_grammars
from tests.grammar_sampling import check_answers, sample_json

REQUESTS = 8


def test_stop_answers_are_valid_json(default_model_dir: Path) -> None:
    answers = sample_json(default_model_dir, SCHEMA, torch.device("cpu"), REQUESTS, max_steps=2000)
    check_answers(answers, SCHEMA, REQUESTS)


def test_only_the_bounded_string_class_is_patched() -> None:
    """The EBNF of a schema with length-bounded strings: their class now refuses control
    characters and surrogates, the rest of the grammar is xgrammar's."""
    fmt = json_format(SCHEMA)
    ebnf = json_grammars(fmt)["grammar"]
    import xgrammar as xgr

    want = str(xgr.Grammar.from_json_schema(json.dumps(SCHEMA), max_whitespace_cnt=fmt["max_whitespace_cnt"]))
    assert _BOUNDED_STRING_CLASS in want and _BOUNDED_STRING_CLASS not in ebnf
    assert ebnf == want.replace(_BOUNDED_STRING_CLASS, _JSON_STRING_CLASS)
    xml = {**fmt, "style": "glm_xml"}  # another style: xgrammar converts it itself
    assert json_grammars({"type": "sequence", "elements": [xml]}) == {"type": "sequence", "elements": [xml]}


def test_utf8_guard_clears_the_tokens_that_start_ill_formed_utf8(default_model_dir: Path) -> None:
    from engine.run.grammar_helper import utf8_guard
    from engine.tokenizer import load_tokenizer, tokenizer_info

    tok = load_tokenizer(str(default_model_dir))
    info = tokenizer_info(tok.hf, len(tok.hf) + 64)
    row = utf8_guard(info)
    banned = {info.decoded_vocab[t] for t in range(info.vocab_size) if not (int(row[t // 32]) >> (t % 32)) & 1}
    assert {b"\xe0", b"\xed", b"\xf0", b"\xf4"} <= banned  # lone lead bytes: the next byte is unchecked
    for b in banned:
        assert b[-1:] in (b"\xe0", b"\xed", b"\xf0", b"\xf4") or any(c in (0xC0, 0xC1) or c >= 0xF5 for c in b) or any(
            (lead, nxt) in _BAD_PAIRS for lead, nxt in zip(b, b[1:], strict=False)), b
    assert b"a" not in banned and "é".encode() not in banned


def _bad(lead: int, lo: int, hi: int) -> set[tuple[int, int]]:
    return {(lead, c) for c in range(0x80, 0xC0) if not lo <= c <= hi}


_BAD_PAIRS = _bad(0xE0, 0xA0, 0xBF) | _bad(0xED, 0x80, 0x9F) | _bad(0xF0, 0x90, 0xBF) | _bad(0xF4, 0x80, 0x8F)
