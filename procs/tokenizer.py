"""The tokenizer process: HTTP (OpenAI API) and ZMQ SDK front door.

    python -m procs.tokenizer --config PATH_TO_CONFIG_JSON

This file owns the process's sockets (the HTTP listener, the SDK's ROUTER, `requests` and
`outputs` to the scheduler, `control` and `notices` with the supervisor) and its one event
loop; what runs on them is engine/serve (Frontend, the HTTP app, the SDK loop). Startup
problems (missing model dir, port in use, a socket that will not bind) are reported to the
supervisor as Fatal with a message a person can act on; once HTTP listens, Ready carries the
http and sdk addresses. SIGTERM (the supervisor's, after its ProcessDied of a shutdown has failed
every request) stops uvicorn gracefully and returns 0; SIGINT is ignored (a Ctrl-C reaches the
whole process group: the supervisor alone orders the shutdown).

When another process dies, the supervisor sends ProcessDied on the notices socket: every
in-flight request is failed with a 503 naming that process, new ones are refused, and
`Flushed` tells the supervisor it may tear down (uvicorn's graceful shutdown then lets the
error responses finish).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import errno
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog
import uvicorn
import uvloop
import zmq
import zmq.asyncio

from engine.config import ServerConfig
from engine.logs import setup_logging
from engine.serve.frontend import Frontend
from engine.serve.grammar import warm_when_ready
from engine.serve.http import MAX_BODY, BoundedHeadProtocol, build_app
from engine.serve.sampling_defaults import model_sampling_defaults
from engine.serve.sdk_server import SdkServer
from engine.serve.state import ServeState
from engine.tokenizer import load_tokenizer
from msgs.channels import (
    CONTROL,
    NOTICES,
    OUTPUTS,
    REQUESTS,
    SDK_IN,
    SDK_OUT,
    AsyncReceiver,
    AsyncSender,
    http_address,
    open_async_receiver,
    open_async_sender,
)
from msgs.control import ALIVE_EVERY_S, Alive, Fatal, Flushed, ProcessDied, Ready, ToSupervisor, ToTokenizerControl
from msgs.outputs import ToTokenizer
from msgs.requests import ToScheduler

log = structlog.get_logger()
PROC = "tokenizer"
GRACEFUL_SHUTDOWN_S = 3  # under the supervisor's 5 s grace: the tokenizer ends on its own
FLUSH_TIMEOUT_S = 0.8  # under the supervisor's 1 s wait, so Flushed arrives in time
FLUSH_SETTLE_S = 0.05  # lets woken handlers write their error before we report Flushed


class StartupError(Exception):
    """A reason the process cannot start, worded for the person running the server."""


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: its handler re-raises the signal after
    shutdown, which would kill us before our cleanup. We install our own instead."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def listen_socket(host: str, port: int) -> socket.socket:
    """Bind the HTTP port ourselves, so 'port in use' is a clear error, not a sys.exit."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        where = http_address(host, port)
        raise StartupError(f"cannot listen on {where}: {exc.strerror or exc}{_hint(exc.errno)}") from exc
    sock.setblocking(False)
    return sock


def _bind(sock: zmq.asyncio.Socket, addr: str, what: str) -> None:
    try:
        sock.bind(addr)
    except zmq.ZMQError as exc:
        raise StartupError(f"cannot bind the {what} socket at {addr}: {exc}{_hint(exc.errno)}") from exc


def _hint(errno_: int | None) -> str:
    """What to check for a bind that failed: the port (in use), or --host (not this machine's)."""
    if errno_ == errno.EADDRINUSE:
        return " (is the port in use?)"
    if errno_ == errno.EADDRNOTAVAIL:
        return " (--host is not an address of this machine)"
    return ""


