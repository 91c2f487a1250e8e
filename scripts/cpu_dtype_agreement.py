"""How often do bf16 greedy tokens equal fp32's? (diagnostic, not in CI)

    .venv/bin/python scripts/cpu_dtype_agreement.py [--batch 16] [--input-len 128] [--output-len 64]

The default model on CPU in one process (LocalEngine), the same seeded random prompts as
`bin/bench cpu` (engine/bench/workload.py), greedy with no EOS stop, once in float32 and once in
bfloat16: prints how many rows are token-equal and the mean length of the common prefix.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the served worker (engine/run/__init__.py)

import numpy as np  # noqa: E402

from engine.bench import workload  # noqa: E402
from engine.config import ServerConfig  # noqa: E402
from engine.local import LocalEngine  # noqa: E402
from models.default_model import ensure_default_model  # noqa: E402
from msgs.params import SamplingParams  # noqa: E402


def run(dtype: str, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    cfg = ServerConfig(model=str(ensure_default_model()), device="cpu", dtype=dtype, max_running_requests=len(prompts),
                       max_total_tokens=len(prompts) * (len(prompts[0]) + output_len + 32))
    params = SamplingParams(max_new_tokens=output_len, temperature=0, ignore_eos=True)
    eng = LocalEngine(cfg)
    eng.generate(prompts[:2], SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True))  # warm-up
    t = time.perf_counter()
    out = [r.output_ids for r in eng.generate(prompts, params)]
    print(f"{dtype}: {len(prompts)} x {output_len} tokens in {time.perf_counter() - t:.2f} s (in process)")
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    reqs = workload.random_requests(a.batch, (a.input_len, a.input_len), (a.output_len, a.output_len), 49152, a.seed)
    prompts = [r.prompt for r in reqs]
    ref, got = run("float32", prompts, a.output_len), run("bfloat16", prompts, a.output_len)
    equal = sum(x == y for x, y in zip(ref, got, strict=True))
    common = [next((i for i, (u, w) in enumerate(zip(x, y, strict=True)) if u != w), len(x)) for x, y in zip(ref, got,
                                                                                                           strict=True)]
    print(f"bf16 vs fp32: {equal}/{len(prompts)} rows token-equal; common prefix mean {np.mean(common):.1f} "
          f"of {a.output_len} tokens (per row: {common})")


if __name__ == "__main__":
    main()
