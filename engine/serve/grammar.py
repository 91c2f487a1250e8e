"""Grammar checks in the tokenizer process, and the structural tags requests constrain with.

What a request constrains (json_schema / regex / ebnf, response_format, a forced
tool_choice) becomes one xgrammar structural tag. It is compiled here, to refuse what does
not compile, takes too long or is too large, and shipped to every rank as its source
(`msgs.params.Grammar`: zlib of the structural tag's JSON), which each rank compiles again,
as each of SGLang's ranks does. Shipping xgrammar's serialized CompiledGrammar instead cost
more than compiling: its JSON grows with the grammar's rules, not only its masks (50 tool
schemas: 37 ms to compile, 93 MB of JSON in 3.4 s; 300 optional-or-union properties: the
tokenizer process past 22 GB while serializing, killed).

* Compilation runs in two child processes (engine/serve/grammar_checker.py), each driven by
  a pool thread, never on the event loop, under a time limit: a grammar that fails to
  compile, takes longer (its child is killed, and another started for the next request), or
  whose compiled form passes MAX_COMPILED_BYTES (what every rank would hold) is a 400; the
  server keeps serving.
* One compiler and one cache of checked grammars (by the SHA-256 of what is compiled)
  are shared by every request: 64 requests with one schema compile it once here.
* xgrammar imports torch, which this process never loads: the children import it and build the
  TokenizerInfo. The first starts once the scheduler is ready (`warm`: 2.7 s on 2 cores, which the
  first constrained request paid before), the second on first use; `--grammar-backend none` starts
  none and refuses every constraint.
* The TokenizerInfo has the MODEL's vocabulary size (logits may be wider than the
  tokenizer's vocabulary: those ids are never allowed). Workers build the same TokenizerInfo
  from the same tokenizer files (`tokenizer_info`), so every rank compiles the same grammar.
* Whitespace between JSON tokens is capped (`JSON_MAX_WHITESPACE` per run), so JSON mode
  cannot loop on spaces or newlines until max_tokens.
* With a reasoning parser on, the constraint starts after the end-of-reasoning marker: the
  structural tag is (reasoning tag of any text) + a few whitespace chars + the constraint.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog

from engine.serve.errors import ApiError
from engine.serve.grammar_checker import Checker, CheckerStartError
from engine.serve.json_schema import check_pattern, enforceable
from engine.serve.metrics import Metrics
from engine.serve.parsers.base import ToolStructure
from engine.serve.parsers.reasoning import GAP_CHARS
from engine.tokenizer import grammar_data
from msgs.params import Grammar

log = structlog.get_logger()

COMPILE_TIMEOUT_S = 10.0
JSON_MAX_WHITESPACE = 8  # per whitespace run: room for a newline and an indent, never a loop
CACHE_ENTRIES = 256  # checked grammars kept (their source: a few KB each)
MAX_COMPILED_BYTES = 64 << 20  # a compiled grammar's masks and automata, held by every rank (GrammarKeys.BYTES in all)
CHECKERS = 2  # child processes compiling, one pool thread each
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")
_ARGS_STYLE = {"json": "json", "glm45_xml": "glm_xml"}  # ToolStructure.args_format -> xgrammar style


@dataclass(frozen=True)
class Reasoning:
    """Where reasoning ends: the grammar applies after `end`. `starts_inside`: the prompt
    pre-filled the start marker, so the output begins inside the reasoning."""

    start: str
    end: str
    starts_inside: bool


def json_format(schema: dict[str, Any] | bool, param: str = "json_schema") -> dict[str, Any]:
    """A JSON-schema part, its allOfs fused (engine/serve/json_schema.py: xgrammar would enforce
    nothing of them); a 400 naming `param` where it cannot be enforced."""
    try:
        schema = enforceable(schema)
    except ValueError as exc:
        raise ApiError(400, f"{param}: {exc}", param=param) from None
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": JSON_MAX_WHITESPACE}


# xgrammar 0.2.9 builds a string with minLength / maxLength from this class, which admits raw
# control characters (U+0000-U+001F but CR and LF: a "stop" answer json.loads refuses) and
# UTF-8-encoded surrogates (one U+FFFD per byte once decoded: maxLength broken); its plain
# strings exclude the former. Patched in the EBNF; a pattern instead (a Regex rule) made every
# mask fill ~8x slower (0.13-0.24 vs 0.017 ms a row), so did a class of explicit ranges.
_BOUNDED_STRING_CLASS = r'[^\"\\\r\n]'
_JSON_STRING_CLASS = r'[^\0-\x1f\"\\\r\n\uD800-\uDFFF]'


def json_grammars(fmt: Any) -> Any:
    """A structural-tag format with each JSON-schema part (JSON style) replaced by its EBNF, the
    class of length-bounded strings patched (_BOUNDED_STRING_CLASS); runs where compiles run
    (a schema xgrammar refuses raises here, as it would compiling)."""
    if isinstance(fmt, list):
        return [json_grammars(f) for f in fmt]
    if not isinstance(fmt, dict):
        return fmt
    if fmt.get("type") == "json_schema" and fmt.get("style", "json") == "json":
        import xgrammar as xgr

        ebnf = str(xgr.Grammar.from_json_schema(json.dumps(fmt["json_schema"]), any_whitespace=True,
                                                max_whitespace_cnt=fmt.get("max_whitespace_cnt")))
        return {"type": "grammar", "grammar": ebnf.replace(_BOUNDED_STRING_CLASS, _JSON_STRING_CLASS)}
    return {k: json_grammars(v) for k, v in fmt.items()}


def compilable(tag_text: str) -> str:
    """A structural tag's JSON as GrammarCompiler.compile_structural_tag should get it."""
    tag = json.loads(tag_text)
    return json.dumps({**tag, "format": json_grammars(tag["format"])})


