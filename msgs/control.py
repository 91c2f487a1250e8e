"""Channel children -> supervisor: readiness and fatal errors."""

from __future__ import annotations

import msgspec

from msgs.codec import Codec


class Ready(msgspec.Struct, tag=True, frozen=True):
    proc: str
    rank: int | None = None
    info: dict[str, str] = {}


class Fatal(msgspec.Struct, tag=True, frozen=True):
    proc: str
    reason: str
    rank: int | None = None


ToSupervisor = Ready | Fatal
codec: Codec[ToSupervisor] = Codec(ToSupervisor, "control")
