"""NGRAM draft trees against chains on CPU, batch 1 (a measurement, not in CI)

    .venv/bin/python scripts/spec_tree_cpu.py [--tokens 96] [--dtype float32]

In one process (LocalEngine), the default model and scripts/spec_cpu.py's code-editing chat
prompt, decoded greedily without speculation, with an NGRAM chain of 3 and 5 drafts and with
NGRAM trees (--speculative-eagle-topk 3, 8 and 12 nodes), and the self-draft (8 of 30 layers, 2
drafts) as a chain and with 2 leaves beside each node. Each engine is warmed up on another
prompt, then answers the prompt once (fresh: the request's own n-grams) and once more (asked
again: the radix tree's continuation). Prints output tok/s, verify rows, the accept length
(tokens a verify row answered) and whether the tokens are the plain run's.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the served worker (engine/run/__init__.py)

from spec_cpu import setup  # noqa: E402  (scripts/: the same workload)

from engine.config import ServerConfig  # noqa: E402
from engine.local import LocalEngine  # noqa: E402
from engine.tokenizer import load_tokenizer  # noqa: E402
from msgs.params import SamplingParams  # noqa: E402

NGRAM = {"speculative_algorithm": "NGRAM"}
SELF = {"speculative_algorithm": "STANDALONE", "speculative_draft_layers": 8, "speculative_num_steps": 2}
RUNS = [
    {},
    NGRAM,
    {**NGRAM, "speculative_num_steps": 5},
    {**NGRAM, "speculative_eagle_topk": 3, "speculative_num_draft_tokens": 8},
    {**NGRAM, "speculative_num_steps": 5, "speculative_eagle_topk": 3, "speculative_num_draft_tokens": 12},
    SELF,
    {**SELF, "speculative_eagle_topk": 3, "speculative_num_draft_tokens": 7},
]


def main() -> None:
    args, model, prompt, params = setup()
    tok = load_tokenizer(model)
    assert tok is not None
    want = None
    for kw in RUNS:
        eng = LocalEngine(ServerConfig(model=model, dtype=args.dtype, max_total_tokens=4096, max_running_requests=4,
                                       **kw))
        eng.generate([tok.encode("Hello there, how are you?")], SamplingParams(max_new_tokens=8, temperature=0))
        st = eng.core.state.spec_stats
        for run in ("fresh", "again"):
            t, rows, acc = time.perf_counter(), st.rows, st.accepted
            (res,) = eng.generate([prompt], params)
            secs = time.perf_counter() - t
            want = want or res.output_ids
            length = 1 + (st.accepted - acc) / max(1, st.rows - rows)
            label = " ".join(f"{k.removeprefix('speculative_')}={v}" for k, v in kw.items()) or "plain"
            print(f"{label} {run}: {args.tokens / secs:.1f} tok/s, {st.rows - rows} verify rows, "
                  f"accept length {length:.2f}, same tokens as plain: {res.output_ids == want}", flush=True)


if __name__ == "__main__":
    main()
