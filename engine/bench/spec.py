"""bin/bench spec: what speculative decoding's machinery costs on the served path, with an oracle
draft (issue 24), or with the model's own MTP layer (`--algorithm NEXTN`).

    bin/bench spec                                      # CPU: the default model, k = 1 and 3
    bin/bench spec --model configs/llama-3.1-8b --load-format dummy --batch-sizes 1 \\
        --drafts 1 3 5 --prompt-len 512 --output-len 256

For plain decoding and then NGRAM with each --drafts k, one `bin/serve` runs. Per batch size,
`batch` random prompts are answered once (greedy, ignore_eos, --output-len + 64 tokens): the warm-up,
which also leaves every prompt and its answer in the prefix cache. Then the same requests again,
all at once, streamed and timed. The second time NGRAM drafts from the prefix cache
(`SpecPolicy.tree_drafts`): the target's own greedy continuation, an oracle that has every draft
accepted when the logits agree bit for bit (float32, or --server-args
--enable-deterministic-inference; in bf16 a verify row's shape may flip a near tie, which shows
as an accept length below k + 1). Reported per configuration and batch: decode tok/s per request
(tokens after the first over the time since the first; median over the batch), its speed-up over
plain decoding against the ideal k + 1, the accept length (/metrics strata_spec_accept_length
over the timed run's verify rows), the tokens a row gains per step (output tokens after the first
over the scheduler's steps, /metrics strata_step_seconds_count: rows planned without drafts
count here, not in the accept length), a step's time against a plain step's ("step x": per-step
wall time, so it holds when a near tie cut the oracle's chain and later steps had no drafts),
the verify rows that had no draft (/metrics strata_spec_empty_rows_total) and whether every
answer equals plain decoding's. The warm-up runs twice: the
second time as the timed run goes (prompt cached), whose answer the drafts then follow.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from engine.bench.cache import wait_idle
from engine.bench.launch import launched_server

TIMEOUT_S = 3600.0
ACCEPT = "strata_spec_accept_length"
STEPS = "strata_step_seconds_count"
EMPTY = "strata_spec_empty_rows_total"
ORACLE_MARGIN = 64  # warm-up tokens past --output-len: a page of any size up to 64 tokens


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The mode's own flags (bin/bench adds --model, --load-format, --seed, --server-args, --out)."""
    p.add_argument("--drafts", type=int, nargs="+", default=[1, 3], help="drafts per row (k), one server each")
    p.add_argument("--algorithm", default="NGRAM", choices=["NGRAM", "NEXTN", "STANDALONE"],
                   help="the draft source: NGRAM (the oracle above), NEXTN (the model's own MTP layer) or "
                        "STANDALONE (--draft-model); with --load-format dummy a random draft is rarely accepted, "
                        "so 'step x', a step's cost against a plain one, is the figure")
    p.add_argument("--draft-model", default="", help="STANDALONE: the draft model's directory (with --load-format "
                   "dummy its config.json only; the model's own directory drafts with the model's weights)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1], help="requests decoded together")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens of each random prompt")
    p.add_argument("--output-len", type=int, default=32, help="tokens each request decodes (ignore_eos)")
    p.add_argument("--corrupt", type=float, default=0.0,
                   help="each oracle draft made wrong with this chance (--speculative-corrupt-drafts): a per-token "
                        "acceptance of 1 - corrupt, to find where speculation stops paying")


def check(args: argparse.Namespace) -> str | None:
    if any(k < 1 or k > 16 for k in args.drafts):
        return "--drafts must be in 1..16"
    if not 0.0 <= args.corrupt < 1.0:
        return "--corrupt must be in [0, 1)"
    if (args.algorithm == "STANDALONE") != bool(args.draft_model):
        return "--draft-model goes with --algorithm STANDALONE, and STANDALONE needs it"
    if args.corrupt and args.algorithm != "NGRAM":
        return "--corrupt corrupts the NGRAM oracle's drafts: it needs --algorithm NGRAM"
    if any(b < 1 for b in args.batch_sizes) or args.prompt_len < 1 or args.output_len < 2:
        return "--batch-sizes and --prompt-len must be >= 1, --output-len >= 2"
    return None


def _stream(url: str, ids: list[int], n: int) -> dict[str, Any]:
    """One streamed greedy request: its tokens and the times of its first and last ones."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}
    first = last = None
    out: list[int] = []
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=TIMEOUT_S) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            data = json.loads(line[5:])
            if "error" in data:
                raise RuntimeError(f"/generate stream error: {str(data)[:300]}")
            if len(data["output_ids"]) > len(out):
                now = time.perf_counter()
                first = first if first is not None else now
                last, out = now, data["output_ids"]
    if first is None or last is None or len(out) != n:
        raise RuntimeError(f"/generate answered {len(out)} of {n} tokens")
    return {"ids": out, "first": first, "last": last}


def _counters(url: str) -> tuple[float, float, float, float]:
    """(sum, count) of the accept-length histogram in /metrics (0, 0 before any verify row), the
    scheduler's steps and the verify rows answered with no draft so far, once the server is idle
    and the scheduler's last stats arrived."""
    m = wait_idle(url, TIMEOUT_S)
    return m.get(ACCEPT + "_sum", 0.0), m.get(ACCEPT + "_count", 0.0), m.get(STEPS, 0.0), m.get(EMPTY, 0.0)


