"""engine/run/host_tier.py on CPU: the host slab's parallel first touch (`populate`), which a
GPU worker runs on HostInit before cudaHostRegister (here as the worker calls it: inside
inference mode, from pool threads that are not), the merging of a step's backups, a round
trip through the effect, and the slab's page-major layout (what L3 reads)."""

from __future__ import annotations

import torch

from engine.cache.slab import create_slab, map_slab, remove_slab
from engine.layers.kv_pool import KVPool
from engine.run import host_tier
from msgs.codec import pack_ids
from msgs.steps import BackupPrepare, HostInit


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


def _copies(monkeypatch, path: str, rank: int = 0, world: int = 1) -> host_tier.HostCopies:  # noqa: ANN001
    """HostCopies of a small fp32 pool (3 layers, 12 device pages of 4 tokens x 2 heads x 8:
    256 bytes a layer, 1.5 KiB a page), with staging chunks of 2 pages (runs of several chunks)."""
    monkeypatch.setattr(host_tier, "STAGING_BYTES", 2 * 2 * 3 * 256 + 100)
    copies = host_tier.HostCopies(KVPool(3, 12, 4, 2, 8, torch.float32, "cpu"), path, rank, world)
    assert copies.layer_bytes == 256 and copies.chunk_pages == 2
    copies.apply(HostInit(8, copies.page_bytes))
    return copies


def test_round_trip_through_the_effect_is_exact(monkeypatch) -> None:  # noqa: ANN001
    path = create_slab("test-host-round-trip")
    try:
        copies = _copies(monkeypatch, path)
        assert host_tier._round_trip(copies, [7, 2, 9, 5, 1], [3, 8, 4, 11, 10])  # 3 chunks, the last one short
        assert copies.take_done() == [1]
        assert copies.stats["backups"] == 1 and copies.stats["load_backs"] == 1
        assert copies.stats["bytes_out"] == copies.stats["bytes_in"] == 5 * copies.page_bytes
    finally:
        remove_slab(path)


def test_a_host_page_holds_every_layer_k_and_v_of_its_device_page(monkeypatch) -> None:  # noqa: ANN001
    """The layout L3 relies on (engine/cache/l3.py): rank r's region is [host page][layer][K, V]
    [layer bytes], so host page p is page_bytes contiguous bytes at (r * host pages + p) *
    page_bytes of the slab file. Two adjacent objects (one run) and one apart, rank 1 of 2."""
    path = create_slab("test-host-layout")
    try:
        copies = _copies(monkeypatch, path, rank=1, world=2)
        kv = copies.kv
        for t in (*kv.k, *kv.v):
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
        placed = {1: [4, 4, 9], 2: [2], 3: [6, 1]}  # object -> device pages (a page twice)
        starts = {1: 2, 2: 5, 3: 0}  # host pages 2-4 and 5 adjacent: one run
        for obj, pages in placed.items():
            copies.apply(BackupPrepare(obj, pack_ids(pages), starts[obj]))
        copies.after_forward()
        assert sorted(copies.take_done()) == [1, 2, 3]
        whole = torch.frombuffer(map_slab(path, 2 * 8 * copies.page_bytes), dtype=torch.uint8)
        for obj, pages in placed.items():
            for i, dev_page in enumerate(pages):
                at = (8 + starts[obj] + i) * copies.page_bytes  # rank 1's region comes after rank 0's
                want = torch.cat(
                    [
                        t.view(torch.uint8).view(kv.num_pages, -1)[dev_page]
                        for pair in zip(kv.k, kv.v, strict=True)
                        for t in pair
                    ]
                )
                assert torch.equal(whole[at : at + copies.page_bytes], want), (obj, i)
        assert not whole[: 8 * copies.page_bytes].any()  # rank 0's region untouched
    finally:
        remove_slab(path)
