"""One real server (bin/serve on the default model) shared by the integration tests."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from engine.bench import cache as bench_cache
from msgs.channels import sdk_address
from tests.ports import reserve_ports

ROOT = Path(__file__).resolve().parents[2]
STARTED: list[subprocess.Popen] = []  # every bin/serve start_server made, for kill_started_since


def kill_started_since(count: int) -> None:
    """Kill the servers started after the first `count` that still run (their children die with
    them): a test that failed or timed out before stopping its server must not leave it to load
    the cores under every later test."""
    for proc in STARTED[count:]:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    del STARTED[count:]


@dataclass
class Server:
    proc: subprocess.Popen
    http: str
    sdk: str
    log_dir: Path

    @property
    def base_url(self) -> str:
        return f"{self.http}/v1"

    def metrics(self) -> dict[str, float]:
        return bench_cache.metrics(self.http)

    def wait_idle(self, timeout: float = 60) -> dict[str, float]:
        """Wait until nothing runs or waits and the metrics hold still; return them then."""
        return bench_cache.wait_idle(self.http, timeout)


def start_server(log_dir: Path, *args: str, timeout: float = 600, new_session: bool = False,
                 ports: tuple[int, int] | None = None, grammar: bool = False) -> Server:
    """ports: (http, sdk), for a test that reserved other ports beside them (reserved here otherwise, with
    the workers' rendezvous port unless args name one: tests/ports.py says why none comes from bind(0)).
    grammar: a server that serves constrained requests; the others run `--grammar-backend none` (unless
    args say), as the grammar checker a server starts when ready costs a short test's 2 cores ~2 s."""
    if not grammar and "--grammar-backend" not in args:
        args = (*args, "--grammar-backend", "none")
    if ports is None:
        base = reserve_ports(3)
        ports = (base, base + 1)
        if "--dist-init-addr" not in args:
            args = (*args, "--dist-init-addr", f"127.0.0.1:{base + 2}")
    port, sdk_port = ports
    cmd = [
        str(ROOT / "bin" / "serve"),
        "--port",
        str(port),
        "--sdk-port",
        str(sdk_port),
        "--log-dir",
        str(log_dir),
        *args,
    ]
    # new_session: its own process group, which a test may signal whole (as a terminal's Ctrl-C does)
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "STRATA_LOG_JSON": "1"}, start_new_session=new_session)
    STARTED.append(proc)
    http = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"bin/serve exited with {proc.returncode} during start-up")
        try:
            if httpx.get(f"{http}/health", timeout=2).status_code == 200:
                return Server(proc, http, sdk_address("127.0.0.1", sdk_port), log_dir)
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise TimeoutError("bin/serve did not become healthy")


def start_servers(*specs: tuple[Path, tuple[str, ...]]) -> list[Server]:
    """start_server for each (log_dir, args), side by side (a start mostly waits on its children).
    If one fails, the others are stopped and its error is raised."""
    with ThreadPoolExecutor(len(specs)) as pool:
        futs = [pool.submit(start_server, d, *args) for d, args in specs]
    started = [f.result() for f in futs if f.exception() is None]
    if len(started) < len(futs):
        for srv in started:
            stop_server(srv)
        raise next(e for f in futs if (e := f.exception()) is not None)
    return started


def stop_server(server: Server) -> int:
    server.proc.send_signal(signal.SIGTERM)
    return server.proc.wait(timeout=30)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(
        tmp_path_factory.mktemp("logs"),
        "--max-total-tokens",
        "16384",
        "--max-prefill-tokens",
        "512",
        grammar=True,
    )
    yield srv
    stop_server(srv)


def worker_procs(srv: Server) -> dict[int, psutil.Process]:
    """The server's worker processes by global rank (their --rank argument)."""
    out = {}
    for child in psutil.Process(srv.proc.pid).children(recursive=True):
        cmd = child.cmdline()
        if "procs.worker" in cmd:
            out[int(cmd[cmd.index("--rank") + 1])] = child
    return out
