"""Deterministic inference's GEMM at mid-sized decode batches, as the served step reads it
(device diagnostic, not in CI):

    python3 scripts/det_gemm_sweep.py [--out sweep.json] > sweep.log

For each projection of Qwen3-0.6B and Llama-3.1-8B and each row count of a large decode batch
(96-512: the offline benchmarks' steps), the one-program TMA tiles of
engine/layers/invariant_gemm.py over (BM, BN, pipeline stages), beside today's `tiles` choice
and cuBLAS. Stages and tile sizes decide no sums (the K slices and the warps per 64 rows do), so
every candidate must keep the prefill tiles' bits: '!' marks one that does not (asserted at the
end). Each time is a CUDA graph's replay over distinct weight copies (more bytes than the L2
holds, as a served step reads each layer's weight from HBM) divided by the copies
(kernel_sweep.graph_us; the results at 61976de took the median of five replays of 10 instead).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from engine.layers import invariant_gemm
from scripts.kernel_sweep import graph_us

SHAPES = {  # (N, K)
    "qwen-qkv": (4096, 1024), "qwen-o": (1024, 2048), "qwen-gate_up": (6144, 1024), "qwen-down": (1024, 3072),
    "llama-qkv": (6144, 4096), "llama-o": (4096, 4096), "llama-gate_up": (28672, 4096), "llama-down": (4096, 14336),
}
ROWS = (96, 128, 192, 256, 384, 512)
# (BM, BN, GROUP_M, stages): GROUP_M 8 one program a tile (TMA loads), 1 the split grid (K slices as programs)
CANDIDATES = [(64, bn, 8, st) for bn in (32, 64, 128) for st in (3, 4, 5, 6, 8)] \
    + [(64, 256, 8, st) for st in (3, 4, 5)] + [(128, bn, 8, st) for bn in (64, 128) for st in (3, 4, 5, 6)] \
    + [(128, 256, 8, st) for st in (3, 4)] + [(64, 64, 1, 4), (64, 128, 1, 4), (64, 128, 1, 6), (128, 256, 1, 3)]
PREFILL_ROWS = (1024, 4096)  # the prefill tile (128 x 256, one program a tile) at its pipeline depths
PREFILL_CANDIDATES = [(128, 256, 8, 3), (128, 256, 8, 4)]


def sweep_shape(name: str, n: int, k: int) -> tuple[list[dict], list[tuple]]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    copies = max(2, min(16, int(160e6 // (n * k * 2))))
    ws = [(torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).to(torch.bfloat16) for _ in range(copies)]
    x = torch.randn(1024, k, generator=gen, device="cuda").to(torch.bfloat16)
    full = invariant_gemm.gemm(x, ws[0])  # the prefill tiles' bits
    slices = invariant_gemm.split(n, k)
    rows, bad = [], []
    for m in ROWS + PREFILL_ROWS:
        xm = x[:m]
        now = invariant_gemm.tiles(m, n, k)
        if not torch.equal(invariant_gemm.gemm(xm, ws[0]), full[:m]):
            bad.append((name, m, now))
        row = {"shape": name, "m": m, "now": list(now),
               "now_us": graph_us([lambda xm=xm, w=w: invariant_gemm.gemm(xm, w) for w in ws]),
               "cublas_us": graph_us([lambda xm=xm, w=w: F.linear(xm, w) for w in ws]), "candidates": {}}
        for bm, bn, group, st in CANDIDATES if m in ROWS else PREFILL_CANDIDATES:
            tile = (bm, bn, group, 4 * bm // 64, st, slices)
            key = f"{bm}x{bn}{'' if group > 1 else 'split'}/{st}"
            try:
                same = torch.equal(invariant_gemm.gemm(xm, ws[0], tile=tile), full[:m])
                t = graph_us([lambda xm=xm, w=w, tile=tile: invariant_gemm.gemm(xm, w, tile=tile) for w in ws])
            except Exception as e:  # noqa: BLE001 - past shared memory or the workspace: recorded
                row["candidates"][key] = type(e).__name__
                continue
            row["candidates"][key] = round(t, 2)
            if not same:
                bad.append((name, m, tile))
        best = min((v, c) for c, v in row["candidates"].items() if isinstance(v, float))
        print(f"{name} M={m}: now {now[:5]} {row['now_us']:.1f} us, cuBLAS {row['cublas_us']:.1f}, "
              f"best {best[1]} {best[0]:.1f}; " + ", ".join(f"{c} {v}" for c, v in row["candidates"].items()),
              flush=True)
        rows.append(row)
    return rows, bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    args = ap.parse_args()
    results, bad = [], []
    for name in args.shapes:
        r, b = sweep_shape(name, *SHAPES[name])
        results += r
        bad += b
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": results, "bits_differ": bad}, f, indent=1)
    print("candidates whose bits differ from the prefill tiles':", bad or "none")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
