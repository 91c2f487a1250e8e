"""bin/bench command line: `offline`, `serve` and `latency` modes.

    bin/bench offline --num-requests 256 --input-len-range 100 1024 --output-len-range 100 1024
    bin/bench serve --request-rate 8 --num-requests 200
    bin/bench latency --model configs/llama-3.1-8b --load-format dummy --batch-sizes 1 8 32
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from collections.abc import Callable
from typing import Any

MODES = ("offline", "serve", "latency")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--load-format", default="auto", choices=("auto", "safetensors", "dummy"))
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and lengths")
    p.add_argument("--server-args", default="", help='extra bin/serve flags, one string: "--max-total-tokens 8192"')
    p.add_argument("--out", default=None, help="result JSON path (default bench/results/<mode>-<model>-<time>.json)")


def _workload(p: argparse.ArgumentParser, num: int) -> None:
    p.add_argument("--num-requests", type=int, default=num)
    p.add_argument("--input-len-range", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX"))
    p.add_argument("--output-len-range", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX"))
    p.add_argument("--input-len", type=int, default=None, help="fixed prompt length (overrides the range)")
    p.add_argument("--output-len", type=int, default=None, help="fixed output length (overrides the range)")
    p.add_argument("--vocab-size", type=int, default=None, help="token id range (default: the model's)")
    p.add_argument("--url", default=None, help="use the running server at this HTTP URL instead of starting one")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bin/bench", description="Strata benchmarks")
    sub = parser.add_subparsers(dest="mode", required=True)
    off = sub.add_parser("offline", help="throughput: every request at once through the process stack")
    _common(off)
    _workload(off, 256)
    off.add_argument("--sdk", default=None, help="use the running server's SDK at tcp://HOST:PORT")
    off.add_argument("--backend", default="sdk", choices=("sdk", "http"), help="ZMQ SDK or HTTP /generate")
    srv = sub.add_parser("serve", help="online load against the HTTP API: TTFT, TPOT, ITL, E2E")
    _common(srv)
    _workload(srv, 200)
    srv.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson (inf: all at once)")
    srv.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    srv.add_argument("--backend", default="generate", choices=("generate", "openai"),
                     help="/generate stream (exact token counts) or /v1/completions stream")
    lat = sub.add_parser("latency", help="in-process decode ms/step vs the memory-bandwidth roofline")
    _common(lat)
    lat.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    lat.add_argument("--context-len", type=int, default=1024, help="prompt tokens per request before decoding")
    lat.add_argument("--steps", type=int, default=50, help="timed decode steps per batch size")
    lat.add_argument("--warmup", type=int, default=5, help="untimed decode steps first (>= 1)")
    lat.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    lat.add_argument("--bandwidth-gib", type=float, default=None, help="copy size for the bandwidth probe")
    lat.add_argument("--profile-idle", action="store_true", help="also measure GPU idle time between steps")
    lat.add_argument("--idle-steps", type=int, default=20, help="decode steps profiled by --profile-idle")
    return parser


def check(args: argparse.Namespace) -> str | None:
    """A problem with the arguments, or None."""
    if args.mode == "latency":
        checks = [
            (all(b >= 1 for b in args.batch_sizes), "--batch-sizes must be >= 1"),
            (args.context_len >= 1 and args.steps >= 1, "--context-len and --steps must be >= 1"),
            (args.warmup >= 1, "--warmup must be >= 1"),
        ]
    else:
        lo_in, hi_in = args.input_len_range
        lo_out, hi_out = args.output_len_range
        checks = [
            (args.num_requests >= 1, "--num-requests must be >= 1"),
            (1 <= lo_in <= hi_in and 1 <= lo_out <= hi_out, "length ranges need 1 <= MIN <= MAX"),
            ((args.input_len or 1) >= 1 and (args.output_len or 1) >= 1, "--input-len/--output-len must be >= 1"),
        ]
        if args.mode == "serve":
            checks.append((args.request_rate > 0, "--request-rate must be > 0"))
            checks.append((args.max_concurrency is None or args.max_concurrency >= 1, "--max-concurrency >= 1"))
    return next((problem for ok, problem in checks if not ok), None)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = check(args)
    if problem:
        print(f"bin/bench: {problem}", file=sys.stderr)
        return 2
    modes: dict[str, Callable[[argparse.Namespace], Any]] = {
        "offline": _offline, "serve": _serve, "latency": _latency,
    }
    modes[args.mode](args)
    return 0


def _settings(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    out = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items() if k != "out"}
    out.update(extra)
    return out


def _requests(args: argparse.Namespace) -> tuple[list[Any], str]:
    """The seeded random workload and the model name for the result file."""
    from engine.bench import workload

    vocab = args.vocab_size or workload.vocab_size(workload.resolve_model_dir(args.model))
    reqs = workload.random_requests(
        args.num_requests, tuple(args.input_len_range), tuple(args.output_len_range), vocab, args.seed,
        args.input_len, args.output_len,
    )
    return reqs, workload.model_name(args.model)


def _finish(args: argparse.Namespace, settings: dict, hardware: dict, figures: dict, title: str, rows: list) -> None:
    from engine.bench import report

    report.print_table(title, rows)
    name = settings["model_name"]
    report.write_record(report.make_record(args.mode, name, settings, hardware, figures), args.out)


def _offline(args: argparse.Namespace) -> None:
    from engine.bench import launch, offline, report, workload
    from engine.bench.hardware import hardware_info_subprocess

    reqs, name = _requests(args)
    n_in, n_out = workload.token_totals(reqs)
    settings = _settings(args, model_name=name, total_input_tokens=n_in, total_output_tokens=n_out)
    report.print_settings("offline", settings)
    hardware = hardware_info_subprocess()
    with launch.endpoints(args.url, args.sdk, args.model, args.load_format, shlex.split(args.server_args)) as ep:
        backend = "sdk" if ep.sdk and (args.backend == "sdk" or not ep.http) else "http"
        settings["backend_used"] = backend
        outcomes, duration = offline.run(backend, ep.sdk if backend == "sdk" else ep.http, reqs)
    figures = offline.figures(outcomes, duration)
    _finish(args, settings, hardware, figures, "Offline Throughput Result", offline.table_rows(figures))


def _serve(args: argparse.Namespace) -> None:
    from engine.bench import launch, online, report, workload
    from engine.bench.hardware import hardware_info_subprocess

    reqs, name = _requests(args)
    n_in, n_out = workload.token_totals(reqs)
    settings = _settings(args, model_name=name, total_input_tokens=n_in, total_output_tokens=n_out)
    report.print_settings("serve", settings)
    hardware = hardware_info_subprocess()
    with launch.endpoints(args.url, None, args.model, args.load_format, shlex.split(args.server_args)) as ep:
        traces, duration = online.run(
            ep.http, args.backend, reqs, args.request_rate, args.max_concurrency, args.seed
        )
    figures = online.figures(traces, duration)
    _finish(args, settings, hardware, figures, "Serving Benchmark Result", online.table_rows(figures))


def _latency(args: argparse.Namespace) -> None:
    from engine.bench import latency, report, workload
    from engine.bench.hardware import hardware_info

    model_dir = workload.resolve_model_dir(args.model)
    settings = _settings(args, model_name=workload.model_name(args.model), model_dir=str(model_dir))
    report.print_settings("latency", settings)
    engine, batches = latency.run(args, str(model_dir), workload.vocab_size(model_dir))
    figures = {**engine, "batches": batches}
    report.print_table("Decode Latency vs Roofline", [
        ("Device", engine["device"]), ("Dtype", engine["dtype"]),
        ("Measured bandwidth (GB/s)", engine["bandwidth_gb_s"]), ("Weight bytes read/step", engine["weight_bytes"]),
        ("KV bytes per token", engine["kv_bytes_per_token"]),
    ])
    report.print_grid(
        ["batch", "ctx", "ms/step", "roofline ms", "ratio", "tok/s", "cycle ms", "idle %", "worker idle %"],
        [[b["batch_size"], b["context_len"], b["ms_per_step_median"], b["roofline_ms"], b["ratio_to_roofline"],
          b["tokens_per_s"], b["cycle_ms_per_step_median"], _idle_pct(b["idle"], "idle_fraction"),
          _idle_pct(b["idle"], "worker_idle_fraction")] for b in batches],
    )
    record = report.make_record("latency", settings["model_name"], settings, hardware_info(), figures)
    report.write_record(record, args.out)


def _idle_pct(idle: dict[str, Any] | None, key: str) -> float | str | None:
    if not idle:
        return None
    if "skipped" in idle:
        return "n/a"
    return idle[key] * 100
