"""What every child process the supervisor starts does first: read `--config` (and
`--rank` for workers), set up its JSON log, exit cleanly on SIGTERM, ignore SIGINT (a Ctrl-C in a
terminal reaches the whole process group: the supervisor alone decides the shutdown)."""

from __future__ import annotations

import argparse
import atexit
import signal
import sys
from pathlib import Path

import structlog

from engine.config import ServerConfig
from engine.logs import setup_logging


def start_child(role: str, with_rank: bool = False) -> tuple[ServerConfig, structlog.stdlib.BoundLogger, int | None]:
    """(config, logger, rank) for `python -m procs.<role> --config PATH [--rank R]`."""
    ap = argparse.ArgumentParser(prog=f"procs.{role}")
    ap.add_argument("--config", required=True, help="the ServerConfig JSON the supervisor wrote")
    if with_rank:
        ap.add_argument("--rank", type=int, default=0, help="this worker's rank")
    args = ap.parse_args()
    cfg = ServerConfig.from_json(Path(args.config).read_text())
    rank = args.rank if with_rank else None
    log = setup_logging(role, cfg.log_dir, rank=rank)
    # 128 + 15, a shell's status for it: the supervisor tells "stopped by SIGTERM" from a clean exit
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # once the process exits anyway, a SIGTERM must not raise SystemExit inside a finalizer (zmq's
    # Context.__del__ printed "Exception ignored ... SystemExit" after a failed start)
    atexit.register(signal.signal, signal.SIGTERM, signal.SIG_IGN)
    return cfg, log, rank