def _batch(url: str, prompts: list[list[int]], n: int) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda ids: _stream(url, ids, n), prompts))


def _config(args: argparse.Namespace, k: int | None, prompts: dict[int, list[list[int]]]) -> list[dict[str, Any]]:
    """One server (plain when k is None, else --algorithm with k drafts): per batch size, the warm-up
    answers, then the timed ones."""
    extra = ["--speculative-algorithm", args.algorithm, "--speculative-num-steps", str(k)] if k else []
    if k and args.draft_model:
        extra += ["--speculative-draft-model-path", args.draft_model]
    if k and args.corrupt:
        extra += ["--speculative-corrupt-drafts", str(args.corrupt)]
    rows = []
    with launched_server(args.model, args.load_format, shlex.split(args.server_args or "") + extra) as ep:
        assert ep.http is not None
        for b in args.batch_sizes:
            # every answer now in the prefix cache, ORACLE_MARGIN tokens longer than the timed
            # ones: the cache holds full pages only, so an answer of exactly output_len tokens left
            # its last partial page out and the timed run's last tokens without drafts
            n = args.output_len + ORACLE_MARGIN
            _batch(ep.http, prompts[b], n)
            # again, now as the timed run will go (prompt cached): in bf16 a fresh prefill and a
            # cached one may part on a near tie, and the drafts follow the most recent answer
            warm = _batch(ep.http, prompts[b], n)
            before = _counters(ep.http)
            timed = _batch(ep.http, prompts[b], args.output_len)
            after = _counters(ep.http)
            rates = [(args.output_len - 1) / (r["last"] - r["first"]) for r in timed]
            rows_verified = after[1] - before[1]
            # less the first token's step (the cached prompt's prefill); with overlap one more than
            # the tokens need: the step planned before the last answer arrived
            steps = after[2] - before[2] - 1
            rows.append({
                "k": k or 0, "batch": b, "tok_s": statistics.median(rates), "steps": steps,
                "rows_without_drafts": after[3] - before[3],
                "tokens_per_step": (args.output_len - 1) / steps if steps > 0 else None,
                "accept_length": (after[0] - before[0]) / rows_verified if rows_verified else None,
                "answers": [r["ids"] for r in timed], "repeat_equal": [r["ids"][: args.output_len] for r in warm] == [
                    r["ids"] for r in timed],
            })
    return rows


def run(args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Every configuration's rows (printed as a table too)."""
    rng = random.Random(args.seed)
    hi = max(min(vocab, 32000) - 1, 4)
    prompts = {b: [[rng.randrange(3, hi) for _ in range(args.prompt_len)] for _ in range(b)]
               for b in args.batch_sizes}
    plain = {r["batch"]: r for r in _config(args, None, prompts)}
    results = list(plain.values())
    for k in args.drafts:
        for r in _config(args, k, prompts):
            base = plain[r["batch"]]
            r["speedup"] = r["tok_s"] / base["tok_s"]
            r["of_ideal"] = r["speedup"] / (k + 1)
            # the machinery's cost whatever the acceptance: speed-up per token a verify row answers
            r["of_accept"] = r["speedup"] / r["accept_length"] if r["accept_length"] else None
            # a step's wall time against a plain step's (issue 24's MTP figure: <= 1.25 at k = 2)
            tps = r["tokens_per_step"], base["tokens_per_step"]
            r["step_cost"] = tps[0] / tps[1] / r["speedup"] if tps[0] and tps[1] else None
            r["equal_to_plain"] = r["answers"] == base["answers"]
            results.append(r)
    print(f"\n{'k':>3} {'batch':>5} {'tok/s':>9} {'speedup':>8} {'of (k+1)':>9} {'accept':>7} {'of accept':>9} "
          f"{'tok/step':>8} {'step x':>7} {'= plain':>8}")
    for r in results:
        acc = f"{r['accept_length']:.2f}" if r["accept_length"] else "-"
        per = f"{r['of_accept']:.2f}" if r.get("of_accept") else "-"
        cost = f"{r['step_cost']:.2f}" if r.get("step_cost") else "-"
        tps = f"{r['tokens_per_step']:.2f}" if r["tokens_per_step"] else "-"
        print(f"{r['k']:>3} {r['batch']:>5} {r['tok_s']:>9.1f} {r.get('speedup', 1.0):>8.2f} "
              f"{r.get('of_ideal', 1.0):>9.2f} {acc:>7} {per:>9} {tps:>8} {cost:>7} "
              f"{str(r.get('equal_to_plain', True)):>8}")
    for r in results:
        if r["rows_without_drafts"]:
            print(f"k={r['k']} batch {r['batch']}: {r['rows_without_drafts']:.0f} verify rows had no draft (one token "
                  "each: a broken oracle, or the cache's end)")
    best = {b: max((r for r in results if r["batch"] == b), key=lambda r: r["tok_s"])["k"] for b in plain}
    print("fastest per batch size (k, 0: off): " + ", ".join(f"batch {b}: k={k}" for b, k in best.items()))
    for r in results:
        del r["answers"]
    ok = all(r.get("equal_to_plain", True) and r["repeat_equal"] for r in results)
    return {"algorithm": args.algorithm, "prompt_len": args.prompt_len, "output_len": args.output_len,
            "corrupt": args.corrupt,
            "fastest_k": {str(b): k for b, k in best.items()}, "results": results,
            "completed": int(ok)}  # 0 (exit 1) when an answer differs from plain decoding's
