"""Online serving load: streamed requests at a Poisson rate against the HTTP API.

Per request it records TTFT (send -> first token), E2E latency, inter-token latencies
(ITL: gaps between streamed events; an event carrying k tokens contributes k gaps of
gap/k, as SGLang's bench_serving does) and TPOT = (latency - TTFT) / (output tokens - 1).
Backends: `generate` (SGLang-native /generate, token counts exact from output_ids) and
`openai` (/v1/completions with a token-id prompt; one streamed chunk counts as one token,
as in vLLM's benchmark_serving: in ids-only mode the server streams no text, so use
`generate` there).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from engine.bench import report
from engine.bench.launch import auth_headers
from engine.bench.report import summary
from engine.bench.workload import BenchRequest

REQUEST_TIMEOUT_S = 3600.0


@dataclass
class Trace:
    """What one streamed request looked like from the client."""

    prompt_tokens: int
    requested: int
    output_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    chunks: int = 0
    error: str | None = None


class _Clock:
    """Turns (timestamp, cumulative token count) events into TTFT / ITL entries."""

    def __init__(self, trace: Trace, t0: float) -> None:
        self.trace, self.t0, self.last = trace, t0, t0

    def tokens(self, total: int) -> None:
        now = time.perf_counter()
        new = total - self.trace.output_tokens
        if new <= 0:
            return
        if self.trace.ttft_s is None:
            self.trace.ttft_s = now - self.t0
        else:
            self.trace.itl_s.extend([(now - self.last) / new] * new)
        self.trace.output_tokens, self.last = total, now
        self.trace.chunks += 1


async def _sse_data(resp: httpx.Response) -> AsyncIterator[str]:
    """The raw `data:` payloads of an SSE stream, up to `data: [DONE]`; errors raise."""
    if resp.status_code != 200:
        raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        if data.startswith('{"error"'):
            raise RuntimeError(f"stream error: {data[:300]}")
        yield data


async def _sse(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of an SSE stream."""
    async for data in _sse_data(resp):
        yield json.loads(data)


# /generate events repeat the whole output so far (text and output_ids): parsing each one
# would cost O(n^2) per request, so only the cumulative count is read, from the last
# occurrence (meta_info follows the text; a quote inside the text is always escaped).
_COMPLETION_TOKENS = re.compile(r'"completion_tokens":\s*(\d+)')


def completion_tokens(data: str) -> int:
    """meta_info.completion_tokens of one /generate stream event."""
    found = _COMPLETION_TOKENS.findall(data, data.rfind('"meta_info"'))
    if not found:
        raise RuntimeError(f"no completion_tokens in stream event {data[:200]}")
    return int(found[-1])


async def stream_generate(client: httpx.AsyncClient, req: BenchRequest, trace: Trace, clock: _Clock) -> None:
    """POST /generate with stream; each event carries the cumulative completion token count."""
    params = {"max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True}
    body = {"input_ids": req.prompt, "sampling_params": params, "stream": True}
    async with client.stream("POST", "/generate", json=body) as resp:
        async for data in _sse_data(resp):
            clock.tokens(completion_tokens(data))


async def stream_openai(client: httpx.AsyncClient, req: BenchRequest, trace: Trace, clock: _Clock) -> None:
    """POST /v1/completions with stream; a chunk with text (or the finish) counts one token; usage gives
    the total."""
    body = {
        "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    usage = None
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        async for event in _sse(resp):
            if any(c.get("text") or c.get("finish_reason") for c in event.get("choices", ())):
                clock.tokens(trace.output_tokens + 1)
            usage = event.get("usage") or usage
    if usage:
        trace.output_tokens = int(usage["completion_tokens"])


BACKENDS = {"generate": stream_generate, "openai": stream_openai}


async def _one(client: httpx.AsyncClient, backend: str, req: BenchRequest, gate: asyncio.Semaphore | None) -> Trace:
    trace = Trace(len(req.prompt), req.output_len)
    async with gate or _NullGate():
        t0 = time.perf_counter()
        try:
            await BACKENDS[backend](client, req, trace, _Clock(trace, t0))
        except Exception as exc:  # noqa: BLE001 - a failed request is a result
            trace.error = f"{type(exc).__name__}: {exc}"
        trace.latency_s = time.perf_counter() - t0
    return trace


class _NullGate:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


def arrival_gaps(n: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: exponential (Poisson process) or 0 for rate inf."""
    if math.isinf(rate):
        return [0.0] * n
    return np.random.default_rng(seed).exponential(1.0 / rate, size=n).tolist()


async def _load(
    url: str, backend: str, reqs: list[BenchRequest], gaps: list[float], max_conc: int | None, bar: tqdm,
    api_key: str = "",
) -> list[Trace]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    gate = asyncio.Semaphore(max_conc) if max_conc else None
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits,
                                 headers=auth_headers(api_key)) as client:
        tasks = []
        for req, gap in zip(reqs, gaps, strict=True):
            if gap > 0:
                await asyncio.sleep(gap)
            task = asyncio.create_task(_one(client, backend, req, gate))
            task.add_done_callback(lambda _t: bar.update(1))
            tasks.append(task)
        return list(await asyncio.gather(*tasks))


def run(
    url: str, backend: str, reqs: list[BenchRequest], rate: float, max_conc: int | None, seed: int, api_key: str = ""
) -> tuple[list[Trace], float]:
    """Replay `reqs` against `url`; return (traces, wall seconds)."""
    gaps = arrival_gaps(len(reqs), rate, seed)
    with tqdm(total=len(reqs), desc="serve", unit="req") as bar:
        t0 = time.perf_counter()
        traces = asyncio.run(_load(url, backend, reqs, gaps, max_conc, bar, api_key))
        duration = time.perf_counter() - t0
    return traces, duration


def warnings(traces: list[Trace], backend: str) -> list[str]:
    """Caveats about the figures (printed and saved with them)."""
    ok = [t for t in traces if t.error is None]
    chunks = sum(t.chunks for t in ok)
    per_chunk = sum(t.output_tokens for t in ok) / max(1, chunks)
    out = []
    if backend == "openai" and per_chunk > 1.5:
        out.append(
            f"the openai stream carried {per_chunk:.1f} tokens per chunk (ids-only model?): TTFT/ITL are not "
            "per token; use --backend generate"
        )
    return out


def figures(traces: list[Trace], duration: float, backend: str = "generate") -> dict[str, Any]:
    """Throughput plus TTFT / TPOT / ITL / E2E statistics in milliseconds."""
    ok = [t for t in traces if t.error is None and t.ttft_s is not None]
    out = sum(t.output_tokens for t in ok)
    tpot = [(t.latency_s - t.ttft_s) / (t.output_tokens - 1) for t in ok if t.output_tokens > 1]
    return {
        **report.throughput(len(traces), ok, duration),
        "mean_tokens_per_chunk": out / max(1, sum(t.chunks for t in ok)),
        "ttft_ms": summary([t.ttft_s for t in ok], 1e3),
        "tpot_ms": summary(tpot, 1e3),
        "itl_ms": summary([g for t in ok for g in t.itl_s], 1e3),
        "e2e_latency_ms": summary([t.latency_s for t in ok], 1e3),
        "errors": sorted({t.error for t in traces if t.error})[:10],
        "warnings": warnings(traces, backend),
    }


def table_rows(f: dict[str, Any]) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = report.throughput_rows(f)
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_latency_ms", "E2E")):
        stats = f[key]
        rows += [(f"{stat.capitalize()} {label} (ms)", stats[stat]) for stat in ("mean", "median", "p90", "p99")]
    return rows
