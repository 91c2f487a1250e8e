"""The scheduler with the disk tier (no model, no controller process: L3Loaded is handed to
the core as the controller would send it). A request whose prompt pages have L3 files
waits at the head of the queue for the load, then is admitted with them loaded back (l3
hits); a failed load makes it compute; an abort while loading leaks nothing; a flush waits
for the load; a replica following the Step stream agrees with the scheduler throughout."""

from __future__ import annotations

from pathlib import Path

from engine.cache import l3
from engine.replica import rank_replica
from engine.sched.scheduler import SchedConfig, SchedulerCore
from msgs.codec import pack_ids, unpack_ids
from msgs.done import StepDone
from msgs.params import SamplingParams
from msgs.requests import TokenizedRequest
from msgs.steps import AddReq, ApplyCommit, BackupPrepare, HostEvict, L3Load, LoadBack, Step

FP = b"f" * 16
PS = 4


class Driver:
    def __init__(self, root: Path, host_pages: int = 40) -> None:
        self.core = SchedulerCore(SchedConfig(
            num_pages=40, page_size=PS, max_running=4, max_prefill_tokens=64, max_context=200,
            eos_token_ids=(1,), vocab_size=1000, digest_every=0, host_pages=host_pages,
            l3_dir=str(root), l3_fingerprint=FP))
        self.replica = rank_replica()
        self.n = 0

    def submit(self, ids: list[int], max_new: int = 2) -> str:
        rid = f"r{self.n}"
        self.n += 1
        params = SamplingParams(max_new_tokens=max_new, temperature=0.0)
        assert self.core.submit(TokenizedRequest(rid=rid, input_ids=pack_ids(ids), params=params)) is None
        return rid

    def step(self) -> Step | None:
        """Plan one step, apply it to the replica, finish it (token 7 for each sample)."""
        step = self.core.plan()
        if step is None:
            return None
        self.replica.apply_step(step)
        assert self.replica["host_tier"].alloc.encode() == self.core.state.cache.host.encode()
        n = sum(unpack_ids(step.forward.sample)) if step.forward is not None else 0
        self.core.on_done(StepDone(seq=step.seq, rank=0, token_ids=pack_ids([7] * n)))
        for op in step.ops:  # every backup copied: the controller's Committed
            if isinstance(op, BackupPrepare):
                self.core.on_committed(op.obj)
        return step

    def until_idle(self) -> list[Step]:
        steps = []
        while (step := self.step()) is not None:
            steps.append(step)
        return steps


def _files(root: Path, tokens: list[int]) -> list[bytes]:
    d = l3.L3Dir(root, FP, 1 << 30)
    keys = l3.page_keys(FP, tokens, PS)
    for k in keys:
        d.write(k, b"kv")
    return keys


def _ops(steps: list[Step], kind: type) -> list:
    return [op for s in steps for op in s.ops if isinstance(op, kind)]


def test_a_request_waits_for_its_l3_load_then_uses_it(tmp_path: Path) -> None:
    prompt = list(range(100, 125))  # 25 tokens: 6 full pages of the 24 matched
    _files(tmp_path, prompt[:20])  # 5 pages on disk
    d = Driver(tmp_path)
    d.submit(prompt)
    first = d.step()
    (load,) = _ops([first], L3Load)
    assert len(l3.unpack_keys(load.keys)) == 5 and not _ops([first], AddReq)  # it waits
    assert d.step() is None and d.core.waiting  # nothing to do until L3Loaded
    assert d.core.flush() is not None  # a load in flight: no flush
    d.core.on_l3_loaded(load.obj, ok=True)
    steps = d.until_idle()
    assert _ops(steps, ApplyCommit)[0].obj == load.obj and _ops(steps, LoadBack)
    assert d.core.reqs == {} and d.core.state.tiers.stats()["l3_hit_tokens"] == 20
    assert d.core.leak_free() and d.core.flush() is None


def test_a_failed_load_computes_and_a_second_request_is_not_probed_again(tmp_path: Path) -> None:
    prompt = list(range(200, 217))
    _files(tmp_path, prompt[:16])
    d = Driver(tmp_path)
    d.submit(prompt)
    (load,) = _ops([d.step()], L3Load)
    d.core.on_l3_loaded(load.obj, ok=False)
    steps = d.until_idle()
    assert [op.obj for op in _ops(steps, HostEvict)] == [load.obj]
    assert _ops(steps, AddReq) and d.core.state.tiers.stats()["l3_hit_tokens"] == 0
    assert d.core.leak_free()
    d.submit(prompt)  # now in L1: no probe, no load
    assert not _ops(d.until_idle(), L3Load)


def test_an_abort_while_loading_leaks_nothing(tmp_path: Path) -> None:
    prompt = list(range(300, 317))
    _files(tmp_path, prompt[:16])
    d = Driver(tmp_path)
    rid = d.submit(prompt)
    (load,) = _ops([d.step()], L3Load)
    d.core.abort(rid)
    d.until_idle()
    assert d.core.state.tiers.loading == 1 and d.core.flush() is not None
    d.core.on_l3_loaded(load.obj, ok=True)
    d.until_idle()
    assert d.core.leak_free() and d.core.state.tiers.loading == 0
    assert d.core.flush() is None
    d.step()
    assert d.replica.digest() == d.core.replica.digest()


def test_a_second_request_behind_a_load_waits_for_it(tmp_path: Path) -> None:
    prompt = list(range(400, 417))
    _files(tmp_path, prompt[:16])
    d = Driver(tmp_path)
    a = d.submit(prompt)
    (load,) = _ops([d.step()], L3Load)
    d.core.abort(a)
    d.submit(prompt + [5, 6])  # the same prefix: waits for the load already in flight
    assert not _ops(d.until_idle(), L3Load) and d.core.waiting
    d.core.on_l3_loaded(load.obj, ok=True)
    d.until_idle()
    assert d.core.state.tiers.stats()["l3_hit_tokens"] == 16 and d.core.leak_free()


def test_l3_loads_go_on_when_l2_is_full_of_earlier_prompts(tmp_path: Path) -> None:
    """After a restart, prompts one after another load from L3 into an L2 that holds two of them:
    the earlier prompts' copies make room (their decode tails once gone, nothing pins them), so
    every prompt is an L3 hit. Before, only the tails were L2 victims and the third prompt
    computed its 20 tokens."""
    prompts = [[500 + 40 * i + k for k in range(21)] for i in range(4)]  # 5 full pages each
    for p in prompts:
        _files(tmp_path, p[:20])
    d = Driver(tmp_path, host_pages=12)
    for i, p in enumerate(prompts):
        d.submit(p, max_new=8)  # a decode tail past the prompt's pages, backed up too
        (load,) = _ops([d.step()], L3Load)
        d.core.on_l3_loaded(load.obj, ok=True)
        d.until_idle()
        assert d.core.state.tiers.stats()["l3_hit_tokens"] == 20 * (i + 1)
    assert d.core.leak_free() and d.replica.digest() == d.core.replica.digest()
