"""`bin/bench quant`: the quantized projections' GEMMs against bf16, at real shapes, on CUDA.

Per shape [N, K] and token count M, each kernel's median time (replayed in a CUDA graph), its
TFLOPS and weight GB/s, and its error against bf16 on the same inputs
(`err_bf16`: relative Frobenius error of the output against F.linear with the unquantized bf16
weight, which includes the quantization; `err_kernel`: against float32 x @ dequantized W^T, the
kernel alone), and its first call's time (`first_call_ms`: with its compile or JIT where this is
the kernel's first shape, the warm-up's cost). Rooflines measured in the same run: the copy
bandwidth, and the FP8 tensor rate of cuBLASLt at 8192^3 (next to the H200's 1979 TFLOPS data-sheet
peak). The record says whether `deep_gemm` imported, or why not.

Kernels: bf16 (cuBLAS), fp8_row (per-token quant + torch._scaled_mm), fp8_gemv (the weight-only
triton GEMV, M <= 4), fp8_block (the block-scaled triton GEMM), deep_gemm (quant_ops.fp8_block_deepgemm
where `deep_gemm` imports: on the GPU machine scripts/build_deepgemm.sh's build), nvfp4.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.nn.functional as F

SHAPES = {  # name -> [(projection, N, K)]
    "llama-3.1-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
    "deepseek-v3": [("q_a+kv_a", 2112, 7168), ("q_b", 24576, 1536), ("kv_b", 32768, 512), ("o", 7168, 16384),
                    ("dense gate_up", 36864, 7168), ("dense down", 7168, 18432), ("expert gate_up", 4096, 7168),
                    ("expert down", 7168, 2048)],
}
TOKENS = {"llama-3.1-8b": [1, 4, 16, 64, 256, 1024, 4096], "deepseek-v3": [1, 16, 32, 64, 256, 1024, 4096]}
H200_FP8_PEAK_TFLOPS = 1979.0  # dense, data sheet


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), help="shape sets to run")
    p.add_argument("--rep-ms", type=int, default=40, help="do_bench repetition time per measurement")
    p.add_argument("--tokens", type=int, nargs="+", help="row counts (default: each shape set's own)")
    p.add_argument("--sweep", action="store_true", help="also sweep kernel configs at the Llama-3.1-8B shapes")


def _bench(fn: Any, rep: int) -> float:
    """Median seconds of one call replayed in a CUDA graph, as the served decode runs it: no
    Python or launch overhead (plain do_bench timed the host's launches at small M: a
    torch._scaled_mm call measured 70-100 us at any M up to 1024). The L2 is not flushed
    between replays: weights under its 50 MB read partly from it."""
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")) / 1e3


def _err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm().clamp(min=1e-30))


def _shape_rows(n: int, k: int, ms: list[int], rep: int) -> list[dict[str, Any]]:
    from engine.layers import quant, quant_ops, triton_ops
    from engine.layers.parallel import Linear

    dev = torch.device("cuda")
    torch.manual_seed(0)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    layers = {}
    for fmt in ("fp8_row", "fp8_block", "nvfp4"):
        lin = Linear(k, n, False, torch.bfloat16).to(dev)
        lin.weight.data.copy_(w)
        quant.quantize(lin, fmt)
        layers[fmt] = lin
    deq = {fmt: quant.dequantize(lin) for fmt, lin in layers.items()}
    gemv = triton_ops.gemv_config(layers["fp8_row"].weight)
    dg = quant_ops.deep_gemm()
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref_bf16 = F.linear(x, w).float()
        row: dict[str, Any] = {"n": n, "k": k, "m": m, "kernels": {}}
        runs = _runs(x, w, layers, gemv, dg)
        for name, (fn, fmt) in runs.items():
            try:
                t0 = time.perf_counter()
                y = fn()
                torch.cuda.synchronize()
                first = time.perf_counter() - t0  # with its compile / JIT where this is the kernel's first shape
                t = _bench(fn, rep)
            except Exception as e:  # noqa: BLE001 - one kernel's failure is a recorded result
                row["kernels"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
                continue
            wbytes = n * k * (2 if fmt is None else 1 if fmt.startswith("fp8") else 0.5625)
            entry = {"ms": t * 1e3, "tflops": 2 * m * n * k / t / 1e12, "weight_gbs": wbytes / t / 1e9,
                     "err_bf16": _err(y, ref_bf16), "first_call_ms": first * 1e3}
            if fmt is not None:
                entry["err_kernel"] = _err(y, x.float() @ deq[fmt].t())
            row["kernels"][name] = entry
        rows.append(row)
    return rows


def _runs(x: torch.Tensor, w: torch.Tensor, layers: dict[str, Any], gemv: tuple | None,
          dg: Any) -> dict[str, tuple[Any, str | None]]:
    """kernel name -> (a call computing x W^T, the weight format it reads or None for bf16)."""
    from engine.layers import quant_ops, triton_ops

    row, blk, fp4 = layers["fp8_row"], layers["fp8_block"], layers["nvfp4"]
    runs = {
        "bf16": (lambda: F.linear(x, w), None),
        "fp8_row": (lambda: quant_ops.fp8_row_gemm(x, row.weight, row.weight_scale), "fp8_row"),
        "fp8_block": (lambda: quant_ops.fp8_block_gemm(x, blk.weight, blk.weight_scale), "fp8_block"),
        "nvfp4": (lambda: quant_ops.nvfp4_gemm(x, fp4.weight, fp4.weight_scale, fp4.weight_scale_2), "nvfp4"),
    }
    if gemv is not None and triton_ops.gemv_rows_ok(gemv, x.shape[1], x.shape[0]):
        runs["fp8_gemv"] = (lambda: quant_ops.gemv_fp8(x, row.weight, row.weight_scale, *gemv), "fp8_row")
        wide = (gemv[0], gemv[1] * 2, *gemv[2:])  # the bf16 rule's bytes per load: twice the fp8 elements
        if x.shape[0] == 1 and x.shape[1] % wide[1] == 0:
            runs["fp8_gemv_k2"] = (lambda: quant_ops.gemv_fp8(x, row.weight, row.weight_scale, *wide), "fp8_row")
    m = x.shape[0]
    if m <= 256:
        runs["fp8_wo_row"] = (lambda: quant_ops.fp8_weight_only_gemm(x, row.weight, row.weight_scale), "fp8_row")
        runs["fp8_wo_block"] = (lambda: quant_ops.fp8_weight_only_gemm(x, blk.weight, blk.weight_scale), "fp8_block")
    runs["served_row"] = (lambda: row(x), "fp8_row")  # Linear.forward: the tuning file's choice
    runs["served_block"] = (lambda: blk(x), "fp8_block")
    runs["cublas_block"] = (lambda: quant_ops.fp8_block_cublas(x, blk.weight, blk.weight_scale), "fp8_block")
    if dg is not None:
        runs["deep_gemm"] = (lambda: quant_ops.fp8_block_deepgemm(x, blk.weight, blk.weight_scale), "fp8_block")
    return runs


def sweep(n: int, k: int, rep: int) -> dict[str, Any]:
    """Config sweeps at one shape: the fp8 GEMV at M = 1, the weight-only GEMM at M = 16 and 64,
    the block-scaled GEMM at M = 4096 (each config's median us; errors recorded)."""
    from engine.layers import quant, quant_ops
    from engine.layers.parallel import Linear

    dev = torch.device("cuda")
    lins = {}
    for fmt in ("fp8_row", "fp8_block"):
        lin = Linear(k, n, False, torch.bfloat16).to(dev)
        lin.weight.data.normal_(0, 0.02)
        quant.quantize(lin, fmt)
        lins[fmt] = lin
    row, blk = lins["fp8_row"], lins["fp8_block"]
    out: dict[str, Any] = {"gemv_m1": {}, "weight_only": {}, "block_m4096": {}}
    x1 = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    for bn in (4, 8, 16, 32):
        for bk in (256, 512, 1024, 2048):
            for warps, stages in ((4, 3), (4, 4), (8, 3)):
                if k % bk:
                    continue
                cfg = (bn, bk, warps, stages)
                out["gemv_m1"][str(cfg)] = _time(lambda c=cfg: quant_ops.gemv_fp8(x1, row.weight, row.weight_scale, *c),
                                                 rep)
    for m in (16, 64):
        xm = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        for bn in (32, 64, 128):
            for stages in (3, 4, 5):
                for name, lin in (("row", row), ("block", blk)):
                    out["weight_only"][f"m{m} {name} bn{bn} s{stages}"] = _time(
                        lambda b=bn, st=stages, lin=lin, xm=xm: quant_ops.fp8_weight_only_gemm(
                            xm, lin.weight, lin.weight_scale, b, st), rep)
    xl = torch.randn(4096, k, device=dev, dtype=torch.bfloat16)
    for cfg in ((64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3), (128, 128, 4, 3), (128, 64, 4, 4)):
        out["block_m4096"][str(cfg)] = _time(
            lambda c=cfg: quant_ops.fp8_block_gemm(xl, blk.weight, blk.weight_scale, c), rep)
    return out


def _time(fn: Any, rep: int) -> float | str:
    try:
        return _bench(fn, rep) * 1e6
    except Exception as e:  # noqa: BLE001 - a config that does not compile or run is recorded
        return f"{type(e).__name__}: {e}"[:200]


def fp8_peak_tflops() -> float:
    """cuBLASLt's FP8 rate at 8192^3 with per-tensor scales (the best case), TFLOPS."""
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    t = _bench(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), 100)
    return 2 * n**3 / t / 1e12


