"""Time the fused MoE layer (engine/layers/moe_kernels.py: align, w13, w2, combine) for each GEMM
block config at a model's expert shapes and token counts, on CUDA, each call replayed in a CUDA
graph (as decode runs). Prints ms per token count for the current tuning and the best config,
the best's weight bandwidth (the touched experts' bytes over its time), and `moe_gemm` rules for
configs/tuning/<GPU>.json.

    python3 scripts/moe_sweep.py --shape qwen3-30b-a3b --quant none --tokens 1 8 32 64 256 1024 4096
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.layers import moe_kernels as mk  # noqa: E402
from engine.layers import moe_quant  # noqa: E402
from engine.layers.moe import Experts  # noqa: E402
from engine.layers.tuning import kernel_tuning  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (2048, 128, 8, 768), "deepseek-v3": (7168, 256, 8, 2048)}


def candidates(rows: int) -> list[mk.GemmConfig]:
    out = []
    for bm in (16, 32, 64, 128):
        if bm > max(16, 4 * rows):
            continue
        if bm <= 32:  # weight-bound: long k-steps, more stages, narrow to wide tiles
            out += [mk.GemmConfig(bm, bn, bk, 1, 4, st)
                    for bn, bk, st in itertools.product((32, 64, 128), (64, 128), (3, 4))]
        else:
            out += [mk.GemmConfig(bm, bn, 64, 8, 8 if bm == 128 else 4, 3) for bn in (64, 128)]
    return out


def time_graph(fn, reps: int = 20) -> float:  # noqa: ANN001
    """ms per call of fn, captured once in a CUDA graph and replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--quant", choices=("none", "fp8_row", "fp8_block"), default="none")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 256, 1024, 4096])
    ap.add_argument("--out", default=None, help="JSON of every timing")
    args = ap.parse_args()
    h, e, k, inter = SHAPES[args.shape]
    with torch.device("cuda"):
        ex = Experts(h, SimpleNamespace(num_experts=e, intermediate_size=inter), torch.bfloat16)
    for p in (ex.w13, ex.w2):
        p.data.normal_(0, 0.02)
    if args.quant != "none":
        moe_quant.quantize(ex, args.quant)
    stacks = [mk.Stack(getattr(ex, n), getattr(ex, n + "_scale", None), ex.quant) for n in ("w13", "w2")]
    per_expert = sum(p.nbytes for n, p in ex.named_parameters() if n.startswith(("w13", "w2"))) / e
    counts = torch.zeros(e, dtype=torch.int64, device="cuda")
    results, best_rules = [], []
    for t in args.tokens:
        logits = torch.randn(t, e, device="cuda")
        w, ids = logits.softmax(-1).topk(k, dim=-1)
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        rows = -(-t * k // min(t * k, e))
        touched = ids.unique().numel()
        default = mk.config_for(x.device, t * k, e)
        timed = {}
        for cfg in dict.fromkeys([default, *candidates(rows)]):
            def call(cfg: mk.GemmConfig = cfg, batch: tuple = (x, w, ids)) -> None:
                mk.fused_experts(*batch, *stacks, counts, 0, cfg)

            timed[cfg] = time_graph(call)
        best = min(timed, key=timed.get)
        gbs = touched * per_expert / (timed[best] / 1e3) / 1e9
        print(f"tokens {t:5d} rows/expert {rows:4d} experts {touched:3d}: tuning {timed[default]:.4f} ms "
              f"{tuple(default)}, best {timed[best]:.4f} ms {tuple(best)} ({gbs:.0f} GB/s of expert weights)",
              flush=True)
        results.append({"tokens": t, "rows": rows, "experts_touched": touched, "tuning": list(default),
                        "tuning_ms": timed[default], "best": list(best), "best_ms": timed[best],
                        "all": [[list(c), ms] for c, ms in sorted(timed.items(), key=lambda kv: kv[1])]})
        best_rules.append({"config": list(best), "max_rows": rows})
    best_rules[-1].pop("max_rows")
    print("moe_gemm rules:", json.dumps(best_rules))
    print("current tuning:", [(r.config, r.max_rows) for r in kernel_tuning(torch.device("cuda")).moe_gemm])
    if args.out:
        Path(args.out).write_text(json.dumps({"shape": args.shape, "quant": args.quant,
                                              "gpu": torch.cuda.get_device_name(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
