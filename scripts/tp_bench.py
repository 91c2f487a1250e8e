"""tp=N vs tp=1 batch-1 decode latency and greedy agreement, on the same dummy weights.

python3 scripts/tp_bench.py --model configs/llama-3.1-8b --tp 2 [--context-len 1024 --steps 64]
Each rank is a spawned process with torch.distributed's environment (tests/models/tp_harness.py,
the same driver the CPU tests use); step times are rank 0's wall time per pure-decode step
(run_step: launch + the host sync of the sampled token, every rank running it). Prints JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "models")]

from tp_harness import run_tp  # noqa: E402

from engine.config import ServerConfig  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from msgs.params import SamplingParams  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--context-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--disable-cuda-graph", action="store_true")
    # float32 + torch attention: the agreement check without bf16 rounding (near-ties of random weights)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    vocab = ModelConfig.from_dir(a.model).vocab_size
    prompt = [(i * 7919) % (vocab - 10) + 10 for i in range(a.context_len)]
    params = SamplingParams(max_new_tokens=a.steps, temperature=0.0, ignore_eos=True)
    report: dict = {"model": a.model, "context_len": a.context_len, "steps": a.steps, "runs": {}}
    tokens = {}
    for tp in a.tp:
        # 16 running requests, not 1: the grammar effect's start-up warm-up slices 16 bitmask rows
        cfg = ServerConfig(model=a.model, load_format="dummy", device=a.device, tp_size=tp, max_running_requests=16,
                           max_total_tokens=a.context_len + a.steps + 64, max_prefill_tokens=max(2048, a.context_len),
                           disable_cuda_graph=a.disable_cuda_graph, disable_overlap=True, dtype=a.dtype,
                           attention_backend=a.attention_backend)
        try:
            (wave,) = run_tp(cfg, [([prompt], params)], timeout_s=500)
        except Exception as exc:  # noqa: BLE001 - one device call: record it and retry eager
            if cfg.disable_cuda_graph or cfg.resolved_device != "cuda":
                raise
            print(f"tp={tp} with CUDA graphs failed, retrying eager: {exc}", flush=True)
            report.setdefault("graph_failures", {})[str(tp)] = str(exc)[-2000:]
            cfg = dataclasses.replace(cfg, disable_cuda_graph=True)
            (wave,) = run_tp(cfg, [([prompt], params)], timeout_s=500)
        report.setdefault("cuda_graphs", {})[str(tp)] = not cfg.disable_cuda_graph
        out = wave[0]
        ms = (out.step_ms or [])[5:]  # after 5 warm-up steps
        tokens[tp] = out.output_ids
        report["runs"][str(tp)] = {"median_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms),
                                   "n": len(ms), "tokens": out.output_ids}
        print(f"tp={tp}: batch-1 decode median {statistics.median(ms):.3f} ms over {len(ms)} steps", flush=True)
    base = min(a.tp)
    for tp in a.tp:
        same = sum(x == y for x, y in zip(tokens[tp], tokens[base], strict=True))
        report["runs"][str(tp)]["greedy_agree_with_tp1"] = f"{same}/{len(tokens[base])}"
        report["runs"][str(tp)]["ratio_vs_tp1"] = report["runs"][str(tp)]["median_ms"] / report["runs"][str(base)][
            "median_ms"]
    print(json.dumps(report, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
