"""DeepGEMM's block-FP8 GEMM against cuBLASLt's at DeepSeek-V3 shapes (issue 23), on CUDA.

    python3 scripts/deepgemm_probe.py --tokens 4096 --out deepgemm.json

Per shape [N, K] and token count M, the median time replayed in a CUDA graph of:
- `cublas`: the served block path (`quant_ops.fp8_block_cublas`: group quant + cuBLASLt 1x128/128x128);
- `cublas_mm`: cuBLASLt alone on inputs quantized before;
- `deep_gemm`: our group quant + DeepGEMM's `fp8_gemm_nt` (SM90 1d2d kernel, float32 scales);
- `deep_gemm_mm`: DeepGEMM alone, its scale layouts made before;
- `quant`: the group quant alone (16-row tiles, scales column-major as the GEMMs read them), and
  `quant_1row`: the kernel it replaced (a program per row and group, row-major scales);
with TFLOPS and the relative error against float32 (q * s) @ dequantized(W)^T (`err`) and against
x @ dequantized(W)^T (`err_x`: the activation's quantization included). DeepGEMM JIT-compiles a
kernel per shape on first use: that time is recorded too. The FP8 roofline is cuBLASLt's rate at 8192^3
measured in the same run, next to the data sheet's 1,979 TFLOPS.

`sgl-deep-gemm`'s wheels are built against torch 2.14, whose headers changed three symbols since the GPU
machine's torch 2.11, and it calls two of torch 2.13's stable-ABI functions: `--shim` compiles a small
library that provides them from torch 2.11's own (an empty error-log capture class, the old CUDA check,
`const_data_ptr<float>`; the error texts as NULL, torch's own fallback) before the import.
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



def load_shim(tmp: Path) -> str:
    """Compile and load (RTLD_GLOBAL) the torch-2.11 shim; returns what happened."""
    lib = Path(torch.__file__).parent / "lib"
    src, so = Path(__file__).with_name("deepgemm_shim.c"), tmp / "libdg_shim.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", str(src), "-o", str(so), f"-L{lib}", "-lc10_cuda",
                    "-ltorch_cpu", f"-Wl,-rpath,{lib}"], check=True)
    for name in ("libnvrtc.so.13", "libcublasLt.so.13", "libcublas.so.13", "libcudart.so.13"):
        for d in Path(torch.__file__).parents[1].glob("nvidia/**/lib"):
            if (d / name).exists():
                ctypes.CDLL(str(d / name), mode=ctypes.RTLD_GLOBAL)
                break
    ctypes.CDLL(str(so), mode=ctypes.RTLD_GLOBAL)
    return f"shim {so}"


@functools.cache
def _one_row_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def one_row(x, xq, xs, K, G, stride_x, GROUP: tl.constexpr):
        r, g = tl.program_id(0), tl.program_id(1)
        cols = g * GROUP + tl.arange(0, GROUP)
        v = tl.load(x + r * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        sc = tl.maximum(tl.max(tl.abs(v), 0), 1e-12) / 448.0
        tl.store(xq + r * K + cols, tl.clamp(v / sc, -448.0, 448.0).to(xq.dtype.element_ty), mask=cols < K)
        tl.store(xs + r * G + g, sc)

    return one_row


def quant_1row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The group quant before this probe: one program (one warp) per row and 128 columns."""
    m, k = x.shape
    g = -(-k // 128)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, g, dtype=torch.float32, device=x.device)
    _one_row_kernel()[(m, g)](x, q, s, k, g, x.stride(0), GROUP=128, num_warps=1)
    return q, s


def bench(fn: Any, rep: int = 60) -> float:
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")) / 1e3


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm().clamp(min=1e-30))


