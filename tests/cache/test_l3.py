"""The disk tier (L3): keys, the file format and its checks, the directory's size cap, the
tree's loading nodes, and the cache controller writing committed objects to disk and
reading them back into the host slab (real shared-memory slab, in-memory channels)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from engine.cache import l3
from engine.cache.allocator import PageAllocator
from engine.cache.controller import CacheController, L3Tier, SlabMapping
from engine.cache.hiradix import TieredRadixCache
from engine.cache.slab import create_slab, remove_slab
from engine.config import ServerConfig
from engine.replica import ReplicaError, rank_replica
from msgs.channels import BACKUPS, COMMITS, STEPS, pipe
from msgs.codec import pack_ids
from msgs.done import BackupDone, Committed, L3Loaded, L3Stats
from msgs.steps import ApplyCommit, BackupPrepare, DigestCheck, HostEvict, HostInit, HostSplit, L3Load, L3Touch, Step

FP = bytes(range(16))
PS = 2


# ---- keys ----------------------------------------------------------------------------------


def test_keys_chain_over_the_prefix_and_the_fingerprint() -> None:
    toks = list(range(10, 20))
    keys = l3.page_keys(FP, toks, PS)
    assert len(keys) == 5 and len(set(keys)) == 5 and all(len(k) == l3.KEY_BYTES for k in keys)
    assert l3.page_keys(FP, toks + [1], PS) == keys  # only full pages
    assert l3.chain(keys[1], toks[4:], PS) == keys[2:]  # continuing the chain = from the start
    other = l3.page_keys(FP, [11] + toks[1:], PS)  # the first page differs: every key differs
    assert not set(other) & set(keys)
    assert l3.page_keys(bytes(16), toks, PS)[0] != keys[0]  # another model, other keys
    assert l3.unpack_keys(l3.pack_keys(keys)) == keys
    base = dict(
        config_json=b"{}",
        weights=b"w",
        dtype="float32",
        kv_dtype="float32",
        page_size=16,
        tp_size=1,
        page_bytes=4096,
        num_layers=2,
    )
    fp = l3.model_fingerprint(**base)
    assert len(fp) == 16 and fp == l3.model_fingerprint(**base)
    for change in (
        {"weights": b"w2"},
        {"config_json": b"{ }"},
        {"kv_dtype": "bfloat16"},
        {"page_size": 32},
        {"tp_size": 2},
        {"page_bytes": 8192},
        {"dtype": "bfloat16"},
    ):
        assert l3.model_fingerprint(**{**base, **change}) != fp, change


def test_weights_identity_follows_the_checkpoint(tmp_path: Path) -> None:
    """An audit: two checkpoints with one header (a fine-tune, an edited tensor) had one identity,
    so L3 served one's KV to the other; each tensor's data is sampled now."""
    from models.loader import weights_identity

    assert weights_identity(tmp_path, "dummy") == b"dummy:0" != weights_identity(tmp_path, "dummy", seed=1)
    header = b'{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},' \
             b'"b":{"dtype":"F32","shape":[4096],"data_offsets":[4,16388]}}'
    f = tmp_path / "model.safetensors"
    data = bytearray(range(256)) * 64 + bytearray(4)
    f.write_bytes(len(header).to_bytes(8, "little") + header + data)
    one = weights_identity(tmp_path)
    assert weights_identity(tmp_path) == one
    for flip in (0, 5, 4 + 4096 * 4 - 1, 4 + (4096 * 4 - 64) * 3 // 7 + 10):  # a; b's first, last, 4th sample
        edited = bytearray(data)
        edited[flip] ^= 0x80  # one sign bit: same size and header
        f.write_bytes(len(header).to_bytes(8, "little") + header + edited)
        assert weights_identity(tmp_path) != one, flip
    header2 = header.replace(b"F32", b"I32")
    f.write_bytes(len(header2).to_bytes(8, "little") + header2 + data)
    assert weights_identity(tmp_path) != one


# ---- files ---------------------------------------------------------------------------------


def _dir(tmp_path: Path, cap: int = 1 << 30) -> l3.L3Dir:
    return l3.L3Dir(tmp_path / "l3", FP, cap)


def test_write_read_roundtrip_is_atomic_and_content_addressed(tmp_path: Path) -> None:
    d = _dir(tmp_path)
    key, payload = l3.page_keys(FP, [1, 2], PS)[0], os.urandom(100)
    assert d.write(key, payload)
    path = d.path(key)
    assert path.parent.name == key.hex()[:2] and path.name == key.hex() + ".kv"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    assert not d.write(key, b"x" * 100)  # exists: not written again
    assert d.read(key, 100) == payload
    assert d.stats["writes"] == 1 and d.stats["reads"] == 1 and d.stats["files"] == 1
    assert d.read(l3.page_keys(FP, [3, 4], PS)[0], 100) is None  # missing: not corrupt
    assert d.stats["corrupt"] == 0
    assert _dir(tmp_path).stats["files"] == 1  # a restart scans what is there


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign", "length"])
def test_a_bad_file_is_rejected_counted_and_removed(tmp_path: Path, damage: str) -> None:
    d = _dir(tmp_path)
    key, payload = l3.page_keys(FP, [5, 6], PS)[0], os.urandom(64)
    d.write(key, payload)
    path = d.path(key)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:-1]
    elif damage == "flip":
        data[-10] ^= 0x01
    elif damage == "foreign":
        data = bytearray(l3.encode_file(bytes(16), key, payload))
    path.write_bytes(bytes(data))
    assert d.read(key, 64 if damage != "length" else 65) is None
    assert d.stats["corrupt"] == 1 and not path.exists()
    why = {"truncate": "bytes, a page file holds", "length": "bytes, a page file holds", "flip": "checksum",
           "foreign": "header"}[damage]
    assert d.last_corrupt is not None and d.last_corrupt.startswith(path.name) and why in d.last_corrupt


def test_the_size_cap_removes_the_oldest_files(tmp_path: Path) -> None:
    size = l3.HEADER.size + 1000
    d = _dir(tmp_path, cap=int(4.5 * size))
    keys = l3.page_keys(FP, list(range(12)), PS)
    for i, key in enumerate(keys[:4]):
        d.write(key, bytes(1000))
        os.utime(d.path(key), (1000 + i, 1000 + i))  # oldest first
    d.read(keys[0], 1000)  # a read makes the oldest the newest
    d.write(keys[4], bytes(1000))  # 5 files > the cap: down to 90% of it (4 files)
    left = {k for k in keys[:5] if d.path(k).exists()}
    assert left == {keys[0], keys[2], keys[3], keys[4]}
    assert d.stats["files"] == 4 and d.stats["bytes"] == 4 * size
    smaller = _dir(tmp_path, cap=int(2.5 * size))  # an engine with a smaller cap: applied at start
    assert smaller.stats["files"] == 2 and {k for k in keys[:5] if d.path(k).exists()} == {keys[0], keys[4]}


def test_the_cap_takes_an_objects_tail_before_its_head(tmp_path: Path) -> None:
    """An object's pages are written (and read back) by a pool of threads at once; their files are
    stamped in page order, so the size cap removes a chain's last pages first and what is left is
    still a usable prefix. Before, the cap took them in no particular order: often the first page,
    and with it the whole chain."""
    d = _dir(tmp_path)
    slab = np.random.default_rng(1).integers(0, 256, (1, 2, 8, 500), dtype=np.uint8)
    store = l3.L3Store(d, slab)
    keys = l3.page_keys(FP, list(range(16)), PS)  # one object of 8 pages
    assert store.write_object(0, keys) == 8
    store.drain()
    ages = [d.path(k).stat().st_mtime_ns for k in keys]
    assert ages == sorted(ages, reverse=True) and len(set(ages)) == 8
    size = d.path(keys[0]).stat().st_size
    d.cap = int(5.5 * size)
    d.enforce_cap()  # down to 90% of the cap: 4 files
    assert [d.path(k).exists() for k in keys] == [True] * 4 + [False] * 4
    assert l3.probe(d.root, keys) == 4
    store.load_object(1, 0, keys[:4])  # a read stamps them in order too
    store.drain()
    assert store.take_loaded() == [(1, True)]
    ages = [d.path(k).stat().st_mtime_ns for k in keys[:4]]
    assert ages == sorted(ages, reverse=True) and len(set(ages)) == 4


def test_entries_named_like_page_files_but_not_files_are_left_alone(tmp_path: Path) -> None:
    """A directory at a page file's path (one of its kind, or at the path of a page being written)
    neither stops the engine at start (the cap used to unlink it: IsADirectoryError, a dead cache
    controller on every restart) nor stops the cap or the writes later; a removed root comes back."""
    size = l3.HEADER.size + 1000
    keys = l3.page_keys(FP, list(range(20)), PS)
    d = _dir(tmp_path, cap=100 * size)
    for i, key in enumerate(keys[:4]):
        d.write(key, bytes(1000))
        os.utime(d.path(key), (1000 + i, 1000 + i))
    squat = d.path(bytes(l3.KEY_BYTES))  # a directory named like a page file, older than every file
    squat.mkdir(parents=True)
    os.utime(squat, (10, 10))
    smaller = _dir(tmp_path, cap=int(2.5 * size))  # over the cap at start: the oldest files go
    assert smaller.stats["files"] == 2 and squat.is_dir()
    assert {k for k in keys[:4] if d.path(k).exists()} == {keys[2], keys[3]}
    d.path(keys[5]).mkdir(parents=True)  # the path of a page about to be written
    assert smaller.write(keys[5], bytes(1000)) is False and d.path(keys[5]).is_dir()
    assert smaller.write(keys[6], bytes(1000)) is True  # the next page is written as ever
    assert smaller.read(keys[5], 1000) is None  # a miss, not an error
    import shutil

    shutil.rmtree(tmp_path / "l3")  # the directory removed under a running engine: re-created
    assert smaller.write(keys[7], bytes(1000)) is True and smaller.read(keys[7], 1000) == bytes(1000)


def test_probe_counts_the_consecutive_files(tmp_path: Path) -> None:
    d = _dir(tmp_path)
    keys = l3.page_keys(FP, list(range(10)), PS)
    for k in (keys[0], keys[1], keys[3]):
        d.write(k, b"x")
    assert l3.probe(d.root, keys) == 2 and l3.probe(d.root, keys[2:]) == 0
    # a stat that fails with an error other than "no such file" (here ENAMETOOLONG) is a miss, not a raise
    assert l3.probe(tmp_path / ("x" * 300), keys) == 0


# ---- the tree --------------------------------------------------------------------------------


def _tree(host_pages: int = 16) -> TieredRadixCache:
    return TieredRadixCache(PS, PageAllocator(33), host_pages, l3_fingerprint=FP, num_layers=1)


def _load(cache: TieredRadixCache, tokens: list[int]) -> int:
    """Start a load of tokens' pages under the root, as admission would after a probe."""
    match = cache.match_prefix(tokens, touch=False)
    rest = tokens[match.num_tokens :]
    assert cache.start_l3_load(match.node, rest, l3.chain(cache.chain_end(match.node), rest, PS))
    (op,) = [c for c in cache.changes if isinstance(c, L3Load)]
    return op.obj


