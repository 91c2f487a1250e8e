"""LocalEngine: SchedulerCore and one ModelRunner in one process, joined by direct calls
instead of sockets. The Step stream, overlap and digests are exactly those of the served
engine; only the transport differs. Used by differential tests and offline scripts."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.config import ServerConfig
from engine.env import env
from engine.run.runner import ModelRunner
from engine.sched.scheduler import SchedConfig, SchedulerCore
from msgs.codec import pack_ids
from msgs.done import StepDone
from msgs.outputs import ReqOutput
from msgs.params import SamplingParams
from msgs.requests import TokenizedRequest
from msgs.steps import Step


@dataclass
class Result:
    rid: str
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float] | None = None  # SamplingParams.prompt_logprobs: prompt tokens 1..
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None


class LocalEngine:
    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.runner = ModelRunner(cfg)
        ready = self.runner.ready_msg()
        self.core = SchedulerCore(SchedConfig.build(cfg, ready, num_ranks=1, digest_every=env().digest_every or 1))
        self.steps_run = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Result]:
        """Run every prompt to completion, all submitted at once (one continuous batch)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        base = self.steps_run
        results = {f"r{base}-{i}": Result(f"r{base}-{i}") for i in range(len(prompts))}
        for (rid, _), ids, p in zip(results.items(), prompts, plist, strict=True):
            err = self.core.submit(TokenizedRequest(rid=rid, input_ids=pack_ids(ids), params=p))
            if err is not None:
                results[rid].finish_reason = "error"
        self._drive(results)
        return list(results.values())

    def flush(self) -> None:
        """Empty the prefix cache (SchedulerCore.flush), settling in-flight steps first; the Flush
        op reaches the runner's replica with the next Step."""
        if (why := self.core.flush()) is not None:
            raise RuntimeError(f"flush: {why}")

    def _drive(self, results: dict[str, Result]) -> None:
        ahead = 1 if self.cfg.disable_overlap else 2
        inflight: deque[Step] = deque()
        while True:
            for report in self.runner.grammar_reports(wait=not inflight and self.core.busy):
                self._emit(self.core.on_grammar_ready(report), results)
            while len(inflight) < ahead and (step := self.core.plan()) is not None:
                inflight.append(step)
            if not inflight:
                if self.runner.compiling:  # requests wait for their grammar
                    continue
                break
            step = inflight.popleft()
            self._collect(self.runner.run_step(step), results)
            self.steps_run += 1

    def _collect(self, done: StepDone, results: dict[str, Result]) -> None:
        self._emit(self.core.on_done(done), results)

    def _emit(self, outs: list[ReqOutput], results: dict[str, Result]) -> None:
        for out in outs:
            res = results.get(out.rid)
            if res is None:
                continue
            res.output_ids.extend(out.new_ids)
            res.cached_tokens = out.cached_tokens
            if out.logprobs:
                res.logprobs.extend(out.logprobs)
            if out.prompt_logprobs is not None:
                res.prompt_logprobs, res.prompt_top_logprobs = out.prompt_logprobs, out.prompt_top_logprobs
            if out.finish_reason:
                res.finish_reason = out.finish_reason
