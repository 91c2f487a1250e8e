"""Reading the logs of a `bin/serve --log-dir` run and summarizing them (engine/analyze)."""


from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

Record = dict[str, Any]

RECEIVED_EVENTS = ("generate request", "chat request", "completion request", "sdk request")
REJECTED_EVENTS = ("request rejected", "sdk request rejected")  # a 4xx before the request ran: its end
FINISHED_EVENT = "request finished"  # the tokenizer's, one per request that ran
# the other ends of a request at the tokenizer: failed before it ran (a server process died) or its
# client gone before the response
FAILED_EVENTS = ("request failed", "sdk request failed", "client disconnected before the response")
ADMIN_EVENTS = ("abort asked",)  # an API call that generates nothing (/abort_request): its line is its end
# a request's own rid where its prompts or choices run (and end) as rid-0, rid-1, ...: a batch's, or n > 1's
PARENT_EVENTS = (*RECEIVED_EVENTS, "generate batch")
ERROR_LEVELS = ("error", "critical", "exception")
_CHOICE_RE = re.compile(r"^(.+)-\d+$")  # a choice's rid: its request's, then -index
_SEQ_RE = re.compile(r"\b(?:step|seq)[ =:]+(\d+)")
_L2_RE = re.compile(r"back ?up|load.?back|l2|l3|host tier|hicache", re.IGNORECASE)
COPIES_EVENT = "host copies"  # engine/run/host_tier.py: per worker, at most once a second
COPY_KEYS = ("backups", "load_backs", "bytes_out", "bytes_in", "backup_s", "load_back_s")
OCCUPANCY_KEYS = (
    "kv_pages_used", "kv_pages_total", "cache_pages", "l2_pages_used", "l2_pages_total", "l3_files", "l3_bytes",
)  # fmt: skip
L3_LOAD_EVENT = "l3 load"  # engine/sched/loop.py: one per L3Loaded
L3_WRITES_EVENT = "l3 writes"  # engine/cache/l3.py: the cache controller's, at most once a second
L3_WRITE_KEYS = ("pages", "bytes", "write_s", "existed", "skips", "corrupt")


@dataclass
class Request:
    rid: str
    received: float | None = None  # seconds since the first log line
    queued: float | None = None
    first_token: float | None = None
    done: float | None = None
    ttft: float | None = None  # seconds, as the tokenizer measured it
    e2e: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    tier: str = "none"
    tier_tokens: tuple[int, int] | None = None  # (l2, l3) of its cached tokens: the scheduler's `admitted`


@dataclass
class Report:
    logdir: str
    files: list[str]
    requests: list[Request]
    summary: dict[str, Any]
    ttft_by_tier: dict[str, dict[str, Any]]
    hit_rates: dict[str, float | None]
    host_tier: dict[str, int]
    copies: dict[str, Any]  # backups / load-backs: counts, bytes, seconds, GB/s, per worker and total
    l3: dict[str, Any]  # disk tier: loads (ok / failed), writes (pages, bytes, GB/s), other l3 events
    occupancy: list[dict[str, Any]]  # (t, kv_pages_used, l2_pages_used, ...) from scheduler lines
    occupancy_summary: dict[str, dict[str, int]]  # per figure: peak, last (and the capacity)
    errors: list[dict[str, Any]]
    first_error_seq: int | None
    notes: list[str] = field(default_factory=list)
    # requests with no 'request finished' line: in flight when the logs end (a crash, a kill)
    unfinished: list[dict[str, Any]] = field(default_factory=list)
    rejected: dict[str, int] = field(default_factory=dict)  # requests refused before they ran, by HTTP status
    kv_pools: dict[str, dict[str, Any]] = field(default_factory=dict)  # per worker: its KV pool and layout
    moe: dict[str, dict[str, Any]] = field(default_factory=dict)  # per worker and MoE layer: expert load
    spec: dict[str, Any] = field(default_factory=dict)  # speculative decoding: accept length, overall and per line
    grammars: dict[str, Any] = field(default_factory=dict)  # grammars: the tokenizer's checks, the ranks' compiles


# ---------------------------------------------------------------- reading


