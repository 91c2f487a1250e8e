"""Printing and saving results: settings banner, summary statistics, tables, JSON record.

A record (one JSON file per run) holds:
  {"mode", "model", "command", "date", "git_commit", "settings": {...},
   "hardware": {...}, "figures": {...}}
"""

from __future__ import annotations

import json
import math
import shlex
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from engine.bench.hardware import ROOT, git_commit

RESULTS_DIR = ROOT / "bench" / "results"


def summary(values: Sequence[float], scale: float = 1.0) -> dict[str, float | None]:
    """mean / median (p50) / p90 / p99 / std / min / max of `values` times `scale` (None if empty)."""
    if not values:
        return dict.fromkeys(("mean", "median", "p90", "p99", "std", "min", "max"))
    a = np.asarray(values, dtype=np.float64) * scale
    return {
        "mean": float(a.mean()),
        "median": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "std": float(a.std()),
        "min": float(a.min()),
        "max": float(a.max()),
    }


def fmt(value: Any, digits: int = 2) -> str:
    """A number for a table cell: fixed digits, thousands separators; '-' for None."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{digits}f}"


def print_settings(mode: str, settings: dict[str, Any]) -> None:
    """The banner every mode prints before it starts."""
    print(f"strata bench {mode}: settings", flush=True)
    width = max(len(k) for k in settings)
    for key, value in settings.items():
        print(f"  {key:<{width}}  {value}")
    sys.stdout.flush()


def print_table(title: str, rows: Sequence[tuple[str, Any]]) -> None:
    """A two-column 'name: value' block, vLLM benchmark style."""
    width = max(48, max(len(name) for name, _ in rows) + 16)
    print(f" {title} ".center(width, "="))
    for name, value in rows:
        cell = fmt(value)
        print(f"{name + ':':<{width - len(cell)}}{cell}")
    print("=" * width, flush=True)


def print_grid(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A column-aligned table with a header line."""
    cells = [list(header)] + [[fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
        if n == 0:
            print("  ".join("-" * w for w in widths))
    sys.stdout.flush()


def default_out(mode: str, model: str) -> Path:
    """bench/results/<mode>-<model>-<timestamp>.json"""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model) or "model"
    return RESULTS_DIR / f"{mode}-{safe}-{stamp}.json"


def _redacted(argv: list[str]) -> list[str]:
    """argv with --api-key's value hidden: a result file is shared, the key is not."""
    out = []
    for i, a in enumerate(argv):
        hide = i > 0 and argv[i - 1] == "--api-key"
        out.append("***" if hide else "--api-key=***" if a.startswith("--api-key=") else a)
    return out


def make_record(
    mode: str, model: str, settings: dict[str, Any], hardware: dict[str, Any], figures: dict[str, Any]
) -> dict[str, Any]:
    """The JSON result of one run."""
    return {
        "mode": mode,
        "model": model,
        "command": shlex.join(["bin/bench", *_redacted(sys.argv[1:])]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "settings": settings,
        "hardware": hardware,
        "figures": figures,
    }


def write_record(record: dict[str, Any], out: str | None) -> Path:
    """Write `record` to `out` (default: default_out) and return the path."""
    path = Path(out) if out else default_out(record["mode"], record["model"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=_json_default) + "\n")
    print(f"result written to {path}", flush=True)
    return path


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def throughput(num_requests: int, ok: Sequence[Any], duration: float) -> dict[str, Any]:
    """Request and token throughput over the successful requests `ok` (each with prompt_tokens,
    output_tokens and requested), shared by the offline and online modes."""
    inp = sum(o.prompt_tokens for o in ok)
    out = sum(o.output_tokens for o in ok)
    return {
        "num_requests": num_requests,
        "completed": len(ok),
        "failed": num_requests - len(ok),
        "output_len_mismatch": sum(1 for o in ok if o.output_tokens != o.requested),
        "duration_s": duration,
        "total_input_tokens": inp,
        "total_output_tokens": out,
        "request_throughput": len(ok) / duration,
        "input_throughput": inp / duration,
        "output_throughput": out / duration,
        "total_token_throughput": (inp + out) / duration,
    }


def throughput_rows(f: dict[str, Any]) -> list[tuple[str, Any]]:
    """The table rows of `throughput()`'s figures."""
    return [
        ("Successful requests", f["completed"]),
        ("Failed requests", f["failed"]),
        ("Output length mismatches", f["output_len_mismatch"]),
        ("Benchmark duration (s)", f["duration_s"]),
        ("Total input tokens", f["total_input_tokens"]),
        ("Total output tokens", f["total_output_tokens"]),
        ("Request throughput (req/s)", f["request_throughput"]),
        ("Input token throughput (tok/s)", f["input_throughput"]),
        ("Output token throughput (tok/s)", f["output_throughput"]),
        ("Total token throughput (tok/s)", f["total_token_throughput"]),
    ]
