"""bin/bench command line: `offline`, `serve`, `latency`, `cpu` and `structured` modes.

bin/bench offline --num-requests 256 --input-len-range 100 1024 --output-len-range 100 1024
bin/bench serve --request-rate 8 --num-requests 200
bin/bench latency --model configs/llama-3.1-8b --load-format dummy --batch-sizes 1 8 32
bin/bench cpu        # served CPU path vs transformers: 16x64 throughput, 8k-prompt TTFT, worker memory
bin/bench deterministic # distinct answers per prompt, SGLang's single/mixed/prefix (engine/bench/deterministic.py)
bin/bench structured # N json_schema requests vs N unconstrained of the same lengths (engine/bench/structured.py)
bin/bench cache      # TTFT of one long prompt: recompute vs L1 vs L2 (vs L3 with --l3-dir) (engine/bench/cache.py)
bin/bench mla        # MLA decode attention at DeepSeek-V3 shapes vs HBM bandwidth, KV capacity (engine/bench/mla.py)
"""

from __future__ import annotations

import argparse
import functools
import math
import shlex
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

MODES = ("offline", "serve", "latency", "cpu", "structured", "cache", "deterministic", "quant", "mla")
TITLES = {"offline": "Offline Throughput Result", "serve": "Serving Benchmark Result"}


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown, unless the help text already says it (or there is none to show)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default" in (action.help or "") or action.default in (None, ""):
            return action.help
        return super()._get_help_string(action)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="model directory or Hugging Face hub id (default: SmolLM2-135M-Instruct)")
    p.add_argument("--load-format", default="auto", choices=("auto", "safetensors", "dummy"),
                   help="dummy: random weights at the model's shapes (configs/)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and lengths")
    p.add_argument("--server-args", default="", help='extra bin/serve flags, one string: "--max-total-tokens 8192"')
    p.add_argument("--out", default=None, help="result JSON path (default bench/results/<mode>-<model>-<time>.json)")


def _workload(p: argparse.ArgumentParser, num: int) -> None:
    p.add_argument("--num-requests", type=int, default=num, help="requests in the run")
    p.add_argument("--input-len-range", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX"),
                   help="prompt lengths, uniform in [MIN, MAX]")
    p.add_argument("--output-len-range", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX"),
                   help="output lengths (ignore_eos), uniform in [MIN, MAX]")
    p.add_argument("--input-len", type=int, default=None, help="fixed prompt length (overrides the range)")
    p.add_argument("--output-len", type=int, default=None, help="fixed output length (overrides the range)")
    p.add_argument("--vocab-size", type=int, default=None, help="token id range (default: the model's)")
    p.add_argument("--url", default=None, help="use the running server at this HTTP URL instead of starting one")
    p.add_argument("--api-key", default=None,
                   help="the server's --api-key (default: STRATA_API_KEY, which a server started here reads too)")


