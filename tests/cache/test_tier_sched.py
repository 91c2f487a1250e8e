"""The scheduler core with the host tier, against 8 fake ranks and the cache controller
(no model: ranks replay the Step stream on their replicas and 'sample' a deterministic
token). Every step is digest-checked on every rank and the controller; randomized
multi-turn conversations with shared prefixes and a small L1/L2 exercise backups,
commits, splits, evictions to host, load-backs and evict-to-fit; nothing leaks."""

from __future__ import annotations

import random
import time
from collections import deque
from pathlib import Path

from engine.cache.controller import CacheController, L3Tier, SlabMapping
from engine.cache.slab import create_slab, remove_slab
from engine.replica import TokenChain, rank_replica
from engine.sched.scheduler import SchedConfig, SchedulerCore
from msgs.channels import BACKUPS, COMMITS, STEPS, pipe
from msgs.codec import pack_ids, unpack_ids
from msgs.done import BackupDone, StepDone
from msgs.params import SamplingParams
from msgs.requests import TokenizedRequest
from msgs.steps import BackupPrepare, Step

RANKS = 8


class FakeRank:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.replica = rank_replica()
        self.chain = TokenChain()

    def run(self, step: Step) -> tuple[StepDone, list[int]]:
        check = self.replica.apply_step(step)
        n = sum(unpack_ids(step.forward.sample)) if step.forward is not None else 0
        tokens = pack_ids((step.seq * 7 + i) % 900 + 50 for i in range(n))  # never an EOS
        self.chain.update(tokens)
        backed = [op.obj for op in step.ops if isinstance(op, BackupPrepare)]
        digest = self.replica.digest() if check else None
        done = StepDone(seq=step.seq, rank=self.rank, token_ids=tokens, digest=digest,
                        tokens_hash=self.chain.hexdigest() if check else None)
        return done, backed


class Cluster:
    def __init__(self, num_pages: int, host_pages: int, l3_dir: str = "", slab: str = "") -> None:
        """With l3_dir (and a slab file for the controller to map): the disk tier is on."""
        l3 = {"l3_dir": l3_dir, "l3_fingerprint": b"m" * 16, "page_bytes": 64, "num_layers": 1} if l3_dir else {}
        cfg = SchedConfig(num_pages=num_pages, page_size=4, max_running=4, max_prefill_tokens=48,
                          max_context=400, eos_token_ids=(1,), vocab_size=1000, digest_every=1,
                          num_ranks=RANKS, host_pages=host_pages, **l3)
        self.core = SchedulerCore(cfg)
        self.ranks = [FakeRank(r) for r in range(RANKS)]
        self.to_ctrl, steps_in = pipe(STEPS)
        self.backups, backups_in = pipe(BACKUPS)
        commits_out, self.commits = pipe(COMMITS)
        self.l3 = None
        effects = []
        if l3_dir:
            mapping = SlabMapping(slab, RANKS)
            self.l3 = L3Tier(mapping, l3_dir, 1 << 30)
            effects = [mapping]
        self.ctrl = CacheController(RANKS, steps_in, backups_in, commits_out, effects, l3=self.l3)
        self.n = 0

    def run(self, prompts: list[list[int]], max_new: int) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for ids in prompts:
            rid = f"r{self.n}"
            self.n += 1
            params = SamplingParams(max_new_tokens=max_new, temperature=0.0)
            assert self.core.submit(TokenizedRequest(rid=rid, input_ids=pack_ids(ids), params=params)) is None
            out[rid] = []
        inflight: deque[Step] = deque()
        deadline = time.monotonic() + 60
        while True:
            while len(inflight) < 2 and (step := self.core.plan()) is not None:
                self.to_ctrl.send(step)
                inflight.append(step)
            if not inflight:
                if self.core.idle:
                    return out
                assert time.monotonic() < deadline, "stuck: nothing to plan, requests left"
                time.sleep(0.002)  # a request waits for an L3 read (the controller's thread)
                self._controller()
                continue
            step = inflight.popleft()
            for rank in reversed(self.ranks):  # rank 0 last: the others' reports arrive first
                done, backed = rank.run(step)
                for o in self.core.on_done(done):
                    out[o.rid].extend(o.new_ids)
                for obj in backed:
                    self.backups.send(BackupDone(obj=obj, rank=rank.rank))
            self._controller()

    def _controller(self) -> None:
        self.ctrl.pump()
        for msg in self.commits.drain():
            self.core.on_controller(msg)