def spec_format(name: str, text: str) -> dict[str, Any]:
    """The structural-tag format of a json_schema / regex / ebnf field (400 on bad JSON, an empty
    pattern or grammar, or a $ref outside the schema, which xgrammar would drop, unenforced)."""
    if name in ("regex", "ebnf") and not text:
        raise ApiError(400, f"{name} must not be empty", param=name)
    if name == "regex":
        try:
            check_pattern(text, "regex")
        except ValueError as exc:
            raise ApiError(400, str(exc), param=name) from None
        return {"type": "regex", "pattern": text}
    if name == "ebnf":
        return {"type": "grammar", "grammar": text, "syntax": "ebnf"}
    if name == "structural_tag":
        return structural_format(text)
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise ApiError(400, f"json_schema is not valid JSON: {exc}", param="json_schema") from None
    if not isinstance(schema, dict | bool):
        raise ApiError(400, "json_schema must be a JSON object (a JSON Schema)", param="json_schema")
    ref = _outside_ref(schema)
    if ref is not None:
        raise ApiError(400, f"json_schema: $ref {ref[:100]!r} points outside the schema (only '#...' refs are "
                       "resolved)", param="json_schema")
    return json_format(schema)


_DATA_KEYWORDS = ("const", "enum", "default", "examples")  # their values are data, not schemas


def _outside_ref(schema: Any) -> str | None:
    """The first $ref of the schema that does not point inside it, if any (iterative: no depth limit)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                return ref
            stack.extend(v for k, v in node.items() if k not in _DATA_KEYWORDS)
        elif isinstance(node, list):
            stack.extend(node)
    return None


def structural_format(text: str) -> dict[str, Any]:
    """SGLang's / vLLM's structural tag, {"structures": [{"begin", "schema", "end"}], "triggers": [...]}, as
    xgrammar's triggered tags: any text, where a trigger starts one of the structures (its begin, which
    starts with a trigger), then JSON of its schema, then its end; 400s naming structural_tag."""
    def bad(why: str) -> ApiError:
        return ApiError(400, f"structural_tag: {why}", param="structural_tag")

    try:
        tag = json.loads(text)
    except ValueError as exc:
        raise bad(f"not valid JSON: {exc}") from None
    if not isinstance(tag, dict) or sorted(tag) != ["structures", "triggers"]:
        raise bad('an object of "structures" and "triggers" (and nothing else)')
    structures, triggers = tag["structures"], tag["triggers"]
    if not (isinstance(triggers, list) and triggers and all(isinstance(t, str) and t for t in triggers)):
        raise bad("triggers must be a non-empty list of non-empty strings")
    if not (isinstance(structures, list) and structures):
        raise bad("structures must be a non-empty list")
    tags = []
    for i, st in enumerate(structures):
        if not (isinstance(st, dict) and set(st) <= {"begin", "schema", "end"} and isinstance(st.get("begin"), str)
                and isinstance(st.get("end"), str) and isinstance(st.get("schema", {}), dict | bool)):
            raise bad(f"structures[{i}] must be {{begin: string, schema: object, end: string}}")
        if not any(st["begin"].startswith(t) for t in triggers):
            raise bad(f"structures[{i}].begin {st['begin'][:100]!r} starts with no trigger")
        content = json_format(st.get("schema", {}), f"structural_tag: structures[{i}].schema")
        tags.append({"type": "tag", "begin": st["begin"], "content": content, "end": st["end"]})
    return {"type": "triggered_tags", "triggers": triggers, "tags": tags, "at_least_one": False,
            "stop_after_first": False}


def tools_format(structure: ToolStructure, parallel: bool) -> dict[str, Any]:
    """The forced call(s) of a tool_choice required / named: prefix + tag (separator +
    tag)* + suffix, one tag per allowed function with its arguments' schema."""
    style = _ARGS_STYLE.get(structure.args_format)
    if style is None:
        raise ApiError(400, f"tool_choice cannot be enforced for argument format {structure.args_format!r}")
    tags = [
        {
            "type": "tag",
            "begin": t.begin,
            "content": {**json_format(t.schema, f"tools: {t.name}'s parameters"), "style": style},
            "end": t.end,
        }
        for t in structure.tags
    ]
    calls = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": structure.separator,
        "at_least_one": True,
        "stop_after_first": not parallel,
    }
    parts = [{"type": "const_string", "value": s} for s in (structure.prefix,) if s]
    parts.append(calls)
    parts += [{"type": "const_string", "value": s} for s in (structure.suffix,) if s]
    return parts[0] if len(parts) == 1 else {"type": "sequence", "elements": parts}