def test_a_loading_node_is_not_matched_and_commits_to_a_host_only_node() -> None:
    cache = _tree()
    toks = [1, 2, 3, 4, 5, 6]
    obj = _load(cache, toks)
    assert cache.match_prefix(toks + [7], touch=False).num_tokens == 0
    assert not cache.match_prefix(toks + [7], touch=False).host_nodes
    assert cache.loading_at(cache.root, toks) and not cache.flushable
    assert cache.match_prefix([1, 2, 3, 4], touch=False).num_tokens == 0  # splits it: still loading
    cache.check_invariants()
    replica = rank_replica()
    replica.apply_step(Step(seq=1, ops=cache.take_changes()))
    cache.l3_loaded(obj, ok=True)
    ops = cache.take_changes()
    assert sorted(type(o).__name__ for o in ops) == ["ApplyCommit", "ApplyCommit"]  # the object and its piece
    replica.apply_step(Step(seq=2, ops=ops))
    assert replica["host_tier"].alloc.encode() == cache.host.encode()
    match = cache.match_prefix(toks + [7], touch=False)
    assert [len(n.key) for n in match.host_nodes] == [4, 2]
    loaded = cache.load_back(match)
    assert loaded is not None and loaded.num_tokens == 6 and cache.last_load == (0, 6)  # an L3 hit
    cache.check_invariants()
    assert cache.flushable