def build_parser() -> argparse.ArgumentParser:
    fmt = _Formatter  # every flag's help shows its default
    parser = argparse.ArgumentParser(prog="bin/bench", description="Strata benchmarks", formatter_class=fmt)
    sub = parser.add_subparsers(dest="mode", required=True)
    sub.add_parser = functools.partial(sub.add_parser, formatter_class=fmt)  # type: ignore[method-assign]
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
    srv.add_argument(
        "--backend",
        default="generate",
        choices=("generate", "openai"),
        help="/generate stream (exact token counts) or /v1/completions stream",
    )
    lat = sub.add_parser("latency", help="in-process decode ms/step vs the memory-bandwidth roofline")
    _common(lat)
    lat.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32], help="decode batch sizes to time")
    lat.add_argument("--context-len", type=int, default=1024, help="prompt tokens per request before decoding")
    lat.add_argument("--steps", type=int, default=50, help="timed decode steps per batch size")
    lat.add_argument("--warmup", type=int, default=5, help="untimed decode steps first (>= 1)")
    lat.add_argument("--temperature", type=float, default=0.0,
                     help="sampling temperature of the requests (0: greedy; > 0 times the sampler's race too)")
    lat.add_argument("--top-k", type=int, default=-1, help="the requests' top_k (with --temperature > 0)")
    lat.add_argument("--top-p", type=float, default=1.0, help="the requests' top_p (with --temperature > 0)")
    lat.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where the model runs")
    lat.add_argument("--bandwidth-gib", type=float, default=None, help="copy size for the bandwidth probe")
    lat.add_argument("--profile-idle", action="store_true", help="also measure GPU idle time between steps")
    lat.add_argument("--idle-steps", type=int, default=20, help="decode steps profiled by --profile-idle")
    from engine.bench import cpu

    cpu_p = sub.add_parser(
        "cpu", help="served CPU path vs transformers on the same weights: throughput, long-prompt TTFT, memory"
    )
    _common(cpu_p)
    cpu.add_arguments(cpu_p)
    from engine.bench import structured

    st = sub.add_parser("structured", help="N json_schema requests vs N unconstrained of the same output lengths")
    _common(st)
    structured.add_arguments(st)
    from engine.bench import cache

    ca = sub.add_parser("cache", help="TTFT of one long prompt served by recompute, L1, L2 and L3, side by side")
    _common(ca)
    cache.add_arguments(ca)
    from engine.bench import deterministic

    det = sub.add_parser("deterministic", help="distinct answers per prompt alone, mixed and behind prefixes (1 each)")
    _common(det)
    deterministic.add_arguments(det)
    from engine.bench import quant

    qu = sub.add_parser("quant", help="quantized GEMMs (fp8 row/block, NVFP4) against bf16 at real shapes (CUDA)")
    _common(qu)
    quant.add_arguments(qu)
    from engine.bench import mla

    ml = sub.add_parser("mla", help="MLA decode attention at DeepSeek-V3 shapes vs the HBM bandwidth (CUDA)")
    _common(ml)
    mla.add_arguments(ml)
    from engine.bench import spec

    sp = sub.add_parser("spec", help="speculative decoding's cost: plain vs NGRAM with an oracle draft (served)")
    _common(sp)
    spec.add_arguments(sp)
    return parser


def check(args: argparse.Namespace) -> str | None:
    """A problem with the arguments, or None."""
    if args.mode == "cpu":
        from engine.bench import cpu

        return cpu.check(args)
    if args.mode == "cache":
        from engine.bench import cache

        return cache.check(args)
    if args.mode == "deterministic":
        return None if args.samples >= 1 and args.max_batch >= 1 and args.max_new >= 1 else "--samples etc. >= 1"
    if args.mode == "quant":
        return None if args.rep_ms >= 1 else "--rep-ms must be >= 1"
    if args.mode == "mla":
        from engine.bench import mla

        return mla.check(args)
    if args.mode == "spec":
        from engine.bench import spec

        return spec.check(args)
    if args.mode == "structured":
        return None if args.num_requests >= 1 and args.max_tokens >= 1 else "--num-requests, --max-tokens >= 1"
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
            (all(n is None or n >= 1 for n in (args.input_len, args.output_len)),
             "--input-len/--output-len must be >= 1"),
        ]
        if args.mode == "serve":
            checks.append((args.request_rate > 0, "--request-rate must be > 0"))
            checks.append((args.max_concurrency is None or args.max_concurrency >= 1, "--max-concurrency >= 1"))
    return next((problem for ok, problem in checks if not ok), None)


def _glued(argv: list[str]) -> list[str]:
    """`--server-args "--flag v"` as `--server-args=--flag v`: argparse reads a value that starts with
    "--" as the next option, and a user who types the flags bin/serve takes means them as the value."""
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        out.append(f"{arg}={next(it, '')}" if arg == "--server-args" else arg)
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(_glued(sys.argv[1:] if argv is None else argv))
    problem = check(args)
    if problem:
        print(f"bin/bench: {problem}", file=sys.stderr)
        return 2
    modes: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
        "offline": _offline,
        "serve": _serve,
        "latency": _latency,
        "cpu": _cpu,
        "structured": _structured,
        "cache": _cache,
        "deterministic": _deterministic,
        "quant": _quant,
        "spec": _spec,
        "mla": _mla,
    }
    from engine.bench.launch import ServerUnavailable

    # SIGTERM as SystemExit, so the `finally` that stops a server this run started runs (an audit
    # found it left running otherwise); Ctrl-C likewise, without a traceback
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        figures = modes[args.mode](args)
    except ServerUnavailable as exc:
        print(f"bin/bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bin/bench: interrupted", file=sys.stderr)
        return 130
    return 1 if figures.get("completed", 1) == 0 or figures.get("tier_errors") else 0


