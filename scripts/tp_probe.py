"""Tensor-parallel probes on a multi-GPU CUDA machine (scripts/gpu_tp.sh runs them).

python3 scripts/tp_probe.py micro --out probe.json
    Two ranks (spawned, NCCL, one GPU each; NVLink multicast off). Per message size (8 KiB ..
    1 MiB of bf16, and fp32 at two sizes): the all-reduce through NCCL and through the engine's
    one-shot path (engine.layers.parallel.SymmAllReduce), each eager and inside a CUDA graph;
    correctness: the one-shot result equals NCCL's bytes and the float32 sum of both ranks'
    inputs to within one rounding, on both ranks. Then on rank 0: the triton GEMVs against
    F.linear (cuBLAS) on Llama-3.1-8B's shard shapes at tp 2 and its whole shapes at tp 1, each
    checked against F.linear and timed inside a CUDA graph.
python3 scripts/tp_probe.py summary DIR
    Reads DIR/tp-probe.json and DIR/tp-*.json (scripts/tp_bench.py reports) and prints the tables,
    with the all-reduce threshold the measurements suggest for the tuning file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

# NVLink multicast stays off in every process (it can take the host's GPUs out of service)
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(MULTICAST_OFF)

SIZES = [8 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20]
EAGER_ITERS, GRAPH_OPS, GRAPH_REPLAYS = 200, 32, 20

# Llama-3.1-8B projections as (name, N, K, silu_mul): tp=2 shards and tp=1 wholes
GEMV_SHAPES = [
    ("tp2 qkv", 3072, 4096, False), ("tp2 o_proj", 4096, 2048, False), ("tp2 gate_up", 14336, 4096, False),
    ("tp2 down (silu fold)", 4096, 7168, True), ("tp2 down", 4096, 7168, False),
    ("tp1 qkv", 6144, 4096, False), ("tp1 o_proj", 4096, 4096, False), ("tp1 gate_up", 28672, 4096, False),
    ("tp1 down (silu fold)", 4096, 14336, True),
]


def _time_eager(fn, iters: int) -> float:  # noqa: ANN001
    """us per call, launched back to back (what an eager step pays, host launch included)."""
    import torch

    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / iters


def _time_graph(fn, ops: int, replays: int) -> float:  # noqa: ANN001
    """us per call inside a CUDA graph of `ops` calls, over `replays` replays."""
    from engine.bench.roofline import graph_us

    return graph_us(fn, ops, replays)


def _two_shot(symm, x):  # noqa: ANN001, ANN202 - torch's two-shot all-reduce through the same buffer
    import torch

    buf = symm.bufs[x.dtype][: x.numel()]
    buf.copy_(x.view(-1))
    out = torch.empty_like(x)
    torch.ops.symm_mem.two_shot_all_reduce_out(buf, "sum", symm.group_name, out.view(-1))
    return out


def _one_shot_copy(symm, x):  # noqa: ANN001, ANN202 - torch's one-shot with the copy inside the kernel
    import torch

    out = torch.empty_like(x)
    torch.ops.symm_mem.one_shot_all_reduce_copy_out(symm.bufs[x.dtype][: x.numel()], x.view(-1), "sum",
                                                   symm.group_name, out.view(-1))
    return out


def _micro_rank(rank: int, world: int, port: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MULTICAST_OFF, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    from engine.layers.parallel import ParallelState, SymmAllReduce, TPGroup, set_parallel_state

    t = set_parallel_state(ParallelState(tp=TPGroup(rank, world, dist.group.WORLD))).tp
    report: dict = {"torch": torch.__version__, "gpus": [torch.cuda.get_device_name(i) for i in range(world)],
                    "nccl": str(torch.cuda.nccl.version()), "world": world, "allreduce": [],
                    "errors": []}
    try:
        t.symm = SymmAllReduce(dist.group.WORLD, max(SIZES), dev)
        report["symm_copy_op"] = hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")
    except Exception:  # noqa: BLE001 - NCCL rows are still measured
        report["errors"].append("SymmAllReduce set-up: " + traceback.format_exc()[-3000:])
    cases = [(n, torch.bfloat16) for n in SIZES] + [(32 << 10, torch.float32), (256 << 10, torch.float32)]
    for nbytes, dtype in cases:
        row: dict = {"bytes": nbytes, "dtype": str(dtype).removeprefix("torch.")}
        try:
            numel = nbytes // dtype.itemsize
            shape = (numel // 4096, 4096) if numel % 4096 == 0 else (numel,)
            g = torch.Generator(device=dev).manual_seed(1000 * rank + nbytes)
            x = torch.randn(shape, generator=g, device=dev).to(dtype)
            ref = x.clone()
            dist.all_reduce(ref)
            parts = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(parts, x)
            exact = sum(p.double() for p in parts)
            zeros = torch.zeros_like(x)  # NCCL timing in place on zeros: the values stay finite
            row["nccl_eager_us"] = _time_eager(lambda z=zeros: dist.all_reduce(z), EAGER_ITERS)
            dist.barrier()
            row["nccl_graph_us"] = _time_graph(lambda z=zeros: dist.all_reduce(z), GRAPH_OPS, GRAPH_REPLAYS)
            if t.symm is not None and t.symm.takes(x):
                before = x.clone()
                y = t.all_reduce(x)
                torch.cuda.synchronize()
                row["symm_equals_nccl"] = bool(torch.equal(y, ref))
                row["symm_max_abs_diff_vs_nccl"] = float((y.float() - ref.float()).abs().max())
                # one rounding of the exact sum: within half an ulp of the output dtype (plus slack)
                ulp = torch.finfo(dtype).eps * exact.abs().clamp_min(1e-30)
                row["symm_within_one_rounding"] = bool(((y.double() - exact).abs() <= ulp).all())
                row["input_untouched"] = bool(torch.equal(x, before))
                ys = [torch.empty_like(y) for _ in range(world)]
                dist.all_gather(ys, y)
                row["same_bytes_on_every_rank"] = all(torch.equal(ys[0], v) for v in ys[1:])
                dist.barrier()
                row["symm_eager_us"] = _time_eager(lambda v=x: t.all_reduce(v), EAGER_ITERS)
                dist.barrier()
                row["symm_graph_us"] = _time_graph(lambda v=x: t.all_reduce(v), GRAPH_OPS, GRAPH_REPLAYS)
                yg = t.all_reduce(x)  # after graph replays the eager path still gives the same bytes
                torch.cuda.synchronize()
                row["symm_equals_nccl_after_graph"] = bool(torch.equal(yg, ref))
                try:  # for comparison: torch's copy-in-kernel one-shot (one launch; not used, see SymmAllReduce)
                    dist.barrier()
                    yc = _one_shot_copy(t.symm, x)
                    torch.cuda.synchronize()
                    row["copyop_equals_nccl"] = bool(torch.equal(yc, ref))
                    dist.barrier()
                    row["copyop_graph_us"] = _time_graph(lambda v=x: _one_shot_copy(t.symm, v), GRAPH_OPS,
                                                         GRAPH_REPLAYS)
                except Exception:  # noqa: BLE001
                    row["copyop_error"] = traceback.format_exc()[-1500:]
                try:  # for comparison: torch's two-shot (reduce-scatter + all-gather over peer memory)
                    dist.barrier()
                    yt = _two_shot(t.symm, x)
                    torch.cuda.synchronize()
                    row["twoshot_equals_nccl"] = bool(torch.equal(yt, ref))
                    dist.barrier()
                    row["twoshot_graph_us"] = _time_graph(lambda v=x: _two_shot(t.symm, v), GRAPH_OPS, GRAPH_REPLAYS)
                except Exception:  # noqa: BLE001
                    row["twoshot_error"] = traceback.format_exc()[-1500:]
            else:
                row["symm"] = "not taken"
        except Exception:  # noqa: BLE001 - the next size still runs
            row["error"] = traceback.format_exc()[-2000:]
        dist.barrier()
        report["allreduce"].append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    dist.barrier()
    report["stress"] = _stress(t, dev, rank) if t.symm is not None else None
    if rank == 0:
        print(json.dumps({"stress": report["stress"]}), flush=True)
        report["gemv"] = _gemv_rows(dev)
        Path(out_path).write_text(json.dumps(report, indent=1))
    dist.barrier()
    from engine.run.dist import shutdown_distributed

    shutdown_distributed(0)  # bounded: destroy_process_group hung at exit here once (issue 11)


def _stress(t, dev, rank: int) -> dict:  # noqa: ANN001
    """Back-to-back all-reduces of changing data (a race shows as a wrong sum): 16 inputs per size,
    each reduced 50 times in a row on the engine's path (and torch's copy-in-kernel op), every
    result compared with NCCL's bytes; counts of mismatching results, summed over ranks."""
    import torch
    import torch.distributed as dist

    res: dict = {}
    for nbytes in (8 << 10, 64 << 10):
        n = nbytes // 2
        g = torch.Generator(device=dev).manual_seed(7 + rank + nbytes)
        xs = [torch.randn(n // 4096, 4096, generator=g, device=dev).to(torch.bfloat16) for _ in range(16)]
        refs = [x.clone() for x in xs]
        for r in refs:
            dist.all_reduce(r)
        for name, fn in (("engine", t.all_reduce), ("copyop", lambda v: _one_shot_copy(t.symm, v))):
            try:
                bad = torch.zeros((), dtype=torch.int64, device=dev)
                for _ in range(50):
                    for x, r in zip(xs, refs, strict=True):
                        bad += (~torch.eq(fn(x), r).all()).long()
                dist.all_reduce(bad)
                res[f"{name}_{nbytes}_bad_of_{2 * 16 * 50}"] = int(bad.item())
            except Exception:  # noqa: BLE001
                res[f"{name}_{nbytes}_error"] = traceback.format_exc()[-800:]
    return res


def _gemv_rows(dev) -> list[dict]:  # noqa: ANN001
    import torch
    import torch.nn.functional as F

    from engine.layers import ops, triton_ops

    rows = []
    for name, n, k, silu in GEMV_SHAPES:
        for m in (1, 4):
            row: dict = {"name": name, "n": n, "k": k, "rows": m}
            try:
                g = torch.Generator(device=dev).manual_seed(n + k)
                w = (torch.randn(n, k, generator=g, device=dev) * 0.02).to(torch.bfloat16)
                x = torch.randn(m, 2 * k if silu else k, generator=g, device=dev).to(torch.bfloat16)
                cfg = triton_ops.gemv_config(w)
                ok = cfg is not None and triton_ops.gemv_rows_ok(cfg, k, m)
                row["config"] = list(cfg) if ok else None

                def vendor(x=x, w=w, silu=silu):  # noqa: ANN202
                    return F.linear(ops.silu_and_mul(x) if silu else x, w)

                ref = vendor()
                row["cublas_graph_us"] = _time_graph(vendor, 50, 20)
                if ok:
                    def mine(x=x, w=w, cfg=cfg, silu=silu):  # noqa: ANN202
                        return triton_ops.gemv(x, w, *cfg, silu_mul=silu)

                    y = mine()
                    scale = ref.float().abs().max().item()
                    row["max_rel_err"] = float((y.float() - ref.float()).abs().max().item() / scale)
                    row["close"] = row["max_rel_err"] < 0.02
                    row["gemv_graph_us"] = _time_graph(mine, 50, 20)
                    row["speedup"] = row["cublas_graph_us"] / row["gemv_graph_us"]
            except Exception:  # noqa: BLE001
                row["error"] = traceback.format_exc()[-2000:]
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def micro(out: str, world: int) -> int:
    import torch.multiprocessing as mp

    from engine.supervise import free_port

    port = free_port()
    mp.start_processes(_micro_rank, args=(world, port, out), nprocs=world, start_method="spawn", join=True)
    return 0 if Path(out).is_file() else 1


# ---- summary ---------------------------------------------------------------------------------


def _f(v: object, fmt: str = "{:.2f}") -> str:
    return fmt.format(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else ("-" if v is None else str(v))


def suggest_threshold(rows: list[dict]) -> int:
    """The largest bf16 size up to which the one-shot path beat NCCL in a graph at every size
    (and was correct), 0 if it never did: the tuning file's tp_symm_allreduce_max_bytes."""
    best = 0
    for r in sorted((r for r in rows if r.get("dtype") == "bfloat16"), key=lambda r: r["bytes"]):
        good = (r.get("symm_equals_nccl") and r.get("same_bytes_on_every_rank") and r.get("symm_graph_us") is not None
                and r["symm_graph_us"] < r["nccl_graph_us"])
        if not good:
            break
        best = r["bytes"]
    return best


def summary(d: str) -> int:
    root = Path(d)
    probe = root / "tp-probe.json"
    if probe.is_file():
        p = json.loads(probe.read_text())
        print(f"== all-reduce, {p['world']} ranks ({', '.join(p['gpus'])}; torch {p['torch']}, NCCL {p['nccl']}, "
              f"one-shot copy op: {p.get('symm_copy_op')}), us per call")
        print(f"{'bytes':>8} {'dtype':>8} {'nccl eager':>10} {'nccl graph':>10} {'1shot eager':>11} {'1shot graph':>11}"
              f" {'=nccl':>6} {'ranks=':>6} {'1 rnd':>6} {'2shot graph':>11} {'copyop graph':>12}")
        for r in p["allreduce"]:
            print(f"{r['bytes']:>8} {r['dtype']:>8} {_f(r.get('nccl_eager_us')):>10} {_f(r.get('nccl_graph_us')):>10} "
                  f"{_f(r.get('symm_eager_us')):>11} {_f(r.get('symm_graph_us')):>11} "
                  f"{_f(r.get('symm_equals_nccl')):>6} {_f(r.get('same_bytes_on_every_rank')):>6} "
                  f"{_f(r.get('symm_within_one_rounding')):>6} {_f(r.get('twoshot_graph_us')):>11} "
                  f"{_f(r.get('copyop_graph_us')):>12}"
                  + ("  ERROR" if "error" in r else "")
                  + ("" if r.get("twoshot_equals_nccl", True) else " 2shot!=nccl")
                  + ("" if r.get("copyop_equals_nccl", True) else " copyop!=nccl"))
        print(f"stress (mismatching results over both ranks): {p.get('stress')}")
        for e in p.get("errors", []):
            print("  error:", e.strip().splitlines()[-1])
        print(f"suggested tp_symm_allreduce_max_bytes: {suggest_threshold(p['allreduce'])}")
        print("== GEMV (triton) vs cuBLAS, bf16, us per call in a CUDA graph")
        for r in p.get("gemv", []):
            print(f"{r['name']:>22} {r['n']:>6}x{r['k']:<6} rows {r['rows']} cfg {_f(r.get('config')):>18} "
                  f"cublas {_f(r.get('cublas_graph_us')):>7} gemv {_f(r.get('gemv_graph_us')):>7} "
                  f"x{_f(r.get('speedup'))} rel err {_f(r.get('max_rel_err'), '{:.1e}')}"
                  + ("  ERROR" if "error" in r else ""))
    else:
        print("== no tp-probe.json (the micro probe did not finish)")
    for f in sorted(root.glob("tp-*.json")):
        if f.name == "tp-probe.json":
            continue
        try:
            _bench_summary(f)
        except Exception:  # noqa: BLE001 - the other files still print
            print(f"== {f.name}: unreadable\n{traceback.format_exc()}")
    return 0


def _bench_summary(f: Path) -> None:
    rep = json.loads(f.read_text())
    print(f"== {f.name}: {rep['model']} layers {rep.get('layers') or 'all'} dtype {rep['dtype']} attention "
          f"{rep['attention_backend']} graphs {rep['cuda_graphs']} ctx {rep['context_len']} steps {rep['steps']} "
          f"(baseline {rep.get('baseline')})")
    for name, run in rep["runs"].items():
        if "error" in run:
            print(f"  {name:>24}: FAILED {run['error'].strip().splitlines()[-1] if run['error'].strip() else ''}")
            continue
        for b in rep["batch_sizes"]:
            st = run.get(f"b{b}", {})
            agree = st.get("agree_with_baseline") or []
            same = sum(a["same"] for a in agree)
            total = sum(a["of"] for a in agree)
            firsts = [a["first_divergence"] for a in agree]
            print(f"  {name:>24} batch {b:>2}: median {_f(st.get('median_ms'), '{:.3f}')} ms "
                  f"(p10 {_f(st.get('p10_ms'), '{:.3f}')}, p90 {_f(st.get('p90_ms'), '{:.3f}')}, n {st.get('n')}) "
                  f"ratio {_f(st.get('ratio_vs_baseline'), '{:.3f}')} agree {same}/{total} first diverge {firsts}"
                  + ("" if run.get("cuda_graphs", True) == rep["cuda_graphs"] else " (EAGER: graphs failed)"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("micro")
    m.add_argument("--out", required=True)
    m.add_argument("--world", type=int, default=2)
    s = sub.add_parser("summary")
    s.add_argument("dir")
    a = ap.parse_args()
    if a.cmd == "micro":
        t0 = time.perf_counter()
        rc = micro(a.out, a.world)
        print(f"micro probe: rc {rc} in {time.perf_counter() - t0:.0f} s", flush=True)
        return rc
    return summary(a.dir)


if __name__ == "__main__":
    sys.exit(main())