def test_a_failed_load_drops_the_object_and_its_pieces() -> None:
    cache = _tree()
    obj = _load(cache, [1, 2, 3, 4, 5, 6])
    cache.match_prefix([1, 2, 9, 9], touch=False)  # a split piece of the loading object
    replica = rank_replica()
    replica.apply_step(Step(seq=1, ops=cache.take_changes()))
    assert replica.digest() != rank_replica().digest()
    cache.l3_loaded(obj, ok=False)
    ops = cache.take_changes()
    assert [type(o) for o in ops] == [HostEvict, HostEvict]
    replica.apply_step(Step(seq=2, ops=ops))
    assert not cache.root.children and cache.host.num_used == 0 and cache.flushable
    cache.check_invariants()
    assert replica["host_tier"].alloc.encode() == cache.host.encode()
    with pytest.raises(RuntimeError, match="not loading"):
        cache.l3_loaded(obj, ok=True)


def test_a_load_without_room_in_l2_is_skipped() -> None:
    cache = _tree(host_pages=2)
    toks = [1, 2, 3, 4, 5, 6]
    assert not cache.start_l3_load(cache.root, toks, l3.page_keys(FP, toks, PS))
    assert not cache.root.children and not any(isinstance(c, L3Load) for c in cache.changes)


def test_backups_carry_their_page_keys() -> None:
    cache = _tree()
    toks = [1, 2, 3, 4]
    pages = cache.allocator.alloc(2)
    cache.insert_node(toks, pages)
    pages2 = cache.allocator.alloc(3)
    cache.insert_node(toks + [5, 6], pages2)
    backups = [c for c in cache.changes if isinstance(c, BackupPrepare)]
    assert [l3.unpack_keys(b.keys) for b in backups] == [
        l3.page_keys(FP, toks, PS),
        l3.page_keys(FP, toks + [5, 6], PS)[2:],
    ]
    assert [b.parent for b in backups] == [-1, backups[0].obj]  # the chain above each, for the controller


