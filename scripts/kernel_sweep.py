"""Batch-1 decode kernels as the served step runs them (device diagnostic, not in CI)

    python3 scripts/kernel_sweep.py [attention] [gemv] [moe] > sweep.log

Each measurement replays a CUDA graph of the kernel over `copies` distinct weights (or KV
caches), launched back to back with programmatic dependent launch as in the decode graphs, so
that nothing is read from the L2 that the served step would read from HBM (the layers' weights
are read once a step); the figure is the median over replays of the graph's time / copies.

* gemv: the triton GEMV (engine/layers/triton_kernels.gemv_kernel) at Llama-3.1-8B's projections,
  fp8 (per-row scales) and bf16, over (block_n, block_k, warps, stages). (ba2f4c9's run also timed a
  variant reducing each tile to its rows at once: slower except fp8 qkv, removed; 87933ea's a GEMV on
  the tensor cores, weight rows as the dot's M side, bf16-widened or with per-tile e4m3 activations:
  1.8-2.9x slower at one row, removed; docs/PERF.md.)
* attention: triton_ops.decode_attention with its prologue, batch 1, ctx 1024, at the geometry of
  Llama-3.1-8B, Qwen3-30B-A3B and Qwen3-0.6B, over (splits, block_n, warps). (ba2f4c9's run also
  timed a merge of 8 splits at a time instead of all at once: slower everywhere, removed.)
* moe: Qwen3-30B-A3B's fused experts at one token over 16 layers' stacks, per GEMM block config,
  and the one-token GEMV path (engine/layers/moe_gemv.py) per config; `gemv_best` is the fastest.
* a3b: Qwen3-30B-A3B's batch-1 attention projections (o; qkv with the norm folded in) over GEMV configs.
* gemm: Llama-3.1-8B's fp8 row-scaled projections at decode batches of 128 and 256 (the offline
  benchmark's): the served path (per-token quantization + cuBLASLt), cuBLASLt alone on quantized
  x, and the triton row-scaled GEMM (quant_ops.fp8_row_mm) over tile configs (cuBLASLt's 128 x 128
  tiles leave half the SMs idle on o and down at 256 rows: 64 tiles); the tuning file's
  fp8_row_triton rules come from it.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any

import torch
import triton.testing

from engine.layers import quant_ops, triton_ops


def graph_us(calls: list[Callable[[], Any]], rep_ms: int = 40) -> float:
    """Median us per call of a CUDA graph running `calls` in order (triton's do_bench_cudagraph)."""
    return triton.testing.do_bench_cudagraph(lambda: [c() for c in calls], rep=rep_ms, return_mode="median") \
        * 1e3 / len(calls)


def copies_for(nbytes: int, budget: int = 512 << 20) -> int:
    return max(4, min(64, budget // nbytes))


def gemv_shape(dtype: str, name: str, n: int, k: int) -> dict[str, float | str]:
    dev = torch.device("cuda")
    isz = 1 if dtype == "fp8" else 2
    c = copies_for(n * k * isz)
    wdt = torch.float8_e4m3fn if dtype == "fp8" else torch.bfloat16
    ws = [(torch.randn(n, k, device=dev) * 0.02).to(wdt) for _ in range(c)]
    scale = torch.rand(n, device=dev) + 0.5 if dtype == "fp8" else None
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    cur = triton_ops.gemv_config(ws[0])
    res: dict[str, float | str] = {"current": str(cur)}
    grid = [(bn, bk, wp, st) for bn in (4, 8, 16) for bk in (1024, 2048, 4096) for wp, st in ((4, 3), (8, 3))]
    for cfg in grid if dtype == "fp8" else [cur]:
        if k % cfg[1] or cfg[0] * cfg[1] * isz > 64 << 10:
            continue
        key = f"plain {cfg}"
        try:
            res[key] = round(graph_us([functools.partial(triton_ops.gemv, x, w, *cfg, scale=scale) for w in ws]), 2)
        except Exception as e:  # noqa: BLE001 - a config that fails is a result
            res[key] = f"{type(e).__name__}: {e}"[:160]
    best = sorted((v, kk) for kk, v in res.items() if isinstance(v, float))
    gb = n * k * isz / 1e3
    print(f"gemv {dtype} {name} [{n}, {k}] x{c} current {cur}: best "
          + "  ".join(f"{kk} {v:.1f}us ({gb / v:.0f} GB/s)" for v, kk in best[:4]), flush=True)
    if isinstance(res.get(f"plain {cur}"), float):
        print(f"     current {res[f'plain {cur}']:.1f}us ({gb / res[f'plain {cur}']:.0f} GB/s)", flush=True)
    return res


def gemv_sweep() -> dict[str, Any]:
    shapes = [("qkv", 6144, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
    return {f"{dt} {name}": gemv_shape(dt, name, n, k) for dt in ("fp8", "bf16") for name, n, k in shapes}


def a3b_sweep(layers: int = 32) -> dict[str, Any]:
    """Qwen3-30B-A3B's batch-1 attention projections, bf16, over the GEMV configs: o (2048 x 4096,
    the looped GEMV) and qkv with the residual add and RMSNorm folded in (5120 x 2048,
    triton_ops.add_norm_gemv), each over `layers` distinct weights."""
    dev = torch.device("cuda")
    out: dict[str, Any] = {}
    for name, n, k in (("o", 2048, 4096), ("qkv+norm", 5120, 2048)):
        ws = [(torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16) for _ in range(layers)]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        r = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        nw = torch.rand(k, device=dev, dtype=torch.bfloat16) + 0.5
        cur = triton_ops.gemv_config(ws[0])
        res: dict[str, float | str] = {"current": str(cur)}
        grid = [(bn, bk, wp, st) for bn in (2, 4, 8, 16) for bk in (512, 1024, 2048, 4096)
                for wp, st in ((4, 3), (4, 4), (8, 3))]
        for cfg in dict.fromkeys([tuple(cur), *grid]):
            if k % cfg[1] and not (cfg[1] >= k) or cfg[0] * min(cfg[1], k) * 2 > 64 << 10:
                continue
            if name == "o":
                calls = [functools.partial(triton_ops.gemv, x, w, *cfg) for w in ws]
            else:
                calls = [functools.partial(triton_ops.add_norm_gemv, x, r, nw, 1e-6, w, *cfg) for w in ws]
            try:
                res[str(cfg)] = round(graph_us(calls), 2)
            except Exception as e:  # noqa: BLE001 - a config that fails is a result
                res[str(cfg)] = f"{type(e).__name__}: {e}"[:160]
        best = sorted((v, kk) for kk, v in res.items() if isinstance(v, float))
        gb = n * k * 2 / 1e3
        print(f"a3b {name} [{n}, {k}] x{layers} current {cur} {res.get(str(cur))}us: best "
              + "  ".join(f"{kk} {v:.2f}us ({gb / v:.0f} GB/s)" for v, kk in best[:5]), flush=True)
        out[name] = res
    return out


def attention_sweep() -> dict[str, Any]:
    geoms = [("llama-3.1-8b", 32, 8, False), ("qwen3-30b-a3b", 32, 4, True), ("qwen3-0.6b", 16, 8, True)]
    dev = torch.device("cuda")
    d, ps, ctx, layers = 128, 16, 1024, 32
    sm = torch.cuda.get_device_properties(dev).multi_processor_count
    out: dict[str, Any] = {}
    for name, hq, hkv, norm in geoms:
        pages = ctx // ps + 1
        caches = [(torch.randn(pages * ps, hkv, d, device=dev, dtype=torch.bfloat16),
                   torch.randn(pages * ps, hkv, d, device=dev, dtype=torch.bfloat16)) for _ in range(layers)]
        table = torch.arange(pages, device=dev, dtype=torch.int32)[None]
        pos = torch.tensor([ctx - 1], device=dev)
        x = torch.randn(1, (hq + 2 * hkv) * d, device=dev, dtype=torch.bfloat16)
        cs = torch.randn(4096, d, device=dev)
        nw = (torch.rand(d, device=dev) + 0.5).to(torch.bfloat16) if norm else None
        ws = triton_ops.decode_workspace(1, hkv, d, sm, dev)
        res: dict[str, float | str] = {"current_splits": triton_ops.decode_splits(1, hkv, sm)}
        for splits, bn, warps in [(s, bn, wp) for s in (8, 16, 32) for bn in (32, 64) for wp in (4, 8)]:
            key = f"splits {splits} block_n {bn} warps {warps}"
            try:
                res[key] = round(graph_us([functools.partial(
                    triton_ops.decode_attention, x, hq, hkv, d, pos, table, kc, vc, ps, ws, splits, cs, nw, nw,
                    1e-6, bn, warps, parts=triton_ops.decode_parts(1, hq, hkv, splits, sm)) for kc, vc in caches]), 2)
            except Exception as e:  # noqa: BLE001
                res[key] = f"{type(e).__name__}: {e}"[:160]
        best = sorted((v, kk) for kk, v in res.items() if isinstance(v, float))
        cur = res.get(f"splits {res['current_splits']} block_n 64 warps 4")
        print(f"attention {name} b1 ctx {ctx}: current {cur}us; best " +
              "  ".join(f"[{kk}] {v:.2f}us" for v, kk in best[:5]), flush=True)
        out[name] = res
    return out


def moe_sweep(layers: int = 16) -> dict[str, Any]:
    """Qwen3-30B-A3B's routed experts at one token: `layers` distinct stacks (a layer's 8 experts
    read from HBM, as served), fused_experts (align, w13, w2, combine) per GEMM config."""
    from engine.layers import moe_kernels as mk

    h, e, k, inter = 2048, 128, 8, 768
    dev = torch.device("cuda")
    stacks = [(mk.Stack(torch.randn(e, 2 * inter, h, device=dev, dtype=torch.bfloat16) * 0.02, None, None),
               mk.Stack(torch.randn(e, h, inter, device=dev, dtype=torch.bfloat16) * 0.02, None, None))
              for _ in range(layers)]
    counts = torch.zeros(e, dtype=torch.int64, device=dev)
    x = torch.randn(1, h, device=dev, dtype=torch.bfloat16)
    routes = [torch.randn(1, e, device=dev).softmax(-1).topk(k, dim=-1) for _ in range(layers)]
    default = mk.config_for(dev, k, e)
    grid = [default]  # ba2f4c9's run swept 24 more block configs: none beat it by more than 1% (PERF.md)
    res: dict[str, Any] = {"current": str(tuple(default))}
    layer_mb = k * 3 * h * inter * 2 / 1e6
    for cfg in dict.fromkeys(grid):
        try:
            res[str(tuple(cfg))] = round(graph_us([functools.partial(
                mk.fused_experts, x, w, ids, w13, w2, counts, 0, cfg) for (w13, w2), (w, ids) in
                zip(stacks, routes, strict=True)]), 2)
        except Exception as e:  # noqa: BLE001
            res[str(tuple(cfg))] = f"{type(e).__name__}: {e}"[:160]
    from engine.layers.moe_gemv import GemvConfig, one_token_experts

    w13s = ((2, 2048), (4, 2048), (4, 1024), (8, 1024), (8, 512))
    w2s = ((2, 1024), (4, 1024), (8, 1024), (4, 256), (8, 256), (16, 256))
    gemv = {f"gemv {(*a, *b, wp)}": GemvConfig(*a, *b, wp) for a in w13s for b in w2s for wp in (4, 8)}
    for key, g in gemv.items():
        try:
            res[key] = round(graph_us([functools.partial(one_token_experts, x, w, ids, w13, w2, counts, 0, g)
                                       for (w13, w2), (w, ids) in zip(stacks, routes, strict=True)]), 2)
        except Exception as e:  # noqa: BLE001
            res[key] = f"{type(e).__name__}: {e}"[:160]
    timed = sorted((v, kk) for kk, v in res.items() if kk in gemv and isinstance(v, float))
    if timed:
        res["gemv_best"] = list(gemv[timed[0][1]])
        print("moe one-token gemv best " + "  ".join(f"{kk} {v:.1f}us ({layer_mb * 1e3 / v:.0f} GB/s)"
                                                     for v, kk in timed[:6]), flush=True)
    best = sorted((v, kk) for kk, v in res.items() if isinstance(v, float) and not kk.startswith("gemv"))
    cur = res.get(str(tuple(default)))
    print(f"moe qwen3-30b-a3b 1 token ({layer_mb:.1f} MB of experts a layer): current {tuple(default)} {cur}us"
          f" ({layer_mb * 1e3 / cur if isinstance(cur, float) else 0:.0f} GB/s); best "
          + "  ".join(f"{kk} {v:.1f}us ({layer_mb * 1e3 / v:.0f} GB/s)" for v, kk in best[:5]), flush=True)
    return res


def gemm_sweep() -> dict[str, Any]:
    dev = torch.device("cuda")
    shapes = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
    cfgs = [(64, 128, 128, 4, 4), (64, 128, 128, 4, 5), (64, 256, 128, 8, 4), (128, 64, 128, 4, 4),
            (128, 128, 128, 8, 4), (128, 128, 128, 4, 4), (64, 64, 128, 4, 5), (128, 256, 128, 8, 3)]
    out: dict[str, Any] = {}
    for name, n, k in shapes:
        c = max(2, min(8, (512 << 20) // (n * k)))
        ws = [(torch.randn(n, k, device=dev) * 0.02).to(torch.float8_e4m3fn) for _ in range(c)]
        scale = torch.rand(n, device=dev) * 0.01 + 0.005
        for m in (128, 256):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            q, qs = quant_ops.per_token_quant(x)
            ref = (q.float() * qs.view(-1, 1)) @ (ws[0].float() * scale[:, None]).T
            res: dict[str, float | str] = {
                "served (quant + cuBLASLt)": round(graph_us([functools.partial(quant_ops.fp8_row_gemm, x, w, scale)
                                                              for w in ws]), 2),
                "quant alone": round(graph_us([functools.partial(quant_ops.per_token_quant, x)] * c), 2),
                "cuBLASLt alone": round(graph_us([functools.partial(
                    torch._scaled_mm, q, w.t(), scale_a=qs, scale_b=scale.view(1, -1), out_dtype=torch.bfloat16)
                    for w in ws]), 2),
            }
            for cfg in cfgs:
                try:
                    y = quant_ops.fp8_row_mm(q, qs, ws[0], scale, torch.bfloat16, cfg)
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    t = graph_us([functools.partial(quant_ops.fp8_row_mm, q, qs, w, scale, torch.bfloat16, cfg)
                                  for w in ws])
                    res[f"triton {cfg}"] = round(t, 2)
                    res[f"triton {cfg} err"] = f"{err:.1e}"
                except Exception as e:  # noqa: BLE001
                    res[f"triton {cfg}"] = f"{type(e).__name__}: {e}"[:160]
            best = sorted((v, kk) for kk, v in res.items() if kk.startswith("triton") and isinstance(v, float))
            tf = 2 * m * n * k / 1e6
            print(f"gemm fp8 {name} [{n}, {k}] x {m} rows: served {res['served (quant + cuBLASLt)']}us, quant "
                  f"{res['quant alone']}us, cuBLASLt {res['cuBLASLt alone']}us "
                  f"({tf / res['cuBLASLt alone']:.0f} TFLOPS); triton best " + "  ".join(
                      f"{kk} {v}us ({tf / v:.0f} TFLOPS, err {res[kk + ' err']})" for v, kk in best[:3]), flush=True)
            out[f"{name} x{m}"] = res
    return out


def main() -> None:
    what = sys.argv[1:] or ["gemv", "attention", "moe"]
    figures: dict[str, Any] = {}
    if "attention" in what:
        figures["attention"] = attention_sweep()
    if "gemv" in what:
        figures["gemv"] = gemv_sweep()
    if "moe" in what:
        figures["moe"] = moe_sweep()
    if "gemm" in what:
        figures["gemm"] = gemm_sweep()
    if "a3b" in what:
        figures["a3b"] = a3b_sweep()
    print("JSON " + json.dumps(figures))


if __name__ == "__main__":
    main()
