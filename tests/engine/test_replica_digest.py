"""The replica digest covers what a rank's replicated state decides: a rank that holds a slot's
token history (its penalties, min_new_tokens and grammar replay read it) or the host tier's layout
differently from its peers fails the digest check, even where no sampled token changes."""

from __future__ import annotations

from engine.replica.components import rank_replica
from msgs.codec import pack_ids
from msgs.steps import AddReq, HostInit, Step, WorkerSampling

SAMPLING = WorkerSampling(1.0, 1.0, -1, 0.0, 1.0, 0.0, 0.0, 7, False, 0)


def _digest(*ops: object) -> str:
    r = rank_replica()
    r.apply_step(Step(seq=1, ops=list(ops)))
    return r.digest()


def test_a_slots_history_is_in_the_digest() -> None:
    base = _digest(AddReq(0, "a", SAMPLING, pack_ids([1, 2, 3])))
    assert base == _digest(AddReq(0, "a", SAMPLING, pack_ids([1, 2, 3])))
    assert base != _digest(AddReq(0, "a", SAMPLING, pack_ids([1, 2, 3, 4, 5])))  # another prompt length
    assert base != _digest(AddReq(0, "a", SAMPLING, pack_ids([1, 2, 4])))  # another token
    assert base != _digest(AddReq(0, "a", SAMPLING, pack_ids([1, 2]), pack_ids([3])))  # a token moved to the output


def test_the_host_tiers_layout_is_in_the_digest() -> None:
    base = _digest(HostInit(8, page_bytes=4096, num_layers=2))
    assert base == _digest(HostInit(8, page_bytes=4096, num_layers=2))
    assert base != _digest(HostInit(8, page_bytes=8192, num_layers=2))
    assert base != _digest(HostInit(8, page_bytes=4096, num_layers=2, kv_components=1))
