"""The scheduler's host time per step: SchedulerCore (the real one) driven at a served GPU
workload's shape, two steps in flight as the overlapped worker keeps them, its StepDones made
by a stand-in rank that replays the Step stream into a real replica (digests included) and
samples random tokens. Also the scheduler's garbage collections while it runs. Not in CI: a
measurement that says whether the Python control plane can keep a GPU fed.

    .venv/bin/python scripts/sched_probe.py [--requests 256] [--pages 40000] [--profile]

--pages sets the KV pool (page size 16): 40000 holds every request of the default workload at
once, 8000 makes the head of the queue wait for pages and decodes retract (the blocked-head and
retraction paths).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import random
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.replica import TokenChain, rank_replica  # noqa: E402
from engine.sched.scheduler import SchedConfig, SchedulerCore  # noqa: E402
from msgs.codec import pack_ids, unpack_ids  # noqa: E402
from msgs.done import StepDone  # noqa: E402
from msgs.params import SamplingParams  # noqa: E402
from msgs.requests import TokenizedRequest  # noqa: E402
from msgs.steps import Step  # noqa: E402

VOCAB = 151_936  # Qwen3's


class Rank:
    """Rank 0 as the scheduler sees it: the replica's digest at each DigestCheck, random tokens."""

    def __init__(self, seed: int) -> None:
        self.replica, self.chain, self.rng = rank_replica(), TokenChain(), random.Random(seed)

    def run(self, step: Step) -> tuple[StepDone, int]:
        digest = self.replica.digest() if self.replica.apply_step(step) else None
        n = sum(unpack_ids(step.forward.sample)) if step.forward is not None else 0
        out = pack_ids(self.rng.randrange(1, VOCAB) for _ in range(n))
        self.chain.update(out)
        done = StepDone(seq=step.seq, rank=0, token_ids=out, digest=digest,
                        tokens_hash=self.chain.hexdigest() if digest else None)
        return done, n


def quantiles(xs: list[float]) -> str:
    xs = sorted(xs)
    return (f"p50 {xs[len(xs) // 2] * 1e3:.3f} ms, p90 {xs[int(len(xs) * 0.9)] * 1e3:.3f} ms, "
            f"max {xs[-1] * 1e3:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256, help="all submitted at once, ignore_eos")
    ap.add_argument("--input-len", type=int, nargs=2, default=(100, 1024), help="prompt lengths, uniform")
    ap.add_argument("--output-len", type=int, nargs=2, default=(100, 1024), help="output lengths, uniform")
    ap.add_argument("--pages", type=int, default=40_000, help="KV pool pages of 16 tokens")
    ap.add_argument("--profile", action="store_true", help="print cProfile's top functions")
    args = ap.parse_args()
    core = SchedulerCore(SchedConfig(num_pages=args.pages, page_size=16, max_running=256, max_prefill_tokens=16384,
                                     max_context=4096, eos_token_ids=(0,), vocab_size=VOCAB))
    rng = random.Random(0)
    for i in range(args.requests):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(*args.input_len))]
        params = SamplingParams(max_new_tokens=rng.randint(*args.output_len), ignore_eos=True, temperature=0.0)
        core.submit(TokenizedRequest(rid=f"r{i}", input_ids=pack_ids(prompt), params=params))
    rank, inflight = Rank(1), deque[Step]()
    plan_s: list[float] = []
    done_s: list[float] = []
    rows: list[int] = []
    collections: list[float] = []
    began = [0.0]

    def on_gc(phase: str, _info: dict) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            collections.append(time.perf_counter() - began[0])

    gc.callbacks.append(on_gc)
    profile = cProfile.Profile() if args.profile else None
    if profile is not None:
        profile.enable()
    while True:
        while len(inflight) < 2:  # the overlapped worker holds two
            t = time.perf_counter()
            step = core.plan()
            plan_s.append(time.perf_counter() - t)
            if step is None:
                break
            inflight.append(step)
        if not inflight:
            break
        done, n = rank.run(inflight.popleft())
        t = time.perf_counter()
        core.on_done(done)
        done_s.append(time.perf_counter() - t)
        rows.append(n)
    if profile is not None:
        profile.disable()
        pstats.Stats(profile).sort_stats("cumulative").print_stats(25)
    gc.callbacks.remove(on_gc)
    assert core.idle and core.leak_free(), "the run ended with pages held"
    print(f"{len(done_s)} steps, {args.requests} requests, {args.pages} pages; "
          f"{core.state.retractions} retractions")
    print(f"plan:    {quantiles(plan_s)}\non_done: {quantiles(done_s)}")
    wide = [i for i, n in enumerate(rows) if n >= 200]
    if wide:
        print(f"steps sampling >= 200 rows ({len(wide)}): plan {quantiles([plan_s[i] for i in wide])}; "
              f"on_done {quantiles([done_s[i] for i in wide])}")
    print(f"garbage collections: {len(collections)}, {sum(collections) * 1e3:.1f} ms in all"
          + (f", longest {max(collections) * 1e3:.2f} ms" if collections else ""))


if __name__ == "__main__":
    main()
