"""Prompt logprobs served under load (docs/PERF.md): a model with dummy weights, its KV pool sized
by memory (so only the runtime reserve is left for a step's logits), an offline load of LOAD
requests keeping the pool busy while SCORED long prompts ask for prompt_logprobs. A scored chunk's
logits (its tokens x the vocabulary, float32) must fit that reserve: every request finishes, each
scored prompt gets one finite logprob per prompt token after the first, and the server is still
healthy at the end. Exits 1 otherwise.

    python3 scripts/prompt_logprobs_served.py --model configs/qwen3-0.6b --prompt-len 4096
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.bench.launch import launched_server  # noqa: E402
from msgs.sdk import AsyncClient  # noqa: E402


async def _run(sdk: str, args: argparse.Namespace) -> list[str]:
    rng = random.Random(0)
    vocab = args.vocab

    def ids(n: int) -> list[int]:
        return [rng.randrange(vocab // 8, vocab) for _ in range(n)]

    client = AsyncClient(sdk)
    load = [client.generate(ids(args.load_input), max_new_tokens=args.load_output, ignore_eos=True)
            for _ in range(args.load)]
    scored_prompts = [ids(args.prompt_len) for _ in range(args.scored)]
    scored = [client.generate(p, max_new_tokens=4, prompt_logprobs=0) for p in scored_prompts]
    t0 = time.perf_counter()
    results = await asyncio.gather(*load, *scored, return_exceptions=True)
    print(f"{len(results)} requests in {time.perf_counter() - t0:.1f} s", flush=True)
    errors = [f"request {i}: {r!r}" for i, r in enumerate(results) if isinstance(r, BaseException)]
    for i, r in enumerate(results[args.load:]):
        if isinstance(r, BaseException):
            continue
        lps = r.prompt_logprobs or []
        bad = sum(not math.isfinite(x) for x in lps)
        print(f"scored {i}: {len(lps)} prompt logprobs, mean {sum(lps) / max(len(lps), 1):.3f}, {bad} not finite")
        if len(lps) != args.prompt_len - 1 or bad:
            errors.append(f"scored {i}: {len(lps)} logprobs ({bad} not finite), want {args.prompt_len - 1} finite")
    return errors


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="configs/qwen3-0.6b")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--scored", type=int, default=3)
    p.add_argument("--load", type=int, default=256)
    p.add_argument("--load-input", type=int, default=1000)
    p.add_argument("--load-output", type=int, default=200)
    p.add_argument("--server-args", default="")
    args = p.parse_args()
    with launched_server(args.model, "dummy", args.server_args.split()) as ends:
        errors = asyncio.run(_run(ends.sdk, args))
        health = httpx.get(f"{ends.http}/health", timeout=30).status_code
        if health != 200:
            errors.append(f"/health answered {health} after the run")
    for e in errors:
        print("FAILED:", e)
    print("OK" if not errors else f"{len(errors)} failures")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
