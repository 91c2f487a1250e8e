"""Offline throughput: every request submitted at once through the real process stack.

Requests go over the ZMQ SDK (default) or HTTP /generate, with ignore_eos and
temperature 0, so each produces exactly its requested number of tokens.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm import tqdm

from engine.bench import report
from engine.bench.launch import auth_headers
from engine.bench.workload import BenchRequest

OFFLINE_TIMEOUT_S = 3600.0


@dataclass
class Outcome:
    prompt_tokens: int
    requested: int
    output_tokens: int = 0
    latency_s: float = 0.0
    error: str | None = None


def sampling(req: BenchRequest) -> dict[str, Any]:
    """Greedy, fixed-length generation parameters for one request."""
    return {"max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True}


async def _timed(coro_fn: Any, req: BenchRequest, bar: tqdm) -> Outcome:
    out = Outcome(len(req.prompt), req.output_len)
    t0 = time.perf_counter()
    try:
        out.output_tokens = await coro_fn(req)
    except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash
        out.error = f"{type(exc).__name__}: {exc}"
    out.latency_s = time.perf_counter() - t0
    bar.update(1)
    return out


async def run_sdk(addr: str, reqs: list[BenchRequest], bar: tqdm, api_key: str = "") -> list[Outcome]:
    """All requests at once over the SDK socket; returns per-request outcomes."""
    from engine.bench.sdk_client import SdkBatchClient

    async with SdkBatchClient(addr, api_key) as client:

        async def one(req: BenchRequest) -> int:
            chunk = await client.generate(req.prompt, **sampling(req))
            return chunk.completion_tokens or len(chunk.token_ids)

        return await asyncio.gather(*(_timed(one, r, bar) for r in reqs))


async def run_http(url: str, reqs: list[BenchRequest], bar: tqdm, api_key: str = "") -> list[Outcome]:
    """All requests at once as non-streaming POST /generate."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=OFFLINE_TIMEOUT_S, limits=limits,
                                 headers=auth_headers(api_key)) as client:

        async def one(req: BenchRequest) -> int:
            body = {"input_ids": req.prompt, "sampling_params": sampling(req), "stream": False}
            resp = await client.post("/generate", json=body)
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
            return int(resp.json()["meta_info"]["completion_tokens"])

        return await asyncio.gather(*(_timed(one, r, bar) for r in reqs))


def run(backend: str, address: str, reqs: list[BenchRequest], api_key: str = "") -> tuple[list[Outcome], float]:
    """Send every request; return (outcomes, wall seconds from first send to last reply)."""
    runner = run_sdk if backend == "sdk" else run_http
    with tqdm(total=len(reqs), desc="offline", unit="req") as bar:
        t0 = time.perf_counter()
        outcomes = asyncio.run(runner(address, reqs, bar, api_key))
        duration = time.perf_counter() - t0
    return list(outcomes), duration


def figures(outcomes: list[Outcome], duration: float) -> dict[str, Any]:
    """Throughput figures over the successful requests."""
    ok = [o for o in outcomes if o.error is None]
    errors = sorted({o.error for o in outcomes if o.error})
    return {
        **report.throughput(len(outcomes), ok, duration),
        "mean_latency_s": sum(o.latency_s for o in ok) / len(ok) if ok else None,
        "errors": errors[:10],
    }


def table_rows(f: dict[str, Any]) -> list[tuple[str, Any]]:
    return [*report.throughput_rows(f), ("Mean request latency (s)", f["mean_latency_s"])]