def shape_row(dg: Any, n: int, k: int, m: int) -> dict[str, Any]:
    import torch.nn.functional as F

    from engine.layers import quant, quant_ops
    from engine.layers.parallel import Linear

    dev = torch.device("cuda")
    torch.manual_seed(0)
    lin = Linear(k, n, False, torch.bfloat16).to(dev)
    lin.weight.data.normal_(0, 0.02)
    quant.quantize(lin, "fp8_block")
    w, ws = lin.weight, lin.weight_scale
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    q, s = quant_ops.group_quant(x, mn_major=True)
    wd = quant.dequantize(lin).float()
    ref = (q.float().view(m, -1, 128) * s.unsqueeze(2)).view(m, k) @ wd.t()
    ref_x = x.float() @ wd.t()
    out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    kb = ws.shape[1]
    ws4 = F.pad(ws, (0, -kb % 4)) if kb % 4 else ws
    s_cm = s
    runs: dict[str, Any] = {
        "quant": lambda: quant_ops.group_quant(x, mn_major=True),
        "quant_1row": lambda: quant_1row(x),
        "cublas": lambda: quant_ops.fp8_block_cublas(x, w, ws),
        "cublas_mm": lambda: F.scaled_mm(q, w.t(), s_cm, F.ScalingType.BlockWise1x128, ws4.t(),
                                         F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16),
    }
    row: dict[str, Any] = {"n": n, "k": k, "m": m, "kernels": {}}
    if dg is not None:
        def dg_full() -> torch.Tensor:
            qq, ss = quant_ops.group_quant(x, mn_major=True)
            dg.fp8_gemm_nt((qq, ss), (w, sfb), out)
            return out

        t0 = time.perf_counter()
        try:
            sfb = dg.transform_sf_into_required_layout(ws, n, k, (1, 128, 128), is_sfa=False)
            row["sfb"] = [list(sfb.shape), list(sfb.stride()), sfb.data_ptr() == ws.data_ptr()]
            dg_full()
            torch.cuda.synchronize()
            row["deep_gemm_first_call_s"] = time.perf_counter() - t0
            runs["deep_gemm"] = dg_full
            sfa = dg.transform_sf_into_required_layout(s, m, k, (1, 128, 128), is_sfa=True)
            row["sfa"] = [list(sfa.shape), list(sfa.stride()), sfa.data_ptr() == s.data_ptr()]

            def dg_mm() -> torch.Tensor:
                dg.fp8_gemm_nt((q, sfa), (w, sfb), out)
                return out

            runs["deep_gemm_mm"] = dg_mm
        except Exception as e:  # noqa: BLE001 - recorded: the probe's point is whether it runs
            row["kernels"]["deep_gemm"] = {"error": f"{type(e).__name__}: {e}"[:400]}
    for name, fn in runs.items():
        try:
            y = fn()
            torch.cuda.synchronize()
            t = bench(fn)
            e = {"us": t * 1e6}
            if not name.startswith("quant"):
                e |= {"tflops": 2 * m * n * k / t / 1e12, "err": rel_err(y, ref), "err_x": rel_err(y, ref_x)}
            row["kernels"][name] = e
        except Exception as e:  # noqa: BLE001
            row["kernels"][name] = {"error": f"{type(e).__name__}: {e}"[:400]}
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[4096])
    p.add_argument("--shim", action="store_true")
    p.add_argument("--names", nargs="+", help="only these DeepSeek-V3 projections (e.g. o 'dense gate_up')")
    p.add_argument("--out", default="deepgemm.json")
    args = p.parse_args()
    from tqdm import tqdm

    from engine.bench.quant import SHAPES, fp8_peak_tflops

    info: dict[str, Any] = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                            "commit": os.environ.get("STRATA_GIT_COMMIT", "")}
    dg = None
    try:
        if args.shim:
            info["shim"] = load_shim(Path("/tmp"))
        import deep_gemm as dg

        info["deep_gemm"] = getattr(dg, "__version__", "?")
    except Exception as e:  # noqa: BLE001 - recorded, with the loader's own message
        info["deep_gemm_error"] = f"{type(e).__name__}: {e}"[:600]
        try:
            ctypes.CDLL(str(Path(sys.modules.get("deep_gemm.cuda_helpers", torch).__file__).parent / "_C.so"))
        except OSError as dl:
            info["dlerror"] = str(dl)[:600]
    info["fp8_peak_tflops_measured"] = fp8_peak_tflops()
    info["rows"] = rows = []
    shapes = [sh for sh in SHAPES["deepseek-v3"] if not args.names or sh[0] in args.names]
    for name, n, k in tqdm(shapes, desc="shapes"):
        for m in args.tokens:
            r = shape_row(dg, n, k, m)
            r["name"] = name
            rows.append(r)
            ks = "  ".join(f"{kn} {v['us']:.0f}us {v.get('tflops', 0):.0f}T e{v.get('err', -1):.4f}" if "us" in v
                           else f"{kn} ERR {v['error'][:120]}" for kn, v in r["kernels"].items())
            print(f"{name:16s} m={m:5d} first={r.get('deep_gemm_first_call_s', -1):.1f}s  {ks}", flush=True)
            Path(args.out).write_text(json.dumps(info, indent=1))  # row by row: a cut run keeps what it measured
    Path(args.out).write_text(json.dumps(info, indent=1))
    print(json.dumps({k: v for k, v in info.items() if k != "rows"}))


if __name__ == "__main__":
    main()
