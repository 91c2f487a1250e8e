"""Scheduler process: `python -m procs.scheduler --config PATH`."""

from __future__ import annotations

import argparse
import signal
import sys
import traceback

from engine.config import ServerConfig
from engine.logs import setup_logging
from engine.sched.loop import SchedulerLoop
from msgs.control import Fatal
from msgs.control import codec as control_codec


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    args = ap.parse_args()
    cfg = ServerConfig.from_json(open(args.config).read())
    log = setup_logging("scheduler", cfg.log_dir)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    loop = SchedulerLoop(cfg)
    try:
        loop.run()
    except Exception as exc:  # fatal by design: report it, then exit non-zero
        log.error("scheduler failed", error=str(exc), trace=traceback.format_exc())
        loop.control.send(control_codec.encode(Fatal(proc="scheduler", reason=str(exc))))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
