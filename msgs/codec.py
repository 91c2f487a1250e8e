"""Wire codec shared by every channel: msgpack via msgspec, never pickle.

Each channel module defines one tagged Union of Structs; `Codec(Union)` builds its
encoder/decoder once. A frame that does not decode is logged and dropped (`decode`
returns None) so a malformed peer can never kill a process.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Iterable
from typing import Any, Generic, TypeVar

import msgspec

log = logging.getLogger("strata.msgs")
T = TypeVar("T")


def pack_ids(ids: Iterable[int]) -> bytes:
    """Token ids as packed little-endian int32 (compact and decodable without Python ints)."""
    return array("i", ids).tobytes()


def id_count(data: bytes) -> int:
    """How many ids pack_ids packed into `data` (4 bytes each)."""
    return len(data) // 4


def unpack_ids(data: bytes) -> list[int]:
    out = array("i")
    out.frombytes(data)
    return out.tolist()


def pack_f32(vals: Iterable[float]) -> bytes:
    return array("f", vals).tobytes()


def unpack_f32(data: bytes) -> list[float]:
    out = array("f")
    out.frombytes(data)
    return out.tolist()


# Frames dropped per channel in this process (exported as strata_dropped_frames_total).
DROPPED: dict[str, int] = {}
WARN_INTERVAL_S = 5.0  # at most one warning per channel per interval; the count says how many


class Codec(Generic[T]):
    """Encoder + decoder for one channel's Union type, built once per process."""

    def __init__(self, union: Any, channel: str) -> None:
        self.channel = channel
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(union)
        self._last_warn = -WARN_INTERVAL_S
        self._unreported = 0

    def encode(self, msg: T) -> bytes:
        return self._enc.encode(msg)

    def decode(self, frame: bytes) -> T | None:
        try:
            return self._dec.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            self._dropped(exc, len(frame))
            return None

    def _dropped(self, exc: Exception, size: int) -> None:
        """Count every dropped frame; warn at most once per interval, so a flood of bad
        frames cannot flood the log."""
        DROPPED[self.channel] = DROPPED.get(self.channel, 0) + 1
        self._unreported += 1
        now = time.monotonic()
        if now - self._last_warn >= WARN_INTERVAL_S:
            log.warning(
                "dropped malformed frame on %s: %s (%d bytes; %d dropped since the last warning)",
                self.channel, exc, size, self._unreported,
            )
            self._last_warn = now
            self._unreported = 0