def _deterministic(args: argparse.Namespace) -> dict[str, Any]:
    from engine.bench import deterministic

    return deterministic.main(args)


def _quant(args: argparse.Namespace) -> dict[str, Any]:
    from engine.bench import quant

    return quant.main(args)


def _mla(args: argparse.Namespace) -> dict[str, Any]:
    from engine.bench import mla

    return mla.main(args)


def _spec(args: argparse.Namespace) -> dict[str, Any]:
    from engine.bench import report, spec, workload
    from engine.bench.hardware import HardwareProbe

    name = workload.model_name(args.model)
    settings = _settings(args, model_name=name, drafts=args.drafts, batch_sizes=args.batch_sizes)
    report.print_settings("spec", settings)
    hardware = HardwareProbe().result()  # before the servers: its ~2 s of CPU never overlaps a timed run
    figures = spec.run(args, workload.vocab_size(workload.resolve_model_dir(args.model)))
    report.write_record(report.make_record("spec", name, settings, hardware, figures), args.out)
    return figures


def _structured(args: argparse.Namespace) -> dict[str, Any]:
    from engine.bench import structured

    return structured.main(args)


def _settings(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    out = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items() if k not in ("out", "api_key")}
    out.update(extra)
    return out


def _requests(args: argparse.Namespace) -> tuple[list[Any], str]:
    """The seeded random workload and the model name for the result file."""
    from engine.bench import workload

    vocab = args.vocab_size or workload.vocab_size(workload.resolve_model_dir(args.model))
    reqs = workload.random_requests(
        args.num_requests,
        tuple(args.input_len_range),
        tuple(args.output_len_range),
        vocab,
        args.seed,
        args.input_len,
        args.output_len,
    )
    name = workload.model_name(args.model)
    if args.url and not args.model:
        name = workload.served_model_name(args.url) or name
    return reqs, name


def _against_server(
    args: argparse.Namespace, measure: Callable[..., dict[str, Any]], rows: Callable[[dict], list]
) -> dict[str, Any]:
    """Shared frame of the server modes: workload, banner, server (given or started), record.

    measure(endpoints, requests, settings) runs the load and returns the figures; rows(figures)
    gives the results table."""
    from engine.bench import launch, report, workload
    from engine.bench.hardware import HardwareProbe

    reqs, name = _requests(args)
    n_in, n_out = workload.token_totals(reqs)
    settings = _settings(args, model_name=name, total_input_tokens=n_in, total_output_tokens=n_out)
    report.print_settings(args.mode, settings)
    probe = HardwareProbe()  # in a child process, overlapping the server start-up
    server_args = shlex.split(args.server_args)
    if args.api_key and "--api-key" not in server_args:  # a server started here takes the same key
        server_args += ["--api-key", args.api_key]
    with launch.endpoints(args.url, getattr(args, "sdk", None), args.model, args.load_format, server_args) as ep:
        hardware = probe.result()  # awaited before the load (PROBE_BEFORE_LOAD)
        settings["load_started_at"] = time.time()
        figures = measure(ep, reqs, settings)
    report.print_table(TITLES[args.mode], rows(figures))
    for problem in figures.get("errors", []):
        print(f"error: {problem}")
    for caveat in figures.get("warnings", []):
        print(f"warning: {caveat}")
    report.write_record(report.make_record(args.mode, name, settings, hardware, figures), args.out)
    return figures


def _api_key(args: argparse.Namespace) -> str:
    from engine.env import env

    return args.api_key if args.api_key is not None else (env().api_key or "")


def _offline(args: argparse.Namespace) -> dict[str, Any]:
    from engine.bench import offline

    def measure(ep: Any, reqs: list[Any], settings: dict[str, Any]) -> dict[str, Any]:
        backend = "sdk" if ep.sdk and (args.backend == "sdk" or not ep.http) else "http"
        settings["backend_used"] = backend
        outcomes, duration = offline.run(backend, ep.sdk if backend == "sdk" else ep.http, reqs, _api_key(args))
        return offline.figures(outcomes, duration)

    return _against_server(args, measure, offline.table_rows)


