"""Control channels between the supervisor and its children.

* children PUSH -> supervisor PULL (channel `control`): readiness, fatal errors, the tokenizer's
  `Flushed` once it has answered every in-flight request after a `ProcessDied`, and `Alive` from the
  scheduler's and the tokenizer's loops (ALIVE_EVERY_S) so that a stuck one is found.
* supervisor PUSH -> tokenizer PULL (channel `notices`): `ProcessDied`, so
  in-flight clients get an explicit error before everything is torn down.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec


class Ready(msgspec.Struct, tag=True, frozen=True):
    proc: str
    rank: int | None = None
    info: dict[str, str] = {}


class Fatal(msgspec.Struct, tag=True, frozen=True):
    proc: str
    reason: str
    rank: int | None = None
    by: str = ""  # the process that reports it, when not proc itself (the scheduler's watchdog names a worker)


class Flushed(msgspec.Struct, tag=True, frozen=True):
    """The tokenizer failed every in-flight request after a ProcessDied (or gave up)."""

    proc: str
    requests: int  # how many in-flight requests were failed


ALIVE_EVERY_S = 1.0  # a loop's heartbeat period; the supervisor allows --watchdog-timeout without one


class Alive(msgspec.Struct, tag=True, frozen=True):
    """A heartbeat from a process's main loop: sent only while the loop turns, so a process that is
    stuck (a deadlock, an endless loop, SIGSTOP) stops sending it."""

    proc: str


class Heartbeat:
    """A loop's Alive, at most every ALIVE_EVERY_S: `tick(now)` once a pass of the loop it vouches
    for (`send` is the control channel's send; `now` the loop's clock)."""

    def __init__(self, proc: str, send: Callable[[Alive], object], now: float) -> None:
        self.proc, self.send, self.last = proc, send, now

    def tick(self, now: float) -> None:
        if now - self.last >= ALIVE_EVERY_S:
            self.last = now
            self.send(Alive(proc=self.proc))


class ProcessDied(msgspec.Struct, tag=True, frozen=True):
    """A child died or reported Fatal, or (proc "") the supervisor was signalled: the server is
    about to shut down, and every request in flight fails with a 503."""

    proc: str  # e.g. "worker-0", "scheduler"; "" for a shutdown
    reason: str  # e.g. "killed by SIGKILL", "exit status 1", a Fatal's reason


ToSupervisor = Ready | Fatal | Flushed | Alive
ToTokenizerControl = ProcessDied
