"""JSON schemas made enforceable before xgrammar compiles them.

xgrammar 0.2.9 turns an `allOf` of several schemas, or one beside other keywords, into "any JSON
value" (a warning on stderr, nothing else), and drops a lookaround in a `pattern`: a request
with `strict: true` then got a "stop" answer its schema refuses. Here every such `allOf` is
fused into one schema, as the keywords allow (properties merged, `required` joined, bounds
tightened, types and enums intersected, closed objects honoured); a combination that cannot be
fused, and a lookaround, is a ValueError that names it (the caller's 400), never a silent
"any JSON".
"""

from __future__ import annotations

import copy
import re
from typing import Any

ANNOTATIONS = frozenset(("title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                         "writeOnly", "$id", "$schema"))
_DATA = frozenset(("const", "enum", "default", "examples"))  # values that are data, not schemas
_LOWER = frozenset(("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties"))
_UPPER = frozenset(("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties"))
_LOOKAROUND = re.compile(r"\(\?<?[=!]")


def enforceable(schema: Any) -> Any:
    """The schema with every `allOf` fused (a copy; the input is left alone); ValueError where
    xgrammar would enforce less than the schema says."""
    try:
        return _Fuser(schema).walk(schema)
    except RecursionError:
        raise ValueError("json_schema is nested too deeply") from None
    except (TypeError, AttributeError) as exc:  # a keyword of the wrong type where parts are combined
        raise ValueError(f"allOf: its parts cannot be combined ({exc})") from None


def check_pattern(pattern: str, where: str = "pattern") -> None:
    if _LOOKAROUND.search(pattern):
        raise ValueError(f"{where} {pattern[:80]!r}: lookaround assertions ((?=, (?!, (?<=, (?<!) are not "
                         "enforced by the grammar engine")


class _Fuser:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.expanding: list[str] = []  # $refs being inlined into an allOf (a cycle cannot be)

    def walk(self, node: Any) -> Any:
        if isinstance(node, list):
            return [self.walk(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {k: v if k in _DATA else self.walk(v) for k, v in node.items()}
        if isinstance(out.get("pattern"), str):
            check_pattern(out["pattern"])
        for key in out.get("patternProperties") or {}:
            check_pattern(key, "patternProperties")
        parts = out.get("allOf")
        if not isinstance(parts, list) or not parts:
            return out
        rest = {k: v for k, v in out.items() if k not in ANNOTATIONS and k != "allOf"}
        if len(parts) == 1 and set(rest) <= {"type"}:
            return out  # what xgrammar enforces as it is
        fused = self.fuse([self.inline(p) for p in parts] + ([rest] if rest else []))
        return {**{k: v for k, v in out.items() if k in ANNOTATIONS}, **fused}

    def inline(self, part: Any) -> dict[str, Any]:
        """An allOf part as a plain schema: a local $ref replaced by what it points to."""
        if part is True or part == {}:
            return {}
        if not isinstance(part, dict):
            raise ValueError("allOf: a part is false or not a schema (no value could satisfy it)")
        ref = part.get("$ref")
        if not isinstance(ref, str):
            return part
        if ref in self.expanding:
            raise ValueError(f"allOf: $ref {ref[:80]!r} refers to itself; such an allOf cannot be enforced")
        self.expanding.append(ref)
        target = self.walk(self.inline(_resolve(self.root, ref)))
        self.expanding.pop()
        return self.fuse([target, {k: v for k, v in part.items() if k != "$ref"}])

    def fuse(self, parts: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for part in parts:
            for key, value in part.items():
                out[key] = value if key not in out else self.merge_key(key, out[key], value)
        if isinstance(out.get("properties", {}), dict):
            _close(out, parts)
        return out

    def merge_key(self, key: str, a: Any, b: Any) -> Any:
        if a == b or key in ANNOTATIONS:
            return a
        if key in _LOWER or key in _UPPER:
            return (max if key in _LOWER else min)(a, b)
        if key == "type":
            return _types(a, b)
        if key == "required":
            return list(dict.fromkeys([*a, *b]))
        if key == "enum":
            both = [x for x in a if x in b]
            if not both:
                raise ValueError("allOf: the parts' enums share no value")
            return both
        if key == "properties" and isinstance(a, dict) and isinstance(b, dict):
            return {n: self.fuse([self.inline(a[n]), self.inline(b[n])]) if n in a and n in b
                    else a.get(n, b.get(n)) for n in {**a, **b}}
        if key in ("items", "additionalProperties") and isinstance(a, dict) and isinstance(b, dict):
            return self.fuse([self.inline(a), self.inline(b)])
        if key == "additionalProperties" and (a is False or b is False):
            return False
        if key == "additionalProperties" and (a is True or b is True):
            return b if a is True else a
        raise ValueError(f"allOf: its parts set {key!r} differently, which cannot be enforced as one schema")


def _close(out: dict[str, Any], parts: list[dict[str, Any]]) -> None:
    """A part with additionalProperties false admits only its own properties: the others go, and
    one the fused schema requires makes it unsatisfiable."""
    for part in parts:
        if part.get("additionalProperties") is False:
            own = part.get("properties") or {}
            for name in out.get("required", ()):
                if name not in own:
                    raise ValueError(f"allOf: {name!r} is required, and a part with additionalProperties false "
                                     "does not admit it")
            for name in [n for n in out.get("properties", {}) if n not in own]:
                del out["properties"][name]


def _types(a: Any, b: Any) -> Any:
    sa, sb = ({a} if isinstance(a, str) else set(a)), ({b} if isinstance(b, str) else set(b))
    both = (sa & sb) | ({"integer"} if ("integer" in sa and "number" in sb) or ("number" in sa and "integer" in sb)
                        else set())
    if not both:
        raise ValueError(f"allOf: the parts' types {a!r} and {b!r} share none")
    return next(iter(both)) if len(both) == 1 else sorted(both)


def _resolve(root: Any, ref: str) -> Any:
    """A '#/...' JSON pointer into the schema (outside refs were refused before)."""
    node = root
    for raw in ref.lstrip("#").split("/")[1:] if ref != "#" else []:
        token = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            raise ValueError(f"allOf: $ref {ref[:80]!r} points at nothing in the schema")
    return copy.deepcopy(node)