def test_replicas_agree_across_l3_loads() -> None:
    """The scheduler's tree and 4 replicas (workers, controller) over an op sequence with
    loads that succeed, fail and are split."""
    cache = _tree(host_pages=6)
    replicas = [rank_replica() for _ in range(4)]
    seq = 0

    def sync() -> None:
        nonlocal seq
        seq += 1
        ops = [*cache.take_changes(), DigestCheck()]
        for r in replicas:
            r.apply_step(Step(seq=seq, ops=ops))
        cache.check_invariants()
        assert len({r.digest() for r in replicas}) == 1
        assert replicas[0]["host_tier"].alloc.encode() == cache.host.encode()

    a, b, c = [1, 1, 2, 2, 3, 3], [4, 4, 5, 5], [6, 6, 7, 7, 8, 8, 9, 9]
    oa, ob = _load(cache, a), 0
    sync()
    ob = _load(cache, b)
    sync()
    cache.match_prefix([1, 1, 2, 2, 0, 0], touch=False)  # splits a's loading object
    sync()
    cache.l3_loaded(oa, ok=True)
    cache.l3_loaded(ob, ok=False)
    sync()
    oc = _load(cache, c)  # 4 pages: evicts a's committed host pieces to fit
    sync()
    cache.l3_loaded(oc, ok=True)
    sync()
    assert cache.stats["host_evicted"] > 0  # c's load evicted a's committed pieces to fit
    cache.reset()
    sync()
    fresh = rank_replica()  # a Flush returns every replica to its freshly built state
    fresh.apply_step(Step(seq=1, ops=[HostInit(6, 0, 1, FP)]))
    assert {r.digest() for r in replicas} == {fresh.digest()}


