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

TEXT = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis to a child.",
    "List three uses of a paperclip.", "How do I boil an egg?", "Summarize the plot of Romeo and Juliet.",
    "What is 17 times 23?", "Give me a recipe for pancakes.", "Why is the sky blue?",
    "Translate 'good morning' into Spanish and German.", "Write a short poem about autumn leaves.",
    "What are the planets of the solar system?", "Describe how a bicycle works.",
    "Tell me a fun fact about octopuses.", "What does a CPU do?", "Suggest a name for a pet turtle.",
]


def run(dtype: str, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    longest = max(len(x) for x in prompts)
    cfg = ServerConfig(model=str(ensure_default_model()), device="cpu", dtype=dtype, max_running_requests=len(prompts),
                       max_total_tokens=len(prompts) * (longest + output_len + 32))
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
    p.add_argument("--text", action="store_true", help="chat prompts (TEXT) instead of random token ids")
    a = p.parse_args()
    if a.text:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(ensure_default_model() / "tokenizer.json"))
        chat = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
        prompts = [tok.encode(chat.format(t)).ids for t in TEXT]
    else:
        reqs = workload.random_requests(a.batch, (a.input_len, a.input_len), (a.output_len, a.output_len), 49152,
                                        a.seed)
        prompts = [r.prompt for r in reqs]
    ref, got = run("float32", prompts, a.output_len), run("bfloat16", prompts, a.output_len)
    equal = sum(x == y for x, y in zip(ref, got, strict=True))
    common = [next((i for i, (u, w) in enumerate(zip(x, y, strict=True)) if u != w), len(x)) for x, y in zip(ref, got,
                                                                                                           strict=True)]
    print(f"bf16 vs fp32: {equal}/{len(prompts)} rows token-equal; common prefix mean {np.mean(common):.1f} "
          f"of {a.output_len} tokens (per row: {common})")


if __name__ == "__main__":
    main()
