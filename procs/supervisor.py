"""bin/serve: start every process, wait for each to be Ready, watch them, tear down.

Exit status: 0 after a clean SIGINT/SIGTERM shutdown, 1 when a child fails to start or
dies (the message names it), 2 for bad arguments.
"""

from __future__ import annotations

import shutil
import signal
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import zmq

from engine.args import parse_args
from engine.config import ServerConfig
from engine.logs import setup_logging
from engine.supervise import ChildSet
from msgs.control import Fatal, Ready
from msgs.control import codec as control_codec

START_TIMEOUT_S = 900.0


def prepare_model(cfg: ServerConfig) -> ServerConfig:
    if cfg.model:
        if not Path(cfg.model, "config.json").is_file():
            sys.exit(f"strata: --model {cfg.model}: no config.json there")
        return cfg
    from models.default_model import ensure_default_model

    return replace(cfg, model=str(ensure_default_model()))


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    log = setup_logging("supervisor", cfg.log_dir)
    cfg = prepare_model(cfg)
    run_dir = tempfile.mkdtemp(prefix="strata-")  # mode 0700: ipc sockets stay private
    cfg = replace(cfg, run_dir=run_dir)
    stop = {"signal": 0}

    def on_signal(signum: int, _frame: object) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    ctx = zmq.Context()
    control = ctx.socket(zmq.PULL)
    control.bind(cfg.ipc("control"))
    children = ChildSet(cfg, Path(run_dir))
    try:
        children.start_all()
        code = _run(cfg, children, control, stop, log)
    finally:
        children.stop_all()
        control.close(0)
        ctx.term()
        shutil.rmtree(run_dir, ignore_errors=True)
    return code


def _run(cfg: ServerConfig, children: ChildSet, control: zmq.Socket, stop: dict, log) -> int:  # noqa: ANN001
    expected = children.names()
    ready: dict[str, Ready] = {}
    deadline = time.monotonic() + START_TIMEOUT_S
    while not stop["signal"]:
        dead = children.first_dead()
        if dead:
            print(f"strata: process {dead} exited unexpectedly; shutting down", file=sys.stderr)
            log.error("child died", child=dead)
            return 1
        if control.poll(200):
            msg = control_codec.decode(control.recv())
            if isinstance(msg, Fatal):
                print(f"strata: {msg.proc} failed: {msg.reason}", file=sys.stderr)
                log.error("child fatal", child=msg.proc, reason=msg.reason)
                return 1
            if isinstance(msg, Ready):
                name = msg.proc if msg.rank is None else f"{msg.proc}-{msg.rank}"
                ready[name] = msg
                log.info("child ready", child=name, **msg.info)
                if set(ready) == set(expected):
                    info = ready["tokenizer"].info
                    print(
                        f"strata: ready. model {cfg.model_name}; HTTP {info.get('http')}; SDK {info.get('sdk')}",
                        flush=True,
                    )
        if len(ready) < len(expected) and time.monotonic() > deadline:
            print(f"strata: start timed out; not ready: {sorted(set(expected) - set(ready))}", file=sys.stderr)
            return 1
    log.info("shutting down", signal=stop["signal"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
