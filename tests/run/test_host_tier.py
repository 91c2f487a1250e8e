"""engine/run/host_tier.py on CPU: the host slab's parallel first touch (`populate`), which a
GPU worker runs on HostInit before cudaHostRegister (here as the worker calls it: inside
inference mode, from pool threads that are not), and the merging of a step's backups."""

from __future__ import annotations

import torch

from engine.cache.slab import create_slab, map_slab, remove_slab
from engine.run import host_tier


def test_populate_touches_every_chunk_of_an_inference_mode_slab(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(host_tier, "POPULATE_CHUNK", 1 << 16)  # many chunks, several threads
    path = create_slab("test-populate")
    try:
        mapping = map_slab(path, 5 << 16 | 123)  # not a multiple of the chunk
        with torch.inference_mode():
            region = torch.frombuffer(mapping, dtype=torch.uint8)[100:]
            host_tier.populate(region)
            assert region.is_inference() and int(region.count_nonzero()) == 0
            region[:10] = 7  # writable after, through the same mapping
        assert mapping[100:110] == bytes([7] * 10)
        del region
        mapping.close()
    finally:
        remove_slab(path)


def test_adjacent_backups_are_merged_into_runs() -> None:
    queued = [(7, [9, 3], 12), (5, [4], 10), (6, [1], 11), (8, [2, 2], 20)]  # (obj, device pages, host start)
    assert host_tier._runs(queued) == [([4, 1, 9, 3], 10), ([2, 2], 20)]
    assert queued[1] == (5, [4], 10)  # the queued lists are not changed
