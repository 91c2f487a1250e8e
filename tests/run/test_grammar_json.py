"""Every json_schema answer that ends in "stop" is valid JSON under its schema (issue 27:
xgrammar's length-bounded strings admitted raw control characters), sampled at temperature 1
from logits that favour byte tokens and the vocabulary tail, on CPU with the real matchers,
mask and sampler."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.bench.structured import SCHEMA
from engine.serve.grammar import JSON_STRING_CHAR, json_safe_strings
from tests.grammar_sampling import check_answers, sample_json

REQUESTS = 8
C = "^" + JSON_STRING_CHAR


def test_stop_answers_are_valid_json(default_model_dir: Path) -> None:
    answers = sample_json(default_model_dir, SCHEMA, torch.device("cpu"), REQUESTS, max_steps=2000)
    check_answers(answers, SCHEMA, REQUESTS)


@pytest.mark.parametrize(
    ("schema", "want"),
    [
        ({"type": "string", "minLength": 4, "maxLength": 24}, {"type": "string", "pattern": C + "{4,24}$"}),
        ({"type": "string", "maxLength": 3}, {"type": "string", "pattern": C + "{0,3}$"}),
        ({"type": "string", "minLength": 2}, {"type": "string", "pattern": C + "{2,}$"}),
        ({"type": "string", "minLength": 2, "pattern": "^a+$"}, {"type": "string", "minLength": 2, "pattern": "^a+$"}),
        ({"type": "string", "maxLength": 9, "format": "email"}, {"type": "string", "maxLength": 9, "format": "email"}),
        ({"type": "array", "items": {"type": "string", "maxLength": 2}},
         {"type": "array", "items": {"type": "string", "pattern": C + "{0,2}$"}}),
        ({"anyOf": [{"type": "string", "minLength": 1}, {"type": "integer"}]},
         {"anyOf": [{"type": "string", "pattern": C + "{1,}$"}, {"type": "integer"}]}),
        ({"type": "integer", "minimum": 0}, {"type": "integer", "minimum": 0}),
    ],
)
def test_length_bounded_strings_become_patterns(schema: dict, want: dict) -> None:
    assert json_safe_strings(schema) == want