def _serve(args: argparse.Namespace) -> dict[str, Any]:
    from engine.bench import online

    def measure(ep: Any, reqs: list[Any], settings: dict[str, Any]) -> dict[str, Any]:
        traces, duration = online.run(ep.http, args.backend, reqs, args.request_rate, args.max_concurrency, args.seed,
                                      _api_key(args))
        return online.figures(traces, duration, args.backend)

    return _against_server(args, measure, online.table_rows)


def _latency(args: argparse.Namespace) -> dict[str, Any]:
    from engine.bench import latency, report, workload
    from engine.bench.hardware import hardware_info

    model_dir = workload.resolve_model_dir(args.model)
    settings = _settings(args, model_name=workload.model_name(args.model), model_dir=str(model_dir))
    report.print_settings("latency", settings)
    engine, batches = latency.run(args, str(model_dir), workload.vocab_size(model_dir))
    figures = {**engine, "batches": batches}
    report.print_table(
        "Decode Latency vs Roofline",
        [
            ("Device", engine["device"]),
            ("Dtype", engine["dtype"]),
            ("Measured bandwidth (GB/s)", engine["bandwidth_gb_s"]),
            ("Weight bytes read/step", engine["weight_bytes"]),
            ("KV bytes per token", engine["kv_bytes_per_token"]),
        ],
    )
    report.print_grid(
        [
            "batch",
            "ctx",
            "ms/step",
            "overlapped ms/step",
            "overlapped mean",
            "roofline ms",
            "ratio",
            "overlapped ratio",
            "tok/s",
            "cycle ms",
            "idle %",
            "worker idle %",
        ],
        [
            [
                b["batch_size"],
                b["context_len"],
                b["ms_per_step_median"],
                b["pipelined_ms_per_step"],
                b.get("pipelined_ms_per_step_mean"),
                b["roofline_ms"],
                b["ratio_to_roofline"],
                b["pipelined_ratio_to_roofline"],
                b["tokens_per_s"],
                b["cycle_ms_per_step_median"],
                _idle_pct(b["idle"], "idle_fraction"),
                _idle_pct(b["idle"], "worker_idle_fraction"),
            ]
            for b in batches
        ],
    )
    record = report.make_record("latency", settings["model_name"], settings, hardware_info(), figures)
    report.write_record(record, args.out)
    return figures


def _cpu(args: argparse.Namespace) -> dict[str, Any]:
    from engine.bench import cpu, report, workload
    from engine.bench.hardware import HardwareProbe

    settings = _settings(args, model_name=workload.model_name(args.model))
    report.print_settings("cpu", settings)
    hardware = HardwareProbe().result()  # before the timed runs, not overlapping them
    figures = cpu.run(args)
    report.print_table("CPU: Strata served vs transformers", cpu.table_rows(figures))
    record = report.make_record("cpu", settings["model_name"], settings, hardware, figures)
    report.write_record(record, args.out)
    return figures


def _cache(args: argparse.Namespace) -> dict[str, Any]:
    from engine.bench import cache, launch, report, workload
    from engine.bench.hardware import HardwareProbe

    name = workload.model_name(args.model)
    server_args = cache.server_args(args)
    settings = _settings(args, model_name=name, pool_tokens=cache.pool_tokens(args),
                         filler_len=cache.filler_len(args), server_command_args=server_args)  # fmt: skip
    report.print_settings("cache", settings)
    probe = HardwareProbe()  # in a child process, overlapping the server start-up
    vocab = workload.vocab_size(workload.resolve_model_dir(args.model))
    with launch.launched_server(args.model, args.load_format, server_args) as ep:
        assert ep.http is not None
        hardware = probe.result()  # awaited before the load (PROBE_BEFORE_LOAD)
        figures = cache.measure(ep.http, args, vocab)
    print(f"Prompt cache TTFT: {args.prompt_len} tokens, median of {args.repeat}")
    report.print_grid(*cache.table(figures))
    for problem in figures["tier_errors"]:
        print(f"error: {problem}")
    report.write_record(report.make_record("cache", name, settings, hardware, figures), args.out)
    return figures


def _idle_pct(idle: dict[str, Any] | None, key: str) -> float | str | None:
    if not idle:
        return None
    if "skipped" in idle:
        return "n/a"
    return idle[key] * 100
