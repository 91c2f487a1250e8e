"""GPU idle time between steps, measured in the served worker with CUDA events.

For each step the worker records an event before its first kernel and one after its last;
the idle time before a step is the gap from the previous step's end event to its start
event. Gaps while the server has no work (longer than IDLE_GAP_S) are not the engine's
overhead and are left out. Every `window` counted steps one log line reports the fraction.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch

log = structlog.get_logger()
IDLE_GAP_S = 0.05  # a longer gap means no request was waiting, not host overhead


@dataclass
class StepEvents:
    start: torch.cuda.Event
    end: torch.cuda.Event
    batch: int


class IdleMeter:
    def __init__(self, min_batch: int = 32, window: int = 200) -> None:
        self.min_batch = min_batch
        self.window = window
        self.prev_end: torch.cuda.Event | None = None
        self.busy_ms = 0.0
        self.idle_ms = 0.0
        self.steps = 0

    @staticmethod
    def start() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def finished(self, ev: StepEvents) -> None:
        """Account a step whose end event has completed."""
        busy = ev.start.elapsed_time(ev.end)
        gap = self.prev_end.elapsed_time(ev.start) if self.prev_end is not None else None
        self.prev_end = ev.end
        if gap is None or gap > IDLE_GAP_S * 1e3 or ev.batch < self.min_batch:
            return
        self.busy_ms += busy
        self.idle_ms += max(gap, 0.0)
        self.steps += 1
        if self.steps == self.window:
            total = self.busy_ms + self.idle_ms
            log.info("gpu idle", idle_fraction=round(self.idle_ms / total, 4), steps=self.steps,
                     busy_ms_per_step=round(self.busy_ms / self.steps, 3),
                     idle_ms_per_step=round(self.idle_ms / self.steps, 3), min_batch=self.min_batch)
            self.busy_ms = self.idle_ms = 0.0
            self.steps = 0
