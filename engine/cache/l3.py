"""The disk tier (L3): KV pages as content-addressed files under `--l3-dir` (docs/architecture.md, Tiers).

No torch here: the scheduler (probing) and the cache controller (reads and writes) use it.

* **Keys.** A model fingerprint (16 bytes) hashes everything that makes a page's bytes
  what they are: the model's config and weights identity, the compute and KV dtypes, the
  page size and the layout (tp size, bytes per page, layers, the model's declared KV layout:
  K and V, or MLA's latent). Page keys chain over the
  token prefix: key_i = blake2b(key_{i-1} || page i's tokens as int32, 16 bytes), key_{-1}
  = the fingerprint, so a key names the whole prefix up to and including its page.
* **Files.** `<dir>/<hex[:2]>/<hex>.kv`, one per page, holding every rank's bytes of that
  page: a header (magic, version, fingerprint, key, payload length, CRC-32 of the
  payload) and the payload, [rank][layer][component][layer bytes] (K, V; or the latent). A write goes to a
  temporary name in the same directory and is renamed into place (`os.replace`), so a
  reader never sees half a file, also on a directory shared by several engines; a file
  that exists is not written again (content-addressed). A read checks the header, the
  length and the checksum: a bad file is counted as corrupt, unlinked and not served.
  The payload is read straight into its host pages (one `preadv` into the page's
  [rank][layer][component] rows of the slab) and checked there: no intermediate buffer. CRC-32
  (zlib's, carry-less-multiply accelerated: ~4 GB/s a core here against blake2b's ~0.9)
  detects a damaged file; the header's fingerprint and key detect a foreign one.
* **Size cap.** `L3Dir` knows the bytes in the directory (a scan at start, then its own
  writes); over the cap it rescans and removes the oldest files (mtime: a read refreshes
  it) down to 90% of the cap. An object's pages, written or read together, are stamped in
  order, each AGE_STEP_NS older than the one before it, so the cap takes a chain's tail before
  its head: a page is useless without the pages before it, and files written or read at once
  by a pool of threads would otherwise go in no particular order. The chain's pages above the
  object (its ancestors' objects, which the controller knows from BackupPrepare / L3Load's
  `parent`) are stamped with it, newer still: a prefix every new conversation extends stays as
  young as its newest child, though hits on it in L1 / L2 never read its files; such a hit also
  sends L3Touch, which stamps the chain alone.
* **Threads.** `L3Store` (the controller's) writes snapshots of committed objects on a
  writer thread (a queue bounded in bytes: over it a write is skipped and counted) and
  reads objects into the host slab on a reader thread; results come back through
  `take_loaded()`. Each spreads an object's pages over a small pool (file I/O and CRC-32
  release the GIL), so a long prefix is not checksummed on one core.
* **Log.** At most once per LOG_INTERVAL_S, and only after activity, `L3Store.maybe_log`
  writes one `l3 writes` line with what happened since the last one: page files written,
  their bytes, the writer's seconds (wall time of its batches), pages that already had a
  file, skips (queue full or I/O error) and corrupt files seen by reads; plus the
  directory's files and bytes. The writer thread calls it after each batch, the controller
  on every pass (so the last activity is logged within a second), and once at shutdown.
"""

from __future__ import annotations

import contextvars
import hashlib
import os
import queue
import secrets
import struct
import threading
import time
import zlib
from array import array
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

KEY_BYTES = 16
MAGIC = b"STRATAKV"
VERSION = 2  # 1: blake2b checksums (such files read as foreign: ignored and removed)
HEADER = struct.Struct("<8sI16s16sQI")  # magic, version, fingerprint, key, payload length, CRC-32
IOV_MAX = 1024  # iovecs per preadv call (POSIX minimum of the Linux limit)
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
STALE_TMP_S = 600.0  # a temporary file this old was left by a writer that died
WRITE_QUEUE_BYTES = 512 << 20
LOG_INTERVAL_S = 1.0
AGE_STEP_NS = 1000  # an object's page i is stamped i microseconds older than its first (the cap's order)
NOTE_INTERVAL_S = 10.0  # at most one `l3 i/o error` warning per interval (a full disk fails every page)
WRITE_BACKOFF_S = 10.0  # after a write fails (a full or read-only disk), no page is copied for the disk this long
# the `l3 writes` line's counters (deltas; bin/analyze sums them): the writer's, by batch
WRITER_KEYS = ("pages", "bytes", "existed", "write_s")
DIR_KEYS = {"write_skips": "skips", "corrupt": "corrupt"}  # L3Dir.stats' (skips: also at queueing)


