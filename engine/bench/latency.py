"""Decode latency vs the HBM roofline, in process (SchedulerCore + ModelRunner, no server).

For each batch size: submit `batch` random prompts of `context_len` tokens, step the
engine through their prefill, then time decode steps (every row extends by one token)
after a warm-up. The Steps come from SchedulerCore exactly as in the served engine
(LocalEngine builds both halves); the loop here just runs them one at a time, without
overlap, so that each ModelRunner.run_step can be timed on its own. The record also keeps the
runner's start-up phases and the kernel-cache files the measured steps added ("compiled after ready":
none where the warm-up covered them, as a served engine's must).
"""

from __future__ import annotations

import math
import shlex
import statistics
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from engine.args import parse_args
from engine.bench import idle, roofline
from engine.bench.launch import cached_kernels, report_compiles
from engine.config import ServerConfig
from engine.local import LocalEngine
from engine.run.memory import kv_bytes_per_token
from msgs.codec import pack_ids, unpack_ids
from msgs.params import SamplingParams
from msgs.requests import TokenizedRequest
from msgs.steps import Step

MAX_PREFILL_STEPS = 100_000  # a guard against a scheduler that never reaches a full decode batch
# prompt tokens a prefill step takes at most: the whole batch in one step up to 64 x 1024 (every
# figure of docs/PERF.md's tables), chunks above (DeepSeek-V3-5L at 64 x 8192 spent over 160 s in
# the warm-up of a 524k-token step: docs/PERF.md, tenth session); rows that finish first decode
# meanwhile, within decode_budget, and timing starts at the first decode step of the whole batch
PREFILL_CAP = 65536


@dataclass
class StepTime:
    run_ms: float  # ModelRunner.run_step wall time (it ends with the host sync of sampled ids)
    cycle_ms: float  # plan + run_step + on_done: the step period of a non-overlapped loop
    cuda_ms: float | None  # CUDA events around run_step (GPU only)
    kv_tokens: int  # tokens attended to, summed over the batch


@dataclass
class BatchResult:
    batch: int
    times: list[StepTime] = field(default_factory=list)
    idle: dict[str, Any] | None = None
    pipelined_ms: float | None = None  # median step interval of the overlapped loop
    pipelined_mean_ms: float | None = None
    pipelined_warmup_ms: list[float] = field(default_factory=list)  # the untimed first steps


def server_config(args: Any, model_dir: str) -> ServerConfig:
    """The engine config: --server-args parsed like bin/serve's flags, then sized for this run."""
    # the model and device first: the auto page size depends on them (ServerConfig._check_page_size)
    cfg = parse_args(["--model", model_dir, "--device", args.device, *shlex.split(args.server_args or "")])
    biggest = max(args.batch_sizes)
    per_req = args.context_len + decode_budget(args) + cfg.page_size
    pages = math.ceil(per_req / cfg.page_size) + 1
    return replace(
        cfg,
        model=model_dir,
        load_format=args.load_format,
        device=args.device,
        max_running_requests=max(cfg.max_running_requests, biggest),
        max_total_tokens=cfg.max_total_tokens or biggest * pages * cfg.page_size,
        max_prefill_tokens=max(cfg.max_prefill_tokens, min(biggest * args.context_len, PREFILL_CAP)),
        disable_radix_cache=True,
    )


def decode_budget(args: Any) -> int:
    """Tokens each request must be able to generate: warm-up (serial and overlapped), timed
    (serial and overlapped) and profiled steps, plus slack, plus one token a prefill step of the
    largest batch (a row prefilled early decodes while the others' chunks run)."""
    chunks = math.ceil(max(args.batch_sizes) * args.context_len / PREFILL_CAP)
    return 2 * args.warmup + 2 * args.steps + (args.idle_steps if args.profile_idle else 0) + 6 + chunks


