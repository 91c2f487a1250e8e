"""Deterministic inference's CUDA GEMV (engine/layers/invariant_gemv.cu) against the triton GEMV it
would replace, on the GPU: bits equal to the prefill tiles' at 1-8 rows, and time (CUDA graph
replays) at each ring depth, beside the triton GEMV, the mode-off FMA GEMV and cuBLAS.

    python3 scripts/det_gemv_probe.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.bench.roofline import graph_us  # noqa: E402
from engine.layers import invariant_gemm, invariant_gemv, triton_ops  # noqa: E402

SHAPES = {  # (N, K)
    "llama-qkv": (6144, 4096), "llama-o": (4096, 4096), "llama-gate_up": (28672, 4096),
    "llama-down": (4096, 14336), "llama-head": (128256, 4096), "qwen-qkv": (4096, 1024),
    "qwen-o": (1024, 2048), "qwen-gate_up": (6144, 1024), "qwen-down": (1024, 3072),
    "odd": (1000, 1000),  # rows past a 16-row block, a K past its last whole tile
}


def time_us(f, reps: int = 50) -> float:  # noqa: ANN001
    return graph_us(f, ops=5, replays=reps)


def cuda_gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, slices: int, stages: int,
              pdl: bool = False) -> torch.Tensor:
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    assert invariant_gemv.gemv(x, w, bias, out, slices, stages, pdl)
    return out


def probe_shape(name: str, n: int, k: int, bad: list) -> dict:
    """One weight shape: the bits at 1-16 rows and every ring depth, then the times at 1 and 16 rows."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(n, k, generator=g, device="cuda") * k**-0.5).to(torch.bfloat16)
    bias = torch.randn(n, generator=g, device="cuda").to(torch.bfloat16) if name == "odd" else None
    x = torch.randn(256, k, generator=g, device="cuda").to(torch.bfloat16)
    s = invariant_gemm.split(n, k)
    full = invariant_gemm.gemm(x, w, bias, tile=(64, 128, 8, 4, 4, s))  # the prefill tiles, one program a tile
    rec: dict = {"name": name, "n": n, "k": k, "slices": s, "bits": {}, "us": {}}
    for m in (1, 2, 3, 8):
        for st in invariant_gemv.STAGES:
            if invariant_gemv.stages_for(s, k, st) != st:
                continue
            same = torch.equal(cuda_gemv(x[:m], w, bias, s, st), full[:m])
            same_pdl = torch.equal(cuda_gemv(x[:m], w, bias, s, st, pdl=True), full[:m])
            rec["bits"][f"m{m}/st{st}"] = same and same_pdl
            if not (same and same_pdl):
                diff = (cuda_gemv(x[:m], w, bias, s, st).float() - full[:m].float()).abs()
                bad.append((name, m, st, int((diff > 0).sum()), float(diff.max())))
        rec["bits"][f"m{m}/triton"] = torch.equal(invariant_gemm.gemm(x[:m], w, bias), full[:m])
    mb = n * k * 2 / 1e6
    cfg = triton_ops.gemv_config(w)
    for m in (1, 8):
        cells = {"triton": time_us(lambda m=m: invariant_gemm.gemm(x[:m], w, bias)),
                 "cublas": time_us(lambda m=m: F.linear(x[:m], w, bias))}
        if m == 1 and bias is None and cfg is not None and triton_ops.gemv_rows_ok(cfg, k, 1):
            cells["off_fma"] = time_us(lambda: triton_ops.gemv(x[:1], w, *cfg))
        for st in invariant_gemv.STAGES:
            if invariant_gemv.stages_for(s, k, st) == st:
                cells[f"cuda{st}"] = time_us(lambda m=m, st=st: cuda_gemv(x[:m], w, bias, s, st))
        rec["us"][f"m{m}"] = cells
        print(f"{name} N={n} K={k} s={s} M={m}: " + ", ".join(
            f"{c} {t:.1f} us ({mb / t:.2f} TB/s)" for c, t in cells.items()), flush=True)
    print(f"{name} bits: {rec['bits']}", flush=True)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    assert invariant_gemv.library(invariant_gemv.arch(torch.device("cuda"))) is not None, "no build"
    rows_out, bad = [], []
    for name, (n, k) in SHAPES.items():
        rows_out.append(probe_shape(name, n, k, bad))
    print("BITS DIFFER:" if bad else "all bits equal", bad, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"shapes": rows_out, "bad": bad,
                                              "device": torch.cuda.get_device_name()}, indent=1))


if __name__ == "__main__":
    main()
