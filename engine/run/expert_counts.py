"""Per-expert token counts of a served MoE model, for /metrics and bin/analyze.

Each MoE layer's `Experts` adds a bincount of its routed expert ids to a counter on the device
every forward (engine/layers/moe.py `token_counts`: one in-place add, no host sync). This reads
them all at once, at a stats cadence, never per step:

* at most once every REPORT_S, when a step finishes (one [layers, experts] device-to-host
  copy; the torch MoE path syncs every forward anyway); and when a step without a forward
  finishes with no newer step launched (the batch drained: the device is idle, so the copy
  stalls nothing, and the final counts of a burst are reported);
* only when they changed since the last report. Rank 0 reports: every rank routes the same
  tokens (the router is replicated), so its counts are the model's.

A report is cumulative: {layer id: [routed (token, expert) pairs of each expert]} since start
(the warm-up's forwards excluded). The worker sends it in its StepDone (`expert_tokens`), the
scheduler passes the latest on in SchedulerStats, and engine/serve/metrics.py turns it into
counters; a `moe expert tokens` log line at most every LOG_S (and at a drained batch) carries the
same for bin/analyze.
"""

from __future__ import annotations

import re

import structlog
import torch
from torch import nn

from engine.layers.moe import Experts

log = structlog.get_logger()
REPORT_S = 1.0
LOG_S = 10.0
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class ExpertCounts:
    def __init__(self, model: nn.Module) -> None:
        self.layers: list[tuple[int, Experts]] = []
        for name, m in model.named_modules():
            if isinstance(m, Experts):
                found = _LAYER.search(name)
                self.layers.append((int(found.group(1)) if found else len(self.layers), m))
        self.sent: dict[int, list[int]] | None = None
        self.logged: dict[int, list[int]] | None = None
        self.last_report = self.last_log = float("-inf")
        self.reset()

    def __bool__(self) -> bool:
        return bool(self.layers)

    def reset(self) -> None:
        """Zero every counter (after warm-up: its forwards are not traffic)."""
        for _, x in self.layers:
            x.token_counts.zero_()

    def read(self) -> dict[int, list[int]]:
        """The counts now, {layer: per expert} (one device-to-host copy)."""
        rows = torch.stack([x.token_counts for _, x in self.layers]).tolist()
        return {layer: row for (layer, _), row in zip(self.layers, rows, strict=True)}

    def poll(self, now: float, drained: bool) -> dict[int, list[int]] | None:
        """The counts to report now (None: not due, or unchanged). `drained`: a step without a
        forward finished and nothing newer is launched."""
        if not self.layers or (not drained and now - self.last_report < REPORT_S):
            return None
        self.last_report = now
        counts = self.read()
        if drained or now - self.last_log >= LOG_S:
            self._log(counts, now)
        if counts == self.sent:
            return None
        self.sent = counts
        return counts

    def _log(self, counts: dict[int, list[int]], now: float) -> None:
        if counts == self.logged:
            return
        self.logged, self.last_log = counts, now
        log.info("moe expert tokens", layers={str(k): v for k, v in counts.items()})