def test_a_replica_refuses_a_misplaced_load() -> None:
    r = rank_replica()
    r.apply_step(Step(seq=1, ops=[HostInit(8), L3Load(1, 0, bytes(32))]))
    with pytest.raises(ReplicaError, match="placed at 2"):
        r.apply_step(Step(seq=2, ops=[L3Load(2, 5, bytes(16))]))


def test_a_replica_refuses_l3_touch_of_an_object_not_committed() -> None:
    r = rank_replica()
    r.apply_step(Step(seq=1, ops=[HostInit(8), L3Load(1, 0, bytes(32))]))
    with pytest.raises(ReplicaError, match="L3Touch of object 1: not a committed object"):
        r.apply_step(Step(seq=2, ops=[L3Touch(1)]))
    r.apply_step(Step(seq=3, ops=[ApplyCommit(1), L3Touch(1)]))


def test_flags() -> None:
    with pytest.raises(ValueError, match="needs --enable-hierarchical-cache"):
        ServerConfig(l3_dir="/tmp/x")
    with pytest.raises(ValueError, match="l3-size"):
        ServerConfig(enable_hierarchical_cache=True, l3_dir="/tmp/x", l3_size=0)
    cfg = ServerConfig(enable_hierarchical_cache=True, l3_dir="rel/l3")
    assert os.path.isabs(cfg.l3_dir) and cfg.l3_size == 16.0


# ---- the controller ---------------------------------------------------------------------------


@pytest.fixture
def slab():
    path = create_slab("strata-test-l3")
    yield path
    remove_slab(path)


def _controller(slab: str, root: Path, ranks: int = 2):
    steps_out, steps_in = pipe(STEPS)
    backups_out, backups_in = pipe(BACKUPS)
    commits_out, commits_in = pipe(COMMITS)
    mapping = SlabMapping(slab, ranks)
    tier = L3Tier(mapping, str(root), 1 << 30)
    ctrl = CacheController(ranks, steps_in, backups_in, commits_out, [mapping], l3=tier)
    return ctrl, mapping, tier, steps_out, backups_out, commits_in


def _wait(ctrl: CacheController, commits, kind: type, timeout: float = 10.0) -> list:
    deadline, got = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        ctrl.pump()
        got += list(commits.drain())
        if any(isinstance(m, kind) for m in got):
            return got
        time.sleep(0.002)
    raise TimeoutError(f"no {kind.__name__}: {got}")


def test_the_controller_writes_committed_objects_and_reads_them_back(slab: str, tmp_path: Path) -> None:
    root = tmp_path / "l3"
    ctrl, mapping, tier, steps, backups, commits = _controller(slab, root)
    layers, layer_bytes, host = 2, 8, 8
    page_bytes = 2 * layers * layer_bytes
    keys = l3.page_keys(FP, list(range(6)), PS)
    steps.send(
        Step(
            seq=1,
            ops=[HostInit(host, page_bytes, layers, FP), BackupPrepare(7, pack_ids([1, 2, 3]), 0, l3.pack_keys(keys))],
        )
    )
    ctrl.pump()
    view = np.frombuffer(mapping.map, dtype=np.uint8).reshape(2, 2 * layers, host, layer_bytes)
    view[:, :, 0:3, :] = np.random.default_rng(0).integers(0, 256, (2, 2 * layers, 3, layer_bytes), dtype=np.uint8)
    want = view[:, :, 0:3, :].copy()
    for rank in (0, 1):
        backups.send(BackupDone(obj=7, rank=rank))
    ctrl.pump()
    assert [m for m in commits.drain() if isinstance(m, Committed)] == [Committed(obj=7)]
    view[:, :, 0:3, :] = 0  # the host pages reused at once: the files hold the snapshot
    tier.store.drain()
    assert all(tier.store.files.exists(k) for k in keys)
    # later: evicted from L2, read back into other host pages
    steps.send(Step(seq=2, ops=[ApplyCommit(7), HostEvict(7), L3Load(8, 0, l3.pack_keys(keys[:2]))]))
    got = _wait(ctrl, commits, L3Loaded)
    assert L3Loaded(obj=8, ok=True) in got
    assert np.array_equal(view[:, :, 0:2, :], want[:, :, 0:2, :])
    # a corrupt file fails the load (and is removed)
    path = tier.store.files.path(keys[2])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    steps.send(Step(seq=3, ops=[HostEvict(8), L3Load(9, 0, l3.pack_keys(keys))]))
    assert L3Loaded(obj=9, ok=False) in _wait(ctrl, commits, L3Loaded)
    assert not path.exists()
    ctrl._send_stats(tier.store, force=True)
    (stats,) = [m for m in commits.drain() if isinstance(m, L3Stats)] or [L3Stats(**tier.store.stats())]
    assert stats.writes == 3 and stats.reads >= 4 and stats.corrupt == 1 and stats.files == 2


