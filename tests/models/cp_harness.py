"""Context-parallel greedy decoding at the model level: cp ranks in spawned processes over gloo.

`CPGreedy` is model_harness.PagedGreedy for one cp rank: a request's page i comes from the
allocator of rank page_owner(i) (every rank runs every owner's allocator over the same calls,
so all ranks build the same page tables without a message, as the replicated scheduler will);
the rank's KV pool has only `pages_per_rank` pages. At cp 1 it is the plain path (TorchAttention,
one pool), the reference. `scenario` is one fixed workload: long prompts prefilled in chunks
next to a short one that decodes meanwhile, then a second wave reusing a cached prefix.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import queue
import random
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.layers.attention import TorchAttention
from engine.layers.cp_attention import page_owner
from engine.layers.forward import ForwardBatch
from engine.layers.kv_pool import KVPool
from engine.layers.parallel import ParallelState, TPGroup, parallel_state, set_parallel_state
from models.registry import kv_layout, load_model
from tests.ports import reserve_ports

PAGE = 4


@dataclass
class Seq:
    tokens: list[int]
    pages: list[int]  # page i: global id local * cp + owner of a page in rank page_owner(i)'s pool
    cached: int = 0
    out: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)


class CPGreedy:
    def __init__(self, model: torch.nn.Module, cfg: Any, pages_per_rank: int, page_size: int = PAGE) -> None:
        from engine.layers.cp_attention import context_parallel

        self.model, self.cfg, self.page_size = model, cfg, page_size
        self.cp = parallel_state().cp
        self.kv = KVPool.from_layout(kv_layout(cfg), cfg.num_layers, pages_per_rank, page_size, torch.float32, "cpu")
        self.backend = context_parallel(TorchAttention("cpu"))
        self.free = [list(range(1, pages_per_rank)) for _ in range(self.cp.world)]  # page 0: padding
        for r, f in enumerate(self.free):
            random.Random(r).shuffle(f)  # non-contiguous page tables
        self.used = [set() for _ in range(self.cp.world)]  # pages handed out, per owner

    def new_seq(self, prompt: Sequence[int], max_new: int, share: Seq | None = None, shared_tokens: int = 0) -> Seq:
        """Room for max_new tokens; the first `shared_tokens` (whole pages) are `share`'s KV."""
        assert shared_tokens % self.page_size == 0
        pages = share.pages[: shared_tokens // self.page_size] if share else []
        for i in range(len(pages), math.ceil((len(prompt) + max_new) / self.page_size)):
            owner = page_owner(i, self.cp.world)
            local = self.free[owner].pop()
            pages.append(local * self.cp.world + owner)  # the global id (engine/cache/allocator.py)
            self.used[owner].add(local)
        return Seq(tokens=list(prompt), pages=list(pages), cached=shared_tokens)

    def step(self, seqs: list[Seq], chunk: int | None) -> None:
        reqs, sample = [], []
        for s in seqs:
            n = len(s.tokens) - s.cached if chunk is None else min(chunk, len(s.tokens) - s.cached)
            reqs.append((s.tokens[s.cached : s.cached + n], s.cached, s.pages))
            s.cached += n
            sample.append(s.cached == len(s.tokens))
        batch = ForwardBatch.from_requests(reqs, self.page_size, "cpu", sample)
        self.backend.prepare(batch)
        logits = self.model(batch, self.kv, self.backend)
        for s, row in zip([s for s, m in zip(seqs, sample, strict=True) if m], logits, strict=True):
            s.out.append(int(row.argmax()))
            s.tokens.append(s.out[-1])
            s.logits.append(row)

    def run(self, seqs: list[Seq], max_new: int, chunk: int | None = None) -> None:
        while active := [s for s in seqs if len(s.out) < max_new]:
            self.step(active, chunk)

    def untouched_pages_zero(self) -> bool:
        """Whether every page of this rank's pool that it never owned is still all zeros."""
        idle = sorted(set(range(1, self.kv.num_pages)) - self.used[self.cp.rank])
        return all(not t[:, idle].any() for t in self.kv.page_bytes())


MAX_NEW = 5


def scenario(model_dir: Path, pages_per_rank: int, seed: int = 0) -> dict:
    """The fixed workload on this rank: tokens, logits, pages used per owner, pool checks."""
    from engine.run.dist import rank_config

    model, cfg = load_model(model_dir, dtype=torch.float32, progress=False)
    g = CPGreedy(model, rank_config(cfg), pages_per_rank)  # at tp > 1 the pool holds this rank's K/V heads
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, cfg.vocab_size) for _ in range(n)]

    # wave 1: long prompts (not multiples of cp x page) in chunks of 24 next to a short one's decodes
    first = [g.new_seq(prompt(n), MAX_NEW) for n in (83, 61, 5)]
    g.run(first, MAX_NEW, chunk=24)
    # wave 2: a suffix over the first prompt's 10 cached pages (40 tokens), next to a fresh prompt
    shared = first[0].tokens[:40]
    second = [g.new_seq(shared + prompt(29), MAX_NEW, share=first[0], shared_tokens=40),
              g.new_seq(prompt(45), MAX_NEW)]
    g.run(second, MAX_NEW, chunk=16)
    seqs = first + second
    return {"tokens": [s.out for s in seqs], "logits": [torch.stack(s.logits) for s in seqs],
            "used": [len(u) for u in g.used], "pages": [s.pages for s in seqs], "pool_pages": g.kv.num_pages,
            "untouched_zero": g.untouched_pages_zero()}


