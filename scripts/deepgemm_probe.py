"""Does DeepGEMM load and compute right on this CUDA machine, and how fast (issue 23)?

    python3 scripts/deepgemm_probe.py --tokens 4096 1024 --out deepgemm.json

Records `deep_gemm`'s version or why it does not import, then per DeepSeek-V3 shape and token count the
first call of the served launcher (`quant_ops.fp8_block_deepgemm`: DeepGEMM JIT-compiles a kernel per tile
choice on first use, the warm-up's cost), its relative error against float32 (q * s) @ dequantized(W)^T on
the same codes, and its time beside cuBLASLt's block GEMM (activation quant included, as served; CUDA
events, median of 30 calls: a quick look; `bin/bench quant` replays CUDA graphs, and
scripts/gpu_bench.sh deepgemm runs both).

On the GPU machine `deep_gemm` is the build of scripts/build_deepgemm.sh (against its torch 2.11): the
`sgl-deep-gemm` wheels are built for torch 2.14, and with 2.11 they fail even where the symbols are
supplied (their kernels register under a dispatch key 2.11 numbers differently, and read tensor sizes
at 2.14's offsets: docs/PERF.md, fifty-second session).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def first_call(n: int, k: int, m: int) -> dict[str, Any]:
    """The served launcher's first call at [m, k] x [n, k]^T (its JIT compile), its error and time."""
    from engine.layers import quant, quant_ops
    from engine.layers.parallel import Linear

    torch.manual_seed(0)
    lin = Linear(k, n, False, torch.bfloat16).cuda()
    lin.weight.data.normal_(0, 0.02)
    quant.quantize(lin, "fp8_block")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    q, s = quant_ops.group_quant(x)
    ref = (q.float().view(m, -1, 128) * s[:, :, None]).view(m, k) @ quant.dequantize(lin).t()
    t0 = time.perf_counter()
    try:
        y = quant_ops.fp8_block_deepgemm(x, lin.weight, lin.weight_scale)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - recorded: the probe's point is whether it runs
        return {"error": f"{type(e).__name__}: {e}"[:400]}
    first_s = time.perf_counter() - t0
    dg_us = _median_us(lambda: quant_ops.fp8_block_deepgemm(x, lin.weight, lin.weight_scale))
    cublas_us = _median_us(lambda: quant_ops.fp8_block_cublas(x, lin.weight, lin.weight_scale))
    return {"first_call_s": first_s, "err": float((y.float() - ref).norm() / ref.norm().clamp(min=1e-30)),
            "us": dg_us, "cublas_us": cublas_us, "tflops": 2 * m * n * k / dg_us / 1e6,
            "cublas_tflops": 2 * m * n * k / cublas_us / 1e6}


def _median_us(fn: Any, reps: int = 30) -> float:
    """Median us of `fn` over `reps` calls, each timed by CUDA events."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[reps // 2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[4096])
    p.add_argument("--out", default="deepgemm.json")
    args = p.parse_args()
    from engine.bench.quant import SHAPES
    from engine.layers import quant_ops

    info: dict[str, Any] = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                            "commit": os.environ.get("STRATA_GIT_COMMIT", ""), "rows": []}
    try:
        import deep_gemm

        info["deep_gemm"] = getattr(deep_gemm, "__version__", "?")
    except Exception as e:  # noqa: BLE001 - recorded
        info["deep_gemm_error"] = f"{type(e).__name__}: {e}"[:600]
    if quant_ops.deep_gemm() is not None:
        for name, n, k in SHAPES["deepseek-v3"]:
            for m in args.tokens:
                row = {"name": name, "n": n, "k": k, "m": m, **first_call(n, k, m)}
                info["rows"].append(row)
                print(json.dumps(row), flush=True)
                Path(args.out).write_text(json.dumps(info, indent=1))  # row by row: a cut run keeps what it had
    Path(args.out).write_text(json.dumps(info, indent=1))
    print(json.dumps({k: v for k, v in info.items() if k != "rows"}))


if __name__ == "__main__":
    main()