def with_reasoning(fmt: dict[str, Any], reasoning: Reasoning | None) -> dict[str, Any]:
    """Free text up to the end-of-reasoning marker, then the constraint."""
    if reasoning is None:
        return fmt
    think = {
        "type": "tag",
        "begin": "" if reasoning.starts_inside else reasoning.start,
        "content": {"type": "any_text"},
        "end": reasoning.end,
    }
    # models put a newline or two after the marker; the reasoning parser drops it from the content
    gap = {"type": "regex", "pattern": rf"[ \t\n]{{0,{GAP_CHARS}}}"}
    return {"type": "sequence", "elements": [think, gap, fmt]}


class GrammarService:
    """Compiles constraints to `Grammar`s for requests; see the module docstring."""

    def __init__(self, model_dir: str, metrics: Metrics, timeout_s: float = COMPILE_TIMEOUT_S,
                 max_compiled_bytes: int = MAX_COMPILED_BYTES, enabled: bool = True) -> None:
        self.enabled = enabled  # --grammar-backend none: every constraint is a 400
        self._model_dir = model_dir
        self._metrics = metrics
        self.timeout_s = timeout_s
        self.max_compiled_bytes = max_compiled_bytes
        self._pool = ThreadPoolExecutor(CHECKERS, thread_name_prefix="grammar")
        self._local = threading.local()  # each pool thread's Checker
        self.checkers: list[Checker] = []
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._inflight: dict[str, asyncio.Task[Grammar]] = {}
        self._down: str | None = None  # why the server went down (`down`)
        self._waiters: set[asyncio.Future[None]] = set()  # requests' waits on a compile, resolved by `down`
        self._warming: Future[None] | None = None  # `warm`'s checker start

    async def compile(self, fmt: dict[str, Any], vocab_size: int, param: str) -> Grammar:
        """The Grammar of one structural-tag format; 400 naming `param` if it does not
        compile, takes longer than the time limit or is too large."""
        if not self.enabled:
            raise ApiError(400, f"{param}: constrained decoding is off on this server (--grammar-backend none)", param)
        tag = {"type": "structural_tag", "format": fmt}
        # keys in the request's order: a JSON schema's properties are generated in the order declared
        # (a "reasoning then answer" schema must not answer first); sorted, they came out alphabetical
        text = json.dumps(tag, separators=(",", ":"))
        key = hashlib.sha256(f"{vocab_size}\0{text}".encode()).hexdigest()
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            self._metrics.grammar_cache_hits.inc()
            return hit
        task = self._inflight.get(key)
        if task is not None:  # the same grammar is compiling for another request: share it
            self._metrics.grammar_cache_hits.inc()
        else:  # a task of its own: a client that leaves cancels its wait, not the others' compile
            task = self._inflight[key] = asyncio.ensure_future(self._compile(text, key, vocab_size, param))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved, if nobody waits
        if self._down is not None:
            raise self._down_error(param)
        stop = asyncio.get_running_loop().create_future()  # resolved by `down`
        self._waiters.add(stop)
        try:  # whichever comes first: the compile, or the server going down (a 503, not a dropped connection)
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._waiters.discard(stop)
        if not task.done():
            raise self._down_error(param)
        return task.result()

    def _down_error(self, param: str) -> ApiError:
        return ApiError(503, f"the server is going down ({self._down}); the grammar was not compiled", param)

    def down(self, why: str) -> None:
        """The server is going down (a process died, or a shutdown): every request waiting on a
        compile, now or later, gets a 503 at once instead of waiting for a compile that no one
        will serve (and a dropped connection once the HTTP server stops). On the event loop."""
        self._down = why
        for stop in self._waiters:
            if not stop.done():
                stop.set_result(None)

    async def _compile(self, text: str, key: str, vocab_size: int, param: str) -> Grammar:
        try:
            if self._warming is not None and not self._warming.done():
                # the started checker is ready sooner than another would be: wait for it, then the
                # compile goes to its thread (the pool's only one so far, and idle)
                await asyncio.wrap_future(self._warming)
            grammar = await asyncio.get_running_loop().run_in_executor(
                self._pool, self._compile_sync, text, key, vocab_size, param)
        except ApiError as exc:
            if exc.status == 400:
                self._metrics.grammar_failures.inc()
            raise
        finally:
            del self._inflight[key]
        self._cache[key] = grammar
        while len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return grammar

    def _compile_sync(self, text: str, key: str, vocab_size: int, param: str) -> Grammar:
        checker = self._checker(vocab_size)
        try:
            reply = checker.check(text, self.timeout_s)
        except TimeoutError:
            raise ApiError(400, f"{param}: grammar compilation took longer than {self.timeout_s:g} s", param) from None
        except ChildProcessError as exc:  # it died compiling this grammar (out of memory, or killed)
            raise ApiError(400, f"{param}: the grammar checker died while compiling it ({exc})", param) from None
        except CheckerStartError as exc:
            raise ApiError(503, f"constrained decoding is unavailable: {exc}", param) from None
        self._metrics.grammar_compile.observe(reply.seconds)
        if reply.error:
            raise ApiError(400, f"{param} does not compile: {reply.error}", param)
        if reply.compiled_bytes > self.max_compiled_bytes:
            raise ApiError(400, f"{param}: the grammar compiles to {reply.compiled_bytes / 2**20:.1f} MiB, more "
                           f"than the {self.max_compiled_bytes / 2**20:.1f} MiB a grammar may take; simplify it", param)
        data = grammar_data(reply.source)
        log.info("grammar compiled", key=key[:12], seconds=round(reply.seconds, 4), compiled_bytes=reply.compiled_bytes,
                 bytes=len(data))
        return Grammar(key=key, data=data, stop_ids=checker.stop_ids, compiled_bytes=reply.compiled_bytes)

    def warm(self, vocab_size: int) -> None:
        """Start a checker now, on a pool thread (returns at once): the first constrained request then
        finds it started, or waits for the start under way. A start that fails is logged; a request
        retries it."""
        if not self.enabled or self.checkers or self._warming is not None:
            return

        def start() -> None:
            t0 = time.perf_counter()
            try:
                self._checker(vocab_size).start()
            except CheckerStartError as exc:
                log.warning("grammar checker not warmed", reason=str(exc))
            else:
                log.info("grammar checker warm", seconds=round(time.perf_counter() - t0, 2))

        self._warming = self._pool.submit(start)

    def _checker(self, vocab_size: int) -> Checker:
        """This pool thread's checker (one child process), for this vocabulary."""
        checker = getattr(self._local, "checker", None)
        if checker is None or checker.vocab_size != vocab_size:
            if checker is not None:
                checker.kill()
                self.checkers.remove(checker)
            checker = self._local.checker = Checker(self._model_dir, vocab_size)
            self.checkers.append(checker)
        return checker

    def close(self) -> None:
        """Stop the children (they also exit when this process does, at the end of their stdin,
        but maybe only after a long compile). A thread waiting on one sees its end: no wait here."""
        for checker in list(self.checkers):
            proc = checker.proc  # read once: its pool thread may set it to None meanwhile
            if proc is not None:
                proc.kill()
        self._pool.shutdown(wait=False, cancel_futures=True)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    lines = [ln for ln in text.splitlines() if ln.strip()]
    # xgrammar's errors start with a '[time] file.cc:line:' prefix: keep the message after it
    msg = _CPP_PREFIX.sub("", lines[-1] if lines else text)
    return msg[:500]