class Driver:
    """Runs SchedulerCore's Steps on the ModelRunner one at a time, timing each."""

    def __init__(self, eng: LocalEngine, temperature: float = 0.0, top_k: int = -1, top_p: float = 1.0) -> None:
        self.eng = eng
        # temperature > 0: every step samples (the race's noise, top_k / top_p's candidates) instead of an argmax
        self.sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
        self.core, self.runner = eng.core, eng.runner
        self.cuda = self.runner.device.type == "cuda"

    def submit(self, prompts: list[list[int]], max_new: int, tag: str) -> list[str]:
        params = SamplingParams(max_new_tokens=max_new, ignore_eos=True, **self.sampling)
        rids = [f"{tag}-{i}" for i in range(len(prompts))]
        for rid, ids in zip(rids, prompts, strict=True):
            err = self.core.submit(TokenizedRequest(rid=rid, input_ids=pack_ids(ids), params=params))
            if err is not None:
                raise RuntimeError(f"request {rid} rejected: {err.error}")
        return rids

    def step(self, events: bool = True) -> tuple[Step, StepTime] | None:
        """Plan, run and collect one Step; None when the scheduler has nothing to do.

        events: time run_step with CUDA events too (a synchronize first; off while profiling)."""
        t0 = time.perf_counter()
        step = self.core.plan()
        if step is None:
            return None
        start = end = None
        if self.cuda and events:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t1 = time.perf_counter()
        done = self.runner.run_step(step)
        if end is not None:
            end.record()
            end.synchronize()
        t2 = time.perf_counter()
        self.core.on_done(done)
        t3 = time.perf_counter()
        cuda_ms = start.elapsed_time(end) if start is not None else None
        return step, StepTime((t2 - t1) * 1e3, (t3 - t0) * 1e3, cuda_ms, kv_tokens(step))

    def step_until_decoding(self, batch: int) -> None:
        """Run Steps until one is a pure decode of the whole batch (it runs, as warm-up)."""
        for _ in range(MAX_PREFILL_STEPS):
            got = self.step()
            if got is None:
                raise RuntimeError("scheduler went idle before the batch reached decode")
            if is_full_decode(got[0], batch):
                return
        raise RuntimeError(f"no full decode step of batch {batch} after {MAX_PREFILL_STEPS} steps")

    def decode_steps(self, n: int, batch: int, bar: tqdm | None = None, events: bool = True) -> list[StepTime]:
        out = []
        for _ in range(n):
            got = self.step(events)
            if got is None or not is_full_decode(got[0], batch):
                raise RuntimeError("the decode batch changed mid-measurement (a request finished early?)")
            out.append(got[1])
            if bar is not None:
                bar.update(1)
        return out

    def decode_pipelined(self, n: int, batch: int, warmup: int) -> tuple[float, float, list[float]]:
        """(median, mean, the warm-up steps' ms) wall ms per decode step when each step is launched before the previous
        one's result is collected: the served worker's loop (procs/worker.py), minus the
        sockets. A step's time is the interval between consecutive results, timed after
        `warmup` untimed steps of the same loop (on an H200 the mean of 50 steps timed from the
        first one ran ~40 ms in all above their median: a start-up transient); the median, like
        the serial figure's, also leaves out a rare host stall that the mean keeps."""
        launched: deque = deque()
        if self.cuda:
            torch.cuda.synchronize()
        stamps = [time.perf_counter()]
        while len(stamps) <= n + warmup:
            while len(launched) < 2:
                step = self.core.plan()
                if step is None or not is_full_decode(step, batch):
                    raise RuntimeError("the decode batch changed mid-measurement (a request finished early?)")
                launched.append(self.runner.launch(step))
            self.core.on_done(self.runner.finish(launched.popleft()))
            stamps.append(time.perf_counter())
        while launched:
            self.core.on_done(self.runner.finish(launched.popleft()))
            stamps.append(time.perf_counter())
        gaps = np.diff(stamps) * 1e3
        timed = gaps[warmup:]
        return float(np.median(timed)), float(timed.mean()), [round(float(g), 3) for g in gaps[:warmup]]

    def finish(self, rids: list[str]) -> None:
        """Abort the batch and run the Steps that free it, so the next batch starts clean."""
        for rid in rids:
            self.core.abort(rid)
        while self.step() is not None:
            pass
        if not self.core.idle:
            raise RuntimeError("engine not idle after aborting the batch")


def is_full_decode(step: Step, batch: int) -> bool:
    fwd = step.forward
    if fwd is None:
        return False
    lens = unpack_ids(fwd.extend_lens)
    return len(lens) == batch and all(n == 1 for n in lens)


def kv_tokens(step: Step) -> int:
    """KV entries the step's attention reads: each row attends to start_pos + its new tokens."""
    if step.forward is None:
        return 0
    return sum(unpack_ids(step.forward.start_pos)) + sum(unpack_ids(step.forward.extend_lens))


def measure_batch(drv: Driver, args: Any, batch: int, vocab: int, bar: tqdm) -> BatchResult:
    """Prefill `batch` prompts, warm up, time `steps` decode steps, optionally profile idle time."""
    rng = np.random.default_rng(args.seed + batch)
    prompts = [rng.integers(0, vocab, size=args.context_len).tolist() for _ in range(batch)]
    rids = drv.submit(prompts, decode_budget(args), f"b{batch}")
    bar.set_postfix_str(f"batch {batch}: prefill")
    drv.step_until_decoding(batch)
    bar.update(1)
    bar.set_postfix_str(f"batch {batch}: decode")
    drv.decode_steps(args.warmup - 1, batch, bar)
    res = BatchResult(batch, drv.decode_steps(args.steps, batch, bar))
    res.pipelined_ms, res.pipelined_mean_ms, res.pipelined_warmup_ms = drv.decode_pipelined(
        args.steps, batch, args.warmup)
    if profiles_idle(args, drv.runner.device):
        res.idle = idle.profile_idle(drv.runner.device, lambda n: _sched_s(drv, n, batch, bar), args.idle_steps)
    elif args.profile_idle:
        res.idle = {"skipped": "no GPU: idle profiling needs CUDA"}
    drv.finish(rids)
    return res


