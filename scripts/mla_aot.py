"""Compile the MLA decode split kernel (engine/layers/mla_kernels.py) for a GPU target on a machine
without one (triton's nvidia backend and its bundled ptxas): per tile config, the shared memory
triton asks for (against mla_kernels' estimate and the target's limit), whether the latent copies
are pipelined (the cp.async wait's pending groups: 0 = the next tile is waited for before any of
its math overlaps), and ptxas' registers and spills.

    .venv/bin/python scripts/mla_aot.py                     # the bench's sweep configs, V3 shapes
    .venv/bin/python scripts/mla_aot.py --r 32 --p 8 --dtype fp32 --config 16 32 4 3
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from engine.layers import mla_kernels as mk  # noqa: E402

PTR = {"bf16": "*bf16", "fp32": "*fp32", "fp8": "*bf16"}  # q's dtype (fp8: a bf16 model, e4m3 pool)


def compile_split(cfg: mk.MLAKernelConfig, v: int, r: int, p: int, dtype: str, page: int, arch: int) -> object:
    """The split kernel as mla_decode launches it (16-byte aligned pointers and strides, as the
    runtime's specialization sees them), compiled for sm_{arch}."""
    fn = mk._mla_split_kernel
    q = PTR[dtype]
    sig = {"q": q, "q_pe": q, "kv": "*u8" if dtype == "fp8" else q, "table": "*i32", "table_rows": "*i32",
           "lens": "*i32", "part_o": q, "part_lse": "*fp32", "sm_scale": "fp32", "stride_qb": "i32", "stride_qh": "i32",
           "stride_pb": "i32", "stride_ph": "i32", "stride_kv": "i32", "stride_tb": "i32", "H": "i32"}
    lo = cfg.min_split or mk.min_split(cfg.block_h)
    cx = dict(R=r, P=p, RB=mk.padded(r), PB=mk.padded(p), PAGE=page, MIN_SPLIT=lo, SPLITS=mk.MAX_SPLITS,
              BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, KV_FP8=dtype == "fp8", DOT_F32=False,
              IEEE=dtype == "fp32", VSPLIT=v, HAS_ROWS=False)
    sig |= dict.fromkeys(cx, "constexpr")
    aligned = ["q", "q_pe", "kv", "table", "lens", "part_o", "part_lse"]
    aligned += [n for n, d in (("stride_qb", r), ("stride_qh", r), ("stride_pb", p), ("stride_ph", p),
                               ("stride_kv", r + p)) if d % 16 == 0]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton.compile(ASTSource(fn, sig, cx, attrs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


def ptxas_stats(ptx: str, arch: int) -> str:
    """ptxas -v's registers and spills (the bundled ptxas that takes triton's PTX version)."""
    bins = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    suffix = "a" if arch == 90 else ""
    for exe in ("ptxas-blackwell", "ptxas"):
        with tempfile.TemporaryDirectory() as d:
            src = Path(d) / "k.ptx"
            src.write_text(ptx)
            cmd = [str(bins / exe), f"-arch=sm_{arch}{suffix}", "-v", str(src), "-o", str(Path(d) / "k.o")]
            res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode == 0:
            regs = re.search(r"Used (\d+) registers", res.stderr)
            spill = re.search(r"(\d+) bytes spill stores", res.stderr)
            return f"{regs.group(1) if regs else '?':>4} regs {spill.group(1) if spill else '?':>4} B spilled"
    return "ptxas failed"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=int, nargs=4, action="append", metavar=("BLOCK_H", "BLOCK_N", "WARPS", "STAGES"),
                    help="a tile config (repeatable; default: bin/bench mla --sweep's)")
    ap.add_argument("--v-split", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--r", type=int, default=512, help="kv_lora_rank")
    ap.add_argument("--p", type=int, default=64, help="rope dims")
    ap.add_argument("--dtype", choices=sorted(PTR), default="bf16", help="q's dtype (fp8: bf16 q, e4m3 pool)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args()
    from engine.bench.mla import sweep_configs

    configs = [tuple(c) for c in args.config] if args.config else sweep_configs()
    print(f"sm_{args.arch}, R {args.r} + P {args.p}, {args.dtype}; limit {mk.HOPPER_SHARED} B (Hopper)")
    for c in configs:
        cfg = mk.MLAKernelConfig(*c)
        for v in args.v_split:
            if mk.padded(args.r) % v:
                continue
            est = cfg.shared_bytes(args.r, args.p, 4 if args.dtype == "fp32" else 2, v_split=v)
            k = compile_split(cfg, v, args.r, args.p, args.dtype, args.page_size, args.arch)
            waits = re.findall(r"async_wait .*\{num = (\d+)", k.asm["ttgir"])
            fits = "fits" if k.metadata.shared <= mk.HOPPER_SHARED else "TOO BIG"
            print(f"{str(c):16} v{v}: shared {k.metadata.shared:>7} (estimate {est:>7}) {fits:7} "
                  f"pending at the wait {waits[0] if waits else '-':>2}  {ptxas_stats(k.asm['ptx'], args.arch)}",
                  flush=True)


if __name__ == "__main__":
    main()
