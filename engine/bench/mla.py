"""`bin/bench mla`: MLA decode attention (engine/layers/mla_kernels.py) at DeepSeek-V3's shapes.

Per (heads, latent dtype, batch, context): the median time of one layer's decode attention
(q_lat [B, H, 512] + q_pe [B, H, 64] against B rows of `context` latents of 576, read through
shuffled page tables), replayed in a CUDA graph over as many layers' pools as make the working
set >= 1 GiB (up to V3's 61 layers), so that the L2 cache does not serve small points; the bytes
it must read and write (latent pages + q + out), the achieved HBM bandwidth against the copy
bandwidth measured in the same run, and its tensor rate (2 x B x H x L x (576 + 512) flops)
against the H200's dense bf16 peak (128 heads are compute bound: 242 flops a latent byte, above
the H200's ridge of ~206). Heads 16 is one rank of V3 at tp 8 (memory bound).

flashinfer's BatchMLAPagedAttentionWrapper is timed beside it where it imports (its output is
checked against ours: `fi_diff`), for the choice of the default. Also printed: the KV pool's
capacity in tokens per GiB, V3's latent (bf16, fp8) against GQA models of configs/.

`--sweep`: the split kernel's tile configs and split lengths (min_split 256 / 1024 against the
default 512) at two points (batch 1 and 64, context 4096, 128 heads, bf16). `--device cpu` runs
tiny points through triton's interpreter (a smoke test of this module, not a measurement).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

R, P = 512, 64  # DeepSeek-V3's kv_lora_rank and rope dims
H200_BF16_PEAK_TFLOPS = 989.0  # dense, data sheet
WORKING_SET = 1 << 30  # bytes of latents a timed replay reads (layers rotate)
CAPACITY_MODELS = ("deepseek-v3", "deepseek-v3-5l", "llama-3.1-8b", "qwen3-0.6b", "qwen3-30b-a3b", "llama-3.1-70b")
# block_h, block_n, warps, stages: the defaults (engine/layers/mla_kernels.py: (64, 32, 8, 3) at
# >= 64 heads, (16, 32, 4, 3) below), the first run's num_stages=2 defaults (no load/math overlap),
# and deeper or wider pipelines; sweep_configs() keeps those that fit Hopper's shared memory at
# v_split 1 (a larger v_split is halved until it fits: mla_kernels.fitting_v_split)
_CANDIDATES = [(64, 32, 8, 3), (64, 32, 8, 2), (64, 16, 8, 4), (64, 16, 8, 3), (32, 32, 8, 3), (16, 32, 4, 3),
               (16, 32, 4, 2), (16, 64, 4, 3), (64, 64, 8, 3)]
REPO = Path(__file__).resolve().parents[2]


def sweep_configs() -> list[tuple[int, int, int, int]]:
    """The tile configs `--sweep` times (and tests/gpu compiles): those of _CANDIDATES that fit
    Hopper's shared memory at v_split 1 (imports triton: not at this module's import, which the
    CLI does)."""
    from engine.layers.mla_kernels import HOPPER_SHARED, MLAKernelConfig

    return [c for c in _CANDIDATES if MLAKernelConfig(*c).shared_bytes(R, P, v_split=1) <= HOPPER_SHARED]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 128], help="decode rows")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768], help="tokens a row attends")
    p.add_argument("--heads", type=int, nargs="+", default=[128, 16], help="query heads (128: V3 at tp 1)")
    p.add_argument("--kv-dtypes", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"], help="latent pool")
    p.add_argument("--page-size", type=int, default=16, help="KV page size (the server's default)")
    p.add_argument("--rep-ms", type=int, default=60, help="do_bench_cudagraph repetition time per point")
    p.add_argument("--no-flashinfer", action="store_true", help="time our kernel only")
    p.add_argument("--sweep", action="store_true", help="also time the split kernel's tile configs")
    p.add_argument("--flashmla", action="store_true", help="also time FlashMLA (sgl-flash-mla) at 64-token pages")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: interpreter smoke run")


def check(args: argparse.Namespace) -> str | None:
    sizes = [*args.batch_sizes, *args.contexts, *args.heads, args.page_size, args.rep_ms]
    if min(sizes) < 1:
        return "--batch-sizes, --contexts, --heads, --page-size and --rep-ms must be >= 1"
    if args.page_size & (args.page_size - 1):
        return "--page-size must be a power of 2"
    return None


def capacity() -> list[dict[str, Any]]:
    """KV bytes a token costs (all layers) and tokens per GiB, per model of configs/, bf16 and fp8."""
    from engine.run.memory import kv_bytes_per_token, weight_bytes
    from models.config import ModelConfig

    rows = []
    for name in CAPACITY_MODELS:
        path = REPO / "configs" / name
        if not (path / "config.json").exists():
            continue
        mcfg = ModelConfig.from_dir(path)
        per = {k: kv_bytes_per_token(mcfg, d) for k, d in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn))}
        rows.append({"model": name, "layers": mcfg.num_layers, "layout": "mla" if mcfg.mla else "gqa",
                     "bytes_per_token": per, "tokens_per_gib": {k: (1 << 30) // v for k, v in per.items()},
                     "weight_gib_bf16": weight_bytes(mcfg, torch.bfloat16) / 2**30})
    return rows


def _time(fn: Any, rep_ms: int, device: torch.device) -> float:
    """Median seconds of fn: replayed in a CUDA graph on CUDA, wall time of a few calls on CPU."""
    if device.type == "cuda":
        import triton.testing

        # do_bench_cudagraph runs fn on a stream of its own, which does not wait for the default
        # stream: without this, the first calls read a point's page table, lengths and pools while
        # the default stream may still be writing them (garbage page indices: the first H200 run's
        # illegal memory access at batch 8, the first point that did not compile a kernel first)
        torch.cuda.synchronize()
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")) / 1e3
    fn()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class _Point:
    """One (heads, dtype, batch, context) setup: `layers` pools of the same shape, one page table."""

    def __init__(self, heads: int, kv_dtype: torch.dtype, batch: int, ctx: int, page_size: int,
                 device: torch.device) -> None:
        self.heads, self.batch, self.ctx, self.ps, self.kv_dtype = heads, batch, ctx, page_size, kv_dtype
        per_row = -(-ctx // page_size)
        self.pages = batch * per_row + 1
        layer_bytes = self.pages * page_size * (R + P) * kv_dtype.itemsize
        self.layers = max(1, min(61, math.ceil(WORKING_SET / layer_bytes))) if device.type == "cuda" else 1
        g = torch.Generator(device=device).manual_seed(batch * 7 + ctx)
        self.pool = torch.empty(self.layers, self.pages * page_size, 1, R + P, dtype=kv_dtype, device=device)
        for layer in self.pool:  # bf16 normals, cast per layer (no float32 copy of the whole pool)
            layer.copy_(torch.randn(layer.shape, generator=g, device=device, dtype=torch.bfloat16))
        perm = torch.randperm(self.pages - 1, generator=g, device=device)[: batch * per_row] + 1
        self.table = perm.to(torch.int32).view(batch, per_row)  # shuffled: non-contiguous pages
        self.lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        self.q_lat = torch.randn(batch, heads, R, generator=g, device=device, dtype=torch.bfloat16)
        self.q_pe = torch.randn(batch, heads, P, generator=g, device=device, dtype=torch.bfloat16)
        self.scale = 192**-0.5
        self.fi_layout = ""  # flashinfer's caches: strided views of our pool, or contiguous copies

    def ours(self, config: Any = None) -> Any:
        from engine.layers import mla_kernels

        cfg = config or mla_kernels.default_config(self.heads)

        def run() -> torch.Tensor:
            out = None
            for layer in self.pool:
                out = mla_kernels.mla_decode(self.q_lat, self.q_pe, layer, self.table, self.lens, self.scale,
                                             self.ps, cfg)
            return out

        return run

    def error(self, out: torch.Tensor) -> float:
        """Relative max error of `out` (ours on the last layer) at rows 0 and B-1 against a float32
        softmax over their latents gathered through the page table: a wrong kernel is not timed."""
        lat, errs = self.pool[-1], []
        raw = lat.view(torch.uint8) if lat.element_size() == 1 else lat  # fp8 gathered as bytes
        pos = torch.arange(self.ctx, device=lat.device)
        for i in sorted({0, self.batch - 1}):
            kv = raw[self.table[i, pos // self.ps].long() * self.ps + pos % self.ps, 0].view(lat.dtype).float()
            q = torch.cat([self.q_lat[i], self.q_pe[i]], -1).float()
            want = (q @ kv.T * self.scale).softmax(-1) @ kv[:, :R]
            errs.append(float((out[i].float() - want).abs().max() / want.abs().max()))
        return max(errs)

    def flashinfer(self) -> Any:
        import flashinfer.mla

        dev = self.pool.device
        ws = torch.empty(128 << 20, dtype=torch.int8, device=dev)
        w = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend="auto")
        per_row = self.table.shape[1]
        w.plan(torch.arange(self.batch + 1, dtype=torch.int32, device=dev),
               torch.arange(self.batch + 1, dtype=torch.int32, device=dev) * per_row,
               self.table.reshape(-1), self.lens, self.heads, R, P, self.ps, False, self.scale,
               torch.bfloat16, self.kv_dtype)
        # ckv / kpe as strided views of our [pages, page, 576] pool; where the wrapper refuses them,
        # contiguous copies (what serving it would need: two pools) and `layout` says so
        caches = [(v[..., :R], v[..., R:]) for v in (layer.view(self.pages, self.ps, R + P) for layer in self.pool)]
        self.fi_layout = "views"
        try:
            w.run(self.q_lat, self.q_pe, *caches[0])
        except Exception:  # noqa: BLE001 - retried below on contiguous copies
            caches = [(c.contiguous(), k.contiguous()) for c, k in caches]
            self.fi_layout = "copies"

        def run() -> torch.Tensor:
            out = None
            for ckv, kpe in caches:
                out = w.run(self.q_lat, self.q_pe, ckv, kpe)
            return out

        return run

    def flashmla(self) -> Any:
        """FlashMLA as served (engine/layers/flash_mla.py: its split schedule once, outside the
        graph, from the lengths; then a run a layer); 64-token pages only."""
        from engine.layers.flash_mla import PAGE, FlashMLA

        if self.ps != PAGE:
            raise ValueError(f"FlashMLA takes {PAGE}-token pages, the point has {self.ps}")
        fm = FlashMLA(self.heads)
        meta = fm.schedule(self.lens)

        def run() -> torch.Tensor:
            out = None
            for layer in self.pool:
                out = fm.run(self.q_lat, self.q_pe, layer, self.table, self.lens, meta, self.scale)
            return out

        return run

    def figures(self, seconds: float) -> dict[str, Any]:
        b, h, n = self.batch, self.heads, self.ctx
        read = b * n * (R + P) * self.kv_dtype.itemsize + b * h * (R + P) * 2 + self.table.numel() * 4
        written = b * h * R * 2
        return {"us": seconds * 1e6, "bytes": read + written, "gbs": (read + written) / seconds / 1e9,
                "tflops": 2 * b * h * n * (R + P + R) / seconds / 1e12}


def _point(heads: int, kvd: str, b: int, ctx: int, args: argparse.Namespace, device: torch.device,
           copy_gbs: float, with_flashinfer: bool) -> dict[str, Any]:
    dtype = torch.bfloat16 if kvd == "bf16" else torch.float8_e4m3fn
    pt = _Point(heads, dtype, b, ctx, args.page_size, device)
    ours = pt.ours()
    row: dict[str, Any] = {"heads": heads, "kv": kvd, "batch": b, "context": ctx, "layers": pt.layers}
    row["ours"] = pt.figures(_time(ours, args.rep_ms, device) / pt.layers)
    row["ours"]["hbm_frac"] = row["ours"]["gbs"] / copy_gbs
    row["ours"]["peak_frac"] = row["ours"]["tflops"] / H200_BF16_PEAK_TFLOPS
    row["ours"]["err"] = pt.error(ours())  # bf16 q, probabilities and output: ~1e-2 at most
    if with_flashinfer:
        try:
            fi = pt.flashinfer()
            ref = ours().float()
            row["fi_diff"] = float((fi().float() - ref).abs().max() / ref.abs().max())
            row["flashinfer"] = pt.figures(_time(fi, args.rep_ms, device) / pt.layers)
            row["flashinfer"]["hbm_frac"] = row["flashinfer"]["gbs"] / copy_gbs
            row["flashinfer"]["layout"] = pt.fi_layout
        except Exception as e:  # noqa: BLE001 - recorded: our kernel's figures stand without it
            row["flashinfer"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    del pt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _flashmla_point(heads: int, b: int, ctx: int, args: argparse.Namespace, device: torch.device,
                    copy_gbs: float) -> dict[str, Any]:
    """FlashMLA (bf16 latents, 64-token pages) against ours on the same 64-token-page point."""
    pt = _Point(heads, torch.bfloat16, b, ctx, 64, device)
    row: dict[str, Any] = {"heads": heads, "kv": "bf16", "batch": b, "context": ctx, "layers": pt.layers}
    ours = pt.ours()
    row["ours"] = pt.figures(_time(ours, args.rep_ms, device) / pt.layers)
    row["ours"]["hbm_frac"] = row["ours"]["gbs"] / copy_gbs
    row["ours"]["peak_frac"] = row["ours"]["tflops"] / H200_BF16_PEAK_TFLOPS
    row["ours"]["err"] = pt.error(ours())
    try:
        fm = pt.flashmla()
        ref = ours().float()
        row["fi_diff"] = float((fm().float() - ref).abs().max() / ref.abs().max())
        row["flashinfer"] = pt.figures(_time(fm, args.rep_ms, device) / pt.layers)  # the column beside ours
        row["flashinfer"]["hbm_frac"] = row["flashinfer"]["gbs"] / copy_gbs
        row["flashinfer"]["layout"] = "flashmla p64"
    except Exception as e:  # noqa: BLE001 - recorded: the package may not load on this machine
        row["flashinfer"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    del pt
    torch.cuda.empty_cache()
    return row


def sweep(args: argparse.Namespace, device: torch.device) -> dict[str, dict[str, float]]:
    """The split kernel's tile configs, and the default tile with shorter and longer splits, at
    batch 1 and 64, context 4096, 128 heads, bf16: us each."""
    from dataclasses import replace

    from engine.layers.mla_kernels import MLAKernelConfig, default_config

    out: dict[str, dict[str, float]] = {}
    wide = default_config(128)
    configs = [MLAKernelConfig(*c) for c in sweep_configs()] + [replace(wide, min_split=m) for m in (256, 1024)]
    for b in (1, 64):
        pt = _Point(128, torch.bfloat16, b, 4096, args.page_size, device)
        res: dict[str, Any] = {}
        for cfg in configs:
            name = f"h{cfg.block_h} n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} m{cfg.min_split or 'auto'}"
            try:
                res[name] = _time(pt.ours(cfg), args.rep_ms, device) / pt.layers * 1e6
            except Exception as e:  # noqa: BLE001 - a config that does not compile (shared memory) is skipped
                res[name] = f"{type(e).__name__}"[:80]
        out[f"batch {b} ctx 4096"] = res
        del pt
    return out


def main(args: argparse.Namespace) -> dict[str, Any]:
    from engine.bench import report
    from engine.bench.hardware import hardware_info
    from engine.bench.roofline import copy_bandwidth, copy_size

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bin/bench mla: needs a CUDA device (or --device cpu for an interpreter smoke run)")
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    copy_gbs = copy_bandwidth(device, copy_size(device, None)) / 1e9
    figures: dict[str, Any] = {"copy_gbs": copy_gbs, "bf16_peak_tflops_datasheet": H200_BF16_PEAK_TFLOPS,
                               "capacity": capacity(), "points": []}
    _print_capacity(figures["capacity"])
    print(f"copy bandwidth {copy_gbs:.0f} GB/s (this run)")
    record = lambda: report.make_record(  # noqa: E731
        "mla", "deepseek-v3-mla-decode", vars(args) | {"out": None}, hardware_info(), figures)
    print(_HEADER)
    points = [(h, k, b, c) for h in args.heads for k in args.kv_dtypes for b in args.batch_sizes for c in args.contexts]
    for h, k, b, c in points:  # ours first: a slow flashinfer JIT below does not hold these back
        figures["points"].append(_point(h, k, b, c, args, device, copy_gbs, with_flashinfer=False))
        print(_line(figures["points"][-1]), flush=True)
    if args.sweep and device.type == "cuda":
        report.write_record(record(), args.out)  # the points kept should the sweep run past a time limit
        figures["sweep"] = sweep(args, device)
        for where, res in figures["sweep"].items():
            ok = sorted((t, c) for c, t in res.items() if isinstance(t, float))
            print(f"sweep {where}: " + "  ".join(f"{c} {t:.1f}us" for t, c in ok), flush=True)
    report.write_record(record(), args.out)
    if not args.no_flashinfer and device.type == "cuda":  # bf16 pools only (one JIT module), first heads
        print(f"flashinfer BatchMLAPagedAttentionWrapper beside ours ({args.heads[0]} heads, bf16 latent pool):")
        print(_HEADER)
        figures["flashinfer_points"] = []
        for h, k, b, c in (p for p in points if p[1] == "bf16" and p[0] == args.heads[0]):
            figures["flashinfer_points"].append(_point(h, k, b, c, args, device, copy_gbs, with_flashinfer=True))
            print(_line(figures["flashinfer_points"][-1]), flush=True)
        report.write_record(record(), args.out)
    if args.flashmla and device.type == "cuda":  # bf16, 64-token pages (FlashMLA's only page size)
        print("FlashMLA (sgl-flash-mla, dense SM90 decode) beside ours, bf16 latents, 64-token pages:")
        print(_HEADER)
        figures["flashmla_points"] = []
        for h, b, c in ((h, b, c) for h in args.heads for b in args.batch_sizes for c in args.contexts):
            figures["flashmla_points"].append(_flashmla_point(h, b, c, args, device, copy_gbs))
            print(_line(figures["flashmla_points"][-1]), flush=True)
        report.write_record(record(), args.out)
    return figures


_HEADER = (f"{'heads':>5} {'kv':>4} {'batch':>5} {'ctx':>6} {'layers':>6} | {'ours us':>9} {'GB/s':>6} "
           f"{'%HBM':>5} {'TFLOPS':>6} {'%peak':>5} {'err':>6} | {'flashinfer us':>13} {'GB/s':>6} {'diff':>7}")


def _line(r: dict[str, Any]) -> str:
    o = r["ours"]
    s = (f"{r['heads']:>5} {r['kv']:>4} {r['batch']:>5} {r['context']:>6} {r['layers']:>6} | {o['us']:>9.1f} "
         f"{o['gbs']:>6.0f} {100 * o['hbm_frac']:>5.1f} {o['tflops']:>6.0f} {100 * o['peak_frac']:>5.1f} "
         f"{o['err']:>6.4f} |")
    fi = r.get("flashinfer")
    if fi is None:
        return s
    if "error" in fi:
        return s + f" {fi['error'][:60]}"
    return s + f" {fi['us']:>13.1f} {fi['gbs']:>6.0f} {r['fi_diff']:>7.4f} {fi['layout']}"


def _print_capacity(rows: list[dict[str, Any]]) -> None:
    print("KV pool capacity (all layers): model, layout, bytes a token (bf16 / fp8), tokens per GiB, weights GiB bf16")
    for r in rows:
        b, t = r["bytes_per_token"], r["tokens_per_gib"]
        print(f"  {r['model']:16} {r['layout']:3} {r['layers']:>3} layers  {b['bf16']:>7} / {b['fp8']:>7} B  "
              f"{t['bf16']:>7} / {t['fp8']:>7} tok/GiB  {r['weight_gib_bf16']:>7.1f} GiB")