# ---- keys ---------------------------------------------------------------------------------


def model_fingerprint(
    config_json: bytes,
    weights: bytes,
    dtype: str,
    kv_dtype: str,
    page_size: int,
    tp_size: int,
    page_bytes: int,
    num_layers: int,
    kv_layout: str = "",
) -> bytes:
    """16 bytes naming the KV a page holds: two engines share L3 files only when equal.
    `kv_layout` is the model's declared layout (engine/layers/kv_layout.py, `describe`)."""
    h = hashlib.blake2b(b"strata.l3.v1", digest_size=KEY_BYTES)
    for part in (
        config_json,
        weights,
        dtype.encode(),
        kv_dtype.encode(),
        b"%d/%d/%d/%d" % (page_size, tp_size, page_bytes, num_layers),
        kv_layout.encode(),
    ):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def chain(prev: bytes, tokens: Sequence[int], page_size: int) -> list[bytes]:
    """The keys of the full pages of `tokens`, continuing the chain after key `prev`."""
    keys = []
    for at in range(0, len(tokens) - page_size + 1, page_size):
        prev = hashlib.blake2b(prev + array("i", tokens[at : at + page_size]).tobytes(), digest_size=KEY_BYTES).digest()
        keys.append(prev)
    return keys


def page_keys(fingerprint: bytes, tokens: Sequence[int], page_size: int) -> list[bytes]:
    return chain(fingerprint, tokens, page_size)


def pack_keys(keys: Iterable[bytes]) -> bytes:
    return b"".join(keys)


def unpack_keys(packed: bytes) -> list[bytes]:
    if len(packed) % KEY_BYTES:
        raise ValueError(f"packed L3 keys of {len(packed)} bytes")
    return [packed[i : i + KEY_BYTES] for i in range(0, len(packed), KEY_BYTES)]


def key_path(root: str | Path, key: bytes) -> Path:
    hx = key.hex()
    return Path(root) / hx[:2] / f"{hx}{SUFFIX}"


def probe(root: str | Path, keys: Sequence[bytes]) -> int:
    """How many of `keys`, from the first, have a file (a stat each; the read verifies). A stat
    that fails (permissions, I/O) is a miss: a lookup never stops the scheduler that asks it."""
    n = 0
    for key in keys:
        try:
            if not key_path(root, key).is_file():
                break
        except OSError:
            break
        n += 1
    return n


# ---- one file -----------------------------------------------------------------------------


def crc32(parts: Iterable[Any]) -> int:
    """CRC-32 over the concatenation of `parts` (buffers)."""
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return crc


def header(fingerprint: bytes, key: bytes, payload: Sequence[Any], payload_len: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, fingerprint, key, payload_len, crc32(payload))


def check_cap(cap_gb: float, page_payload: int) -> None:
    """--l3-size must hold one page file (else every file written is removed at once: disk
    traffic for nothing, and no hit ever)."""
    need = HEADER.size + page_payload
    if page_payload > 0 and cap_gb * 2**30 < need:
        raise ValueError(f"--l3-size {cap_gb:g} GB holds no page file: one takes {need:,} bytes here")


def encode_file(fingerprint: bytes, key: bytes, payload: bytes) -> bytes:
    return header(fingerprint, key, [payload], len(payload)) + payload


def header_ok(head: bytes, fingerprint: bytes, key: bytes, payload_len: int) -> int | None:
    """The payload's CRC-32 the header promises, or None when the header is not this page's."""
    if len(head) != HEADER.size:
        return None
    magic, version, fp, k, n, check = HEADER.unpack(head)
    if (magic, version, fp, k, n) != (MAGIC, VERSION, fingerprint, key, payload_len):
        return None
    return check


