"""structlog setup: JSON lines to <log_dir>/<proc>[-<rank>].log, console on a terminal.

Every line carries `proc` and, where it has one, `rank`; callers bind `rid` / `seq`.
Standard-library logging (used by msgs/, which must not depend on structlog) is routed
through the same processors.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import structlog

from engine.env import env

# No locals: they can hold prompts and whole tensors.
_TRACEBACKS = structlog.processors.ExceptionRenderer(structlog.tracebacks.ExceptionDictTransformer(show_locals=False))


def setup_logging(proc: str, log_dir: str = "", rank: int | None = None) -> structlog.stdlib.BoundLogger:
    level = getattr(logging, env().log_level.upper(), logging.INFO)
    pre = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    # dict_tracebacks: an exception becomes one structured "exception" field of the same
    # event (type, message, frames), not a bare exc_info flag or extra text lines.
    json_fmt = structlog.stdlib.ProcessorFormatter(
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            _TRACEBACKS,
            structlog.processors.JSONRenderer(),
        ],
        foreign_pre_chain=pre,
    )
    console = env().log_json is False or (env().log_json is None and sys.stderr.isatty())
    err_fmt = (
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, structlog.dev.ConsoleRenderer()],
            foreign_pre_chain=pre,
        )
        if console
        else json_fmt
    )
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(level)
    err = logging.StreamHandler(sys.stderr)
    err.setFormatter(err_fmt)
    root.addHandler(err)
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        name = proc if rank is None else f"{proc}-{rank}"
        fh = logging.FileHandler(Path(log_dir) / f"{name}.log")
        fh.setFormatter(json_fmt)
        root.addHandler(fh)
    structlog.configure(
        processors=[*pre, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(proc=proc, **({} if rank is None else {"rank": rank}))
    return structlog.get_logger()