def _ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def load(logdir: Path) -> list[Record]:
    """Every parseable JSON line of every *.log file, in timestamp order, each with `file` and `t`."""
    out: list[Record] = []
    for path in sorted(logdir.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            rec = _parse(line)
            if rec is not None:
                rec["file"] = path.name
                out.append(rec)
    out.sort(key=lambda r: r["t"])
    return out


def _parse(line: str) -> Record | None:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(rec, dict) or "event" not in rec or "timestamp" not in rec:
        return None
    try:
        rec["t"] = _ts(str(rec["timestamp"]))
    except ValueError:
        return None
    return rec


# ---------------------------------------------------------------- requests


def _reopens(rec: Record) -> bool:
    """A request's arrival at the tokenizer: with a rid already finished, a new request (a rid
    reused after its abort or its client's disconnect, as HTTP and the SDK allow)."""
    return rec.get("proc") == "tokenizer" and rec["event"] in RECEIVED_EVENTS


def build_requests(records: list[Record], t0: float, has_l2: bool) -> list[Request]:
    current: dict[str, Request] = {}
    done: list[Request] = []
    for rec in records:
        rid = rec.get("rid")
        if not isinstance(rid, str):
            continue
        req = current.get(rid)
        if req is None or (req.done is not None and _reopens(rec)):
            req = current[rid] = Request(rid=rid)
        finished = req.done is not None
        _apply(req, rec, rec["t"] - t0)
        if not finished and req.done is not None:
            done.append(req)
    for r in done:
        _finish(r, has_l2)
    return sorted(done, key=lambda r: r.received if r.received is not None else r.done or 0.0)


def _ends(rec: Record) -> bool:
    return rec.get("proc") == "tokenizer" and rec["event"] in (FINISHED_EVENT, *REJECTED_EVENTS, *FAILED_EVENTS,
                                                              *ADMIN_EVENTS)


def unfinished(records: list[Record], t0: float) -> list[dict[str, Any]]:
    """The requests that a process logged but the tokenizer never finished nor rejected: each with
    when it was first and last seen (seconds since t0) and its last event, in order of arrival. A
    batch's or an n > 1 request's own rid is not one once its children ended; a finished rid counts
    again only when it is received again."""
    seen: dict[str, dict[str, Any]] = {}
    ended: set[str] = set()
    for rec in records:
        rid = rec.get("rid")
        if not isinstance(rid, str):
            continue
        if _ends(rec):
            ended.add(rid)
            seen.pop(rid, None)
            continue
        if rid in ended:
            if not _reopens(rec):
                continue  # a late line of the request that ended
            ended.discard(rid)
        t = round(rec["t"] - t0, 3)
        entry = seen.setdefault(rid, {"rid": rid, "first_seen": t})
        entry.update(last_seen=t, last_event=rec["event"], last_proc=rec.get("proc"))
    parents = {m.group(1) for rid in ended if (m := _CHOICE_RE.match(rid))}  # whose children ended
    return [e for rid, e in seen.items()
            if not (rid in parents and e["last_proc"] == "tokenizer" and e["last_event"] in PARENT_EVENTS)]


def rejected(records: list[Record]) -> dict[str, int]:
    """Requests the tokenizer refused before they ran (a 4xx; a 413, 503...), by HTTP status."""
    counts: dict[str, int] = {}
    for rec in records:
        if rec.get("proc") == "tokenizer" and rec["event"] in REJECTED_EVENTS:
            status = str(rec.get("status", "?"))
            counts[status] = counts.get(status, 0) + 1
    return dict(sorted(counts.items()))


def _apply(req: Request, rec: Record, t: float) -> None:
    event, proc = rec["event"], rec.get("proc")
    if proc == "tokenizer" and event in RECEIVED_EVENTS and req.received is None:
        req.received = t
    elif proc == "scheduler" and event == "request" and req.queued is None:
        req.queued = t
    elif proc == "scheduler" and event == "admitted" and req.tier_tokens is None:
        req.tier_tokens = (int(rec.get("l2_tokens") or 0), int(rec.get("l3_tokens") or 0))
    elif proc == "tokenizer" and event == FINISHED_EVENT:
        req.done = t
        req.ttft = rec.get("ttft")
        req.prompt_tokens = rec.get("prompt_tokens")
        req.completion_tokens = rec.get("completion_tokens")
        req.cached_tokens = rec.get("cached_tokens")
        req.finish_reason = rec.get("finish_reason")


def _finish(req: Request, has_l2: bool) -> None:
    start = req.received if req.received is not None else req.queued
    if start is not None and req.done is not None:
        req.e2e = req.done - start
        if req.ttft is not None:
            req.first_token = start + req.ttft
    if req.cached_tokens and req.tier_tokens is not None:  # each tier its cached tokens came from
        l2, l3 = req.tier_tokens
        parts = (("l1", req.cached_tokens - l2 - l3), ("l2", l2), ("l3", l3))
        req.tier = "+".join(name for name, n in parts if n > 0) or "l1"
    elif req.cached_tokens:  # (logs of a server that did not say)
        req.tier = "l1+l2" if has_l2 else "l1"


# ---------------------------------------------------------------- statistics


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def _dist(values: list[float]) -> dict[str, Any]:
    return {"count": len(values), **{f"p{q}": percentile(values, q) for q in (50, 90, 99)}}


def summarize(reqs: list[Request]) -> dict[str, Any]:
    ttft = [r.ttft for r in reqs if r.ttft is not None]
    e2e = [r.e2e for r in reqs if r.e2e is not None]
    reasons: dict[str, int] = {}
    for r in reqs:
        reasons[r.finish_reason or "?"] = reasons.get(r.finish_reason or "?", 0) + 1
    tokens = {name: sum(getattr(r, f"{name}_tokens") or 0 for r in reqs) for name in ("prompt", "cached", "completion")}
    return {"count": len(reqs), "ttft": _dist(ttft), "e2e": _dist(e2e), "finish_reasons": reasons, "tokens": tokens}


def ttft_by_tier(reqs: list[Request]) -> dict[str, dict[str, Any]]:
    tiers: dict[str, list[float]] = {}
    for r in reqs:
        if r.ttft is not None:
            tiers.setdefault(r.tier, []).append(r.ttft)
    return {tier: _dist(v) for tier, v in sorted(tiers.items())}


def hit_rates(reqs: list[Request]) -> dict[str, float | None]:
    prompt = sum(r.prompt_tokens or 0 for r in reqs)
    cached = sum(r.cached_tokens or 0 for r in reqs)
    hits = sum(1 for r in reqs if r.cached_tokens)
    return {
        "token_hit_rate": cached / prompt if prompt else None,
        "request_hit_rate": hits / len(reqs) if reqs else None,
    }


def host_tier_counts(records: list[Record]) -> dict[str, int]:
    """Counts of host/disk-tier log events by event name: l3 loads, tier warnings (the
    workers' `host copies` lines are summed by copies() instead)."""
    out: dict[str, int] = {}
    for rec in records:
        if rec["event"] in (COPIES_EVENT, L3_WRITES_EVENT):
            continue
        if rec.get("proc") == "cache" or _L2_RE.search(str(rec["event"])):
            out[str(rec["event"])] = out.get(str(rec["event"]), 0) + 1
    return out


def copies(records: list[Record]) -> dict[str, Any]:
    """The workers' `host copies` lines summed per worker and in total: backups (device ->
    host) and load-backs (host -> device), their bytes and copy seconds, and GB/s (bytes over
    copy seconds; on a GPU a backup's seconds include the forward it overlaps)."""
    per: dict[str, dict[str, float]] = {}
    for rec in records:
        if rec["event"] != COPIES_EVENT:
            continue
        name = rec["file"].removesuffix(".log")
        acc = per.setdefault(name, dict.fromkeys(COPY_KEYS, 0.0))
        for k in COPY_KEYS:
            v = rec.get(k)
            if isinstance(v, int | float):
                acc[k] += v
    if not per:
        return {}
    total = {k: sum(w[k] for w in per.values()) for k in COPY_KEYS}
    return {"total": _rates(total), "workers": {n: _rates(w) for n, w in sorted(per.items())}}


def _rates(acc: dict[str, float]) -> dict[str, Any]:
    out: dict[str, Any] = {k: (acc[k] if k.endswith("_s") else int(acc[k])) for k in COPY_KEYS}
    out["backup_gbps"] = acc["bytes_out"] / acc["backup_s"] / 1e9 if acc["backup_s"] > 0 else None
    out["load_back_gbps"] = acc["bytes_in"] / acc["load_back_s"] / 1e9 if acc["load_back_s"] > 0 else None
    return out


def l3_activity(records: list[Record]) -> dict[str, Any]:
    """Disk-tier (L3) events: the scheduler's `l3 load` lines (ok or not), the cache
    controller's `l3 writes` lines summed (`writes`: pages written, bytes, writer seconds,
    GB/s = bytes over those seconds, pages whose file existed, skips, corrupt files seen;
    {} when none), any other l3 event."""
    loads = [rec for rec in records if rec["event"] == L3_LOAD_EVENT]
    writes = [rec for rec in records if rec["event"] == L3_WRITES_EVENT]
    others: dict[str, int] = {}
    for rec in records:
        ev = str(rec["event"])
        if ev not in (L3_LOAD_EVENT, L3_WRITES_EVENT) and re.search(r"\bl3\b", ev, re.IGNORECASE):
            others[ev] = others.get(ev, 0) + 1
    if not loads and not writes and not others:
        return {}
    ok = sum(1 for r in loads if r.get("ok") is True)
    return {
        "loads": len(loads),
        "loads_ok": ok,
        "loads_failed": len(loads) - ok,
        "writes": _l3_writes(writes),
        "events": others,
    }


def _l3_writes(lines: list[Record]) -> dict[str, Any]:
    if not lines:
        return {}
    acc = dict.fromkeys(L3_WRITE_KEYS, 0.0)
    for rec in lines:
        for k in L3_WRITE_KEYS:
            v = rec.get(k)
            if isinstance(v, int | float) and not isinstance(v, bool):
                acc[k] += v
    out: dict[str, Any] = {k: (acc[k] if k.endswith("_s") else int(acc[k])) for k in L3_WRITE_KEYS}
    out["lines"] = len(lines)
    out["gbps"] = acc["bytes"] / acc["write_s"] / 1e9 if acc["write_s"] > 0 else None
    last = lines[-1]
    out["files"], out["dir_bytes"] = last.get("files"), last.get("dir_bytes")
    return out


def occupancy(records: list[Record], t0: float) -> list[dict[str, Any]]:
    """Cache occupancy over time from scheduler lines that carry page counts (e.g. a periodic
    stats line with kv_pages_used, l2_pages_used); empty when the logs carry none."""
    out = []
    for rec in records:
        if rec.get("proc") != "scheduler":
            continue
        point = {k: rec[k] for k in OCCUPANCY_KEYS if isinstance(rec.get(k), int | float)}
        if "kv_pages_used" in point or "l2_pages_used" in point:
            out.append({"t": rec["t"] - t0, **point})
    return out


def occupancy_summary(points: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per figure of the occupancy lines (L1 pages used, prefix-cache pages, L2 pages used,
    L3 files and bytes): its peak and last value, and the last capacity where there is one."""
    out: dict[str, dict[str, int]] = {}
    for key, cap in (("kv_pages_used", "kv_pages_total"), ("cache_pages", "kv_pages_total"),
                     ("l2_pages_used", "l2_pages_total"), ("l3_files", ""), ("l3_bytes", "")):  # fmt: skip
        vals = [p[key] for p in points if key in p]
        if not vals:
            continue
        out[key] = {"peak": max(vals), "last": vals[-1]}
        caps = [p[cap] for p in points if cap in p]
        if caps:
            out[key]["total"] = caps[-1]
    return out


# ---------------------------------------------------------------- errors


def errors(records: list[Record]) -> list[dict[str, Any]]:
    out = []
    for rec in records:
        if str(rec.get("level", "")).lower() not in ERROR_LEVELS:
            continue
        text = _error_text(rec)
        out.append(
            {
                "timestamp": rec["timestamp"],
                "file": rec["file"],
                "proc": rec.get("proc"),
                "event": rec["event"],
                "detail": text[:300],
                "seq": _first_seq(rec, text),
            }
        )
    return out


def _error_text(rec: Record) -> str:
    # the supervisor's `child died` names the process in `child` (an audit: every death read alike)
    child = f"process {rec['child']}" if rec.get("child") else ""
    parts = [str(rec["event"]), child, str(rec.get("error", "")), str(rec.get("reason", ""))]
    exc = rec.get("exception")
    if isinstance(exc, list):
        parts += [f"{e.get('exc_type', '')}: {e.get('exc_value', '')}" for e in exc if isinstance(e, dict)]
    elif exc:
        parts.append(str(exc))
    return " | ".join(p for p in parts if p)


def _first_seq(rec: Record, text: str) -> int | None:
    if isinstance(rec.get("seq"), int):
        return rec["seq"]
    m = _SEQ_RE.search(text)
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------- the report


def analyze(logdir: Path) -> Report:
    records = load(logdir)
    files = sorted(p.name for p in logdir.glob("*.log"))
    has_l2 = "cache.log" in files
    t0 = records[0]["t"] if records else 0.0
    reqs = build_requests(records, t0, has_l2)
    errs = errors(records)
    seqs = [e["seq"] for e in errs if e["seq"] is not None]
    occ = occupancy(records, t0)
    return Report(
        logdir=str(logdir),
        files=files,
        requests=reqs,
        summary=summarize(reqs),
        ttft_by_tier=ttft_by_tier(reqs),
        hit_rates=hit_rates(reqs),
        host_tier=host_tier_counts(records),
        copies=copies(records),
        l3=l3_activity(records),
        occupancy=occ,
        occupancy_summary=occupancy_summary(occ),
        errors=errs,
        first_error_seq=min(seqs) if seqs else None,
        notes=_notes(reqs, has_l2, records),
        unfinished=unfinished(records, t0),
        rejected=rejected(records),
        kv_pools=kv_pools(records),
        moe=moe_load(records),
        spec=spec_accept(records, t0),
        grammars=grammar_compiles(records),
    )


GRAMMAR_CHECKED = "grammar compiled"  # engine/serve/grammar.py: the tokenizer's check of a new grammar
GRAMMAR_READY = "grammar ready"  # engine/sched/grammars.py: every rank compiled a PrepareGrammar


def grammar_compiles(records: list[Record]) -> dict[str, Any]:
    """New grammars: the tokenizer's checks (seconds each) and the ranks' compiles (the grammar
    gate: ms from PrepareGrammar to the last rank's report, steps that went out meanwhile)."""
    checked = [float(r["seconds"]) * 1e3 for r in records
               if r["event"] == GRAMMAR_CHECKED and isinstance(r.get("seconds"), (int, float))]
    ready = [r for r in records if r["event"] == GRAMMAR_READY and isinstance(r.get("ready_ms"), (int, float))]
    if not checked and not ready:
        return {}
    return {"checked": len(checked), "check_ms": _dist(checked),
            "ready": len(ready), "ready_ms": _dist([float(r["ready_ms"]) for r in ready]),
            "distinct_keys": len({r.get("key") for r in ready}),
            "steps_meanwhile": sum(int(r.get("steps_meanwhile", 0)) for r in ready)}


SPEC_EVENT = "speculative decoding"  # engine/sched/loop.py: cumulative verify rows, at most once a second


def spec_accept(records: list[Record], t0: float) -> dict[str, Any]:
    """The scheduler's `speculative decoding` lines: the last one's totals (verify rows, drafts
    proposed and accepted, accept length = tokens a row answered, rows by drafts accepted) and
    the accept length between consecutive lines (t, rows, accept length over that interval)."""
    lines = [r for r in records if r["event"] == SPEC_EVENT and isinstance(r.get("rows"), int)]
    if not lines:
        return {}
    last = lines[-1]
    series, rows, acc = [], 0, 0
    for r in lines:
        if r["rows"] < rows:  # a restart: counts begin again
            rows = acc = 0
        if r["rows"] > rows:
            series.append({"t": round(r["t"] - t0, 3), "rows": r["rows"] - rows,
                           "accept_length": round(1 + (r["accepted"] - acc) / (r["rows"] - rows), 3)})
        rows, acc = r["rows"], r["accepted"]
    return {"rows": last["rows"], "drafted": last["drafted"], "accepted": last["accepted"],
            "accept_length": last["accept_length"], "accept_hist": last.get("accept_hist"), "series": series,
            # overlap while speculating: rows planned before the previous one answered, and those voided
            "chained": last.get("chained", 0), "void": last.get("void", 0),
            "empty": last.get("empty", 0)}  # verify rows answered with no draft: one token each


MOE_EVENT = "moe expert tokens"  # engine/run/expert_counts.py: rank 0's cumulative counts, per layer


def moe_load(records: list[Record]) -> dict[str, dict[str, Any]]:
    """Each worker's last `moe expert tokens` line (cumulative since start), per MoE layer: the
    routed (token, expert) pairs, the busiest and idlest expert, and max / mean (1 = even load)."""
    last: dict[str, dict[str, list[int]]] = {}
    for r in records:
        if r["event"] == MOE_EVENT and isinstance(r.get("layers"), dict):
            last[r["file"].removesuffix(".log")] = r["layers"]
    out: dict[str, dict[str, Any]] = {}
    for worker, layers in last.items():
        out[worker] = {}
        for layer, counts in sorted(layers.items(), key=lambda kv: int(kv[0])):
            total, n = sum(counts), len(counts)
            mean = total / n if n else 0.0
            hot = max(range(n), key=counts.__getitem__) if n else None
            cold = min(range(n), key=counts.__getitem__) if n else None
            out[worker][layer] = {
                "tokens": total, "experts": n, "idle_experts": sum(1 for c in counts if c == 0),
                "hottest": hot, "hottest_tokens": counts[hot] if hot is not None else 0,
                "coldest": cold, "coldest_tokens": counts[cold] if cold is not None else 0,
                "max_over_mean": round(max(counts) / mean, 3) if mean else None,
                "min_over_mean": round(min(counts) / mean, 3) if mean else None,
            }
    return out


KV_POOL_EVENT = "kv pool: "  # engine/run/runner.py: "kv pool: N tokens, X GiB on DEV", layout=...
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1}


def kv_pools(records: list[Record]) -> dict[str, dict[str, Any]]:
    """Each worker's KV pool from its start-up line: the size, and the KV layout its model declares
    (engine/layers/kv_layout.py: `k:8x128:bfloat16,v:8x128:bfloat16`, or MLA's one latent) with
    the bytes it costs a token in one layer (None where a dtype is not known here)."""
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        if not str(r["event"]).startswith(KV_POOL_EVENT):
            continue
        layout = r.get("layout")
        out[r["file"].removesuffix(".log")] = {
            "pool": str(r["event"])[len(KV_POOL_EVENT):],
            "layout": layout,
            "token_layer_bytes": _layout_bytes(layout) if isinstance(layout, str) else None,
        }
    return out


def _layout_bytes(layout: str) -> int | None:
    total = 0
    for comp in layout.split(","):
        parts = comp.split(":")  # name:HxD:dtype
        if len(parts) != 3 or parts[2] not in _DTYPE_BYTES:
            return None
        heads, _, dim = parts[1].partition("x")
        total += int(heads) * int(dim) * _DTYPE_BYTES[parts[2]]
    return total


def _notes(reqs: list[Request], has_l2: bool, records: list[Record]) -> list[str]:
    notes = []
    if not records:
        notes.append("no log lines here: is this a --log-dir of bin/serve?")
        return notes
    if any(r.ttft is None and r.completion_tokens for r in reqs):
        notes.append("some 'request finished' lines carry no ttft (logs from an older server)")
    if has_l2 and any(r.cached_tokens and r.tier_tokens is None for r in reqs):
        notes.append("per-request L1/L2/L3 split not logged (older server): those cached requests show as tier 'l1+l2'")
    if has_l2:
        if not copies(records):
            notes.append("no 'host copies' lines in the worker logs (older server or no worker log): no copy counts")
        if l3_activity(records).get("loads") and not _l3_writes([r for r in records if r["event"] == L3_WRITES_EVENT]):
            notes.append("no 'l3 writes' lines in cache.log (older server): L3 writes are not counted")
    else:
        notes.append("no cache.log: host tier (L2) off, every cached token came from the device tier (L1)")
    if not occupancy(records, 0.0):
        notes.append("no 'cache occupancy' lines in scheduler.log (older server): occupancy over time is not known")
    t0 = records[0]["t"]
    for r in records:  # a stop is no error line, yet it ends what is in flight (their finish: "error")
        if r.get("proc") == "supervisor" and r["event"] == "shutting down":
            cut = sum(1 for q in reqs if q.finish_reason == "error" and q.done is not None and q.done >= r["t"] - t0)
            notes.append(f"the server was stopped by {r.get('signal', 'a signal')} at {r['t'] - t0:.3f} s"
                         + (f": {cut} requests in flight then ended with an error" if cut else ""))
    return notes
