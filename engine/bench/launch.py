"""Start bin/serve for a benchmark (free ports, wait for /health) and stop it afterwards."""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from engine.bench.hardware import ROOT
from engine.supervise import free_ports
from msgs.channels import sdk_address

START_TIMEOUT_S = 900.0


class ServerUnavailable(RuntimeError):
    """The benchmark's server did not start or answer /health."""


@dataclass(frozen=True)
class Endpoints:
    http: str | None  # e.g. http://127.0.0.1:8000
    sdk: str | None  # e.g. tcp://127.0.0.1:8001
    pid: int | None = None  # the supervisor's process id when the benchmark started the server


def serve_command(model: str | None, load_format: str, server_args: list[str], port: int, sdk_port: int) -> list[str]:
    cmd = [str(ROOT / "bin" / "serve"), "--port", str(port), "--sdk-port", str(sdk_port)]
    if model:
        cmd += ["--model", model]
    if load_format != "auto":
        cmd += ["--load-format", load_format]
    return cmd + server_args


def wait_healthy(url: str, proc: subprocess.Popen | None, log: Path | None, timeout_s: float) -> float:
    """Poll GET url/health until 200; return seconds waited. Raises if the server died."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc is not None and proc.poll() is not None:
            raise ServerUnavailable(f"bin/serve exited with {proc.returncode} during start-up\n{_tail(log)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise ServerUnavailable(f"{url} did not become healthy in {timeout_s:.0f} s\n{_tail(log)}")


def _tail(log: Path | None, lines: int = 30) -> str:
    if log is None or not log.is_file():
        return ""
    return "server log tail:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def kernel_caches() -> list[Path]:
    """Where compiled kernels land on disk: triton's, flashinfer's JIT, DeepGEMM's JIT and torch
    inductor's."""
    home = Path.home()
    return [Path(os.environ.get("TRITON_CACHE_DIR") or home / ".triton" / "cache"),
            Path(os.environ.get("FLASHINFER_WORKSPACE_BASE") or home) / ".cache" / "flashinfer",
            Path(os.environ.get("DG_JIT_CACHE_DIR") or home / ".deep_gemm"),
            Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or Path(tempfile.gettempdir()) / f"torchinductor_{_user()}")]


def _user() -> str:
    """The user name in torch inductor's default cache folder (getpass, as torch names it)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def cached_kernels() -> set[Path]:
    """Every file in the kernel caches now."""
    return {f for d in kernel_caches() if d.is_dir() for f in d.rglob("*") if f.is_file()}


def report_compiles(at_ready: set[Path]) -> list[str]:
    """Files the kernel caches gained since ready, printed: a compile a request met (ready means
    warm, docs/architecture.md). Empty when everything served was compiled before /health said ready."""
    new = sorted(str(f) for f in cached_kernels() - at_ready)
    print(f"compiled after ready: {len(new)} new kernel-cache files" + "".join(f"\n  {f}" for f in new[:12]),
          flush=True)
    return new


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """SIGTERM the supervisor (it stops its children); SIGKILL if it does not exit in time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def auth_headers(api_key: str) -> dict[str, str]:
    """The HTTP header of the server's --api-key, where one is given."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@contextmanager
def launched_server(model: str | None, load_format: str, server_args: list[str]) -> Iterator[Endpoints]:
    """bin/serve on free ports for the duration of the block; its output goes to a temp log."""
    port, sdk_port = free_ports(2)
    cmd = serve_command(model, load_format, server_args, port, sdk_port)
    tmp = Path(tempfile.mkdtemp(prefix="strata-bench-"))
    log = tmp / "serve.log"
    print(f"starting: {' '.join(cmd)}  (log: {log})", flush=True)
    ok = False
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            waited = wait_healthy(url, proc, log, START_TIMEOUT_S)
            print(f"server ready in {waited:.1f} s", flush=True)
            at_ready = cached_kernels()
            yield Endpoints(http=url, sdk=sdk_address("127.0.0.1", sdk_port), pid=proc.pid)
            report_compiles(at_ready)
            ok = True
        finally:
            code = stop(proc)
            ok = ok and code == 0
    if ok:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"bin/serve exit status {code}; its log is kept at {log}", flush=True)


@contextmanager
def endpoints(
    url: str | None, sdk: str | None, model: str | None, load_format: str, server_args: list[str]
) -> Iterator[Endpoints]:
    """The given server (--url / --sdk), or one started here for the duration of the block."""
    if url or sdk:
        if url:
            wait_healthy(url.rstrip("/"), None, None, 60.0)
        yield Endpoints(http=url.rstrip("/") if url else None, sdk=sdk)
        return
    with launched_server(model, load_format, server_args) as ep:
        yield ep
