"""One rank's driver: Steps in, StepDones out, around a ModelRunner.

Each Step is launched as it arrives; while one runs on the device the next is launched
before the first's results are awaited (at most two in flight), so the device never idles
on the host between steps. Owns no socket: procs/worker.py hands it zmq ends, tests hand
it in-memory pipes (msgs/channels.py) and call `pump()`.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from msgs.channels import Inbox, Outbox
from msgs.done import FromWorker
from msgs.steps import Shutdown, Step, ToWorker

MAX_IN_FLIGHT = 2


class WorkerPipeline:
    def __init__(self, runner: Any, steps: Inbox[ToWorker], done: Outbox[FromWorker]) -> None:
        self.runner = runner  # a ModelRunner: launch / ready / finish / ready_msg
        self.steps = steps
        self.done = done
        self.pending: deque[Any] = deque()
        self.stopped = False
        self.last_seq = 0  # the last Step received

    def start(self) -> None:
        self.done.send(self.runner.ready_msg())

    def pump(self) -> bool:
        """One non-blocking move: finish a step, or launch one. False when nothing moved."""
        pending = self.pending
        if pending and (len(pending) == MAX_IN_FLIGHT or self.runner.ready(pending[0])):
            self.done.send(self.runner.finish(pending.popleft()))
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
        on the Step socket when nothing is in flight."""
        while not (self.stopped and not self.pending):
            if not self.pump() and not self.pending:
                self.steps.poll(-1)