def test_a_full_write_queue_writes_a_prefix_and_counts_the_rest(slab: str, tmp_path: Path) -> None:
    ctrl, mapping, tier, steps, backups, commits = _controller(slab, tmp_path / "l3", ranks=1)
    tier.queue_bytes = 80
    keys = l3.page_keys(FP, [1, 2, 3, 4, 5, 6], PS)
    steps.send(Step(seq=1, ops=[HostInit(4, 32, 2, FP), BackupPrepare(3, pack_ids([1, 2, 3]), 0, l3.pack_keys(keys))]))
    ctrl.pump()
    assert tier.store.queue_bytes == 4 * 32  # the bound grows to one L2's worth (4 pages of 32 bytes)
    tier.store.queue_bytes = 80  # room for 2 pages of 32 bytes
    backups.send(BackupDone(obj=3, rank=0))
    ctrl.pump()
    assert Committed(obj=3) in list(commits.drain())  # the commit does not wait for the disk
    tier.store.drain()
    assert tier.store.stats()["write_skips"] == 1  # the leading pages fit: the key chain stays whole
    assert [tier.store.files.exists(k) for k in keys] == [True, True, False]


def test_a_disk_refusing_every_write_logs_once_an_interval_and_counts_every_page(slab: str, tmp_path: Path) -> None:
    """An audit's full disk logged one warning per page of every request, without limit."""
    from structlog.testing import capture_logs

    ctrl, mapping, tier, steps, backups, commits = _controller(slab, tmp_path / "l3", ranks=1)
    keys = l3.page_keys(FP, list(range(8)), PS)  # 4 pages
    steps.send(Step(seq=1, ops=[HostInit(4, 32, 2, FP), BackupPrepare(3, pack_ids([1, 2, 3, 4]), 0,
                                                                      l3.pack_keys(keys))]))
    ctrl.pump()
    for k in keys:  # a file where each page's directory goes: every write fails with an OSError
        parent = tier.store.files.path(k).parent
        parent.parent.mkdir(parents=True, exist_ok=True)
        parent.touch()
    with capture_logs() as logs:
        backups.send(BackupDone(obj=3, rank=0))
        ctrl.pump()
        tier.store.drain()
    assert tier.store.stats()["write_skips"] == 4 and not any(tier.store.files.exists(k) for k in keys)
    assert [e["event"] for e in logs].count("l3 i/o error") == 1
    assert not tier.store.errors  # not fatal: the engine serves on
    # for a while after, nothing is copied for the disk: the next object's pages are skipped at once
    assert tier.store.write_object(0, keys) == 0 and tier.store.stats()["write_skips"] == 8
    assert tier.store.writes.empty()


