"""Time the fused MoE layer's small launches at decode batches, each replayed in a CUDA graph of
50 back-to-back copies (what a captured decode step pays a launch, gaps included): the router's
product (cuBLAS against the projections' triton GEMV), the route kernel and the align kernel at
1, 2 and 4 warps. Prints microseconds a launch; the winners go into engine/layers/moe_kernels.py.

    python3 scripts/moe_launch_probe.py --out bench/results/moe-launch-probe-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.layers import moe_kernels as mk  # noqa: E402
from engine.layers import triton_ops  # noqa: E402
from scripts.moe_sweep import time_graph  # noqa: E402

COPIES = 50
MODELS = {  # hidden, experts, top_k, scoring, method, groups, router dtype
    "qwen3-30b-a3b": (2048, 128, 8, "softmax", "greedy", (1, 1), torch.bfloat16),
    "deepseek-v3": (7168, 256, 8, "sigmoid", "noaux_tc", (8, 4), torch.float32),
}


def per_launch_us(fn) -> float:  # noqa: ANN001
    """Microseconds a call of fn, COPIES calls captured in one CUDA graph and replayed."""
    return time_graph(fn, copies=COPIES) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 32])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for name, (h, e, k, scoring, method, groups, rdtype) in MODELS.items():
        spec = SimpleNamespace(num_experts=e, top_k=k, scoring_func=scoring, topk_method=method,
                               norm_topk_prob=True, n_group=groups[0], topk_group=groups[1], routed_scaling_factor=1.0)
        w = torch.randn(e, h, device="cuda", dtype=rdtype) * 0.02
        bias = torch.randn(e, device="cuda") * 0.01 if method == "noaux_tc" else None
        cfg = triton_ops.gemv_config(w)
        counts = torch.zeros(e, dtype=torch.int64, device="cuda")
        for t in args.tokens:
            x = torch.randn(t, h, device="cuda", dtype=rdtype)
            r = {"model": name, "tokens": t, "router_cublas": per_launch_us(partial(torch.matmul, x, w.T))}
            if cfg is not None and triton_ops.gemv_rows_ok(cfg, h, t):
                r["router_gemv"] = per_launch_us(partial(triton_ops.gemv, x, w, *cfg))
            logits = (x @ w.T).to(torch.bfloat16 if rdtype == torch.bfloat16 else torch.float32)
            ids = mk.route(logits, spec, bias)[1]
            for warps in (1, 2, 4):
                r[f"route_w{warps}"] = per_launch_us(partial(mk.route, logits, spec, bias, warps))
                r[f"align_w{warps}"] = per_launch_us(partial(mk.align, ids, counts, 0, e, 16, None, warps))
            rows.append(r)
            print(" ".join(f"{a}={b:.2f}" if isinstance(b, float) else f"{a}={b}" for a, b in r.items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "copies": COPIES,
                                              "us_per_launch": rows}, indent=1))


if __name__ == "__main__":
    main()