def response_format_spec(response_format: dict[str, Any] | None) -> dict[str, str]:
    """OpenAI `response_format` -> the SamplingParams field it sets ({} for text)."""
    if response_format is None:
        return {}
    rf = response_format
    kind = rf.get("type")
    if not isinstance(kind, str):
        raise ApiError(400, "response_format.type is required: text, json_object, json_schema or structural_tag",
                       param="response_format.type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": '{"type": "object"}'}
    if kind == "structural_tag":  # vLLM's and SGLang's: {"type", "structures", "triggers"}
        return {"structural_tag": json.dumps({k: v for k, v in rf.items() if k != "type"})}
    if kind != "json_schema":
        raise ApiError(400, f"response_format type {kind!r} is not supported", param="response_format")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise ApiError(400, "response_format.json_schema must be an object", param="response_format.json_schema")
    extra = sorted(set(js) - {"name", "schema", "strict", "description"})
    if extra:
        raise ApiError(400, f"response_format.json_schema has unknown fields: {', '.join(extra)}",
                       param=f"response_format.json_schema.{extra[0]}")
    if not isinstance(js.get("name"), str) or not isinstance(js.get("strict", False), bool | None):
        raise ApiError(400, "response_format.json_schema: name (a string) is required, strict is a boolean",
                       param="response_format.json_schema")
    schema = js.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise ApiError(400, "response_format.json_schema.schema must be an object",
                       param="response_format.json_schema.schema")
    return {"json_schema": json.dumps(schema)}


