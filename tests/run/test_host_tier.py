"""engine/run/host_tier.py on CPU: the host slab's parallel first touch (`populate`), which a
GPU worker runs on HostInit before cudaHostRegister (here as the worker calls it: inside
inference mode, from pool threads that are not), a step's backups as a list of copies, and
the pieces of a load-back."""

from __future__ import annotations

import torch

from engine.bench.hostcopy import round_trip
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


def test_batch_copies_merge_stretches_across_objects_and_match_the_slab_layout() -> None:
    """A step's backups as 1D copies: pages consecutive on the device and in the slab make one
    copy per layer and K/V (also across objects placed one after another); executed, the
    copies put every page's bytes of every layer at its host page."""
    import ctypes

    from engine.layers.kv_pool import KVPool

    pool = KVPool(3, 64, 4, 2, 8, torch.float32, torch.device("cpu"))
    dev = pool.page_bytes()
    for t in dev:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
    slab = torch.zeros(3, 2, 40, dev[0].shape[-1], dtype=torch.uint8)
    # (obj, device pages, host start): 5 and 6 continue each other on both sides; 7 is scattered
    queued = [(6, [13, 14], 12), (5, [10, 11, 12], 9), (7, [40, 2, 3], 30), (8, [20], 14)]
    hosts = [(obj, pages, list(range(start, start + len(pages)))) for obj, pages, start in queued]
    dsts, srcs, sizes = host_tier.batch_copies(hosts + [(9, [], [])], dev, slab)  # 9: none of its pages here
    # stretches: 10-14 -> 9-13 (objects 5 and 6), 20 -> 14, 40 -> 30, 2-3 -> 31-32
    assert sorted(set(sizes.tolist())) == [dev[0].shape[-1], 2 * dev[0].shape[-1], 5 * dev[0].shape[-1]]
    assert len(sizes) == 2 * 3 * 4
    for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(dst, src, size)
    for _, pages, start in queued:
        for i, page in enumerate(pages):
            for kv in (0, 1):
                assert torch.equal(slab[:, kv, start + i], dev[kv][:, page])
    assert int(slab[:, :, :9].count_nonzero()) == 0 and int(slab[:, :, 15:30].count_nonzero()) == 0


def test_segments_copy_long_stretches_straight_and_gather_the_rest(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(host_tier, "MIN_DIRECT_PAGES", 3)
    pages = [10, 11, 12, 13, 40, 7, 8, 20, 21, 22, 5]
    assert host_tier._segments(pages) == [(0, 4, 10), (4, 3, None), (7, 3, 20), (10, 1, None)]
    assert host_tier._segments([]) == []
    scattered = [9, 1, 5, 3] * 3
    assert host_tier._segments(scattered) == [(0, 12, None)]
    monkeypatch.setattr(host_tier, "MAX_SEGMENTS", 2)  # too many pieces: gather the whole run
    assert host_tier._segments(pages) == [(0, len(pages), None)]


def test_round_trip_through_direct_and_gathered_pieces(monkeypatch) -> None:  # noqa: ANN001
    """Back up a run mixing consecutive and scattered device pages, load it into another such
    run: every layer's K and V bytes arrive, through both kinds of copy, both ways."""
    from engine.layers.kv_pool import KVPool

    monkeypatch.setattr(host_tier, "MIN_DIRECT_PAGES", 3)
    pool = KVPool(3, 64, 4, 2, 8, torch.float32, torch.device("cpu"))
    path = create_slab("test-segments")
    try:
        copies = host_tier.HostCopies(pool, path)
        copies.apply(host_tier.HostInit(32, copies.page_bytes))
        src = [5, 6, 7, 8, 30, 2, 40, 41, 42]
        dst = [50, 12, 13, 14, 15, 16, 60, 61, 3]
        assert round_trip(copies, src, dst)
        copies.close()
    finally:
        remove_slab(path)


def test_a_copier_that_fails_is_raised_on_the_worker_thread_and_never_hangs_drain() -> None:
    """The GPU copier thread's protocol, on a real HostCopies: a failure (here its set-up: no
    such device, on any machine) is kept and raised by take_done and drain; jobs handed over
    after it are still taken off the queue, so drain returns; close() ends the thread."""
    import queue
    import threading
    import weakref

    import pytest

    from engine.layers.kv_pool import KVPool

    pool = KVPool(2, 8, 4, 2, 8, torch.float32, torch.device("cpu"))
    path = create_slab("test-copier")
    try:
        copies = host_tier.HostCopies(pool, path)
        copies.apply(host_tier.HostInit(4, copies.page_bytes))
        jobs: queue.Queue = copies._jobs
        thread = threading.Thread(target=host_tier._copier, args=(weakref.ref(copies), jobs, 10**6), daemon=True)
        thread.start()
        copies._copier_started = True
        jobs.put(([(1, [1, 2], 0)], None))
        jobs.put(([(2, [3], 2)], None))
        done = threading.Thread(target=jobs.join, daemon=True)
        done.start()
        done.join(10)
        assert not done.is_alive(), "drain would hang"
        with pytest.raises(RuntimeError, match="copier thread failed"):
            copies.take_done()
        with pytest.raises(RuntimeError, match="copier thread failed"):
            copies.drain()
        copies._error = None  # as if nothing failed: close() stops the thread and returns
        copies.close()
        thread.join(10)
        assert not thread.is_alive()
        assert copies.done == []  # nothing was copied, nothing is reported done
    finally:
        remove_slab(path)