def test_a_failed_load_is_reported_after_every_read_of_it_ended(slab: str, tmp_path: Path) -> None:
    """A read that raises fails the load, but the report waits for the object's other reads: the
    scheduler frees a failed load's host pages, and a read still running would write into them."""
    ctrl, mapping, tier, steps, backups, commits = _controller(slab, tmp_path / "l3", ranks=1)
    keys = l3.page_keys(FP, list(range(8)), PS)  # 4 pages
    steps.send(Step(seq=1, ops=[HostInit(8, 32, 2, FP), BackupPrepare(3, pack_ids([1, 2, 3, 4]), 0,
                                                                      l3.pack_keys(keys))]))
    ctrl.pump()
    view = np.frombuffer(mapping.map, dtype=np.uint8).reshape(1, 4, 8, 8)
    view[:, :, 0:4, :] = np.random.default_rng(1).integers(0, 256, (1, 4, 4, 8), dtype=np.uint8)
    want = view[:, :, 0:4, :].copy()
    backups.send(BackupDone(obj=3, rank=0))
    ctrl.pump()
    tier.store.drain()
    first = tier.store.files.path(keys[0])
    first.unlink()
    first.mkdir()  # its read raises (EISDIR), the other three read
    view[:, :, 0:4, :] = 0
    steps.send(Step(seq=2, ops=[ApplyCommit(3), HostEvict(3), L3Load(4, 0, l3.pack_keys(keys))]))
    assert L3Loaded(obj=4, ok=False) in _wait(ctrl, commits, L3Loaded)
    assert np.array_equal(view[:, :, 1:4, :], want[:, :, 1:4, :])  # done before the failure was reported


def test_a_writer_killed_mid_write_leaves_no_page_file(tmp_path: Path) -> None:
    """A temporary file is never a page file (a reader never sees it); a stale one (its
    writer died) is removed by the next scan, a young one (a live writer) is left alone."""
    d = _dir(tmp_path)
    key = l3.page_keys(FP, [1, 2], PS)[0]
    sub = d.path(key).parent
    sub.mkdir()
    stale, young = sub / f".{key.hex()}.kv.1.aa.tmp", sub / f".{key.hex()}.kv.2.bb.tmp"
    for f in (stale, young):
        f.write_bytes(b"half a file")
    os.utime(stale, (1, 1))
    assert l3.probe(d.root, [key]) == 0 and d.read(key, 11) is None
    d.scan()
    assert not stale.exists() and young.exists() and d.stats["files"] == 0


def test_a_pending_object_split_before_its_commit_is_written_whole(slab: str, tmp_path: Path) -> None:
    ctrl, _, tier, steps, backups, commits = _controller(slab, tmp_path / "l3", ranks=1)
    keys = l3.page_keys(FP, list(range(8)), PS)
    steps.send(
        Step(
            seq=1,
            ops=[
                HostInit(8, 32, 2, FP),
                BackupPrepare(7, pack_ids([1, 2, 3, 4]), 0, l3.pack_keys(keys)),
                HostSplit(7, 1, 9),
                HostSplit(7, 2, 11),
            ],
        )
    )  # pieces 9 | 11 | 7
    ctrl.pump()
    backups.send(BackupDone(obj=7, rank=0))
    ctrl.pump()
    assert Committed(obj=7) in list(commits.drain())
    tier.store.drain()
    assert all(tier.store.files.exists(k) for k in keys)
    steps.send(Step(seq=2, ops=[ApplyCommit(7), ApplyCommit(9), ApplyCommit(11)]))
    ctrl.pump()
    assert not tier.pending and not tier.pieces and not tier.origin  # nothing kept once committed