async def constrain(
    service: GrammarService | None,
    params: Any,
    vocab_size: int,
    tools: tuple[ToolStructure, bool] | None = None,
    reasoning: Reasoning | None = None,
) -> Any:
    """`params` (a SamplingParams) with its `grammar` compiled from its json_schema / regex /
    ebnf field or the forced tool calls, or None: whatever a client put in `grammar` is
    always replaced. 400 when a constraint is asked of a server without a tokenizer."""
    import msgspec

    specs = params.grammar_specs()
    if tools is not None and specs:
        raise ApiError(400, f"{next(iter(specs))} cannot be combined with a forced tool_choice", param="tool_choice")
    if params.allowed_token_ids is not None and tools is not None:  # (beside a spec: SamplingParams.validate's)
        raise ApiError(400, "allowed_token_ids cannot be combined with a forced tool_choice (its grammar's next "
                       "tokens could all lie outside the set)", param="allowed_token_ids")
    if params.bad_words and tools is not None:
        raise ApiError(400, "bad_words cannot be combined with a forced tool_choice (its grammar's next tokens "
                       "could all be banned)", param="bad_words")
    if not specs and tools is None:
        return msgspec.structs.replace(params, grammar=None) if params.grammar is not None else params
    if service is None:
        raise ApiError(400, "constrained decoding needs the model's tokenizer, and this server has none")
    if tools is not None:
        fmt, param = tools_format(*tools), "tools"  # (what fails to compile is a tool's parameters schema)
    else:
        (param, text), = specs.items()
        fmt = spec_format(param, text)
    grammar = await service.compile(with_reasoning(fmt, reasoning), vocab_size, param)
    return msgspec.structs.replace(params, grammar=grammar)


def service_of(state: Any) -> GrammarService | None:
    """The server's GrammarService (made on first use or by `warm_when_ready`), or None without a tokenizer."""
    if state.tok is None:
        return None
    if state.grammar is None:
        state.grammar = GrammarService(state.cfg.model, state.frontend.metrics,
                                       enabled=state.cfg.constrained_decoding)
    return state.grammar


async def warm_when_ready(state: Any) -> None:
    """Once the scheduler is ready (the vocabulary size is its), start a grammar checker in the
    background: ready means warm, as far as a child process of its own can be."""
    service = service_of(state)
    if service is None or not service.enabled:
        return
    try:
        while not await state.frontend.wait_ready(60.0):  # a large model loads for minutes
            pass
        limits = await state.limits()  # at once now
    except ApiError:  # a process died: nothing to serve
        return
    service.warm(limits.vocab_size)
