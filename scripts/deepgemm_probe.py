"""Does DeepGEMM load and compute right on this CUDA machine (issue 23)?

    python3 scripts/deepgemm_probe.py --shim --tokens 4096 1024 --out deepgemm.json

Records `deep_gemm`'s version or why it does not load (the import's error and the dynamic loader's own
message), then per DeepSeek-V3 shape and token count the first call of the served launcher
(`quant_ops.fp8_block_deepgemm`: DeepGEMM JIT-compiles a kernel per tile choice on first use, the
warm-up's cost) and its relative error against float32 (q * s) @ dequantized(W)^T on the same codes.
It also times the served launcher and cuBLASLt's (quant included, CUDA events, median of 30 calls: a
quick look; `bin/bench quant` replays CUDA graphs, and scripts/gpu_bench.sh deepgemm runs both).

`sgl-deep-gemm`'s wheels are built against torch 2.14, and the GPU machine has torch 2.11: `--shim`
compiles scripts/deepgemm_shim.c, which provides the eight symbols 2.11 lacks from its own, and loads it
(RTLD_GLOBAL) before the import. Its kernels then register under the dispatch key whose number is
CUDA's in 2.14 (the enum moved between the versions: 2.11 lists them under another backend and refuses
CUDA tensors); `remap_dispatch` finds which key holds them, by a small product checked against the
float32 one, and routes `deep_gemm`'s GEMM there (`redispatch`). `bin/bench quant` runs the same way:

    LD_PRELOAD=/tmp/libdg_shim.so python3 scripts/deepgemm_probe.py --bench --shapes deepseek-v3 ...
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHIM_SO = Path("/tmp/libdg_shim.so")  # gpu_bench.sh preloads it for the GPU tests and the bench


def load_shim() -> None:
    """Compile the torch-2.11 shim and load it, with the CUDA 13 libraries the wheel links, globally."""
    lib = Path(torch.__file__).parent / "lib"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", str(Path(__file__).with_name("deepgemm_shim.c")), "-o",
                    str(SHIM_SO), f"-L{lib}", "-lc10_cuda", "-ltorch_cpu", f"-Wl,-rpath,{lib}"], check=True)
    for name in ("libnvrtc.so.13", "libcublasLt.so.13", "libcublas.so.13", "libcudart.so.13"):
        for d in Path(torch.__file__).parents[1].glob("nvidia/**/lib"):
            if (d / name).exists():
                ctypes.CDLL(str(d / name), mode=ctypes.RTLD_GLOBAL)
                break
    ctypes.CDLL(str(SHIM_SO), mode=ctypes.RTLD_GLOBAL)


def remap_dispatch() -> str:
    """Route deep_gemm's fp8 GEMM to the dispatch key its kernel sits under on this torch (see the module
    docstring); returns that key's name ("CUDA" where nothing moved) or raises with the dispatcher's table."""
    import deep_gemm

    op = torch.ops.deep_gemm.fp8_fp4_gemm_nt.default
    table = torch._C._dispatch_dump("deep_gemm::fp8_fp4_gemm_nt")
    keys = [line.split(":")[0] for line in table.splitlines() if ": registered at" in line]
    m, n, k = 128, 256, 512
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") * 0.05).to(torch.float8_e4m3fn)
    from engine.layers import quant_ops

    q, s = quant_ops.group_quant(x, mn_major=True)
    ws = torch.ones(n // 128, k // 128, device="cuda")
    ref = (q.float() * s.repeat_interleave(128, 1)) @ w.float().t()
    tried: list[str] = []
    for key in ["CUDA"] + [k for k in keys if k != "CUDA" and hasattr(torch._C.DispatchKey, k)]:
        call = op if key == "CUDA" else functools.partial(op.redispatch,
                                                         torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key)))
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        try:
            call(q, s, w, ws, out, None, None, None, None, "", False, None, *deep_gemm._encode_epilogue(None))
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - the next key
            tried.append(f"{key}: {type(e).__name__}: {e}"[:300])
            continue
        err = float((out.float() - ref).norm() / ref.norm())
        if err < 0.02:
            deep_gemm._C.fp8_fp4_gemm_nt = call
            return key
        tried.append(f"{key}: relative error {err:.3g}")
    raise RuntimeError("deep_gemm's GEMM runs under no dispatch key: " + "; ".join(tried) + f"\n{table}")


def first_call(n: int, k: int, m: int) -> dict[str, Any]:
    """The served launcher's first call at [m, k] x [n, k]^T (its JIT compile), and its error."""
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
    """Median us of `fn` (activation quant included, as served) over `reps` calls, each timed by events."""
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
    p.add_argument("--shim", action="store_true")
    p.add_argument("--out", default="deepgemm.json")
    p.add_argument("--bench", action="store_true", help="then run bin/bench quant with the other arguments")
    args, rest = p.parse_known_args()
    if args.bench:  # the shim is preloaded (LD_PRELOAD)
        import runpy

        print("deep_gemm under dispatch key", remap_dispatch(), flush=True)
        sys.argv = ["engine.bench", "quant", *rest]
        runpy.run_module("engine.bench", run_name="__main__")
        return
    from engine.bench.quant import SHAPES
    from engine.layers import quant_ops

    info: dict[str, Any] = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                            "commit": os.environ.get("STRATA_GIT_COMMIT", ""), "rows": []}
    if args.shim:
        load_shim()
    try:
        import deep_gemm

        info["deep_gemm"] = getattr(deep_gemm, "__version__", "?")
        if args.shim:  # the wheel's TORCH_LIBRARY ops (a source build is a pybind module: nothing to route)
            try:
                info["dispatch_key"] = remap_dispatch()
            except RuntimeError as e:
                info["dispatch_error"] = str(e)[:2000]
    except Exception as e:  # noqa: BLE001 - recorded, with the loader's own message
        info["deep_gemm_error"] = f"{type(e).__name__}: {e}"[:600]
        try:
            ctypes.CDLL(str(Path(sys.modules["deep_gemm.cuda_helpers"].__file__).parent / "_C.so"))
        except (KeyError, OSError) as dl:
            info["dlerror"] = str(dl)[:600]
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