def _groups(rank: int, cp: int, tp: int) -> ParallelState:
    """rank = cp_rank * tp + tp_rank (tp innermost: a tp group is consecutive ranks). Every rank
    creates every group, in one order (torch.distributed.new_group is collective)."""
    import torch.distributed as dist

    if tp == 1:
        return ParallelState(cp=TPGroup(rank, cp))  # the default group is the cp group
    tp_groups = [dist.new_group([c * tp + t for t in range(tp)]) for c in range(cp)]
    cp_groups = [dist.new_group([c * tp + t for c in range(cp)]) for t in range(tp)]
    c, t = divmod(rank, tp)
    return ParallelState(tp=TPGroup(t, tp, tp_groups[c]), cp=TPGroup(c, cp, cp_groups[t]))


def _die_at_merge(n: int) -> None:
    """This rank exits (no report, no goodbye) at its n-th attention merge: a dead peer mid-step."""
    import os

    from engine.layers.cp_attention import ContextParallelAttention

    merge, calls = ContextParallelAttention.merge, [0]

    def dying(self: ContextParallelAttention, o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == n:
            os._exit(3)
        return merge(self, o, lse)

    ContextParallelAttention.merge = dying  # type: ignore[method-assign]


def _rank_main(model_dirs: list[str], rank: int, cp: int, tp: int, port: int, pages_per_rank: int,
               out: Any, die_at: int = 0) -> None:
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp * tp)
        set_parallel_state(_groups(rank, cp, tp))
        if die_at and rank == cp * tp - 1:
            _die_at_merge(die_at)
        results = [scenario(Path(d), pages_per_rank) for d in model_dirs]  # one start-up for every model
        for res in results:  # numpy pickles by value: a tensor would go through shared memory the rank takes away
            res["logits"] = [t.numpy() for t in res["logits"]]
        out.put((rank, "ok", results))
    except BaseException:  # noqa: BLE001 - reported to the test
        out.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_reference(model_dir: Path, pages: int) -> dict:
    """cp = 1 in this process (the plain path)."""
    set_parallel_state(ParallelState())
    return scenario(model_dir, pages)


def spawn_ranks(model_dirs: list[Path], cp: int, pages_per_rank: int, tp: int = 1, timeout_s: float = 120.0,
                die_at: int = 0) -> dict[int, tuple[str, Any]]:
    """Run the scenario on cp x tp spawned ranks: rank -> ("ok", per-model results) or ("error",
    traceback), or ("died", exit code) for a rank that exited without a report. `die_at`: the last
    rank exits at its die_at-th attention merge."""
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), reserve_ports(1)
    dirs = [str(d) for d in model_dirs]
    procs = [ctx.Process(target=_rank_main, args=(dirs, r, cp, tp, port, pages_per_rank, out, die_at), daemon=True)
             for r in range(cp * tp)]
    for p in procs:
        p.start()
    reports: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(reports) < len(procs) and time.monotonic() < deadline:
            try:
                rank, kind, msg = out.get(timeout=0.2)
                reports[rank] = (kind, msg)
            except queue.Empty:  # every rank gone and nothing more to read: the rest died silently
                if not any(p.is_alive() for p in procs):
                    break
        for r, p in enumerate(procs):
            p.join(10)
            reports.setdefault(r, ("died", p.exitcode))
        return reports
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


def run_cp(model_dirs: list[Path], cp: int, pages_per_rank: int, tp: int = 1,
           timeout_s: float = 120.0) -> list[list[dict]]:
    """The scenario for each model on cp x tp ranks (spawned processes, gloo): per model, each
    rank's result, by rank."""
    reports = spawn_ranks(model_dirs, cp, pages_per_rank, tp, timeout_s)
    errors = [f"rank {r}: {kind}: {msg}" for r, (kind, msg) in sorted(reports.items()) if kind != "ok"]
    assert not errors, "\n".join(errors)
    per_rank = [reports[r][1] for r in range(cp * tp)]
    for res in (res for results in per_rank for res in results):
        res["logits"] = [torch.from_numpy(a) for a in res["logits"]]
    return [list(by_model) for by_model in zip(*per_rank, strict=True)]
