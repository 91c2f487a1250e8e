"""Differential integrity of the host tier, in one process with the real parts: the
scheduler core, a ModelRunner on the default model (CPU), the cache controller driver
over the real channel codecs, and a real shared-memory slab.

Multi-turn conversations with a small L1 and L2: every turn's greedy output must equal
the output of the same prompt computed fresh (radix cache off), whether its prefix was
computed, hit in L1 or loaded back from L2; every step is digest-checked (workers and
the controller against the scheduler's mirror); nothing leaks in either tier afterwards.
The tiered engine also writes L3 files (--l3-dir); after a full restart (a new runner,
slab, controller and scheduler on the same directory) the conversations are served from
L3 with the same outputs, and a conversation whose file was corrupted is recomputed, with
the same output too.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest

from engine.cache import l3
from engine.cache.controller import CacheController, L3Tier, SlabMapping
from engine.cache.slab import create_slab, remove_slab
from engine.config import ServerConfig
from engine.run.runner import ModelRunner
from engine.sched.scheduler import SchedConfig, SchedulerCore
from msgs.channels import BACKUPS, COMMITS, STEPS, pipe
from msgs.codec import pack_ids
from msgs.done import BackupDone
from msgs.params import SamplingParams
from msgs.requests import TokenizedRequest

# two tokens: the first from the prompt's prefill, the second from a decode step, whose KV (the
# first output's) the next turn's prefix carries
GREEDY = SamplingParams(max_new_tokens=2, temperature=0.0, logprobs=True)


class Engine:
    """SchedulerCore + one ModelRunner (+ the cache controller when the tier is on),
    stepped like the served engine (two steps in flight), digests checked every step."""

    def __init__(self, cfg: ServerConfig) -> None:
        from engine.run.fingerprint import l3_ready_fields

        self.runner = ModelRunner(cfg)
        ready = msgspec.structs.replace(self.runner.ready_msg(), **l3_ready_fields(cfg, self.runner))
        self.fingerprint = ready.l3_fingerprint
        self.core = SchedulerCore(SchedConfig.build(cfg, ready, num_ranks=1, digest_every=1))
        self.to_ctrl, steps_in = pipe(STEPS)
        self.backups, backups_in = pipe(BACKUPS)
        commits_out, self.commits = pipe(COMMITS)
        slab = SlabMapping(cfg.hicache_path)
        self.l3 = L3Tier(slab, cfg.l3_dir, 1 << 30) if cfg.l3_dir else None
        self.ctrl = CacheController(1, steps_in, backups_in, commits_out, [slab], l3=self.l3)
        self.n = 0
        self.logprobs: list[list[float]] = []  # of the last run's prompts

    def run(self, prompts: list[list[int]]) -> list[list[int]]:
        """Each prompt's greedy output ids (`logprobs` keeps their logprobs by prompt)."""
        rids = []
        for ids in prompts:
            rid = f"r{self.n}"
            self.n += 1
            assert self.core.submit(TokenizedRequest(rid=rid, input_ids=pack_ids(ids), params=GREEDY)) is None
            rids.append(rid)
        out: dict[str, list[int]] = {rid: [] for rid in rids}
        lps: dict[str, list[float]] = {rid: [] for rid in rids}
        inflight: deque = deque()
        deadline = time.monotonic() + 120
        while True:
            while len(inflight) < 2 and (step := self.core.plan()) is not None:
                self.to_ctrl.send(step)
                inflight.append(step)
            if not inflight:
                if self.core.idle:
                    self.logprobs = [lps[r] for r in rids]
                    return [out[r] for r in rids]
                assert time.monotonic() < deadline, "stuck: nothing to plan, requests left"
                time.sleep(0.002)  # a request waits for an L3 read (the controller's thread)
                self._controller()
                continue
            for o in self.core.on_done(self.runner.run_step(inflight.popleft())):
                out[o.rid].extend(o.new_ids)
                lps[o.rid].extend(o.logprobs or [])
            self._controller()

    def _controller(self) -> None:
        if self.core.state.tiers is None:  # tier off: no controller in the served engine either
            return
        for obj in self.runner.host_tier.take_done():
            self.backups.send(BackupDone(obj=obj, rank=0))
        self.ctrl.pump()
        for msg in self.commits.drain():
            self.core.on_controller(msg)


@pytest.fixture(scope="module")
def slab():
    path = create_slab("strata-test")
    yield path
    remove_slab(path)
    assert not Path(path).exists()


def _cfg(model: Path, **kw) -> ServerConfig:
    # bfloat16 with deterministic inference: the tiers must give the very tokens
    # and logprobs of a fresh compute, whose KV of the earlier turns' outputs came from a prefill
    # where the tiers' came from decode steps (with the mode off, bf16 tokens differ)
    base = dict(model=str(model), device="cpu", dtype="bfloat16", enable_deterministic_inference=True,
                max_total_tokens=8 * 16, max_running_requests=4, max_prefill_tokens=256)
    return ServerConfig(**(base | kw))


