"""All-reduce (and all-gather) through shared memory for CPU ranks on one host (tp and cp on CPU,
one node).

Why: gloo's all-reduce of a decode step's activations took ~2 ms on a 2-core host (a tcp round
trip through its I/O threads) against ~50 us here, and a Llama-family step does two per layer:
on the default model at tp=2 that was ~120 ms of a ~175 ms decode step.

How: one shared-memory file per group, mapped by every rank (rank 0 creates it, the others open
it by the name rank 0 broadcasts; it is unlinked once all have mapped it, so nothing is left
behind whatever happens later). Per rank a sequence word and, in each of two alternating halves,
a slot of MAX_BYTES. A call copies x into this rank's slot of the call's half, publishes the call's
sequence number, waits until every peer published it, then sums the slots in rank order 0..W-1
into x: every rank gets the same bytes. Two halves, because a rank may start call k+1 while a
peer still reads call k; it can start call k+2 only after every peer published k+1, which each
does after reading k. Ordering relies on x86's stores being seen in program order (the slot's
bytes before the sequence word), so the path is x86-64 only; elsewhere, across nodes and for
larger messages, gloo.

A wait that lasts longer than the collective timeout, or whose peer process is gone, raises (as
gloo's would), so a rank never spins forever on a dead peer.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import time
from typing import Any

import torch
import torch.distributed as dist

MAX_BYTES = 1 << 20  # per rank and half: a decode or small prefill's activations; larger goes to gloo
_WORD = 8
_HEADER = 4096  # per rank: [sequence, pid] at rank * 64 bytes (own cache line)
SPIN = 200  # polls before yielding the core (peers may share it: more processes than cores)
CHECK_S = 1.0  # how often a long wait looks at the peers' processes and the clock


def available(device: torch.device) -> bool:
    """Whether CPU ranks of one host may use this path (x86-64: ordered stores)."""
    return device.type == "cpu" and platform.machine().lower() in ("x86_64", "amd64")


def setup(group: Any, rank: int, world: int, timeout_s: float) -> ShmAllReduce | None:
    """The group's shared-memory all-reduce, or None (gloo for every message) where any rank could
    not map it: a collective over `group` (every member, at the same point), so that every rank
    takes the same path."""
    if world > _HEADER // 64:
        return None
    word = torch.zeros(2, dtype=torch.int64)  # rank 0's (pid, token); pid 0: it could not create the file
    if rank == 0:
        word[0], word[1] = os.getpid(), secrets.randbits(62)
        try:
            fd = os.open(_path(*word.tolist()), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, _HEADER + 2 * world * MAX_BYTES)
            finally:
                os.close(fd)
        except OSError:
            word.zero_()
    dist.broadcast(word, src=dist.get_global_rank(group, 0), group=group)
    path = _path(*word.tolist()) if word[0] else None
    shm = None
    if path is not None:
        try:
            shm = ShmAllReduce(path, rank, world, timeout_s)
        except OSError:
            shm = None
    ok = torch.tensor([1 if shm is not None else 0], dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # every rank has mapped it (or failed)
    if rank == 0 and path is not None:
        os.unlink(path)  # mapped where it will be: nothing is left behind from here on
    return shm if int(ok.item()) == 1 else None


def _path(pid: int, token: int) -> str:
    return f"/dev/shm/strata-allreduce-{pid}-{token:x}"


class ShmAllReduce:
    """The CPU small-message all-reduce of one group (`TPGroup.symm`'s slot, as SymmAllReduce on
    CUDA); made by `setup`."""

    def __init__(self, path: str, rank: int, world: int, timeout_s: float) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.max_bytes = MAX_BYTES  # the largest message it takes (SymmAllReduce's field)
        size = _HEADER + 2 * world * MAX_BYTES
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._words = memoryview(self._map)[:_HEADER].cast("q")
        self._seq_at = [r * 64 // _WORD for r in range(world)]
        self._pid_at = [at + 1 for at in self._seq_at]
        self._words[self._pid_at[rank]] = os.getpid()
        self._slots = torch.frombuffer(self._map, dtype=torch.uint8, offset=_HEADER).view(2, world, MAX_BYTES)
        self.seq = 0
        self._since: tuple[int, float, float] | None = None  # (seq, wait start, last check) of a long wait

    def takes(self, x: torch.Tensor) -> bool:
        n = x.numel() * x.element_size()
        return x.device.type == "cpu" and 0 < n <= MAX_BYTES and x.is_contiguous()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the group's ranks in rank order, in place (as gloo's path); returns x."""
        slots = self._exchange(x)
        flat = x.view(-1)
        flat.copy_(slots[0].view(x.dtype))
        for r in range(1, self.world):
            flat.add_(slots[r].view(x.dtype))
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[world, *x.shape]: every rank's x in rank order, the same bytes on every rank (the
        context-parallel merge's exchange, gloo's ~2 ms a layer otherwise); the slots and the
        sequence as all_reduce's."""
        return self._exchange(x).view(x.dtype).view(self.world, *x.shape).clone()

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        """This call's half of the slots [world, x's bytes] once every rank has written x's bytes
        to its own slot there."""
        self.seq += 1
        slots = self._slots[self.seq & 1, :, : x.numel() * x.element_size()]
        slots[self.rank].view(x.dtype).copy_(x.view(-1))
        self._words[self._seq_at[self.rank]] = self.seq  # after the slot's bytes (x86 keeps store order)
        self._wait()
        return slots

    def _wait(self) -> None:
        words, seq = self._words, self.seq
        for r in range(self.world):
            at = self._seq_at[r]
            spins = 0
            while words[at] < seq:
                spins += 1
                if spins > SPIN:
                    self._yield(r, spins)

    def _yield(self, r: int, spins: int) -> None:
        os.sched_yield()
        if spins % 4096 == 0:  # now and then: is the wait hopeless?
            now = time.monotonic()
            if self._since is None or self._since[0] != self.seq:
                self._since = (self.seq, now, now)
                return
            _, t0, checked = self._since
            if now - checked >= CHECK_S:
                self._since = (self.seq, t0, now)
                pid = self._words[self._pid_at[r]]  # written when the peer mapped the file (0: not yet)
                if pid and not _alive(pid):
                    raise RuntimeError(f"shared-memory all-reduce: rank {r} of the group (pid {pid}) is gone")
            if now - t0 > self.timeout_s:
                raise RuntimeError(f"shared-memory all-reduce: rank {r} of the group did not arrive in "
                                   f"{self.timeout_s:.0f} s")


def _alive(pid: int) -> bool:
    """Whether the process runs (an exited one not yet reaped by its parent, a zombie, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: whether the pid exists at all
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