def test_randomized_conversations_keep_every_replica_identical() -> None:
    rng = random.Random(5)
    cl = Cluster(num_pages=40, host_pages=60)
    system = [rng.randrange(50, 900) for _ in range(24)]  # a shared system prompt
    convs = [system + [rng.randrange(50, 900) for _ in range(rng.randrange(8, 40))] for _ in range(10)]
    for _ in range(4):
        batch = rng.sample(range(len(convs)), 3)
        outs = cl.run([convs[c] for c in batch], max_new=rng.randrange(2, 9))
        for c, toks in zip(batch, outs.values(), strict=True):
            convs[c] = convs[c] + toks + [rng.randrange(50, 900) for _ in range(rng.randrange(4, 20))]
    stats = cl.core.state.tiers.stats()
    assert stats["load_backs"] > 0 and stats["backups_committed"] > 0 and stats["l2_hit_tokens"] > 0
    assert cl.core.state.cache.stats["host_evicted"] > 0  # L2 was full at least once: evict-to-fit
    while (step := cl.core.plan()) is not None:  # publish the last FreeReqs and commits
        cl.to_ctrl.send(step)
        for rank in cl.ranks:
            cl.core.on_done(rank.run(step)[0])
    assert cl.core.idle and cl.core.leak_free()
    want = cl.core.replica.digest()
    assert {r.replica.digest() for r in cl.ranks} == {want}
    cl.ctrl.pump()
    assert cl.ctrl.replica.digest() == want


def test_pending_backups_are_not_evictable_until_committed() -> None:
    cl = Cluster(num_pages=12, host_pages=40)
    core = cl.core
    prompt = list(range(100, 140))  # 10 pages: the whole pool but one
    assert core.submit(TokenizedRequest(rid="a", input_ids=pack_ids(prompt),
                                        params=SamplingParams(max_new_tokens=1, temperature=0.0))) is None
    step = core.plan()
    assert step is not None and any(isinstance(op, BackupPrepare) for op in step.ops)
    for rank in cl.ranks:
        core.on_done(rank.run(step)[0])  # finished: its pages are the tree's, still pending
    assert core.cache.evictable_pages == 0  # pending: they may not leave the device
    for op in step.ops:  # what the controller reports once all 8 ranks copied it
        if isinstance(op, BackupPrepare):
            core.on_committed(op.obj)
    assert core.cache.evictable_pages == 10
    assert core.cache.evict(10) == 10 and core.cache.total_pages == 0  # host-only now, still matched
    assert len(core.cache.match_prefix(prompt, touch=False).host_nodes) == 1


def test_host_tier_size_and_flags() -> None:
    import pytest

    from engine.config import ServerConfig
    from engine.sched.state import host_pages
    from msgs.done import WorkerReady

    ready = WorkerReady(0, num_pages=101, page_size=16, max_context=512, vocab_size=100, eos_token_ids=[1],
                        page_bytes=1 << 20)
    assert host_pages(ServerConfig(), ready) == 0  # off by default: no tier at all
    assert host_pages(ServerConfig(enable_hierarchical_cache=True), ready) == 200  # 2 x the usable pool
    assert host_pages(ServerConfig(enable_hierarchical_cache=True, hicache_size=0.5), ready) == 512
    # within the host memory there is: the ratio is capped to fit, an explicit size is an error
    on = ServerConfig(enable_hierarchical_cache=True)
    assert host_pages(on, ready, ranks=2, room=100 << 20) == 50  # 100 MiB over 2 ranks of 1 MiB pages
    with pytest.raises(ValueError, match="--hicache-size 0.5 needs 1.0 GiB"):
        host_pages(ServerConfig(enable_hierarchical_cache=True, hicache_size=0.5), ready, ranks=2, room=100 << 20)
    with pytest.raises(ValueError, match="no host memory"):
        host_pages(on, ready, room=1 << 10)
    # an audit: an --l3-size below one page file started, and every file it wrote was removed at once
    from engine.sched.state import SchedConfig
    small = ServerConfig(enable_hierarchical_cache=True, l3_dir="/tmp/unused", l3_size=0.0001)
    with pytest.raises(ValueError, match=r"--l3-size 0.0001 GB holds no page file: one takes 1,048,632 bytes"):
        SchedConfig.build(small, ready, 1, 0)
    assert SchedConfig.build(ServerConfig(enable_hierarchical_cache=True, l3_dir="/tmp/unused", l3_size=0.001),
                             ready, 1, 0).l3_dir
    for bad in ({"hicache_write_policy": "write_back"}, {"disable_radix_cache": True}, {"hicache_ratio": 0.0}):
        with pytest.raises(ValueError):
            ServerConfig(enable_hierarchical_cache=True, **bad)
    for without_the_tier in ({"hicache_size": 1.0}, {"hicache_write_policy": "write_through_selective"},
                             {"hicache_write_policy": "write_back"}):
        with pytest.raises(ValueError, match="--hicache-|write_back is not implemented"):
            ServerConfig(**without_the_tier)


