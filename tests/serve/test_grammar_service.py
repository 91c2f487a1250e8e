"""GrammarService (engine/serve/grammar.py): compile off the event loop, one shared cache,
400s for what does not compile or takes too long, and what a request's fields turn into."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.serve.errors import ApiError
from engine.serve.grammar import MAX_COMPILED_BYTES, GrammarService, constrain, response_format_spec, spec_format
from engine.serve.metrics import Metrics
from engine.tokenizer import compile_grammar, grammar_compiler, load_tokenizer, tokenizer_info
from msgs.params import Grammar, SamplingParams

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


@pytest.fixture(scope="module")
def hf(default_model_dir: Path):  # noqa: ANN201
    tok = load_tokenizer(str(default_model_dir))
    assert tok is not None
    return tok.hf


@pytest.fixture(scope="module")
def service(default_model_dir: Path) -> Iterator[GrammarService]:
    """One service (its two checker processes) for the tests that need no settings of their own."""
    svc = GrammarService(str(default_model_dir), Metrics())
    yield svc
    svc.close()


def test_compiles_once_for_concurrent_requests_and_counts_hits(default_model_dir: Path) -> None:
    metrics = Metrics()
    service = GrammarService(str(default_model_dir), metrics)
    params = SamplingParams(json_schema=SCHEMA)

    async def main() -> list[SamplingParams]:
        return await asyncio.gather(*(constrain(service, params, 49152) for _ in range(4)))

    out = asyncio.run(main())
    service.close()
    assert all(isinstance(p.grammar, Grammar) for p in out)
    assert len({p.grammar.key for p in out}) == 1
    assert out[0].grammar.stop_ids == [2]
    assert metrics.grammar_compile._sum.get() > 0  # one compile observed
    assert metrics.grammar_cache_hits._value.get() == 3


def test_warm_starts_a_checker_and_a_disabled_service_refuses(default_model_dir: Path) -> None:
    """warm starts one checker in the background, which the next compile uses; --grammar-backend
    none's service refuses every constraint (a 400 naming the field) and starts nothing."""
    svc = GrammarService(str(default_model_dir), Metrics())
    try:
        svc.warm(49152)
        deadline = time.monotonic() + 120
        while not (svc.checkers and svc.checkers[0].proc is not None and svc.checkers[0].stop_ids):
            assert time.monotonic() < deadline, "the warmed checker started"
            time.sleep(0.05)
        pid = svc.checkers[0].proc.pid
        out = asyncio.run(constrain(svc, SamplingParams(json_schema=SCHEMA), 49152))
        assert isinstance(out.grammar, Grammar) and [c.proc.pid for c in svc.checkers] == [pid]
    finally:
        svc.close()
    off = GrammarService(str(default_model_dir), Metrics(), enabled=False)
    with pytest.raises(ApiError) as err:
        asyncio.run(constrain(off, SamplingParams(regex="[a-z]+"), 49152))
    assert err.value.status == 400 and err.value.param == "regex" and "--grammar-backend none" in str(err.value)
    off.warm(49152)
    assert not off.checkers


def test_what_does_not_compile_is_a_400(service: GrammarService) -> None:
    for params in (
        SamplingParams(json_schema="{not json"),
        SamplingParams(json_schema='{"type": "nonsense"}'),
        SamplingParams(regex="(unclosed"),
        SamplingParams(ebnf="root ::= missing"),
    ):
        with pytest.raises(ApiError) as info:
            asyncio.run(constrain(service, params, 49152))
        assert info.value.status == 400


def test_a_grammar_that_matches_nothing_is_a_400(service: GrammarService) -> None:
    """It compiles, but no token can begin an answer: every logit would be masked (an audit got a
    200 of token 0 at logprob -9999 per step)."""
    for param, params in (("ebnf", SamplingParams(ebnf="root ::= root")),
                          ("regex", SamplingParams(regex="[^\\s\\S]"))):
        with pytest.raises(ApiError) as info:
            asyncio.run(constrain(service, params, 49152))
        assert info.value.status == 400 and info.value.param == param and "matches no text" in info.value.message
    ok = asyncio.run(constrain(service, SamplingParams(regex="[ab]"), 49152))  # a one-character language is fine
    assert isinstance(ok.grammar, Grammar)


def _union_properties(n: int) -> str:
    union = {"anyOf": [{"type": "string", "maxLength": 200}, {"type": "integer"},
                       {"type": "array", "items": {"type": "string", "pattern": "[a-z]{1,50}"}}]}
    return json.dumps({"type": "object", "properties": {f"k{i}": union for i in range(n)}})


