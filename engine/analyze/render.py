"""What `bin/analyze` prints and draws from a Report: text, JSON, PNG charts."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from engine.analyze.report import Report, Request

# ---------------------------------------------------------------- output


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def print_text(rep: Report, timelines: bool = True, out: Any = sys.stdout) -> None:
    w = lambda s="": print(s, file=out)  # noqa: E731
    w(f"logs: {rep.logdir} ({', '.join(rep.files) or 'no *.log files'})")
    for worker, kv in rep.kv_pools.items():
        per = f", {kv['token_layer_bytes']} bytes a token and layer" if kv["token_layer_bytes"] else ""
        w(f"kv pool ({worker}): {kv['pool']}; layout {kv['layout']}{per}")
    if timelines and rep.requests:
        _print_timelines(rep.requests, w)
    _print_summary(rep, w)
    _print_moe(rep, w)
    _print_spec(rep, w)
    _print_grammars(rep, w)
    _print_errors(rep, w)
    _print_unfinished(rep, w)
    for n in rep.notes:
        w(f"note: {n}")


def _print_spec(rep: Report, w: Any) -> None:
    s = rep.spec
    if not s:
        return
    rate = s["accepted"] / s["drafted"] if s["drafted"] else 0.0
    w(f"\nspeculative decoding: {s['rows']} verify rows, accept length {s['accept_length']:.2f} tokens a row, "
      f"{s['accepted']} of {s['drafted']} drafts accepted ({rate:.0%}); rows by drafts accepted {s['accept_hist']}")
    if s.get("chained"):
        w(f"  overlapped: {s['chained']} rows chained on a row in flight, {s['void']} of them void (a draft rejected)")
    if s.get("empty"):
        w(f"  {s['empty']} more rows found nothing to draft (one token each, not in the accept length)")
    if len(s["series"]) > 1:
        w("  accept length over time: " + ", ".join(f"{p['t']:.0f}s {p['accept_length']:.2f}" for p in s["series"]))


def _print_grammars(rep: Report, w: Any) -> None:
    g = rep.grammars
    if not g:
        return
    w(f"\ngrammars: {g['checked']} checked by the tokenizer (ms {_fmt_dist(g['check_ms'])}); "
      f"{g['ready']} compiled on every rank ({g['distinct_keys']} keys; ms from PrepareGrammar "
      f"{_fmt_dist(g['ready_ms'])}; {g['steps_meanwhile']} steps went out meanwhile)")
    if g["ready"] > g["distinct_keys"]:
        again = g["ready"] - g["distinct_keys"]
        w(f"  {again} compiles of keys compiled before (evicted or flushed, then needed again)")


def _fmt_dist(d: dict[str, Any]) -> str:
    return " ".join(f"{k} {v:.0f}" for k, v in d.items() if isinstance(v, (int, float)) and k != "count") or "-"


def _print_timelines(reqs: list[Request], w: Any) -> None:
    w("\nrequest timelines (seconds since the first log line; ttft/e2e in ms)")
    width = min(48, max((len(r.rid) for r in reqs), default=3))  # (12 cut "chatcmpl-..." ids to one prefix)
    w(
        f"{'rid':<{width}} {'received':>9} {'queued':>9} {'first':>9} {'done':>9} {'ttft':>8} {'e2e':>8} "
        f"{'prompt':>6} {'compl':>5} {'cached':>6} {'tier':<11} finish"
    )
    for r in reqs:
        w(
            f"{r.rid[:width]:<{width}} {_s(r.received):>9} {_s(r.queued):>9} {_s(r.first_token):>9} {_s(r.done):>9} "
            f"{_ms(r.ttft):>8} {_ms(r.e2e):>8} {r.prompt_tokens or 0:>6} {r.completion_tokens or 0:>5} "
            f"{r.cached_tokens or 0:>6} {r.tier:<11} {r.finish_reason}"
        )


def _print_summary(rep: Report, w: Any) -> None:
    s = rep.summary
    w(f"\nrequests: {s['count']}  finish reasons: {s['finish_reasons']}")
    t = s["tokens"]
    w(f"tokens: prompt {t['prompt']} ({t['cached']} cached), completion {t['completion']}")
    w(f"{'':<22} {'count':>5} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}")
    rows = [("TTFT", s["ttft"]), ("E2E", s["e2e"])] + [(f"TTFT tier={t}", d) for t, d in rep.ttft_by_tier.items()]
    for name, d in rows:
        w(f"{name:<22} {d['count']:>5} {_ms(d['p50']):>8} {_ms(d['p90']):>8} {_ms(d['p99']):>8}")
    h = rep.hit_rates
    pct = lambda v: "-" if v is None else f"{v:.1%}"  # noqa: E731
    w(f"prefix cache: token hit rate {pct(h['token_hit_rate'])}, requests with a hit {pct(h['request_hit_rate'])}")
    if rep.copies:
        _print_copies(rep.copies, w)
    if rep.l3:
        l3 = rep.l3
        w(f"disk tier (L3): {l3['loads']} loads ({l3['loads_ok']} ok, {l3['loads_failed']} failed)"
          + "".join(f", {k}: {v}" for k, v in sorted(l3["events"].items())))  # fmt: skip
        if l3["writes"]:
            _print_l3_writes(l3["writes"], w)
    if rep.host_tier:
        w("cache tier events: " + ", ".join(f"{k}: {v}" for k, v in sorted(rep.host_tier.items())))
    if rep.occupancy:
        _print_occupancy(rep, w)


OCCUPANCY_LABELS = {"kv_pages_used": "L1 pages used", "cache_pages": "L1 prefix-cache pages",
                    "l2_pages_used": "L2 pages used", "l3_files": "L3 files", "l3_bytes": "L3 bytes"}  # fmt: skip


def _print_occupancy(rep: Report, w: Any) -> None:
    head = f"cache occupancy ({len(rep.occupancy)} samples)"
    w(f"{head:<35} {'peak':>12} {'last':>12} {'capacity':>12}")
    for key, d in rep.occupancy_summary.items():
        if key == "l3_bytes":
            peak, last, cap = f"{d['peak'] / 1e9:.3f} GB", f"{d['last'] / 1e9:.3f} GB", "-"
        else:
            peak, last, cap = str(d["peak"]), str(d["last"]), str(d.get("total", "-"))
        w(f"  {OCCUPANCY_LABELS[key]:<33} {peak:>12} {last:>12} {cap:>12}")


def _print_l3_writes(d: dict[str, Any], w: Any) -> None:
    gbps = "-" if d["gbps"] is None else f"{d['gbps']:.2f}"
    w(f"disk tier (L3) writes: {d['pages']} pages, {d['bytes'] / 1e9:.3f} GB in {d['write_s']:.3f} s "
      f"({gbps} GB/s); already on disk {d['existed']}, skipped {d['skips']}, corrupt seen {d['corrupt']}")  # fmt: skip


def _print_copies(c: dict[str, Any], w: Any) -> None:
    gbps = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    w(f"{'host tier (L2) copies':<22} {'count':>7} {'GB':>9} {'seconds':>9} {'GB/s':>7}")
    rows = [("total", c["total"])] + (list(c["workers"].items()) if len(c["workers"]) > 1 else [])
    for name, d in rows:
        label = "" if name == "total" else f" {name}"
        w(f"{'backups' + label:<22} {d['backups']:>7} {d['bytes_out'] / 1e9:>9.3f} {d['backup_s']:>9.3f} "
          f"{gbps(d['backup_gbps']):>7}")
        w(f"{'load-backs' + label:<22} {d['load_backs']:>7} {d['bytes_in'] / 1e9:>9.3f} {d['load_back_s']:>9.3f} "
          f"{gbps(d['load_back_gbps']):>7}")


def _print_errors(rep: Report, w: Any) -> None:
    if not rep.errors:
        w("errors: none")
        return
    first = "" if rep.first_error_seq is None else f" (first seq mentioned: {rep.first_error_seq})"
    w(f"errors: {len(rep.errors)}{first}")
    for e in rep.errors:
        seq = "" if e["seq"] is None else f" seq={e['seq']}"
        w(f"  {e['timestamp']} {e['file']}{seq}: {e['detail']}")


def _print_unfinished(rep: Report, w: Any, most: int = 20) -> None:
    if rep.rejected:
        by = ", ".join(f"{status}: {n}" for status, n in rep.rejected.items())
        w(f"rejected requests: {sum(rep.rejected.values())} (by HTTP status: {by})")
    if not rep.unfinished:
        return
    w(f"unfinished requests: {len(rep.unfinished)} (no 'request finished' line: in flight when the logs end)")
    for u in rep.unfinished[:most]:
        w(f"  {u['rid'][:64]}: first seen {u['first_seen']:.3f} s, last {u['last_seen']:.3f} s "
          f"({u['last_proc']}: {u['last_event']})")
    if len(rep.unfinished) > most:
        w(f"  ... and {len(rep.unfinished) - most} more (--json lists them all)")


def _print_moe(rep: Report, w: Any) -> None:
    """Expert load per MoE layer (the worker's cumulative counts): max / mean 1 is an even load."""
    for worker, layers in rep.moe.items():
        w(f"\nmoe expert load ({worker}; routed (token, expert) pairs since start)")
        w(f"{'layer':>6} {'tokens':>10} {'experts':>7} {'idle':>5} {'max/mean':>8} {'min/mean':>8} "
          f"{'hottest':>14} {'coldest':>14}")
        for layer, d in layers.items():
            hot, cold = f"#{d['hottest']}: {d['hottest_tokens']}", f"#{d['coldest']}: {d['coldest_tokens']}"
            w(f"{layer:>6} {d['tokens']:>10} {d['experts']:>7} {d['idle_experts']:>5} {_ratio(d['max_over_mean']):>8} "
              f"{_ratio(d['min_over_mean']):>8} {hot:>14} {cold:>14}")


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def to_json(rep: Report) -> str:
    return json.dumps(asdict(rep), indent=2)


# ---------------------------------------------------------------- plots


def plot(rep: Report, out_dir: Path) -> list[Path]:
    """PNG charts: TTFT by tier (box plot), TTFT over time, and cache occupancy over time when
    the logs carry it; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    by_tier: dict[str, list[float]] = {}
    for r in rep.requests:
        if r.ttft is not None:
            by_tier.setdefault(r.tier, []).append(r.ttft * 1000)
    paths = [out_dir / "ttft_by_tier.png", out_dir / "ttft_over_time.png"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if by_tier:
        names = sorted(by_tier)
        ax.boxplot([by_tier[n] for n in names], tick_labels=[f"{n}\n(n={len(by_tier[n])})" for n in names])
    ax.set(title="TTFT by the tier that served the prefix", ylabel="TTFT (ms)", xlabel="prefix tier")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)
    _plot_over_time(plt, rep, paths[1])
    if rep.occupancy:
        paths.append(out_dir / "cache_occupancy.png")
        _plot_occupancy(plt, rep.occupancy, paths[-1])
    return paths


def _plot_occupancy(plt: Any, points: list[dict[str, Any]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = {}
    for key, label in (("kv_pages_used", "L1 pages used"), ("cache_pages", "L1 prefix-cache pages"),
                       ("l2_pages_used", "L2 pages used")):  # fmt: skip
        pts = [(p["t"], p[key]) for p in points if key in p]
        if pts:
            (line,) = ax.step([t for t, _ in pts], [v for _, v in pts], where="post", label=label)
            colors[key] = line.get_color()
    for key, used, label in (("kv_pages_total", "kv_pages_used", "L1 capacity"),
                             ("l2_pages_total", "l2_pages_used", "L2 capacity")):  # fmt: skip
        caps = [p[key] for p in points if key in p]
        if caps:
            ax.axhline(caps[-1], linestyle="--", alpha=0.5, color=colors.get(used), label=label)
    ax.set(title="Cache occupancy over time", xlabel="s since the first log line", ylabel="pages")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    l3 = [(p["t"], p["l3_bytes"] / 1e9) for p in points if "l3_bytes" in p]
    if l3 and any(v for _, v in l3):
        ax3 = ax.twinx()
        ax3.step([t for t, _ in l3], [v for _, v in l3], where="post", color="tab:gray", label="L3 bytes (GB)")
        ax3.set_ylabel("L3 GB")
        more = ax3.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, loc="upper left", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_over_time(plt: Any, rep: Report, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    tiers = sorted({r.tier for r in rep.requests})
    for tier in tiers:
        pts = [
            (r.received, r.ttft * 1000)
            for r in rep.requests
            if r.tier == tier and r.ttft is not None and r.received is not None
        ]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], label=tier, s=24)
    ax.set(title="TTFT over time (by arrival)", xlabel="arrival (s since the first log line)", ylabel="TTFT (ms)")
    ax.grid(alpha=0.3)
    if tiers:
        ax.legend(title="prefix tier")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
