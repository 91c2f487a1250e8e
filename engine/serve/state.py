"""What every front (HTTP routes, SDK loop) shares: config, tokenizer, frontend core."""

from __future__ import annotations

import importlib.metadata
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from engine.config import ServerConfig
from engine.serve.errors import ApiError
from engine.serve.frontend import Frontend
from engine.serve.validate import Limits
from engine.tokenizer import TextTokenizer

# Requests that arrive before the scheduler reported ready wait this long, then get a 503:
# the supervisor may announce readiness a moment before the first SchedulerStats lands.
READY_TIMEOUT_S = 30.0

try:
    VERSION = importlib.metadata.version("strata")
except importlib.metadata.PackageNotFoundError:  # run from a tree on PYTHONPATH, not installed
    VERSION = "unknown"


@dataclass
class ServeState:
    cfg: ServerConfig
    tok: TextTokenizer | None  # None: ids-only mode
    frontend: Frontend
    ready_timeout_s: float = READY_TIMEOUT_S
    grammar: Any = None  # engine.serve.grammar.GrammarService, made on the first constrained request
    # what a request's unset sampling fields default to (engine/serve/sampling_defaults.py)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.cfg.model_name

    @property
    def served_names(self) -> tuple[str, ...]:
        """The served name, then --served-model-name's others: what /v1/models lists."""
        return (self.cfg.model_name, *self.cfg.served_model_aliases)

    @property
    def accepted_models(self) -> tuple[str, ...]:
        """Names a request may use for this model: a served name or the path."""
        return tuple(n for n in (*self.served_names, self.cfg.model) if n)

    async def limits(self) -> Limits:
        """The scheduler's limits, waiting for it to be ready; 503 if it does not come up."""
        if not await self.frontend.wait_ready(self.ready_timeout_s):
            raise ApiError(503, "the server is not ready yet (the scheduler has not reported ready)")
        limits = self.frontend.limits()
        assert limits is not None  # ready implies stats arrived
        return limits


@dataclass
class Reply:
    """A handler's answer: a JSON body, or an SSE byte stream plus the cleanup that must
    run however the stream ends (the client may disconnect before it even starts)."""

    body: dict[str, Any] | list[dict[str, Any]] | None = None  # (a list: a /generate batch)
    stream: AsyncIterator[bytes] | None = None
    close: Callable[[], None] | None = None
    rid: str | None = None  # set when the handler chose the rid itself (/generate's body rid)


@dataclass(frozen=True)
class Call:
    """Per-request facts the HTTP layer knows before the handler runs."""

    rid: str
    t0: float  # monotonic arrival time (TTFT is measured from it)
    rid_given: bool = True  # the client sent x-request-id (else /generate may use its body rid)