def test_a_compile_past_the_time_limit_is_a_400_and_its_process_is_killed(service: GrammarService) -> None:
    """In a thread, such a compile ran on for minutes after its 400 (an audit's 300 union-typed
    properties), holding one of the two compile threads."""
    service.timeout_s = 0.2  # 60 of these properties take ~1 s to compile on this CPU
    try:
        with pytest.raises(ApiError) as info:
            asyncio.run(constrain(service, SamplingParams(json_schema=_union_properties(60)), 49152))
    finally:
        service.timeout_s = 10.0
    assert info.value.status == 400 and "longer than 0.2 s" in info.value.message
    assert any(c.proc is None for c in service.checkers)  # killed (another starts on that thread's next use)
    for regex in ("[a-z]{3}", "[0-9]{4}", "x+", "y+"):  # both threads serve again
        assert asyncio.run(constrain(service, SamplingParams(regex=regex), 49152)).grammar is not None


def test_a_client_leaving_does_not_fail_the_others_waiting_on_its_grammar(service: GrammarService) -> None:
    """An audit: the first request's disconnect cancelled the shared compile, and the request
    waiting on the same schema got a bare 500 (CancelledError)."""
    params = SamplingParams(json_schema=_union_properties(20))  # ~0.5 s to compile

    async def main() -> SamplingParams:
        first = asyncio.ensure_future(constrain(service, params, 49152))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(constrain(service, params, 49152))
        await asyncio.sleep(0.05)
        first.cancel()
        return await second

    assert asyncio.run(main()).grammar is not None


def test_the_checker_is_read_whatever_its_pipe_s_fd_number(service: GrammarService) -> None:
    """A server holding many connections gives the checker's pipes fd numbers past 1,024, which
    select() refuses (poll does not)."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2200:
        pytest.skip(f"the fd limit ({hard}) leaves no room past 1,024")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2200) if hard == resource.RLIM_INFINITY else hard, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        for checker in service.checkers:
            checker.kill()  # restarted now: their pipes get fds past the 1,100 held
        got = asyncio.run(constrain(service, SamplingParams(regex="[fd]{2}[0-9]+"), 49152)).grammar
        assert got is not None
        assert any(c.proc is not None and c.proc.stdout.fileno() > 1024 for c in service.checkers)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_grammar_travels_as_its_source_and_one_too_large_compiled_is_a_400(hf, service: GrammarService) -> None:  # noqa: ANN001
    import xgrammar as xgr

    # 200 optional properties: 50 KB of rules whose serialized CompiledGrammar was 18 MB of JSON
    many = json.dumps({"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(200)}})
    grammar = asyncio.run(constrain(service, SamplingParams(json_schema=many), 49152)).grammar
    assert grammar is not None and len(grammar.data) < 64 << 10
    matcher = xgr.GrammarMatcher(compile_grammar(grammar_compiler(tokenizer_info(hf, 49152), 1), grammar.data))
    assert matcher.accept_string('{"k7": "x", "k150": "y"}') and not matcher.accept_string("]")
    # what every rank would hold compiled is bounded: a 400 naming the field, and the service serves on
    service.max_compiled_bytes = 1 << 20
    try:
        with pytest.raises(ApiError) as info:
            asyncio.run(constrain(service, SamplingParams(json_schema=_union_properties(10)), 49152))
        assert info.value.status == 400 and info.value.param == "json_schema" and "MiB" in info.value.message
        assert asyncio.run(constrain(service, SamplingParams(json_schema=SCHEMA), 49152)).grammar is not None
    finally:
        service.max_compiled_bytes = MAX_COMPILED_BYTES


def test_a_client_grammar_is_always_replaced(service: GrammarService) -> None:
    forged = Grammar("k", b"not a grammar", [1])
    assert asyncio.run(constrain(None, SamplingParams(grammar=forged), 49152)).grammar is None
    got = asyncio.run(constrain(service, SamplingParams(regex="a+", grammar=forged), 49152)).grammar
    assert got is not None and got.key != "k"
    with pytest.raises(ApiError):  # a constraint on a server without a tokenizer
        asyncio.run(constrain(None, SamplingParams(regex="a"), 49152))


def test_response_format() -> None:
    assert response_format_spec(None) == {}
    assert response_format_spec({"type": "text"}) == {}
    assert json.loads(response_format_spec({"type": "json_object"})["json_schema"]) == {"type": "object"}
    schema = {"type": "object", "properties": {"x": {"type": "string"}}}
    spec = response_format_spec({"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}})
    assert json.loads(spec["json_schema"]) == schema
    for bad in ({"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": [1]}},
                {"type": "json_schema", "json_schema": {"name": "n", "oops": 1}}):  # fmt: skip
        with pytest.raises(ApiError):
            response_format_spec(bad)
    assert SamplingParams(regex="a", ebnf="b").validate() is not None  # at most one constraint


def test_a_ref_outside_the_schema_is_a_400_and_data_is_not_schema() -> None:
    """xgrammar drops a $ref it cannot resolve (the field then goes unenforced): one that does not
    point inside the schema is refused; pydantic's '#/$defs/...' and '$ref' inside data are not."""
    inside = {"$defs": {"A": {"type": "integer"}}, "type": "object",
              "properties": {"a": {"$ref": "#/$defs/A"}, "$ref": {"type": "string"}},
              "default": {"$ref": "http://example.com/data-not-schema"}, "enum": [{"$ref": "x"}]}
    spec_format("json_schema", json.dumps(inside))
    for ref in ("http://example.com/a.json", "other.json#/x", ""):
        with pytest.raises(ApiError, match="points outside"):
            spec_format("json_schema", json.dumps({"type": "object", "properties": {"a": {"$ref": ref}}}))
    for name in ("regex", "ebnf"):
        with pytest.raises(ApiError, match="must not be empty"):
            spec_format(name, "")