def profiles_idle(args: Any, device: torch.device) -> bool:
    return bool(args.profile_idle) and device.type == "cuda"


def _sched_s(drv: Driver, n: int, batch: int, bar: tqdm) -> float:
    """Run n decode steps without CUDA events; return the seconds spent in plan / on_done."""
    times = drv.decode_steps(n, batch, bar, events=False)
    return sum(t.cycle_ms - t.run_ms for t in times) / 1e3


def summarize(res: BatchResult, context_len: int, weights: int, kv_per_token: int, bw: float) -> dict[str, Any]:
    """Figures of one batch size: measured ms/step against the roofline ms/step (`weights`: the
    bytes a step of this batch reads, roofline.weight_bytes)."""
    run = [t.run_ms for t in res.times]
    cuda = [t.cuda_ms for t in res.times if t.cuda_ms is not None]
    kv_read = statistics.fmean(t.kv_tokens for t in res.times) * kv_per_token
    step_bytes = weights + kv_read
    ms = statistics.median(run)
    roof_ms = step_bytes / bw * 1e3
    return {
        "batch_size": res.batch,
        "context_len": context_len,
        "mean_kv_tokens_per_row": statistics.fmean(t.kv_tokens for t in res.times) / res.batch,
        "ms_per_step_median": ms,
        "ms_per_step_mean": statistics.fmean(run),
        "ms_per_step_p90": float(np.percentile(run, 90)),
        "cuda_ms_per_step_median": statistics.median(cuda) if cuda else None,
        "cycle_ms_per_step_median": statistics.median(t.cycle_ms for t in res.times),
        "weight_bytes": weights,
        "kv_bytes_read": int(kv_read),
        "bytes_per_step": int(step_bytes),
        "roofline_ms": roof_ms,
        "ratio_to_roofline": ms / roof_ms,
        "tokens_per_s": res.batch / (ms / 1e3),
        "pipelined_ms_per_step": res.pipelined_ms,
        "pipelined_ms_per_step_mean": res.pipelined_mean_ms,
        "pipelined_warmup_ms": res.pipelined_warmup_ms,
        "pipelined_ratio_to_roofline": res.pipelined_ms / roof_ms if res.pipelined_ms else None,
        "idle": res.idle,
    }


def run(args: Any, model_dir: str, vocab: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Measure every batch size; return (engine-level figures, per-batch figures)."""
    cfg = server_config(args, model_dir)
    eng = LocalEngine(cfg)
    runner = eng.runner
    at_ready = cached_kernels()  # the runner is warm: what the steps below compile, a request would meet
    weights = roofline.weight_bytes(runner.model, runner.mcfg.tie_word_embeddings)  # all of them
    moe = getattr(runner.mcfg, "moe", None) is not None
    kv_per_token = kv_bytes_per_token(runner.mcfg, runner.kv_dtype)
    copy_bytes = roofline.copy_size(runner.device, args.bandwidth_gib)
    bw = roofline.copy_bandwidth(runner.device, copy_bytes)
    need = args.context_len + decode_budget(args)
    if need > runner.max_context:
        raise SystemExit(
            f"bench: context {args.context_len} + {decode_budget(args)} decode tokens exceeds the "
            f"engine's max context {runner.max_context}"
        )
    drv = Driver(eng, args.temperature, args.top_k, args.top_p)
    per_step = args.warmup + args.steps + (args.idle_steps if profiles_idle(args, runner.device) else 0)
    with tqdm(total=per_step * len(args.batch_sizes), desc="latency", unit="step") as bar:
        results = [measure_batch(drv, args, b, vocab, bar) for b in args.batch_sizes]
    compiled = report_compiles(at_ready)
    engine = {
        "device": str(runner.device),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "bandwidth_gb_s": bw / 1e9,
        "bandwidth_copy_bytes": copy_bytes,
        "weight_bytes": weights,
        "weight_bytes_rule": roofline.MOE_RULE if moe else "every parameter but the embedding gather",
        "kv_bytes_per_token": kv_per_token,
        "num_parameters": sum(p.numel() for p in runner.model.parameters()),
        "kv_pool_tokens": (runner.num_pages - 1) * runner.page_size,
        "startup_s": {k: round(v, 2) for k, v in runner.startup.items()},  # load, warm-up, capture
        "compiled_after_ready": compiled,  # kernel-cache files the measured steps added (ready means warm)
    }
    tied = runner.mcfg.tie_word_embeddings
    step_weights = {b: roofline.weight_bytes(runner.model, tied, b) for b in args.batch_sizes}  # MoE: by batch
    return engine, [summarize(r, args.context_len, step_weights[r.batch], kv_per_token, bw) for r in results]
