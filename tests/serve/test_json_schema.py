"""allOf fused before xgrammar compiles a schema (engine/serve/json_schema.py). An audit found xgrammar
0.2.9 turns an allOf of several schemas, or one beside other keywords, into "any JSON value": a
strict request got "stop" answers its schema refuses. Each case compiles through the served path
(json_format -> json_grammars -> xgrammar) and the grammar must accept exactly the instances that
jsonschema says the ORIGINAL schema admits."""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from engine.serve.errors import ApiError
from engine.serve.grammar import json_format, json_grammars, spec_format

S = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
CASES = [
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]},
     [{"a": 1, "b": "x"}, {"a": 1}, {"b": "x"}, {"a": "s", "b": "x"}, "Ave", None]),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False,
      "allOf": [{"required": ["a"]}]},
     [{"a": 1}, {"a": 1, "b": 2}, {}, {"a": 1.5}, None]),
    ({"$defs": {"S": S},
      "allOf": [{"$ref": "#/$defs/S"}, {"properties": {"y": {"type": "string"}}, "required": ["y"]}]},
     [{"x": 1, "y": "a"}, {"x": 1}, {"y": "a"}, {"x": "1", "y": "a"}]),
    ({"allOf": [{"type": "number", "minimum": 0}, {"type": "integer", "maximum": 10}]}, [5, 0, 10, 11, -1, 2.5, "5"]),
    ({"allOf": [{"enum": ["a", "b", "c"]}, {"enum": ["b", "c", "d"]}]}, ["b", "c", "a", "d"]),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
                {"type": "object", "properties": {"b": {"type": "integer"}}}]},
     [{"a": 1}, {}, {"a": 1, "b": 2}, {"b": 2}]),
    ({"type": "object", "properties": {"p": {"allOf": [{"type": "string", "minLength": 2}, {"maxLength": 3}]}},
      "required": ["p"]},
     [{"p": "ab"}, {"p": "abc"}, {"p": "a"}, {"p": "abcd"}]),
    # a property in two parts, one a boolean schema, one a $ref
    ({"$defs": {"S": S}, "allOf": [{"type": "object", "properties": {"a": True, "s": {"$ref": "#/$defs/S"}},
                                    "required": ["a", "s"]},
                                   {"type": "object", "properties": {"a": {"type": "integer"},
                                                                     "s": {"properties": {"y": {"type": "string"}}}}}]},
     [{"a": 1, "s": {"x": 1}}, {"a": 1, "s": {"x": 1, "y": "z"}}, {"a": "1", "s": {"x": 1}}, {"a": 1, "s": {}}]),
]


def _accepts(schema: dict, instance: object) -> bool:
    ebnf = json_grammars(json_format(schema))["grammar"]
    return _is_grammar_accept_string(xgr.Grammar.from_ebnf(ebnf), json.dumps(instance))


@pytest.mark.parametrize(("schema", "instances"), CASES, ids=[str(i) for i in range(len(CASES))])
def test_a_fused_allof_admits_what_the_schema_admits(schema: dict, instances: list) -> None:
    valid = [jsonschema.Draft202012Validator(schema).is_valid(x) for x in instances]
    assert any(valid) and not all(valid)  # (the cases tell both kinds apart)
    assert [_accepts(schema, x) for x in instances] == valid


@pytest.mark.parametrize(("schema", "why"), [
    ({"allOf": [{"type": "string", "pattern": "^a"}, {"type": "string", "pattern": "b$"}]},
     "set 'pattern' differently"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "share none"),
    ({"$defs": {"T": {"allOf": [{"$ref": "#/$defs/T"}, {"type": "object"}]}}, "$ref": "#/$defs/T"}, "refers to itself"),
    ({"allOf": [{"properties": {"a": {}}, "additionalProperties": False}, {"required": ["b"]}]}, "'b' is required"),
    ({"allOf": [{"enum": [1]}, {"enum": [2]}]}, "share no value"),
    ({"allOf": [False, {"type": "string"}]}, "false or not a schema"),
    ({"allOf": [{"minimum": "a"}, {"minimum": 1}]}, "cannot be combined"),  # (a TypeError inside: not a 500)
    ({"type": "string", "pattern": "^(?=a)ab+$"}, "lookaround"),
    ({"type": "object", "patternProperties": {"^(?!x)": {}}}, "lookaround"),
])
def test_what_cannot_be_enforced_is_a_400(schema: dict, why: str) -> None:
    with pytest.raises(ApiError, match=f"json_schema: .*{why.replace('$', '[$]')}") as err:
        spec_format("json_schema", json.dumps(schema))
    assert err.value.status == 400
    with pytest.raises(ApiError, match="lookaround"):
        spec_format("regex", "(?<=a)b")


def test_allof_xgrammar_enforces_is_left_alone() -> None:
    for schema in ({"allOf": [S]}, {"title": "t", "type": "object", "allOf": [S]}, S):
        assert json_format(schema)["json_schema"] == schema
