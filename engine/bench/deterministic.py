"""bin/bench deterministic: SGLang's test_deterministic modes against one server, counting the
distinct answers each prompt got (tokens and logprobs, bit for bit); with deterministic
inference on, every count must be 1, and the bench exits 1 when one is not.

    bin/bench deterministic --server-args "--enable-deterministic-inference" --samples 1000

* single: one prompt, sent `samples` times in batches of random size (1..max-batch) of itself;
* mixed: the prompt and a short one, each batch a random mix of both and of random other prompts;
* prefix: four prompts sharing one long prefix (cut at different lengths, so each finds a
  different part of it cached), in random batches, the cache warm or flushed at random.

Sampling at temperature 1 with a fixed seed: a changed logit flips a draw, not only an argmax.
`--sampling filtered` also filters: the prompts under test ask top_k 20 with top_p 0.95, and
mixed mode's other prompts each ask one of `NEIGHBOURS` (top_p alone puts the batch in the
sampler's sort mode, a larger top_k cuts through other ties): the candidates' order must not
depend on them (engine/run/ranking.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import time
from pathlib import Path
from typing import Any

import httpx

from engine.bench.launch import launched_server
from engine.bench.report import RESULTS_DIR

MODES = ("single", "mixed", "prefix")
PLAIN = {"temperature": 1.0, "seed": 42}
FILTERED = {**PLAIN, "top_k": 20, "top_p": 0.95}
NEIGHBOURS = (PLAIN, {"temperature": 0.7, "top_p": 0.9}, {"temperature": 1.0, "top_k": 1000},
              {"temperature": 0.0}, {"temperature": 1.0, "min_p": 0.05, "top_logprobs": 5})


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    """A prompt of n token ids (ids, not text: random-weight model dirs have no tokenizer)."""
    return [rng.randrange(vocab // 8, vocab) for _ in range(n)]


async def _ask(client: httpx.AsyncClient, url: str, ids: list[int], max_new: int, sampling: dict[str, Any]) -> str:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True, "logprobs": True,
                                                  **sampling}}
    r = await client.post(f"{url}/generate", json=body)
    r.raise_for_status()
    return json.dumps(r.json()["meta_info"]["output_token_logprobs"])  # ids with their logprobs, exactly


async def _mode(url: str, mode: str, samples: int, max_batch: int, max_new: int, seed: int,
                vocab: int, filtered: bool) -> dict[str, int]:
    """Distinct answers per prompt of this mode."""
    rng = random.Random(seed)
    own = FILTERED if filtered else PLAIN
    base = _ids(rng, 600, vocab)
    if mode == "single":
        targets = [_ids(rng, 40, vocab)]
    elif mode == "mixed":
        targets = [_ids(rng, 40, vocab), _ids(rng, 5, vocab)]
    else:
        targets = [base[: len(base) * k // 4] for k in (1, 2, 3, 4)]
    seen: dict[int, dict[str, list[int]]] = {i: {} for i in range(len(targets))}  # answer -> [count, 1st batch size]
    sent = 0
    async with httpx.AsyncClient(timeout=600) as client:
        while sent < samples:
            batch = [(i, targets[i], own)
                     for i in (rng.randrange(len(targets)) for _ in range(rng.randint(1, max_batch)))]
            if mode == "mixed":
                batch += [(-1, _ids(rng, rng.randint(1, 200), vocab), rng.choice(NEIGHBOURS) if filtered else own)
                          for _ in range(rng.randint(0, max_batch))]
            if mode == "prefix" and rng.random() < 0.2:
                await client.post(f"{url}/flush_cache")  # refused (409) while others run: fine
            rng.shuffle(batch)
            answers = await asyncio.gather(*(_ask(client, url, ids, max_new, p) for _, ids, p in batch))
            for (i, _, _), a in zip(batch, answers, strict=True):
                if i >= 0:
                    seen[i].setdefault(a, [0, len(batch)])[0] += 1
                    sent += 1
    for i, v in seen.items():
        if len(v) > 1:  # how often each answer came, and the batch size it first came in
            print(f"  {mode} prompt{i}: {sorted(v.values(), reverse=True)}", flush=True)
    return {f"prompt{i}": len(v) for i, v in seen.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.bench import workload

    vocab = workload.vocab_size(workload.resolve_model_dir(args.model))
    result: dict[str, Any] = {"model": args.model, "samples": args.samples, "server_args": args.server_args,
                              "sampling": args.sampling}
    with launched_server(args.model, args.load_format, shlex.split(args.server_args)) as ep:
        assert ep.http is not None
        result["health"] = httpx.get(f"{ep.http}/health", timeout=10).json()
        for mode in args.modes:
            t0 = time.perf_counter()
            result[mode] = asyncio.run(_mode(ep.http, mode, args.samples, args.max_batch, args.max_new, args.seed,
                                             vocab, args.sampling == "filtered"))
            print(f"{mode:8s} distinct answers per prompt: {result[mode]}  ({time.perf_counter() - t0:.1f} s)",
                  flush=True)
    # a prompt the draw never picked has no answer, which is not a second one (an audit: "0" read as a failure)
    result["deterministic"] = all(v <= 1 for m in args.modes for v in result[m].values())
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--samples", type=int, default=50, help="answers collected per mode (SGLang's test: 1000)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="which tests to run")
    p.add_argument("--max-batch", type=int, default=8, help="largest batch of the prompt under test")
    p.add_argument("--max-new", type=int, default=8, help="tokens per answer")
    p.add_argument("--sampling", choices=("temperature", "filtered"), default="temperature",
                   help="temperature 1 alone (SGLang's test), or top_k/top_p beside neighbours that filter otherwise")


def main(args: argparse.Namespace) -> dict[str, Any]:
    result = run(args)
    name = Path(args.model).name if args.model else "default"
    out = Path(args.out or RESULTS_DIR / f"deterministic-{name}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.write_text(json.dumps(result, indent=2))
    print(f"result: {out}\ndeterministic: {result['deterministic']}")
    return {**result, "completed": int(result["deterministic"])}
