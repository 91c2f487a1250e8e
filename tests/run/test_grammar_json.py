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