class TokenizerProcess:
    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.ctx = zmq.asyncio.Context()
        self.control: AsyncSender[ToSupervisor] | None = None

    def start(self) -> tuple[ServeState, socket.socket]:
        """Everything that can fail at startup, in order; raises StartupError."""
        cfg = self.cfg
        if not cfg.run_dir:
            raise StartupError("run_dir is not set: the supervisor must give a private directory for ipc sockets")
        run_dir = cfg.run_dir
        # Ready/Fatal must get out before we exit
        self.control = open_async_sender(self.ctx, CONTROL, PROC, run_dir, linger_ms=5000)
        self.notices: AsyncReceiver[ToTokenizerControl] = open_async_receiver(self.ctx, NOTICES, PROC, run_dir)
        try:
            tok = load_tokenizer(cfg.model, cfg.chat_template)
        except Exception as exc:  # noqa: BLE001 - any loading failure is fatal, with its reason
            raise StartupError(f"cannot load the tokenizer from {cfg.model!r}: {exc}") from exc
        if tok is None:
            log.warning("no tokenizer files in the model directory: ids-only mode", model=cfg.model)
        else:
            log.info("tokenizer loaded", max_piece_chars=tok.max_piece_chars)  # the length bound's scan, once
        defaults = self._sampling_defaults()
        # TCP ports first: they are what another server may hold. Binding an ipc path
        # replaces whoever had it, so that only happens once nothing else can fail.
        http_sock = listen_socket(cfg.host, cfg.port)
        self.sdk = self.ctx.socket(zmq.ROUTER)
        self.sdk.setsockopt(zmq.RCVHWM, SDK_IN.hwm)
        self.sdk.setsockopt(zmq.SNDHWM, SDK_OUT.hwm)
        # a send to a client that is gone fails (EHOSTUNREACH) instead of vanishing: its requests
        # are aborted (engine/serve/sdk_server.py), and so are those of a client whose queue stays full
        # (SNDHWM frames it does not read) for seconds: a send waits that long, never losing chunks silently
        self.sdk.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # a frame past HTTP's body limit is refused by zmq before it is read: it was decoded on the
        # event loop first (an audit: 95 MB frames stalled every client 2-6 s, 57 MB took ~1 GB)
        self.sdk.setsockopt(zmq.MAXMSGSIZE, MAX_BODY)
        if ":" in cfg.host:
            self.sdk.setsockopt(zmq.IPV6, 1)
        _bind(self.sdk, cfg.sdk_addr, "SDK")
        self.to_sched: AsyncSender[ToScheduler] = open_async_sender(self.ctx, REQUESTS, PROC, run_dir)
        try:
            self.from_sched: AsyncReceiver[ToTokenizer] = open_async_receiver(self.ctx, OUTPUTS, PROC, run_dir)
        except zmq.ZMQError as exc:
            raise StartupError(f"cannot bind the scheduler output socket in {run_dir}: {exc}") from exc
        return ServeState(cfg=cfg, tok=tok, frontend=Frontend(), sampling_defaults=defaults), http_sock

    def _sampling_defaults(self) -> dict[str, Any]:
        """The model's recommended sampling parameters, where --sampling-defaults model (the default)."""
        if self.cfg.sampling_defaults != "model":
            return {}
        try:
            defaults = model_sampling_defaults(self.cfg.model)
        except ValueError as exc:
            raise StartupError(f"{exc} (--sampling-defaults openai ignores the file)") from None
        if defaults:  # as vLLM says it: requests that leave these unset get the model's values
            log.info("sampling defaults from the model's generation_config.json", **defaults)
        return defaults

    async def fatal(self, reason: str) -> None:
        log.error("startup failed", reason=reason)
        with contextlib.suppress(zmq.ZMQError, TimeoutError):  # no supervisor listening: still exit
            if self.control is not None:
                await asyncio.wait_for(self.control.send(Fatal(proc=PROC, reason=reason)), 5)

    async def serve(self, state: ServeState, http_sock: socket.socket) -> int:
        cfg = self.cfg
        config = uvicorn.Config(
            build_app(state),
            log_config=None,  # keep our structlog setup
            access_log=False,
            lifespan="off",
            ws="none",
            http=BoundedHeadProtocol,  # httptools, with a bound on a request's head
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        server = _Server(config)
        loop = asyncio.get_running_loop()
        stopping: list[asyncio.Task[None]] = []  # holds the task (the loop keeps weak references only)
        loop.add_signal_handler(signal.SIGTERM, lambda: stopping.append(asyncio.create_task(self.stop(state, server))))
        loop.add_signal_handler(signal.SIGINT, lambda: None)
        tasks = {
            asyncio.create_task(state.frontend.run_sender(self.to_sched), name="sender"),
            asyncio.create_task(state.frontend.run_receiver(self.from_sched), name="receiver"),
            asyncio.create_task(SdkServer(state, self.sdk).run(), name="sdk"),
            asyncio.create_task(self.watch_supervisor(state), name="notices"),
            asyncio.create_task(self.beat(), name="alive"),
        }
        http = asyncio.create_task(server.serve(sockets=[http_sock]), name="http")
        warm = asyncio.create_task(warm_when_ready(state), name="grammar-warm")  # ends early: not in `tasks`
        try:
            while not server.started:
                if http.done():
                    await self.fatal(f"the HTTP server stopped during startup: {http.exception()!r}")
                    return 1
                await asyncio.sleep(0.01)
            info = {"http": http_address(cfg.host, cfg.port), "sdk": cfg.sdk_addr}
            await self.control.send(Ready(proc=PROC, info=info))
            log.info("tokenizer ready", **info, model=cfg.model_name, ids_only=state.tok is None)
            done, _ = await asyncio.wait({http, *tasks}, return_when=asyncio.FIRST_COMPLETED)
            return self._exit_code(done, http)
        finally:
            for task in (http, warm, *tasks):
                task.cancel()
            await asyncio.gather(http, warm, *tasks, return_exceptions=True)
            if state.grammar is not None:  # its grammar checker processes
                state.grammar.close()

    async def watch_supervisor(self, state: ServeState) -> None:
        """On ProcessDied: fail every request, wait until their consumers have seen it,
        then report Flushed so the supervisor tears down only after clients were told."""
        while True:
            msg = await self.notices.recv()
            if not isinstance(msg, ProcessDied):
                continue
            frontend = state.frontend
            failed = frontend.process_died(msg.proc, msg.reason)
            if state.grammar is not None:  # requests still waiting on their grammar's compile: 503 too
                state.grammar.down(frontend.down_reason()[0])
            if not await frontend.drained(FLUSH_TIMEOUT_S):
                log.warning("requests still in flight after a process died", left=frontend.num_in_flight)
            await asyncio.sleep(FLUSH_SETTLE_S)
            await self.control.send(Flushed(proc=PROC, requests=failed))

    async def beat(self) -> None:
        """Alive to the supervisor every ALIVE_EVERY_S while the event loop turns: a front end stuck
        in a callback is found by its silence (procs/supervisor.py)."""
        while True:
            await asyncio.sleep(ALIVE_EVERY_S)
            await self.control.send(Alive(proc=PROC))

    async def stop(self, state: ServeState, server: uvicorn.Server) -> None:
        """SIGTERM: fail every request in flight with the ordered shutdown's 503 (as the supervisor's
        notice does; a SIGTERM to this process alone used to cut streams without a word), wait
        briefly until their consumers saw it, then stop the HTTP server."""
        frontend = state.frontend
        if frontend.died is None:
            frontend.process_died("", "stopped by SIGTERM")
            if state.grammar is not None:
                state.grammar.down(frontend.down_reason()[0])
            await frontend.drained(FLUSH_TIMEOUT_S)
            await asyncio.sleep(FLUSH_SETTLE_S)
        server.should_exit = True

    @staticmethod
    def _exit_code(done: set[asyncio.Task[None]], http: asyncio.Task[None]) -> int:
        for task in done:
            if task is not http or task.exception() is not None:
                log.error("task ended unexpectedly", task=task.get_name(), error=repr(task.exception()))
                return 1
        log.info("tokenizer stopped")
        return 0

    def close(self) -> None:
        self.ctx.destroy(linger=1000)


async def run(cfg: ServerConfig) -> int:
    """Run the tokenizer process until signalled; the exit status."""
    proc = TokenizerProcess(cfg)
    try:
        try:
            state, http_sock = proc.start()
        except StartupError as exc:
            await proc.fatal(str(exc))
            return 1
        return await proc.serve(state, http_sock)
    finally:
        proc.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="ServerConfig as a JSON file")
    args = parser.parse_args(argv)
    try:
        cfg = ServerConfig.from_json(Path(args.config).read_text())
    except (OSError, ValueError) as exc:  # no run_dir known yet: stderr is all we have
        print(f"tokenizer: bad --config {args.config}: {exc}", file=sys.stderr)
        return 2
    setup_logging("tokenizer", cfg.log_dir)
    if not cfg.model:
        # The supervisor normally resolves the default model; this keeps a hand-started
        # tokenizer working too (a no-op lookup once the conversion is cached).
        from models.default_model import ensure_default_model

        cfg = dataclasses.replace(cfg, model=str(ensure_default_model()))
    return uvloop.run(run(cfg))


if __name__ == "__main__":
    sys.exit(main())
