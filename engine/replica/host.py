"""The host tier's (L2) replicated state: the HostAllocator driven by the host ops.

Every replica applies the same ops, so the placement of each object is identical
everywhere; BackupPrepare carries the scheduler's placement and a replica that computes
another one stops (ReplicaError) instead of copying to the wrong pages. `Flush` empties
the tier. L3Load reserves host pages exactly as BackupPrepare does (the cache controller
fills them from disk; workers copy nothing). L3Touch changes nothing here, but names a committed object
(checked). Without HostInit the tier does not exist: every host op is then refused.
"""

from __future__ import annotations

import msgspec

from engine.replica.base import Component, ReplicaError
from engine.replica.host_alloc import HostAllocator, HostAllocError
from msgs.codec import unpack_ids
from msgs.steps import ApplyCommit, BackupPrepare, Flush, HostEvict, HostInit, HostSplit, L3Load, L3Touch, LoadBack

HostOp = HostInit | BackupPrepare | ApplyCommit | HostSplit | LoadBack | HostEvict | Flush | L3Load | L3Touch
L3_KEY_BYTES = 16  # engine/cache/l3.py: KEY_BYTES
_ENCODER = msgspec.msgpack.Encoder()


class HostTier(Component):
    name = "host_tier"
    ops = (HostInit, BackupPrepare, ApplyCommit, HostSplit, LoadBack, HostEvict, Flush, L3Load, L3Touch)

    def __init__(self) -> None:
        self.alloc = HostAllocator()
        self.layout = b""  # the HostInit's fields (page bytes, layers, components, fingerprint), in the digest

    def apply(self, op: HostOp) -> None:
        if not isinstance(op, (HostInit, Flush)) and not self.alloc.capacity:
            raise ReplicaError(f"{type(op).__name__} without a host tier (no HostInit)")
        try:
            self._apply(op)
        except HostAllocError as exc:
            raise ReplicaError(str(exc)) from exc

    def _apply(self, op: HostOp) -> None:
        a = self.alloc
        match op:
            case HostInit(num_pages=n):
                a.init(n)
                self.layout = _ENCODER.encode(op)
            case BackupPrepare(obj=obj, device_pages=pages, host_start=want):
                got = a.reserve(obj, len(unpack_ids(pages)))
                if got != want:  # the scheduler placed it elsewhere: this replica diverged
                    raise ReplicaError(f"BackupPrepare of object {obj}: placed at {got}, the stream says {want}")
            case L3Load(obj=obj, host_start=want, keys=keys):
                # reserved as a backup is: the controller fills it from disk, workers copy nothing
                if not keys or len(keys) % L3_KEY_BYTES:
                    raise ReplicaError(f"L3Load of object {obj} with {len(keys)} bytes of keys")
                got = a.reserve(obj, len(keys) // L3_KEY_BYTES)
                if got != want:
                    raise ReplicaError(f"L3Load of object {obj}: placed at {got}, the stream says {want}")
            case ApplyCommit(obj=obj):
                a.commit(obj)
            case HostSplit(obj=obj, cut=cut, new_obj=new):
                a.split(obj, cut, new)
            case LoadBack(obj=obj, device_pages=pages, host_start=start):
                n = len(unpack_ids(pages))
                if obj not in a.committed or a.ranges[obj] != (start, n):
                    raise ReplicaError(f"LoadBack of object {obj} ({n} pages at {start}): not a committed object there")
            case L3Touch(obj=obj) if obj not in a.committed:
                raise ReplicaError(f"L3Touch of object {obj}: not a committed object")
            case HostEvict(obj=obj):
                a.release(obj)
            case Flush():
                a.reset()

    def encode(self) -> bytes:
        return self.layout + self.alloc.encode() if self.alloc.capacity else b""