def test_ranks_with_different_host_pages_cannot_start_the_tier() -> None:
    import pytest

    from engine.config import ServerConfig
    from engine.sched.loop import SchedulerLoop, SchedulerPorts, WorkerFailure
    from msgs.channels import CONTROL, DONE, OUTPUTS, REQUESTS
    from msgs.done import WorkerReady

    def ports() -> SchedulerPorts:
        return SchedulerPorts(requests=pipe(REQUESTS)[1], done=pipe(DONE)[1], outputs=pipe(OUTPUTS)[0],
                              steps=[pipe(STEPS)[0], pipe(STEPS)[0]], control=pipe(CONTROL)[0])

    loop = SchedulerLoop(ServerConfig(enable_hierarchical_cache=True), ports())
    loop.on_worker_ready(WorkerReady(0, 50, 16, 512, 1000, [1], page_bytes=4096))
    with pytest.raises(WorkerFailure, match="KV pages of one size on every rank"):
        loop.on_worker_ready(WorkerReady(1, 50, 16, 512, 1000, [1], page_bytes=2048))


def test_a_protected_host_object_survives_a_scan() -> None:
    """Evict-to-fit takes one-hit objects before an object hit twice (segmented LRU), even
    when the twice-hit one is older: a scan of new prefixes does not flush the hot one."""
    from engine.cache.allocator import PageAllocator
    from engine.cache.hiradix import TieredRadixCache

    cache = TieredRadixCache(2, PageAllocator(64), 6)
    hot = [9, 9, 9, 9]

    def insert(tokens: list[int]) -> None:
        cache.tick()
        pages = cache.allocator.alloc(len(tokens) // 2)
        kept, _ = cache.insert_node(tokens, pages)
        cache.allocator.free(pages[: kept // 2])
        for obj, node in list(cache.objects.items()):
            if not node.committed:
                cache.commit(obj)

    insert(hot)
    for _ in range(2):
        cache.tick()
        cache.touch(cache.match_prefix(hot + [1], touch=False).node)
    for i in range(10):  # a scan: 10 one-hit prefixes through an L2 of 3 objects
        insert([i, i, i, i])
    assert cache.match_prefix(hot, touch=False).node.host >= 0  # still backed up
    cache.check_invariants()


def test_l3_after_a_restart_keeps_every_replica_identical(tmp_path: Path) -> None:
    """Randomized conversations write L3; a new cluster (scheduler, 8 ranks, controller, slab)
    on the same directory serves them from L3 (loads into a smaller L2: evict-to-fit), every
    step digest-checked on every rank and the controller."""
    rng = random.Random(11)
    system = [rng.randrange(50, 900) for _ in range(24)]
    convs = [system + [rng.randrange(50, 900) for _ in range(rng.randrange(8, 30))] for _ in range(6)]
    slabs = [create_slab("strata-test"), create_slab("strata-test")]
    try:
        first = Cluster(num_pages=40, host_pages=60, l3_dir=str(tmp_path), slab=slabs[0])
        for c in range(0, 6, 3):
            first.run(convs[c : c + 3], max_new=3)
        first.l3.store.drain()
        assert first.l3.store.stats()["writes"] > 0
        again = Cluster(num_pages=40, host_pages=24, l3_dir=str(tmp_path), slab=slabs[1])
        for _ in range(3):
            batch = rng.sample(range(len(convs)), 2)
            again.run([convs[c] + [rng.randrange(50, 900) for _ in range(3)] for c in batch], max_new=2)
        tiers = again.core.state.tiers
        assert tiers.stats()["l3_hit_tokens"] > 0 and again.core.cache.stats["l3_loaded"] > 0
        assert again.core.cache.stats["host_evicted"] > 0
        while (step := again.core.plan()) is not None:  # publish the last FreeReqs and commits
            again.to_ctrl.send(step)
            for rank in again.ranks:
                again.core.on_done(rank.run(step)[0])
        assert again.core.idle and again.core.leak_free() and tiers.loading == 0
        want = again.core.replica.digest()
        assert {r.replica.digest() for r in again.ranks} == {want}
        again.ctrl.pump()
        assert again.ctrl.replica.digest() == want
        again.l3.store.drain()
    finally:
        for s in slabs:
            remove_slab(s)
