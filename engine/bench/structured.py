"""Structured-output throughput: N concurrent json_schema requests vs N unconstrained
requests of the same output lengths, on one server (target >= 90%: docs/PERF.md).

    bin/bench structured --model configs/qwen3-0.6b --load-format dummy \\
        --tokenizer-from ~/.cache/strata/models/SmolLM2-135M-Instruct --num-requests 64

Random-weight model dirs have no tokenizer, and a grammar needs one: `--tokenizer-from`
copies a tokenizer's files next to the config in a temp dir (the model's vocabulary may be
larger: the grammar masks the ids past the tokenizer's). The constrained pass runs first;
each unconstrained request then asks for exactly the tokens its twin produced
(ignore_eos), so both passes generate the same number of tokens.

`--cold-schemas K` adds a third pass: the unconstrained requests again, while K requests with
new, distinct schemas that are slow to compile (patterned strings) arrive at once. Ranks compile
those beside the steps (the grammar gate, docs/architecture.md), so the unconstrained requests'
wall time should stay near the second pass's; before the gate each compile stalled every step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from engine.bench.launch import launched_server
from engine.bench.report import RESULTS_DIR
from engine.tokenizer import TOKENIZER_FILES

SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 8,
            "maxItems": 24,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 99999},
                    "name": {"type": "string", "minLength": 4, "maxLength": 24},
                    "kind": {"enum": ["alpha", "beta", "gamma"]},
                    "ok": {"type": "boolean"},
                },
                "required": ["id", "name", "kind", "ok"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}


def cold_schema(i: int) -> dict[str, Any]:
    """A schema no cache holds (its own lengths), slow to compile: 12 strings with patterns."""
    props = {f"f{j}": {"type": "string", "pattern": f"[a-z]{{2,{20 + j + 16 * i}}}"} for j in range(12)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


async def _beside(url: str, plain: list[dict[str, Any]], cold: list[dict[str, Any]]) -> tuple[float, float]:
    """The plain requests and the cold ones at once: seconds until every plain one finished, and
    until every cold one did."""
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        cold_tasks = [asyncio.ensure_future(client.post(f"{url}/generate", json=b)) for b in cold]
        replies = await asyncio.gather(*(client.post(f"{url}/generate", json=b) for b in plain))
        plain_s = time.perf_counter() - t0
        replies += await asyncio.gather(*cold_tasks)
        cold_s = time.perf_counter() - t0
    for r in replies:
        r.raise_for_status()
    return plain_s, cold_s


def model_with_tokenizer(model: str, tokenizer_from: str) -> str:
    tmp = Path(tempfile.mkdtemp(prefix="strata-structured-"))
    shutil.copy(Path(model) / "config.json", tmp / "config.json")
    for name in TOKENIZER_FILES:
        src = Path(tokenizer_from).expanduser() / name
        if src.is_file():
            shutil.copy(src, tmp / name)
    return str(tmp)


async def _pass(url: str, bodies: list[dict[str, Any]]) -> tuple[float, list[dict[str, Any]]]:
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        replies = await asyncio.gather(*(client.post(f"{url}/generate", json=b) for b in bodies))
        wall = time.perf_counter() - t0
    for r in replies:
        r.raise_for_status()
    return wall, [r.json() for r in replies]


PASS_METRICS = ("strata_step_seconds_count", "strata_step_seconds_sum", "strata_ttft_seconds_count",
                "strata_ttft_seconds_sum")


def _metrics(url: str) -> dict[str, float]:
    """The counters a pass is described by (steps, their summed worker seconds, first tokens)."""
    out = dict.fromkeys(PASS_METRICS, 0.0)
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        if name in out:
            out[name] = float(value)
    return out


def _measured(url: str, bodies: list[dict[str, Any]]) -> tuple[float, list[dict[str, Any]], dict[str, float]]:
    """One pass and what it did: steps, mean step and mean time to first token (ms)."""
    before = _metrics(url)
    wall, out = asyncio.run(_pass(url, bodies))
    d = {k: v - before[k] for k, v in _metrics(url).items()}
    steps = d["strata_step_seconds_count"]
    return wall, out, {
        "steps": steps,
        "mean_step_ms": 1e3 * d["strata_step_seconds_sum"] / max(steps, 1),
        "wall_per_step_ms": 1e3 * wall / max(steps, 1),
        "mean_ttft_ms": 1e3 * d["strata_ttft_seconds_sum"] / max(d["strata_ttft_seconds_count"], 1),
    }


def _stopped(out: dict[str, Any]) -> bool:
    return (out["meta_info"]["finish_reason"] or {}).get("type") == "stop"  # SGLang's {"type", "matched"}


def _validity(outs: list[dict[str, Any]]) -> tuple[int, int]:
    """(answers that are JSON valid under SCHEMA, answers that finished with "stop" and are
    not: a grammar that let a wrong token through; must be 0)."""
    import jsonschema

    valid = invalid_stop = 0
    for o in outs:
        try:
            jsonschema.validate(json.loads(o["text"]), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            invalid_stop += _stopped(o)
    return valid, invalid_stop


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = model_with_tokenizer(args.model, args.tokenizer_from) if args.tokenizer_from else args.model
    server_args = shlex.split(args.server_args) + ["--max-running-requests", str(max(args.num_requests, 1))]
    prompt = "Write a JSON inventory of items:"
    with launched_server(model, args.load_format, server_args) as ep:
        url = ep.http
        assert url is not None
        # warm-up: compile the grammar once (cached after) and run both paths once
        warm = {"text": prompt, "sampling_params": {"max_new_tokens": 8, "json_schema": json.dumps(SCHEMA)}}
        asyncio.run(_pass(url, [warm, {"text": prompt, "sampling_params": {"max_new_tokens": 8}}]))
        constrained = [
            {"text": prompt, "sampling_params": {"max_new_tokens": args.max_tokens, "temperature": 1.0,
                                                 "seed": args.seed + i, "json_schema": json.dumps(SCHEMA)}}
            for i in range(args.num_requests)
        ]  # fmt: skip
        c_wall, c_out, c_pass = _measured(url, constrained)
        lengths = [o["meta_info"]["completion_tokens"] for o in c_out]
        valid, invalid_stop = _validity(c_out)
        plain = [
            {"text": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 1.0,
                                                 "seed": args.seed + i, "ignore_eos": True}}
            for i, n in enumerate(lengths)
        ]  # fmt: skip
        p_wall, p_out, p_pass = _measured(url, plain)
        beside = None
        if args.cold_schemas:
            cold = [{"text": prompt, "sampling_params": {"max_new_tokens": 16,
                                                          "json_schema": json.dumps(cold_schema(i))}}
                    for i in range(args.cold_schemas)]
            plain_s, cold_s = asyncio.run(_beside(url, plain, cold))
            beside = {"cold_schemas": args.cold_schemas, "plain_s": plain_s, "plain_alone_s": p_wall,
                      "plain_ratio": p_wall / plain_s, "cold_done_s": cold_s}
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    tokens = sum(lengths)
    assert sum(o["meta_info"]["completion_tokens"] for o in p_out) == tokens
    c_tps, p_tps = tokens / c_wall, tokens / p_wall
    result = {
        "model": args.model,
        "tokenizer_from": args.tokenizer_from,
        "num_requests": args.num_requests,
        "output_tokens": tokens,
        "mean_output_len": tokens / max(len(lengths), 1),
        "json_valid": valid,
        "finish_stop": sum(_stopped(o) for o in c_out),
        "invalid_stop": invalid_stop,
        "constrained_s": c_wall,
        "unconstrained_s": p_wall,
        "constrained_tok_s": c_tps,
        "unconstrained_tok_s": p_tps,
        "ratio": c_tps / p_tps,
        "constrained_pass": c_pass,
        "unconstrained_pass": p_pass,
        "grammar_metrics": [ln for ln in metrics.splitlines() if ln.startswith("strata_grammar")],
        "cold_pass": beside,
    }
    print("============ Structured Output Result ============")
    for k in ("num_requests", "output_tokens", "mean_output_len", "json_valid", "finish_stop", "invalid_stop",
              "constrained_tok_s",
              "unconstrained_tok_s", "ratio", "constrained_pass", "unconstrained_pass", "cold_pass"):  # fmt: skip
        print(f"{k:24s} {result[k]}")
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The mode's own flags (bin/bench adds --model, --load-format, --server-args, --out)."""
    p.add_argument("--tokenizer-from", default=None, help="copy this directory's tokenizer files next to the config")
    p.add_argument("--num-requests", type=int, default=64, help="concurrent requests in each pass")
    p.add_argument("--max-tokens", type=int, default=512, help="max_new_tokens of the constrained requests")
    p.add_argument("--cold-schemas", type=int, default=0,
                   help="a third pass: the unconstrained requests while this many new slow schemas arrive")


def main(args: argparse.Namespace) -> dict[str, Any]:
    """bin/bench structured: run, print, and write the result JSON when --out is given."""
    if args.num_requests < 1 or args.max_tokens < 1:
        raise SystemExit("bin/bench: --num-requests and --max-tokens must be >= 1")
    result = run(args)
    if result["invalid_stop"]:  # written first, so the answers' figures are kept
        print(f"bin/bench structured: {result['invalid_stop']} answers finished with 'stop' but are not "
              "valid under the schema")
    name = Path(args.model).name if args.model else "default"
    out = Path(args.out or RESULTS_DIR / f"structured-{name}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.write_text(json.dumps(result, indent=2))
    print(f"result: {out}")
    if result["invalid_stop"]:
        raise SystemExit(1)
    return result