def test_a_childs_write_and_read_stamp_its_chain_above_it(slab: str, tmp_path: Path) -> None:
    """A prefix hit in L1 / L2 never reads its L3 files, so they age while every conversation that
    extends it writes newer ones: the cap would take the shared prefix first, and every chain with
    it. The controller knows each object's parent (BackupPrepare / L3Load `parent`): a child's write
    stamps the chain above it too, newer than the child, in order (split objects included)."""
    ctrl, mapping, tier, steps, backups, commits = _controller(slab, tmp_path / "l3", ranks=1)
    keys = l3.page_keys(FP, list(range(20)), PS)  # a chain of 10 pages: prefix 0-5 (split 0-2 | 3-5), child 6-9
    d = l3.L3Dir(tmp_path / "l3", FP, 1 << 30)

    def commit(obj: int) -> None:
        backups.send(BackupDone(obj=obj, rank=0))
        _wait(ctrl, commits, Committed)
        tier.store.drain()

    steps.send(Step(seq=1, ops=[HostInit(16, 32, 2, FP), BackupPrepare(1, pack_ids(list(range(6))), 0,
                                                                       l3.pack_keys(keys[:6]))]))
    ctrl.pump()
    commit(1)
    steps.send(Step(seq=2, ops=[ApplyCommit(1), HostSplit(1, 3, 2)]))  # a later request split the prefix
    ctrl.pump()
    for k in keys[:6]:
        os.utime(d.path(k), (1000, 1000))  # written long ago, only hit in L1 since
    steps.send(Step(seq=3, ops=[BackupPrepare(3, pack_ids([6, 7, 8, 9]), 6, l3.pack_keys(keys[6:]), parent=1)]))
    ctrl.pump()
    commit(3)
    ages = [d.path(k).stat().st_mtime_ns for k in keys]
    assert ages == sorted(ages, reverse=True) and len(set(ages)) == 10  # the prefix newer than its child, in order
    size = d.path(keys[0]).stat().st_size
    d.cap = int(9.5 * size)
    d.enforce_cap()
    assert l3.probe(d.root, keys) == 8  # the child's tail went first
    for k in keys[:6]:
        os.utime(d.path(k), (1000, 1000))
    tier.stamped.clear()  # (ancestors are stamped at most every STAMP_EVERY_S)
    steps.send(Step(seq=4, ops=[HostEvict(3), L3Load(4, 6, l3.pack_keys(keys[6:8]), parent=1)]))
    assert L3Loaded(obj=4, ok=True) in _wait(ctrl, commits, L3Loaded)  # a read stamps the chain too
    ages = [d.path(k).stat().st_mtime_ns for k in keys[:8]]
    assert ages == sorted(ages, reverse=True) and ages[5] > 10**18
    for k in keys[:8]:
        os.utime(d.path(k), (1000, 1000))
    tier.stamped.clear()
    steps.send(Step(seq=5, ops=[ApplyCommit(4), L3Touch(4)]))  # a hit in L1 / L2 on the chain's end
    ctrl.pump()
    tier.store.drain()
    ages = [d.path(k).stat().st_mtime_ns for k in keys[:8]]
    assert ages == sorted(ages, reverse=True) and ages[7] > 10**18


def _l3_touches(cache: TieredRadixCache, tokens: list[int]) -> list[int]:
    """The objects a used match of tokens marks used in L3 (the L3Touch ops of its touch)."""
    cache.touch(cache.match_prefix(tokens, touch=False).node)
    return [op.obj for op in cache.take_changes() if isinstance(op, L3Touch)]


def test_a_used_match_marks_its_l3_chain_used_at_most_once_a_window() -> None:
    """touch (a match a request uses) sends L3Touch for the deepest committed host copy on its path,
    once per L3_TOUCH_STEPS steps an object, and only with the disk tier on."""
    from engine.cache.hiradix import L3_TOUCH_STEPS

    for fingerprint in (FP, b""):
        cache = TieredRadixCache(PS, PageAllocator(33), 16, l3_fingerprint=fingerprint, num_layers=1)
        toks = [1, 2, 3, 4, 5, 6]
        cache.insert_node(toks, cache.allocator.alloc(3))
        cache.insert_node(toks + [7, 8], cache.allocator.alloc(4))  # a child not committed yet
        (first, _) = [op.obj for op in cache.changes if isinstance(op, BackupPrepare)]
        cache.commit(first)
        cache.take_changes()
        want = [first] if fingerprint else []
        cache.tick()
        assert _l3_touches(cache, toks + [7, 8, 9]) == want  # the committed one, above the pending child
        cache.tick()
        assert _l3_touches(cache, toks + [7, 8, 9]) == []
        for _ in range(L3_TOUCH_STEPS):
            cache.tick()
        assert _l3_touches(cache, toks + [7, 8, 9]) == want
