"""A child that dies while serving: every in-flight client gets an explicit error within
about a second (an SSE error event then [DONE], a JSON 503, an SDK 503), then bin/serve
exits 1 naming the process, with no orphans and no run dir left. Each test starts its own
bin/serve and kills one child (kill -9) or makes one report Fatal."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import zmq

from msgs.channels import CONTROL
from msgs.control import Fatal
from msgs.sdk import Client, StrataError
from tests.integration.conftest import Server, start_server

LONG = {"ignore_eos": True, "temperature": 0}  # with a large max_tokens: runs until killed
MAX = 1500
TOLD_WITHIN_S = 5.0  # from the kill to the client's error (the goal is ~1 s; margin for a loaded 2-core machine)


def _children(srv: Server, workers: int = 1) -> dict[str, psutil.Process]:
    """The server's processes by role: worker-0 (.. worker-N), scheduler, tokenizer."""
    out = {}
    for child in psutil.Process(srv.proc.pid).children(recursive=True):
        cmd = child.cmdline()
        for role in ("worker", "scheduler", "tokenizer"):
            if f"procs.{role}" in cmd:
                out[f"{role}-{cmd[cmd.index('--rank') + 1]}" if role == "worker" else role] = child
    assert set(out) == {*(f"worker-{r}" for r in range(workers)), "scheduler", "tokenizer"}, out
    return out


def _shm(children: dict[str, psutil.Process]) -> set[Path]:
    """Shared-memory files the children map (none today; the L2 host slab will be one)."""
    paths = {m.path for c in children.values() for m in c.memory_maps()}
    return {Path(p) for p in paths if p.startswith("/dev/shm/") and not p.endswith("(deleted)")}


def _run_dir(children: dict[str, psutil.Process]) -> Path:
    (path,) = {Path(a).parent for c in children.values() for a in c.cmdline() if a.endswith("config.json")}
    return path


class Background:
    """Runs fn in a thread; `started` is set by fn when its request is under way."""

    def __init__(self, fn: Callable[[threading.Event], Any]) -> None:
        self.started = threading.Event()
        self.result: Any = None
        self.done_at = 0.0
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[threading.Event], Any]) -> None:
        try:
            self.result = fn(self.started)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            self.result = exc
        self.done_at = time.monotonic()
        self.started.set()

    def join(self, timeout: float = 15) -> Any:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the client was never told"
        return self.result


def _sdk_stream(addr: str) -> Callable[[threading.Event], Any]:
    def run(started: threading.Event) -> Any:
        with Client(addr, timeout_s=20) as c:
            for chunk in c.stream("Count to a thousand:", max_new_tokens=MAX, **LONG):
                if chunk.token_ids:
                    started.set()
        return "finished"  # a crash must never look like this

    return run


def _http_post(url: str, body: dict[str, Any]) -> Callable[[threading.Event], Any]:
    def run(started: threading.Event) -> Any:
        started.set()  # non-streaming: nothing arrives before the end
        return httpx.post(url, json=body, timeout=30)

    return run


def _sse_events(resp: httpx.Response, first: threading.Event) -> list[Any]:
    """Every SSE data payload (JSON or the '[DONE]' string) in order; sets `first` at the
    first one that carries generated text."""
    events: list[Any] = []
    for line in resp.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
        if len(events) >= 2:
            first.set()
    return events


def _three_in_flight(srv: Server, act: Callable[[], None]) -> tuple[list[Any], Background, Background, Background,
                                                                     float]:
    """An SDK stream, a whole /completions and a streamed chat running, then act() (a kill, a
    signal): the chat's SSE events, the chat's, SDK's and whole request's clients, and when act ran."""
    sdk = Background(_sdk_stream(srv.sdk))
    whole = Background(_http_post(f"{srv.base_url}/completions", {"prompt": "Once upon a time", "max_tokens": MAX,
                                                                   **LONG}))
    chat = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": MAX, "stream": True}
    first = threading.Event()
    with httpx.stream("POST", f"{srv.base_url}/chat/completions", json={**chat, **LONG}, timeout=30) as resp:
        assert resp.status_code == 200
        stream = Background(lambda _started: _sse_events(resp, first))
        assert first.wait(30) and sdk.started.wait(30)
        _wait_running(srv, 3)
        t_act = time.monotonic()
        act()
        events = stream.join()
    assert not isinstance(events, BaseException), events
    return events, stream, sdk, whole, t_act


