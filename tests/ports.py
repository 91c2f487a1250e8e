"""Free local ports for tests that start servers."""

from __future__ import annotations

import socket


def free_port_range(n: int) -> int:
    """A port P with P .. P+n-1 all free now on 127.0.0.1 (e.g. a rendezvous, then the tcp
    channels of a multi-node run)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65536:
            continue
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise AssertionError("no free port range")
