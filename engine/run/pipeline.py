"""One rank's driver: Steps in, StepDones out, around a ModelRunner.

Each Step is launched as it arrives; while one runs on the device the next is launched
before the first's results are awaited (at most two in flight), so the device never idles
on the host between steps. A step with grammar rows is launched without its sampling (the
mask needs the previous step's tokens): the previous step is answered first, then the
runner `complete`s it, so the scheduler plans the next step while the masks are filled.
While the runner compiles grammars in the background (PrepareGrammar), the loop asks it every
POLL_S which are done and sends their GrammarReady.
Owns no socket: procs/worker.py hands it zmq ends, tests hand it in-memory pipes
(msgs/channels.py) and call `pump()`.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Protocol

from msgs.channels import Inbox, Outbox
from msgs.done import FromWorker, GrammarReady, WorkerReady
from msgs.steps import Shutdown, Step, ToWorker

MAX_IN_FLIGHT = 2
HOST_WAIT_MS = 1  # the Step socket's wait while a runner's host thread works (GIL-free)
POLL_S = 0.002  # how often compiles are asked about (a look at futures, or one poll() of the helpers' notice pipes)


class StepRunner(Protocol):
    """What the pipeline drives (engine/run/runner.py's ModelRunner; fakes in tests).

    `launch` applies a Step's ops and starts its forward, returning a handle without waiting;
    `ready(handle)` says whether its results can be read without blocking; `finish(handle)`
    waits for them and answers the Step (StepDone, or SpecDone). `deferred`, where not None, is
    a launched step whose sampling waits for the step answered just before (its grammar masks),
    which `complete` samples. `host_busy` says a host thread of the runner is working.
    `compiling` says grammars compile in the background; `grammar_reports` those done since."""

    deferred: Any
    compiling: bool

    def ready_msg(self) -> WorkerReady: ...
    def launch(self, step: Step) -> Any: ...
    def ready(self, handle: Any) -> bool: ...
    def finish(self, handle: Any) -> FromWorker: ...
    def complete(self, handle: Any) -> None: ...
    def host_busy(self) -> bool: ...
    def grammar_reports(self) -> list[GrammarReady]: ...


class WorkerPipeline:
    def __init__(self, runner: StepRunner, steps: Inbox[ToWorker], done: Outbox[FromWorker]) -> None:
        self.runner = runner
        self.steps = steps
        self.done = done
        self.pending: deque[Any] = deque()
        self.stopped = False
        self.last_seq = 0  # the last Step received
        self.next_poll = 0.0  # when compiles are asked about next

    def start(self) -> None:
        self.done.send(self.runner.ready_msg())

    def pump(self) -> bool:
        """One non-blocking move: report compiled grammars, finish a step, or launch one. False
        when nothing moved."""
        if self.runner.compiling and (now := time.monotonic()) >= self.next_poll:
            self.next_poll = now + POLL_S
            reports = self.runner.grammar_reports()
            for msg in reports:
                self.done.send(msg)
            if reports:
                return True
        pending = self.pending
        if pending and (len(pending) == MAX_IN_FLIGHT or self.runner.ready(pending[0])):
            self.done.send(self.runner.finish(pending.popleft()))
            return True
        deferred = self.runner.deferred
        if deferred is not None:  # its mask waited for the step just answered: sample it now
            self.runner.complete(deferred)
            return True
        if self.stopped or not self.steps.poll(0):
            return False
        msg = self.steps.recv()
        if isinstance(msg, Shutdown):
            self.stopped = True
        elif isinstance(msg, Step):
            self.last_seq = msg.seq  # what a failure report names (a StepOrderError included)
            pending.append(self.runner.launch(msg))
        return True  # a dropped (malformed) frame also counts: the next Step's seq check catches a loss

    def run(self) -> None:
        """The process loop. Spins while a step runs (a GPU worker owns its core); blocks
        on the Step socket when nothing is in flight, and in slices of HOST_WAIT_MS while a
        host thread of the runner works (a grammar job): a thread spinning in Python holds
        the GIL, and the job's xgrammar calls, which need it, ran ~20x slower against one
        (measured: 64 rows' accepts 0.13 ms alone, 2.7 ms against a spinning loop)."""
        while not (self.stopped and not self.pending):
            if self.pump():
                continue
            if not self.pending:
                self.steps.poll(int(POLL_S * 1000) if self.runner.compiling else -1)
            elif self.runner.host_busy():
                self.steps.poll(HOST_WAIT_MS)
