"""Batch-1 GEMV probe (GPU only): cuBLAS (F.linear) against engine/run/triton_ops.gemv over the
decode GEMM shapes of Llama-3.1-8B and Qwen3-0.6B, each timed as L distinct weight matrices
(one per layer, so nothing stays in L2) in one CUDA graph, next to the HBM time of the bytes.

Usage: python3 scripts/gemv_probe.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.bench import roofline  # noqa: E402
from engine.run import triton_ops  # noqa: E402
from scripts.attn_probe import graph_ms  # noqa: E402

SHAPES = {  # name: (N, K, layers)
    "llama qkv": (6144, 4096, 32), "llama o": (4096, 4096, 32), "llama gate_up": (28672, 4096, 32),
    "llama down": (4096, 14336, 32), "qwen3 qkv": (4096, 1024, 28), "qwen3 o": (1024, 2048, 28),
    "qwen3 gate_up": (6144, 1024, 28), "qwen3 down": (1024, 3072, 28),
}
CONFIGS = [(8, 512, 4, 3), (16, 512, 4, 3), (16, 256, 4, 4), (32, 256, 8, 3), (8, 1024, 4, 2), (4, 1024, 4, 3),
           (4, 512, 4, 3), (8, 256, 4, 4), (8, 512, 8, 3), (8, 512, 4, 4), (16, 512, 8, 3), (4, 512, 2, 4),
           (8, 256, 2, 5), (16, 128, 4, 6)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--only", default="", help="shapes whose name starts with this")
    ap.add_argument("--tune-out", type=Path, help='write {"N,K": best config} here (for STRATA_GEMV_TUNE)')
    a = ap.parse_args()
    dev = torch.device("cuda")
    bw = roofline.copy_bandwidth(dev, 1 << 30)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for name, (n, k, layers) in SHAPES.items():
        if not name.startswith(a.only):
            continue
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        ref = F.linear(x, ws[0]).float()
        hbm_ms = layers * n * k * 2 / bw * 1e3
        row = {"shape": name, "n": n, "k": k, "layers": layers, "hbm_ms": hbm_ms,
               "cublas_ms": graph_ms(lambda ws=ws, x=x: [F.linear(x, w) for w in ws])}
        best = None
        for cfg in CONFIGS:
            if k % cfg[1]:
                continue
            try:
                err = (triton_ops.gemv(x, ws[0], *cfg).float() - ref).abs().max().item()
                t = graph_ms(lambda ws=ws, x=x, cfg=cfg: [triton_ops.gemv(x, w, *cfg) for w in ws])
            except Exception as e:  # noqa: BLE001
                print(f"  {name} {cfg} failed: {e!r}"[:300])
                continue
            row[f"triton{cfg}"] = (t, err)
            if best is None or t < best[1]:
                best = (cfg, t, err)
        row["best"] = best
        rows.append(row)
        print(f"{name:14s} N={n:6d} K={k:6d} x{layers}: hbm {hbm_ms:.3f} ms | cublas {row['cublas_ms']:.3f} ms | "
              f"triton best {best[1]:.3f} ms {best[0]} (err {best[2]:.2g})", flush=True)
        del ws
    if a.tune_out:
        a.tune_out.write_text(json.dumps({f"{r['n']},{r['k']}": list(r["best"][0]) for r in rows}))
    if a.json:
        a.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "copy_bw": bw, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
