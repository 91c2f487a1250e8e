"""tp=N vs tp=1 decode latency and greedy agreement, on the same dummy weights.

python3 scripts/tp_bench.py --model configs/llama-3.1-8b --runs 1 2:nccl 2:symm [--batch-sizes 1 8]
    [--context-len 1024 --steps 64] [--layers 4] [--dtype float32 --attention-backend torch
    --disable-cuda-graph] [--out FILE]

Each run is `TP[:ALLREDUCE]`, started in its own spawned processes (tests/models/tp_harness.py,
the driver the CPU tests use):
  TP         ranks (1 = the baseline)
  ALLREDUCE  tuned (default: the GPU's tuning file), nccl (NCCL for every size), symm (the
             one-shot all-reduce over peer memory up to --symm-max-bytes, NCCL above)
Per batch size, one wave of that many prompts (distinct, --context-len tokens each); step time is
rank 0's wall time per pure-decode step of exactly that batch (run_step: launch + the host sync
of the sampled tokens, every rank running it, no overlap), median after 5 warm-up steps. Greedy
agreement: each run's tokens against the first tp=1 run's (or the first run's), per batch size.
--layers N cuts the model to its first N layers (a copy of the config; dummy weights). The JSON
report is written to --out after every run, so a run that hangs or fails loses only itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import queue
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "models")]

from tp_harness import run_tp  # noqa: E402

from engine.bench.workload import cut_model  # noqa: E402
from engine.config import ServerConfig  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from msgs.params import SamplingParams  # noqa: E402

ALLREDUCE = ("tuned", "nccl", "symm")
WARMUP_STEPS = 5


@dataclasses.dataclass(frozen=True)
class Run:
    tp: int
    allreduce: str = "tuned"

    @property
    def name(self) -> str:
        return str(self.tp) + ("" if self.allreduce == "tuned" else f":{self.allreduce}")


def parse_run(spec: str) -> Run:
    tp, _, allreduce = spec.partition(":")
    r = Run(int(tp), allreduce or "tuned")
    if r.tp < 1 or r.allreduce not in ALLREDUCE:
        raise argparse.ArgumentTypeError(f"bad run {spec!r}: TP[:{'|'.join(ALLREDUCE)}]")
    return r


def tuning_of(run: Run, symm_max_bytes: int) -> dict | None:
    """override_tuning's fields for the run's all-reduce choice (None: the GPU's file as is)."""
    if run.allreduce == "nccl":
        return {"tp_symm_allreduce_max_bytes": 0}
    if run.allreduce == "symm":
        return {"tp_symm_allreduce_max_bytes": symm_max_bytes}
    return None


def prompts(vocab: int, n: int, length: int) -> list[list[int]]:
    """n distinct prompts (prompt 0 is the one earlier versions of this script used)."""
    return [[(j * 7919 + i * 104729) % (vocab - 10) + 10 for j in range(length)] for i in range(n)]


def step_stats(out, batch: int) -> dict:  # noqa: ANN001 - tp_harness.Out
    ms = [m for m, r in zip(out.step_ms or [], out.step_rows or [], strict=True) if r == batch][WARMUP_STEPS:]
    if not ms:
        return {"n": 0}
    ms_sorted = sorted(ms)
    return {"median_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms), "n": len(ms),
            "p10_ms": ms_sorted[len(ms) // 10], "p90_ms": ms_sorted[(9 * len(ms)) // 10]}


def agreement(a: list[int], b: list[int]) -> dict:
    same = sum(x == y for x, y in zip(a, b, strict=False))
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    return {"same": same, "of": min(len(a), len(b)), "first_divergence": first}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--runs", type=parse_run, nargs="+", default=None)
    ap.add_argument("--tp", type=int, nargs="+", default=None, help="shorthand for --runs with tuned all-reduce")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    ap.add_argument("--context-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N layers")
    ap.add_argument("--symm-max-bytes", type=int, default=1 << 20, help="the symm runs' threshold")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--disable-cuda-graph", action="store_true")
    # float32 + torch attention: the agreement check without bf16 rounding (near-ties of random weights)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--timeout", type=float, default=400.0, help="per run")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    runs = a.runs or [Run(t) for t in (a.tp or [1, 2])]
    model = a.model
    tmp = tempfile.TemporaryDirectory(prefix="tp-bench-")
    if a.layers:
        model = cut_model(a.model, a.layers, Path(tmp.name) / "model")
    vocab = ModelConfig.from_dir(model).vocab_size
    params = SamplingParams(max_new_tokens=a.steps, temperature=0.0, ignore_eos=True)
    waves = [(prompts(vocab, b, a.context_len), params) for b in a.batch_sizes]
    most = max(a.batch_sizes)
    report: dict = {"model": a.model, "layers": a.layers, "context_len": a.context_len, "steps": a.steps,
                    "batch_sizes": a.batch_sizes, "dtype": a.dtype, "attention_backend": a.attention_backend,
                    "cuda_graphs": not a.disable_cuda_graph, "symm_max_bytes": a.symm_max_bytes, "runs": {}}

    def save() -> None:
        if a.out:
            Path(a.out).write_text(json.dumps(report, indent=1))

    tokens: dict[str, list[list[int]]] = {}
    for run in runs:
        # 16 running requests at least: the grammar effect's start-up warm-up slices 16 bitmask rows
        cfg = ServerConfig(model=model, load_format="dummy", device=a.device, tp_size=run.tp,
                           max_running_requests=max(16, most),
                           max_total_tokens=most * (a.context_len + a.steps + 64) + 256,
                           max_prefill_tokens=max(2048, a.context_len), disable_cuda_graph=a.disable_cuda_graph,
                           disable_overlap=True, dtype=a.dtype, attention_backend=a.attention_backend)
        rec: dict = {"tp": run.tp, "allreduce": run.allreduce}
        report["runs"][run.name] = rec
        t0 = time.perf_counter()
        try:
            try:
                outs = run_tp(cfg, waves, timeout_s=a.timeout, tuning=tuning_of(run, a.symm_max_bytes))
            except Exception as exc:  # noqa: BLE001 - one device call: record it and retry eager
                if cfg.disable_cuda_graph or cfg.resolved_device != "cuda" or isinstance(exc, queue.Empty):
                    raise  # a run that timed out is not retried
                print(f"{run.name} with CUDA graphs failed, retrying eager: {str(exc)[-3000:]}", flush=True)
                rec["graph_failure"] = str(exc)[-3000:]
                cfg = dataclasses.replace(cfg, disable_cuda_graph=True)
                outs = run_tp(cfg, waves, timeout_s=a.timeout, tuning=tuning_of(run, a.symm_max_bytes))
        except Exception as exc:  # noqa: BLE001 - the other runs still run
            rec["error"] = f"{type(exc).__name__}: {str(exc)[-3000:]}"
            print(f"{run.name}: FAILED {rec['error']}", flush=True)
            traceback.print_exc()
            save()
            continue
        rec["seconds"] = round(time.perf_counter() - t0, 1)
        rec["cuda_graphs"] = not cfg.disable_cuda_graph
        tokens[run.name] = [wave[0].output_ids for wave in outs]
        for b, wave in zip(a.batch_sizes, outs, strict=True):
            st = step_stats(wave[0], b)
            rec[f"b{b}"] = st | {"tokens": [o.output_ids for o in wave]}
            if st["n"]:
                print(f"{run.name}: batch {b} decode median {st['median_ms']:.3f} ms over {st['n']} steps", flush=True)
            else:
                print(f"{run.name}: batch {b}: no pure-decode step of that size", flush=True)
        save()
    base = next((r.name for r in runs if r.tp == 1 and r.name in tokens), next(iter(tokens), None))
    report["baseline"] = base
    for name, rec in report["runs"].items():
        if base is None or name not in tokens:
            continue
        for b in a.batch_sizes:
            st, ref = rec[f"b{b}"], report["runs"][base][f"b{b}"]
            st["agree_with_baseline"] = [agreement(x, y) for x, y in zip(st["tokens"], ref["tokens"], strict=True)]
            if st.get("n") and ref.get("n"):
                st["ratio_vs_baseline"] = st["median_ms"] / ref["median_ms"]
    save()
    print(json.dumps({name: {k: ({kk: vv for kk, vv in v.items() if kk != "tokens"} if isinstance(v, dict) else v)
                             for k, v in rec.items()} for name, rec in report["runs"].items()}, indent=1))
    return 0 if tokens else 1


if __name__ == "__main__":
    sys.exit(main())
