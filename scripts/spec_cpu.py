"""Speculative decoding on CPU, batch 1 (a measurement, not in CI)

    .venv/bin/python scripts/spec_cpu.py [--tokens 96] [--dtype float32]

In one process (LocalEngine: the served Step stream, no sockets), the default model: a
code-editing chat prompt (rename three functions, keep the rest) decoded greedily without
speculation, with NGRAM at 3 and 5 drafts (the radix cache off: drafts from the request's own
tokens; then on: the repeated prompt drafts its earlier answer from the prefix cache), and with the
self-draft (8 and 20 of 30 layers).
Prints output tok/s (best of 2 after a warm-up), steps and the accept length (tokens a verify
row answered), and checks every run gives the tokens of the plain one.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the served worker (engine/run/__init__.py)

from engine.config import ServerConfig  # noqa: E402
from engine.local import LocalEngine  # noqa: E402
from engine.tokenizer import load_tokenizer  # noqa: E402
from models.default_model import ensure_default_model  # noqa: E402
from msgs.params import SamplingParams  # noqa: E402

CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
RUNS = [
    {},
    # the radix cache off: NGRAM's own-token lookup only, what a prompt gets the first time
    {"speculative_algorithm": "NGRAM", "disable_radix_cache": True},
    {"speculative_algorithm": "NGRAM", "speculative_num_steps": 5, "disable_radix_cache": True},
    # on: the timed runs repeat the prompt, so NGRAM drafts the earlier answer from the prefix cache
    {"speculative_algorithm": "NGRAM"},
    {"speculative_algorithm": "NGRAM", "speculative_num_steps": 5},
    {"speculative_algorithm": "STANDALONE", "speculative_draft_layers": 8, "speculative_num_steps": 2},
    {"speculative_algorithm": "STANDALONE", "speculative_draft_layers": 20, "speculative_num_steps": 2},
]


def setup() -> tuple[argparse.Namespace, str, list[int], SamplingParams]:
    """The flags, the default model's directory, the code-editing chat prompt's ids and greedy params
    (scripts/spec_tree_cpu.py runs the same workload)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    model = str(ensure_default_model())
    tok = load_tokenizer(model)
    assert tok is not None
    chat = [{"role": "user", "content": "Rename the functions to plus, minus and times, keep the rest:\n\n" + CODE}]
    prompt = tok.hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"]) if hasattr(prompt, "keys") else list(prompt)
    return args, model, prompt, SamplingParams(max_new_tokens=args.tokens, temperature=0, ignore_eos=True)


def main() -> None:
    args, model, prompt, params = setup()
    want = None
    for kw in RUNS:
        eng = LocalEngine(ServerConfig(model=model, dtype=args.dtype, max_total_tokens=4096, max_running_requests=4,
                                       **kw))
        eng.generate([prompt], SamplingParams(max_new_tokens=4, temperature=0))  # warm-up
        best, st = 1e9, eng.core.state.spec_stats
        for _ in range(2):
            t, steps, rows, acc = time.perf_counter(), eng.steps_run, st.rows, st.accepted
            (res,) = eng.generate([prompt], params)
            best = min(best, time.perf_counter() - t)
        want = want or res.output_ids
        length = 1 + (st.accepted - acc) / max(1, st.rows - rows)
        print(f"{kw or 'plain'}: {args.tokens / best:.1f} tok/s, {eng.steps_run - steps} steps, "
              f"accept length {length:.2f}, same tokens as plain: {res.output_ids == want}")


if __name__ == "__main__":
    main()