class Fresh:
    """The reference: each prompt computed from scratch (radix cache off), once. Prompts known
    together run as one batch (the mode's answers do not depend on the batch; a step's fixed
    cost, a decode step's, is paid once for all of them)."""

    def __init__(self, model: Path) -> None:
        self.engine = Engine(_cfg(model, disable_radix_cache=True, max_total_tokens=48 * 16,
                                  max_running_requests=8, max_prefill_tokens=768))
        self.done: dict[tuple[int, ...], tuple[list[int], list[float]]] = {}

    def compute(self, prompts: list[list[int]]) -> None:
        todo = list({tuple(p): p for p in prompts if tuple(p) not in self.done}.values())
        if todo:
            for p, out, lps in zip(todo, self.engine.run(todo), self.engine.logprobs, strict=True):
                self.done[tuple(p)] = (out, lps)

    def run(self, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        """Each prompt's greedy output ids and their logprobs."""
        self.compute(prompts)
        return [self.done[tuple(p)][0] for p in prompts], [self.done[tuple(p)][1] for p in prompts]


def test_outputs_equal_fresh_l1_l2_and_l3(default_model_dir: Path, slab: str, tmp_path: Path) -> None:
    rng = random.Random(0)
    fresh = Fresh(default_model_dir)
    tier_cfg = _cfg(default_model_dir, enable_hierarchical_cache=True, hicache_ratio=2.0, hicache_path=slab,
                    l3_dir=str(tmp_path / "l3"))
    tiered = Engine(tier_cfg)
    # 3 conversations of 3-4 pages, 2 turns: the device pool (7 pages) holds about two, so the
    # second turn finds its history in L2 (or in L1 when it ran recently); L2 holds twice the pool
    convs = [[rng.randrange(200, 20000) for _ in range(48)] for _ in range(3)]
    for turn in range(2):
        order = list(range(len(convs))) if turn % 2 == 0 else list(reversed(range(len(convs))))
        fresh.compute(convs)
        asked = list(convs)  # the second turn's prompts are asked again after the restart
        for c in order:
            (ref,), (ref_lps,) = fresh.run([convs[c]])
            got = tiered.run([convs[c]])[0]
            assert got == ref, f"conversation {c} turn {turn}: {got} != fresh {ref}"
            assert tiered.logprobs == [ref_lps] and len(ref_lps) == 2, f"conversation {c} turn {turn}"
            convs[c] = convs[c] + got + [rng.randrange(200, 20000) for _ in range(10)]
    # two requests at once that share a conversation's history
    pair = [convs[0] + [5, 6, 7], convs[0] + [8, 9]]
    ref, ref_lps = fresh.run(pair)
    assert tiered.run(pair) == ref and tiered.logprobs == ref_lps
    stats = tiered.core.state.tiers.stats()
    assert stats["load_backs"] > 0 and stats["l2_hit_tokens"] > 0 and stats["backups_committed"] > 0
    assert tiered.core.cache_hit_tokens > stats["l2_hit_tokens"]  # some prefixes were L1 hits too
    assert tiered.ctrl.committed > 0
    # idle: every FreeReq and commit published, both tiers accounted for
    while (step := tiered.core.plan()) is not None:
        tiered.to_ctrl.send(step)
        tiered.core.on_done(tiered.runner.run_step(step))
        tiered._controller()
    assert tiered.core.leak_free()
    assert tiered.core.state.cache.pending == 0
    assert tiered.runner.replica.digest() == tiered.core.replica.digest() == tiered.ctrl.replica.digest()

    # L3 after a full restart: a new engine on the same directory asked the second turn's prompts
    # again (3 full pages each, written to L3 in the first turn); conversation 2's first page file
    # is corrupted first (the whole load fails: recomputed)
    tiered.l3.store.drain()
    assert tiered.l3.store.stats()["writes"] > 0
    victim = l3.key_path(tier_cfg.l3_dir, l3.page_keys(tiered.fingerprint, asked[2], 16)[0])
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x10
    victim.write_bytes(bytes(data))
    slab2 = create_slab("strata-test")
    try:
        again = Engine(replace(tier_cfg, hicache_path=slab2))
        for c in range(3):
            ref, ref_lps = fresh.run([asked[c]])
            assert again.run([asked[c]]) == ref, f"conversation {c} after the restart"
            assert again.logprobs == ref_lps, f"conversation {c} after the restart"
        hits = again.core.state.tiers.stats()
        assert hits["l3_hit_tokens"] >= 2 * 48, hits  # conversations 0 and 1 came from L3
        assert again.l3.store.stats()["corrupt"] == 1
        while (step := again.core.plan()) is not None:  # publish the last FreeReqs and commits
            again.to_ctrl.send(step)
            again.core.on_done(again.runner.run_step(step))
            again._controller()
        assert again.core.leak_free() and again.core.state.tiers.loading == 0
        assert again.runner.replica.digest() == again.core.replica.digest() == again.ctrl.replica.digest()
        again.l3.store.drain()
    finally:
        remove_slab(slab2)
