"""Length-prefixed frames over a pipe: a 4-byte little-endian length, then the payload (msgpack
of a msgspec message, never a pickle). Between a process and the children it talks to over
their stdin / stdout: the grammar helpers (engine/run/grammar_helper.py) and the grammar
checker (engine/serve/grammar_checker.py)."""

from __future__ import annotations

import os
import struct

FRAME = struct.Struct("<I")


def write_frame(fd: int, payload: bytes) -> None:
    data = FRAME.pack(len(payload)) + payload
    while data:
        data = data[os.write(fd, data):]


def read_frame(fd: int) -> bytes | None:
    """One frame, or None at end of stream."""
    head = _read_exact(fd, FRAME.size)
    return None if head is None else _read_exact(fd, FRAME.unpack(head)[0])


def _read_exact(fd: int, n: int) -> bytes | None:
    parts, left = [], n
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)
