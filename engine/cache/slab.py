"""The host slab's file: one shared-memory file per server, created and removed by the
supervisor (it outlives any child, so a child killed with -9 leaves nothing behind).

The supervisor creates it empty; the first HostInit op sizes it (every rank computes the
same size from the stream, so the ftruncate is idempotent) and each process maps it.
No torch here: the cache controller maps it too.
"""

from __future__ import annotations

import mmap
import os
import secrets
import tempfile
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def slab_dir() -> Path:
    """Where slabs live: /dev/shm, or the temp dir where there is none."""
    return SHM_DIR if SHM_DIR.is_dir() else Path(tempfile.gettempdir())


def create_slab(tag: str = "strata") -> str:
    """An empty file, mode 0600, under `slab_dir()`, named `<tag>-<pid>-...` (the supervisor's tag
    lets engine/supervise.py: remove_stale_runs find a killed supervisor's)."""
    path = slab_dir() / f"{tag}-{os.getpid()}-{secrets.token_hex(4)}-l2"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.close(fd)
    return str(path)


def remove_slab(path: str) -> None:
    if path:
        Path(path).unlink(missing_ok=True)


def open_slab(path: str) -> int:
    """A descriptor of the slab, for a process that maps it only later (`map_slab(fd=)`): the
    supervisor unlinks the name once every process is ready."""
    if not path:
        raise RuntimeError("the host tier is on but no slab file was given (hicache_path)")
    return os.open(path, os.O_RDWR)


def map_slab(path: str, nbytes: int, fd: int = -1) -> mmap.mmap:
    """Map `nbytes` of the slab (by its name, or by `fd` from open_slab, which stays open),
    growing the file to that size if it is smaller."""
    own = fd < 0
    if own:
        fd = open_slab(path)
    try:
        if os.fstat(fd).st_size < nbytes:
            os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        if own:
            os.close(fd)  # the mapping keeps the memory; the file name is the supervisor's


def available_memory() -> int:
    """Host memory free now for a slab: the smaller of MemAvailable and /dev/shm's free space."""
    avail = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    if SHM_DIR.is_dir():
        st = os.statvfs(SHM_DIR)
        avail.append(st.f_bavail * st.f_frsize)
    return min(avail) if avail else 1 << 62