def test_when_the_server_goes_down_a_request_waiting_on_a_compile_gets_a_503(default_model_dir: Path) -> None:
    """Before, such a request waited for its compile through the shutdown and got a dropped
    connection (or a bare 500) when the HTTP server stopped; the others were already 503s."""
    service = GrammarService(str(default_model_dir), Metrics())

    async def main() -> tuple[ApiError, ApiError, bool]:
        waiting = asyncio.ensure_future(constrain(service, SamplingParams(json_schema=_union_properties(40)), 49152))
        await asyncio.sleep(0.1)  # compiling (~1 s)
        service.down("the server is shutting down")
        with pytest.raises(ApiError) as first:
            await waiting
        still_compiling = bool(service._inflight)  # the 503 came at once, not after the compile
        with pytest.raises(ApiError) as later:  # a new one too, whether compiled or not
            await constrain(service, SamplingParams(regex="[a-z]{5}"), 49152)
        return first.value, later.value, still_compiling

    try:
        first, later, still_compiling = asyncio.run(main())
    finally:
        service.close()
    assert first.status == later.status == 503 and "shutting down" in first.message and still_compiling


def test_a_forced_tool_whose_parameters_do_not_compile_names_tools(service: GrammarService) -> None:
    """An audit: the 400 of a tool schema xgrammar cannot compile named tool_choice, which was fine."""
    from engine.serve.parsers.tool_request import check_tools

    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}, "required": ["a"]}}}
    tools = check_tools([tool], "required", None, "hermes")
    assert tools is not None and (structure := tools.structure()) is not None
    with pytest.raises(ApiError) as info:
        asyncio.run(constrain(service, SamplingParams(), 49152, (structure, tools.parallel)))
    assert info.value.status == 400 and info.value.param == "tools", info.value.message


def test_allowed_token_ids_are_refused_beside_a_constraint() -> None:
    """A grammar's next tokens could all lie outside allowed_token_ids: a forced tool_choice is
    refused by constrain (before any compile), a json_schema / regex / ebnf by SamplingParams.validate."""
    with pytest.raises(ApiError) as err:
        asyncio.run(constrain(None, SamplingParams(allowed_token_ids=[1, 2]), 49152, tools=(None, False)))  # type: ignore[arg-type]
    assert err.value.status == 400 and err.value.param == "allowed_token_ids"
    problem = SamplingParams(allowed_token_ids=[1], regex="[ab]").validate(49152)
    assert problem is not None and problem.startswith("allowed_token_ids")


def test_the_grammar_backend_flag_takes_xgrammar_or_none() -> None:
    from engine.config import ServerConfig

    assert ServerConfig().grammar_backend == "xgrammar"
    assert ServerConfig(grammar_backend="none").grammar_backend == "none"
    with pytest.raises(ValueError, match="--grammar-backend"):
        ServerConfig(grammar_backend="outlines")
