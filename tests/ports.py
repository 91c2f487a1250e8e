"""Local ports for tests that start servers, from outside the kernel's ephemeral range.

A port picked with bind(0) and released comes from the ephemeral range, where the other xdist
worker's picks, gloo's listeners and every outgoing connection's local port (each left in
TIME_WAIT for a minute after it closes) land too: a server bound seconds later found its port
taken (a CI run failed so). Ports below the ephemeral range are handed out only by this module:
each xdist worker owns a slice of them and walks it with a cursor, so no port is given twice in
one run, and each is checked free (a plain bind, no SO_REUSEADDR) when given.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

LOWEST = 10_000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def _slice() -> tuple[int, int]:
    """[lo, hi) of this process's ports: one slice per xdist worker (the whole span without xdist)."""
    high = max(_ephemeral_low(), LOWEST + 2_000)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(worker.removeprefix("gw")) % count if worker.startswith("gw") else 0
    width = (high - LOWEST) // max(count, 1)
    return LOWEST + index * width, LOWEST + (index + 1) * width


_LO, _HI = _slice()
_cursor = _LO + (os.getpid() * 7919) % max(_HI - _LO - 64, 1)  # a restarted worker starts elsewhere


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def reserve_ports(n: int) -> int:
    """A port P with P .. P+n-1 free now and given to no one else in this test run."""
    global _cursor
    for _ in range((_HI - _LO) // max(n, 1) + 1):
        if _cursor + n > _HI:
            _cursor = _LO
        base, _cursor = _cursor, _cursor + n
        if all(_free(p) for p in range(base, base + n)):
            return base
    raise AssertionError(f"no {n} free ports in [{_LO}, {_HI})")

