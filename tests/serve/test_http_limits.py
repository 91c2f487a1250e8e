"""engine/serve/http.py BoundedHeadProtocol, the HTTP listener's bounds on a request's head, on a
real uvicorn server in this process: a connection that never finishes its headers is closed after
HEAD_TIMEOUT_S (an audit: 20,000 silent connections held every file descriptor, no API key needed),
and one whose head passes MAX_HEAD_BYTES gets a 431."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from engine.serve import http
from tests.ports import reserve_ports


@pytest.fixture
def listener(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, int]]:
    monkeypatch.setattr(http, "HEAD_TIMEOUT_S", 0.5)
    monkeypatch.setattr(http, "MAX_HEAD_BYTES", 64 << 10)
    app = Starlette(routes=[Route("/", lambda _r: PlainTextResponse("ok"))])
    port = reserve_ports(1)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=http.BoundedHeadProtocol,
                                           lifespan="off", log_config=None, access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    yield "127.0.0.1", port
    server.should_exit = True
    thread.join(10)


def _read_all(s: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := s.recv(4096):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def test_a_head_that_never_ends_is_closed(listener: tuple[str, int]) -> None:
    for sent in (b"", b"GET / HTTP/1.1\r\nhost: x\r\n"):  # nothing at all; a head left open
        with socket.create_connection(listener, timeout=10) as s:
            s.sendall(sent)
            t0 = time.monotonic()
            assert _read_all(s) == b""  # closed by the server, not by our 10 s timeout
            assert time.monotonic() - t0 < 5
    with socket.create_connection(listener, timeout=10) as s:  # a whole request is served, and kept alive
        s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 200 ")
        time.sleep(1.0)  # past the head timeout: a served request's connection is the keep-alive's to end
        s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert _read_all(s).startswith(b"HTTP/1.1 200 ")


def test_a_head_past_the_bound_is_a_431(listener: tuple[str, int]) -> None:
    with socket.create_connection(listener, timeout=10) as s:
        s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (32 << 10))
        try:
            s.sendall(b"a" * (64 << 10))
        except OSError:
            pass
        reply = _read_all(s)
    assert reply.startswith(b"HTTP/1.1 431 ") or reply == b""
