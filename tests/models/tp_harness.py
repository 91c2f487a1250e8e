"""Tensor-parallel engine harness: N real worker ranks in N spawned processes over gloo.

Rank 0 runs the scheduler core (SchedulerCore, num_ranks=N, a digest check every step) next to
its ModelRunner, like engine/local.py's LocalEngine; every Step goes to every rank (a pipe
per other rank), each rank runs it (the collectives meet), and every rank's StepDone goes
back to the core, which checks each rank's replica digest and token hash chain against
rank 0's. Steps are planned one ahead (overlap, future token references) unless the config
disables it. Only the transport differs from bin/serve: pipes instead of zmq sockets.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from engine.config import ServerConfig
from tests.ports import reserve_ports


@dataclass
class Out:
    output_ids: list[int]
    cached_tokens: int
    finish_reason: str | None
    step_ms: list[float] | None = None  # wall ms of every pure-decode step of its wave (rank 0)
    step_rows: list[int] | None = None  # the batch size of each of those steps


def _rank_main(cfg_json: str, rank: int, port: int, peers: list[Connection], waves: list[Any], out: Any,
               tuning: dict | None = None) -> None:
    """One rank's process: the environment bin/serve's supervisor would give it, then serve.
    `tuning`: KernelTuning fields over the GPU's file (engine.layers.tuning.override_tuning)."""
    cfg = ServerConfig.from_json(cfg_json)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(cfg.tp_size), LOCAL_RANK=str(rank))
    try:
        import torch

        if tuning:
            from engine.layers.tuning import override_tuning

            override_tuning(**tuning)

        if cfg.resolved_device == "cpu":
            torch.set_num_threads(1)
        from engine.run.runner import ModelRunner

        runner = ModelRunner(cfg, rank)
        if rank == 0:
            out.put(("ok", _drive(cfg, runner, peers, waves)))
        else:
            (conn,) = peers
            conn.send(runner.ready_msg())
            while (step := conn.recv()) is not None:
                conn.send(runner.run_step(step))
            out.put(("ok", None))
    except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
        out.put(("error", f"rank {rank}: {traceback.format_exc()}"))
    finally:
        from engine.run.dist import shutdown_distributed

        shutdown_distributed(1)


def _drive(cfg: ServerConfig, runner: Any, peers: list[Connection], waves: list[Any]) -> list[list[Out]]:
    from engine.sched.loop import agree
    from engine.sched.scheduler import SchedConfig, SchedulerCore
    from msgs.codec import pack_ids, unpack_ids
    from msgs.requests import TokenizedRequest

    readies = {0: runner.ready_msg()} | {r + 1: c.recv() for r, c in enumerate(peers)}
    core = SchedulerCore(SchedConfig.build(cfg, agree(readies), num_ranks=cfg.tp_size, digest_every=1))
    ahead = 1 if cfg.disable_overlap else 2
    results: list[list[Out]] = []
    for w, (prompts, params) in enumerate(waves):  # one wave = one continuous batch; later waves hit the cache
        outs = {f"w{w}-{i}": Out([], 0, None) for i in range(len(prompts))}
        for rid, ids in zip(outs, prompts, strict=True):
            assert core.submit(TokenizedRequest(rid=rid, input_ids=pack_ids(ids), params=params)) is None
        inflight: deque = deque()
        while True:
            while len(inflight) < ahead and (step := core.plan()) is not None:
                inflight.append(step)
            if not inflight:
                break
            step = inflight.popleft()
            for c in peers:  # every rank gets every Step, before rank 0 runs it (the collectives meet)
                c.send(step)
            t0 = time.perf_counter()
            dones = [runner.run_step(step)] + [c.recv() for c in peers]
            ms = (time.perf_counter() - t0) * 1e3
            lens = unpack_ids(step.forward.extend_lens) if step.forward is not None else []
            if lens and set(lens) == {1}:
                for o in outs.values():
                    o.step_ms = (o.step_ms or []) + [ms]
                    o.step_rows = (o.step_rows or []) + [len(lens)]
            for done in dones:  # rank 0 first: the others' token chains are checked against its tokens
                for o in core.on_done(done):
                    res = outs[o.rid]
                    res.output_ids.extend(o.new_ids)
                    res.cached_tokens = o.cached_tokens
                    res.finish_reason = o.finish_reason or res.finish_reason
        assert core.idle and core.leak_free()
        results.append(list(outs.values()))
    for c in peers:
        c.send(None)
    return results


def run_tp(cfg: ServerConfig, waves: list[Any], timeout_s: float = 240.0,
           tuning: dict | None = None) -> list[list[Out]]:
    """Run `waves` ([(prompts, SamplingParams)]) on cfg.tp_size ranks; per wave, per prompt, the
    output. `tuning` as in _rank_main (every rank the same)."""
    ctx = mp.get_context("spawn")
    port = reserve_ports(1)
    pipes = [ctx.Pipe() for _ in range(cfg.tp_size - 1)]
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(cfg.to_json(), 0, port, [a for a, _ in pipes], waves, out, tuning),
                    daemon=True)
    ] + [
        ctx.Process(target=_rank_main, args=(cfg.to_json(), r + 1, port, [b], waves, out, tuning), daemon=True)
        for r, (_, b) in enumerate(pipes)
    ]
    for p in procs:
        p.start()
    for a, b in pipes:  # only the ranks hold them now: a rank that dies closes its end (EOF, not a hang)
        a.close()
        b.close()
    try:
        reports = [out.get(timeout=timeout_s) for _ in procs]
        errors = [msg for kind, msg in reports if kind == "error"]
        assert not errors, "\n".join(errors)
        (result,) = [msg for _, msg in reports if msg is not None]
        return result
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