# ---- the directory ------------------------------------------------------------------------


class L3Dir:
    """The files of one model in one directory: write, read, size cap, counters.
    Thread-safe (the controller's reader and writer threads share one)."""

    def __init__(self, root: str | Path, fingerprint: bytes, cap_bytes: int) -> None:
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.cap = cap_bytes
        self.lock = threading.Lock()
        self.stats = {
            "reads": 0,
            "writes": 0,
            "bytes_read": 0,
            "bytes_written": 0,
            "corrupt": 0,
            "write_skips": 0,
            "files": 0,
            "bytes": 0,
        }
        self.last_corrupt: str | None = None  # the last rejected file and why (the `l3 writes` log line)
        self.root.mkdir(parents=True, exist_ok=True)
        self.scan()
        if self.stats["bytes"] > self.cap:  # a directory left larger than this engine's --l3-size
            self.enforce_cap()

    def path(self, key: bytes) -> Path:
        return key_path(self.root, key)

    def _files(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of every page file (regular files only: a directory or link named
        like one is not ours to count or remove); stale temporary files are removed. An entry
        that cannot be listed or stat'ed (removed meanwhile, unreadable) is skipped."""
        out, now = [], time.time()
        try:
            subs = [sub for sub in self.root.iterdir() if len(sub.name) == 2 and sub.is_dir()]
        except OSError:  # the directory removed or unreadable meanwhile: nothing to count
            return out
        for sub in subs:
            try:
                entries = list(os.scandir(sub))
            except OSError:
                continue
            for entry in entries:
                try:
                    if not entry.is_file(follow_symlinks=False):
                        continue
                    st = entry.stat(follow_symlinks=False)
                    if entry.name.endswith(SUFFIX):
                        out.append((st.st_mtime, st.st_size, Path(entry.path)))
                    elif entry.name.endswith(TMP_SUFFIX) and now - st.st_mtime > STALE_TMP_S:
                        Path(entry.path).unlink(missing_ok=True)
                except OSError:  # removed meanwhile (another engine), or not ours
                    continue
        return out

    def scan(self) -> None:
        files = self._files()
        with self.lock:
            self.stats["files"] = len(files)
            self.stats["bytes"] = sum(size for _, size, _ in files)

    def exists(self, key: bytes) -> bool:
        return self.path(key).is_file()

    def write(self, key: bytes, payload: bytes) -> bool:
        """Write one page file atomically; False when it already existed (its mtime is
        refreshed: it was just wanted again)."""
        dst = self.path(key)
        if dst.is_file():
            _stamp([dst])
            return False
        if dst.exists():  # something not a page file squats the page's path: this page stays off disk
            return False
        dst.parent.mkdir(parents=True, exist_ok=True)  # (the root too, should it have been removed)
        head = header(self.fingerprint, key, [payload], len(payload))
        tmp = dst.parent / f".{dst.name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(payload)
            os.replace(tmp, dst)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        with self.lock:
            self.stats["writes"] += 1
            self.stats["bytes_written"] += len(head) + len(payload)
            self.stats["files"] += 1
            self.stats["bytes"] += len(head) + len(payload)
            over = self.stats["bytes"] > self.cap
        if over:
            self.enforce_cap()
        return True

    def read(self, key: bytes, payload_len: int) -> bytes | None:
        """The verified payload of `key`'s page, or None (missing, or corrupt: then unlinked
        and counted)."""
        buf = bytearray(payload_len)
        return bytes(buf) if self.read_into(key, [memoryview(buf)]) else None

    def read_into(self, key: bytes, parts: Sequence[memoryview], touch: bool = True) -> bool:
        """Read `key`'s verified payload into the writable buffers `parts`, in order (their
        sizes sum to the payload's length); False when missing, or corrupt: then unlinked and
        counted, and `parts` hold garbage. `touch`: refresh its mtime (an object's reader
        stamps its pages in order instead, `stamp`)."""
        path = self.path(key)
        payload_len = sum(p.nbytes for p in parts)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            size = os.fstat(fd).st_size
            # never read more than a page file can hold (a shared directory may hold anything)
            check = (
                header_ok(os.pread(fd, HEADER.size, 0), self.fingerprint, key, payload_len)
                if size == HEADER.size + payload_len
                else None
            )
            ok = check is not None and _preadv(fd, parts, HEADER.size) == payload_len and crc32(parts) == check
        finally:
            os.close(fd)
        if not ok:
            why = (f"{size} bytes, a page file holds {HEADER.size + payload_len}" if size != HEADER.size + payload_len
                   else "header (magic, model fingerprint, key or length)" if check is None else "checksum")
            with self.lock:
                self.stats["corrupt"] += 1
                self.last_corrupt = f"{path.name}: {why}"
            self._remove(path, size)
            return False
        if touch:
            _stamp([path])
        with self.lock:
            self.stats["reads"] += 1
            self.stats["bytes_read"] += size
        return True

    def stamp(self, keys: Sequence[bytes]) -> None:
        """An object's page files (in page order) used now, each older than the one before."""
        _stamp([self.path(k) for k in keys])

    def _remove(self, path: Path, size: int) -> None:
        try:
            path.unlink()
        except OSError:  # gone already (another engine), or not ours to remove: best effort
            return
        with self.lock:
            self.stats["files"] = max(0, self.stats["files"] - 1)
            self.stats["bytes"] = max(0, self.stats["bytes"] - size)

    def enforce_cap(self) -> int:
        """Over the cap: rescan (other engines write here too) and remove the oldest files
        down to 90% of it. Returns the files removed."""
        files = sorted(self._files())
        total = sum(size for _, size, _ in files)
        removed = 0
        target = int(self.cap * 0.9)
        for _, size, path in files:
            if total <= target:
                break
            try:
                path.unlink(missing_ok=True)
            except OSError:  # not ours to remove (permissions): the next oldest goes instead
                continue
            total -= size
            removed += 1
        with self.lock:
            self.stats["files"] = len(files) - removed
            self.stats["bytes"] = total
        return removed


def _preadv(fd: int, parts: Sequence[memoryview], offset: int) -> int:
    """Read into `parts` from `offset`, as many preadv calls as it takes; the bytes read."""
    done = 0
    for at in range(0, len(parts), IOV_MAX):
        group = parts[at : at + IOV_MAX]
        want = sum(p.nbytes for p in group)
        got = os.preadv(fd, group, offset + done)
        done += got
        if got != want:  # short: the file shrank under us (another engine) or an odd filesystem
            return done
    return done


def _stamp(paths: Sequence[Path]) -> None:
    """Used now, in order: page i of an object i x AGE_STEP_NS older than its first page."""
    now = time.time_ns()
    for i, path in enumerate(paths):
        try:
            os.utime(path, ns=(now - i * AGE_STEP_NS,) * 2)
        except OSError:  # removed meanwhile (another engine's cap): nothing to age
            pass


# ---- the controller's threads -------------------------------------------------------------


class L3Store:
    """Reads and writes of whole host objects between the host slab and an `L3Dir`.

    `slab` is a numpy uint8 view [rank, layer x component, host page, layer bytes] of the
    slab (every rank's region): one page of every rank is `slab[:, :, page, :]`, the payload
    of its file."""

    def __init__(self, files: L3Dir, slab: Any, queue_bytes: int = WRITE_QUEUE_BYTES) -> None:
        self.files = files
        self.slab = slab
        self.page_payload = slab.shape[0] * slab.shape[1] * slab.shape[3]
        self.queue_bytes = queue_bytes
        self.queued_bytes = 0
        self.lock = threading.Lock()
        self.writes: queue.Queue[Any] = queue.Queue()
        self.reads: queue.Queue[Any] = queue.Queue()
        self.loaded: queue.Queue[tuple[int, bool]] = queue.Queue()
        self.reading = 0  # loads submitted and not yet taken
        self.errors: list[str] = []
        # the writer's totals over finished batches (under self.lock): pages written, their
        # bytes, pages whose file existed, wall seconds
        self.written: dict[str, float] = dict.fromkeys(WRITER_KEYS, 0)
        self._log_lock = threading.Lock()
        self._logged: dict[str, float] = {}  # the counters at the last `l3 writes` line
        self._logged_at = -LOG_INTERVAL_S
        self._noted_at = -NOTE_INTERVAL_S  # the last `l3 i/o error` line, and the notes since
        self._notes_held = 0
        self._refused_until = 0.0  # monotonic time until which write_object queues nothing
        self.pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="l3-io")
        # each with the log context (proc) of the thread that made the store
        self._threads = [
            threading.Thread(target=contextvars.copy_context().run, args=(fn,), daemon=True, name=name)
            for fn, name in ((self._writer, "l3-writer"), (self._reader, "l3-reader"))
        ]
        for t in self._threads:
            t.start()

    # -- the controller's side (one thread)

    def write_object(self, start: int, keys: Sequence[bytes], before: Sequence[bytes] = ()) -> int:
        """Snapshot the object's pages at host page `start` (those not on disk yet) and queue
        them for the writer, which then stamps `before` (the chain's pages above the object,
        first page first) and the object's pages in order (`stamp`). Returns the pages queued:
        as many leading pages as the byte bound leaves room for (a prefix keeps the key chain
        whole); the rest are skipped, counted."""
        chain = [*before, *keys]
        todo = [(i, k) for i, k in enumerate(keys) if not self.files.exists(k)]
        if not todo:
            self.stamp_later(chain)  # on disk already: only used again
            return 0
        if time.monotonic() < self._refused_until:  # the disk refused a write just now: no copies for it
            with self.files.lock:
                self.files.stats["write_skips"] += len(todo)
            return 0
        with self.lock:
            room = max(0, self.queue_bytes - self.queued_bytes) // self.page_payload
            todo, skipped = todo[:room], len(todo) - min(room, len(todo))
            self.queued_bytes += len(todo) * self.page_payload
        if skipped:
            with self.files.lock:
                self.files.stats["write_skips"] += skipped
        if not todo:
            return 0
        # the copy happens now, before Committed goes out: a later HostEvict and reuse of
        # these host pages can never reach the disk
        pages = [(k, self.slab[:, :, start + i, :].tobytes()) for i, k in todo]
        self.writes.put((pages, chain))
        return len(pages)

    def stamp_later(self, keys: Sequence[bytes]) -> None:
        """Stamp these page files (a chain's, first page first) as used, on the writer thread."""
        if keys:
            self.writes.put(([], list(keys)))

    def load_object(self, obj: int, start: int, keys: Sequence[bytes], before: Sequence[bytes] = ()) -> None:
        """Read the object's pages into host pages from `start` (on a thread; `take_loaded`), then
        stamp `before` (the chain's pages above it) and its pages in order."""
        self.reading += 1
        self.reads.put((obj, start, list(keys), list(before)))

    def take_loaded(self) -> list[tuple[int, bool]]:
        out = []
        while True:
            try:
                out.append(self.loaded.get_nowait())
            except queue.Empty:
                break
        self.reading -= len(out)
        if self.errors:
            raise RuntimeError(f"L3 I/O failed: {self.errors[0]}")
        return out

    @property
    def busy(self) -> bool:
        return self.reading > 0 or self.queued_bytes > 0

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until every queued write and read is done (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while (self.writes.unfinished_tasks or self.reads.unfinished_tasks) and time.monotonic() < deadline:
            time.sleep(0.002)

    # -- the threads

    def _write_page(self, page: tuple[bytes, bytes]) -> bool | None:
        """True: written; False: its file existed; None: failed (counted as a skip)."""
        key, payload = page
        try:
            return self.files.write(key, payload)
        except OSError as exc:  # a full or read-only disk: count it, keep serving, back off
            self._refused_until = time.monotonic() + WRITE_BACKOFF_S
            with self.files.lock:
                self.files.stats["write_skips"] += 1
            self._note(f"write of {key.hex()}: {exc}", fatal=False)
        except Exception as exc:  # noqa: BLE001 - a bug: the controller fails loudly
            self._note(f"write of {key.hex()}: {exc!r}", fatal=True)
        return None

    def _writer(self) -> None:
        while True:
            pages, chain = self.writes.get()
            begin = time.perf_counter()
            done: list[bool | None] = []
            try:
                done = [f.result() for f in self._each(self._write_page, [(p,) for p in pages])]
                self.files.stamp(chain)  # (a page that failed is not there to stamp)
            except RuntimeError:  # the interpreter is exiting: queued writes are dropped (a cache)
                return
            finally:
                written = sum(1 for d in done if d)
                with self.lock:
                    self.queued_bytes -= len(pages) * self.page_payload
                    self.written["pages"] += written
                    self.written["bytes"] += written * (HEADER.size + self.page_payload)
                    self.written["existed"] += sum(1 for d in done if d is False)
                    self.written["write_s"] += time.perf_counter() - begin
                self.writes.task_done()
            self.maybe_log()

    def _read_page(self, at: int, key: bytes) -> bool:
        """Read and verify one page's file straight into host page `at` (every rank's part)."""
        ranks, rows = self.slab.shape[0], self.slab.shape[1]
        return self.files.read_into(key, [memoryview(self.slab[r, j, at]) for r in range(ranks) for j in range(rows)],
                                    touch=False)

    def _reader(self) -> None:
        while True:
            obj, start, keys, before = self.reads.get()
            ok = False
            try:
                reads = self._each(self._read_page, list(zip(range(start, start + len(keys)), keys, strict=True)))
                # every read done before the load is reported, failed or not: the scheduler frees a
                # failed load's host pages, and a read still running would write into their next use
                wait(reads)
                errors = [exc for f in reads if (exc := f.exception()) is not None]
                if errors:  # a read error fails this load only
                    self._note(f"read of object {obj}: {errors[0]}", fatal=False)
                ok = not errors and all(f.result() for f in reads)
                if ok:
                    self.files.stamp([*before, *keys])
            except RuntimeError:  # the interpreter is exiting
                return
            finally:
                self.loaded.put((obj, ok))
                self.reads.task_done()

    def _each(self, fn: Any, calls: Sequence[tuple[Any, ...]]) -> list[Future[Any]]:
        """fn(*args) for each args on the pool, each in a copy of this thread's log context (proc)."""
        return [self.pool.submit(contextvars.copy_context().run, fn, *args) for args in calls]

    def _note(self, msg: str, fatal: bool) -> None:
        """A warning, at most one per NOTE_INTERVAL_S with the count of those not logged (a full
        disk fails every page of every request); a fatal one is always logged, and kept."""
        import structlog

        with self._log_lock:
            now = time.monotonic()
            self._notes_held += 1
            if not fatal and now - self._noted_at < NOTE_INTERVAL_S:
                return
            held, self._notes_held, self._noted_at = self._notes_held - 1, 0, now
        structlog.get_logger().warning("l3 i/o error", error=msg, **({"not_logged": held} if held else {}))
        if fatal:
            self.errors.append(msg)

    def stats(self) -> dict[str, int]:
        with self.files.lock:
            return dict(self.files.stats)

    def maybe_log(self, now: float | None = None, force: bool = False) -> dict[str, Any] | None:
        """One `l3 writes` line with the activity since the last one (see the module's
        docstring), at most once per LOG_INTERVAL_S unless `force`, none without activity;
        returns what it logged. Any thread."""
        now = time.monotonic() if now is None else now
        with self._log_lock:
            if not force and now - self._logged_at < LOG_INTERVAL_S:
                return None
            with self.lock:
                counters = dict(self.written)
            with self.files.lock:
                counters.update({k: self.files.stats[k] for k in DIR_KEYS})
                files, size = self.files.stats["files"], self.files.stats["bytes"]
            delta = {k: v - self._logged.get(k, 0) for k, v in counters.items()}
            if not any(delta.values()):
                return None
            self._logged, self._logged_at = counters, now
        out: dict[str, Any] = {DIR_KEYS.get(k, k): int(v) for k, v in delta.items() if k != "write_s"}
        out["write_s"] = round(delta["write_s"], 6)
        if delta.get("corrupt") and self.files.last_corrupt:
            out["last_corrupt"] = self.files.last_corrupt
        import structlog

        structlog.get_logger().info("l3 writes", **out, files=files, dir_bytes=size)
        return out