def _wait_running(srv: Server, n: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while srv.metrics().get("strata_running_requests", 0) < n:
        assert time.monotonic() < deadline, "requests never started running"
        time.sleep(0.05)


def _assert_error_event(events: list[Any], proc: str) -> None:
    assert events[-1] == "[DONE]", events[-3:]
    err = events[-2]["error"]
    assert err["type"] == "server_error" and err["code"] == "process_died", err
    assert proc in err["message"], err


def _assert_503(resp: Any, proc: str) -> None:
    assert isinstance(resp, httpx.Response), resp
    assert resp.status_code == 503, resp.text
    err = resp.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "process_died" and proc in err["message"], err


def _assert_sdk_503(result: Any, proc: str) -> None:
    assert isinstance(result, StrataError), result
    assert result.status == 503 and proc in result.message, result


def _assert_refused_or_down(srv: Server) -> None:
    """Right after the errors went out the tokenizer may still answer; then it must say 503
    (health and new requests), never 200. Once it is gone, the connection is refused."""
    try:
        health = httpx.get(f"{srv.http}/health", timeout=2)
        new = httpx.post(f"{srv.http}/generate", json={"text": "hi"}, timeout=2)
    except httpx.HTTPError:
        return
    assert health.status_code == 503, health.text
    assert new.status_code == 503, new.text


def _assert_orderly_exit(
    srv: Server,
    children: dict[str, psutil.Process],
    leftovers: tuple[Path, set[Path]],
    capfd: pytest.CaptureFixture[str],
    says: str,
) -> None:
    assert srv.proc.wait(timeout=20) == 1
    _, alive = psutil.wait_procs(list(children.values()), timeout=5)
    assert not alive, f"orphans: {alive}"
    run_dir, shm = leftovers
    assert not run_dir.exists(), "the ipc run dir must be removed"
    assert not any(p.exists() for p in shm), f"shared memory left behind: {shm}"
    assert says in capfd.readouterr().err


def test_worker_killed_mid_stream(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    srv = start_server(tmp_path / "logs", "--max-total-tokens", "4096")
    children = _children(srv)
    run_dir = _run_dir(children)
    leftovers = (run_dir, _shm(children))
    events, stream, sdk, whole, t_kill = _three_in_flight(srv, lambda: children["worker-0"].send_signal(signal.SIGKILL))
    _assert_error_event(events, "worker-0")
    assert stream.done_at - t_kill < TOLD_WITHIN_S
    _assert_refused_or_down(srv)
    _assert_sdk_503(sdk.join(), "worker-0")
    _assert_503(whole.join(), "worker-0")
    assert max(sdk.done_at, whole.done_at) - t_kill < TOLD_WITHIN_S
    _assert_orderly_exit(srv, children, leftovers, capfd, "worker-0 (killed by SIGKILL)")


def test_scheduler_killed_mid_request(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    srv = start_server(tmp_path / "logs", "--max-total-tokens", "4096")
    children = _children(srv)
    run_dir = _run_dir(children)
    leftovers = (run_dir, _shm(children))
    chat = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": MAX, **LONG}
    whole = Background(_http_post(f"{srv.base_url}/chat/completions", chat))
    sdk = Background(_sdk_stream(srv.sdk))
    first = threading.Event()
    body = {"input": "Tell me a long story.", "max_output_tokens": MAX, "stream": True, **LONG}
    with httpx.stream("POST", f"{srv.base_url}/responses", json=body, timeout=30) as resp:  # /v1/responses' stream
        assert resp.status_code == 200
        streamed = Background(lambda _started: _sse_events(resp, first))
        assert sdk.started.wait(30) and first.wait(30)
        _wait_running(srv, 3)
        t_kill = time.monotonic()
        children["scheduler"].send_signal(signal.SIGKILL)
        events = streamed.join()
    _assert_503(whole.join(), "scheduler")
    _assert_sdk_503(sdk.join(), "scheduler")
    failed = events[-1]  # the Responses API's end: response.failed, its error the process that died
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed", failed
    error = failed["response"]["error"]
    assert error["code"] == "process_died" and "scheduler" in error["message"], error
    assert max(sdk.done_at, whole.done_at, streamed.done_at) - t_kill < TOLD_WITHIN_S
    _assert_orderly_exit(srv, children, leftovers, capfd, "scheduler (killed by SIGKILL)")


def test_fatal_after_ready_fails_streams(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A child that reports Fatal while serving (a digest mismatch, say) is handled like a
    death. The Fatal is sent on the real control socket, as the scheduler would send it."""
    srv = start_server(tmp_path / "logs", "--max-total-tokens", "4096")
    children = _children(srv)
    run_dir = _run_dir(children)
    leftovers = (run_dir, _shm(children))
    body = {"text": "Once upon a time", "stream": True, "sampling_params": {"max_new_tokens": MAX, **LONG}}
    first = threading.Event()
    with httpx.stream("POST", f"{srv.http}/generate", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        stream = Background(lambda _started: _sse_events(resp, first))
        assert first.wait(30)
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(CONTROL.address(str(run_dir)))
        push.send(CONTROL.codec.encode(Fatal(proc="scheduler", reason="digest mismatch at step 7 (test)")))
        push.close(linger=1000)
        ctx.term()
        events = stream.join()
    assert not isinstance(events, BaseException), events
    _assert_error_event(events, "scheduler")
    assert "digest mismatch at step 7" in events[-2]["error"]["message"]
    assert all("error" not in e for e in events[:-2] if isinstance(e, dict))
    _assert_orderly_exit(srv, children, leftovers, capfd, "scheduler failed: digest mismatch at step 7 (test)")


def _told_shutdown(three: tuple[list[Any], Background, Background, Background, float], how: str) -> None:
    """_three_in_flight's clients each got the ordered shutdown's 503 ("stopped by `how`") in time."""
    events, stream, sdk, whole, t_signal = three
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "server_shutdown", events[-3:]
    assert f"stopped by {how}" in events[-2]["error"]["message"]
    assert stream.done_at - t_signal < TOLD_WITHIN_S
    resp = whole.join()
    assert isinstance(resp, httpx.Response) and resp.status_code == 503, resp
    assert resp.json()["error"]["code"] == "server_shutdown"
    result = sdk.join()
    assert isinstance(result, StrataError) and result.status == 503 and "shutting down" in result.message, result


def test_ctrl_c_fails_requests_in_flight_and_exits_0(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it: the children ignore it,
    the supervisor has the tokenizer fail every request in flight (an SSE error event, a JSON 503,
    an SDK 503: "the server is shutting down"), then stops them all and exits 0, with no
    traceback and no "exited unexpectedly"."""
    srv = start_server(tmp_path / "logs", "--max-total-tokens", "4096", new_session=True)
    children = _children(srv)
    leftovers = (_run_dir(children), _shm(children))
    _told_shutdown(_three_in_flight(srv, lambda: os.killpg(srv.proc.pid, signal.SIGINT)), "SIGINT")
    assert srv.proc.wait(timeout=20) == 0
    _, alive = psutil.wait_procs(list(children.values()), timeout=5)
    assert not alive, f"orphans: {alive}"
    run_dir, shm = leftovers
    assert not run_dir.exists() and not any(p.exists() for p in shm)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "unexpectedly" not in err, err[-2000:]


def test_sigterm_to_the_front_end_alone_tells_its_clients(tmp_path: Path,
                                                         capfd: pytest.CaptureFixture[str]) -> None:
    """SIGTERM to the tokenizer process only (not the group): it fails every request in flight with
    the ordered shutdown's 503 before its HTTP server stops (it used to close streams after its
    graceful wait with no error event and no [DONE]); bin/serve then stops, naming it."""
    srv = start_server(tmp_path / "logs", "--max-total-tokens", "4096")
    children = _children(srv)
    term = children["tokenizer"]
    _told_shutdown(_three_in_flight(srv, lambda: term.send_signal(signal.SIGTERM)), "SIGTERM")
    assert srv.proc.wait(timeout=20) == 1
    _, alive = psutil.wait_procs(list(children.values()), timeout=5)
    assert not alive, f"orphans: {alive}"
    assert "tokenizer" in capfd.readouterr().err


def test_tokenizer_killed_sdk_clients_hear_silence(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Nobody is left to answer an SDK client when the tokenizer dies: the client's own liveness
    check (no keep-alive for SILENCE_S) raises a 503 for a stream and a whole request alike."""
    from msgs.sdk import SILENCE_S

    srv = start_server(tmp_path / "logs", "--max-total-tokens", "4096")
    children = _children(srv)
    sdk = Background(_sdk_stream(srv.sdk))

    def whole(started: threading.Event) -> Any:
        started.set()
        with Client(srv.sdk, timeout_s=120) as c:
            return c.generate("Count to a thousand:", max_new_tokens=MAX, **LONG)

    plain = Background(whole)
    assert sdk.started.wait(30) and plain.started.wait(30)
    _wait_running(srv, 2)
    t_kill = time.monotonic()
    children["tokenizer"].send_signal(signal.SIGKILL)
    for result in (sdk.join(SILENCE_S + 10), plain.join(SILENCE_S + 10)):
        assert isinstance(result, StrataError) and result.status == 503 and "no word" in result.message, result
    assert max(sdk.done_at, plain.done_at) - t_kill < SILENCE_S + 5
    assert srv.proc.wait(timeout=20) == 1


def _stop_one_mid_requests(tmp_path: Path, capfd: pytest.CaptureFixture[str], child: str, says: str) -> None:
    """An SDK stream and a whole /completions running, then `child` SIGSTOPped with a 3 s
    --watchdog-timeout: both clients get the 503 naming `child` (a lone worker that stops answering
    is the one at fault: the scheduler's watchdog names it) within the timeout and a few seconds,
    and bin/serve exits 1 saying `says`, with nothing left behind."""
    srv = start_server(tmp_path / "logs", "--max-total-tokens", "4096", "--watchdog-timeout", "3")
    children = _children(srv)
    leftovers = (_run_dir(children), _shm(children))
    sdk = Background(_sdk_stream(srv.sdk))
    whole = Background(_http_post(f"{srv.base_url}/completions", {"prompt": "Once upon a time", "max_tokens": MAX,
                                                                   **LONG}))
    assert sdk.started.wait(30) and whole.started.wait(30)
    _wait_running(srv, 2)
    t_stop = time.monotonic()
    children[child].send_signal(signal.SIGSTOP)
    try:
        _assert_503(whole.join(20), child)
        _assert_sdk_503(sdk.join(20), child)
        assert max(sdk.done_at, whole.done_at) - t_stop < 3 + 5
    finally:
        children[child].send_signal(signal.SIGCONT)  # so that the teardown's SIGTERM can end it
    _assert_orderly_exit(srv, children, leftovers, capfd, says)


def test_a_stuck_worker_trips_the_watchdog(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A worker that stops making progress (SIGSTOP: stuck in a kernel, a collective, swap) does not
    hang its clients: after --watchdog-timeout the scheduler fails, naming the step and the worker, and
    every client in flight gets its 503."""
    _stop_one_mid_requests(tmp_path, capfd, "worker-0", "--watchdog-timeout")


def test_a_stopped_rank_of_two_is_named(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """tp=2 with worker-1 SIGSTOPped: worker-0 waits in its all-reduce, so no rank answers and the
    scheduler's watchdog cannot tell which is at fault; the supervisor finds the stopped process and
    names it, to the client in flight (503) and on exit (it named the scheduler before)."""
    srv = start_server(tmp_path / "logs", "--tp-size", "2", "--max-total-tokens", "4096", "--watchdog-timeout", "3")
    children = _children(srv, workers=2)
    leftovers = (_run_dir(children), _shm(children))
    whole = Background(_http_post(f"{srv.base_url}/completions", {"prompt": "Once upon a time", "max_tokens": MAX,
                                                                   **LONG}))
    assert whole.started.wait(30)
    _wait_running(srv, 1)
    children["worker-1"].send_signal(signal.SIGSTOP)
    try:
        _assert_503(whole.join(20), "worker-1")
    finally:
        children["worker-1"].send_signal(signal.SIGCONT)
    _assert_orderly_exit(srv, children, leftovers, capfd, "process worker-1 is stopped (SIGSTOP)")
    lines = [json.loads(x) for x in (srv.log_dir / "supervisor.log").read_text().splitlines()]
    assert [rec["child"] for rec in lines if rec.get("event") == "child died"] == ["worker-1"]


def test_a_stuck_cache_controller_is_found_by_its_silence(tmp_path: Path) -> None:
    """The host tier's controller stopped (SIGSTOP): backups never commit, but nothing else waits on
    it, so only its silence tells: the supervisor names it within --watchdog-timeout and stops."""
    srv = start_server(tmp_path / "logs", "--max-total-tokens", "4096", "--watchdog-timeout", "2",
                       "--enable-hierarchical-cache", "--hicache-ratio", "2")
    (cache,) = [c for c in psutil.Process(srv.proc.pid).children(recursive=True) if "procs.cache" in c.cmdline()]
    t_stop = time.monotonic()
    cache.send_signal(signal.SIGSTOP)
    try:
        assert srv.proc.wait(timeout=20) == 1
        assert time.monotonic() - t_stop < 2 + 5 + 5  # the watchdog, the teardown's grace, a loaded machine
    finally:
        if cache.is_running():
            cache.send_signal(signal.SIGCONT)
    lines = [json.loads(x) for x in (srv.log_dir / "supervisor.log").read_text().splitlines()]
    died = [rec for rec in lines if rec.get("event") == "child died"]
    assert [rec["child"] for rec in died] == ["cache"] and "stuck" in died[0]["reason"], died


def test_a_stuck_scheduler_is_found_by_its_silence(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A scheduler that stops between passes (SIGSTOP: a deadlock, an endless loop) sends no Alive:
    after --watchdog-timeout the supervisor names it and every client in flight gets its 503 (the
    front end keeps SDK clients' keep-alives going, so they never noticed; /health said 200)."""
    _stop_one_mid_requests(tmp_path, capfd, "scheduler", "stuck: no sign of life for 3 s")