def main(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from engine.bench import report
    from engine.bench.hardware import hardware_info
    from engine.bench.roofline import copy_bandwidth

    if not torch.cuda.is_available():
        raise SystemExit("bin/bench quant: needs a CUDA device")
    figures: dict[str, Any] = {"copy_gbs": copy_bandwidth(torch.device("cuda"), 1 << 30) / 1e9,
                               "fp8_peak_tflops_measured": fp8_peak_tflops(),
                               "fp8_peak_tflops_datasheet": H200_FP8_PEAK_TFLOPS, "deep_gemm": _deep_gemm_status(),
                               "shapes": {}}
    jobs = [(s, name, n, k) for s in args.shapes for name, n, k in SHAPES[s]]
    for s, name, n, k in tqdm(jobs, desc="quantized GEMMs", unit="shape"):
        figures["shapes"][f"{s} {name}"] = _shape_rows(n, k, args.tokens or TOKENS[s], args.rep_ms)
    if args.sweep:
        figures["sweep"] = {name: sweep(n, k, args.rep_ms) for name, n, k in tqdm(SHAPES["llama-3.1-8b"], desc="sweep")}
        figures["sweep"]["deepseek-v3 dense gate_up"] = sweep(36864, 7168, args.rep_ms)
    _print(figures)
    record = report.make_record("quant", "gemm-shapes", vars(args) | {"out": None}, hardware_info(), figures)
    report.write_record(record, args.out)
    return figures


def _deep_gemm_status() -> str:
    """`deep_gemm`'s version, or why it does not import here (quant_ops.deep_gemm() only says None)."""
    try:
        import deep_gemm
    except Exception as e:  # noqa: BLE001 - recorded: an optional package's failure is a result
        return f"not imported: {type(e).__name__}: {e}"[:600]
    return f"deep_gemm {getattr(deep_gemm, '__version__', '?')}"


def _print(fig: dict[str, Any]) -> None:
    print(f"copy {fig['copy_gbs']:.0f} GB/s; FP8 cuBLASLt 8192^3 {fig['fp8_peak_tflops_measured']:.0f} TFLOPS "
          f"(data sheet {fig['fp8_peak_tflops_datasheet']:.0f}); {fig['deep_gemm']}")
    print("per shape and M: kernel us/TFLOPS/err_bf16")
    for shape, rows in fig["shapes"].items():
        for r in rows:
            cells = [f"{n} {e['ms'] * 1e3:.1f}/{e['tflops']:.0f}/{e['err_bf16']:.3f}"
                     for n, e in r["kernels"].items() if "error" not in e]
            print(f"{shape:26} {r['m']:>5}  " + "  ".join(cells))
    failed = {n: e["error"] for rows in fig["shapes"].values() for r in rows for n, e in r["kernels"].items()
              if "error" in e}
    for name, error in failed.items():  # one line a kernel: its last failure
        print(f"failed: {name}: {error}")
    for shape, sw in fig.get("sweep", {}).items():
        for what, res in sw.items():
            ok = {c: t for c, t in res.items() if isinstance(t, float)}
            best = sorted(ok.items(), key=lambda kv: kv[1])[:4]
            print(f"sweep {shape:26} {what:12} best: " + "  ".join(f"{c} {t:.1f}us" for c, t in best))
