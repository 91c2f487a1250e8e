"""The Starlette app: routes, request ids, error bodies, disconnect handling.

Handlers (openai_api, native) return a `Reply`; this module owns everything HTTP:
- x-request-id becomes the rid (validated) and is echoed on every response;
- ApiError -> its status with an OpenAI-style body; any other exception -> logged, 500
  in the same format (the process stays up);
- a client that disconnects aborts its request: non-streaming handlers race a watcher on
  the ASGI receive channel; streaming responses are cancelled by Starlette on disconnect
  and the Reply's `close` runs as the response's background task either way.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import structlog
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from engine.serve import formats as fmt
from engine.serve.errors import ApiError, api_error_body, error_body
from engine.serve.frontend import GenerationFailed
from engine.serve.native import abort_request, generate_http, health_generate, model_info, server_info
from engine.serve.openai_api import chat_completions, completions
from engine.serve.responses import responses
from engine.serve.state import VERSION, Call, Reply, ServeState
from engine.serve.tokenize_api import detokenize, tokenize, tokenizer_info
from engine.serve.validate import check_model, check_rid
from msgs.client import MAX_FRAME_BYTES

log = structlog.get_logger()
Handler = Callable[[ServeState, bytes, Call], Awaitable[Reply]]


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


def request_id(header: str | None) -> str:
    """The rid for a request: the client's x-request-id, or a fresh one."""
    return uuid.uuid4().hex if header is None else check_rid(header, "x-request-id")


def json_response(body: Any, status: int = 200, rid: str | None = None) -> Response:
    headers = {"x-request-id": rid} if rid else None
    return Response(fmt.to_json(body), status_code=status, media_type="application/json", headers=headers)


def error_response(err: ApiError, rid: str | None = None) -> Response:
    return json_response(api_error_body(err), err.status, rid)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Coroutine[Any, Any, Reply]) -> Reply:
    """Run `work`; if the client disconnects first, cancel it (its finally blocks abort
    the scheduler requests) and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()


async def _guarded(stream: AsyncIterator[bytes], rid: str) -> AsyncIterator[bytes]:
    """A bug while streaming ends the stream with an error event instead of a torn
    connection (the status line has already gone out as 200)."""
    try:
        async for chunk in stream:
            yield chunk
    except Exception:
        log.exception("stream failed", rid=rid)
        yield fmt.sse(error_body(500, "internal server error"))
        yield fmt.SSE_DONE


def api_route(state: ServeState, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        t0 = time.monotonic()
        header = request.headers.get("x-request-id")
        try:
            rid = request_id(header)
        except ApiError as exc:
            return error_response(exc)
        with structlog.contextvars.bound_contextvars(rid=rid):
            try:
                body = await read_body(request)
                reply = await until_disconnect(request, handler(state, body, Call(rid, t0, header is not None)))
            except GenerationFailed as exc:  # it ran (or was due to) and failed: not a refusal
                log.warning("request failed", status=exc.status, error=exc.message)
                return error_response(exc, rid)
            except ApiError as exc:
                log.info("request rejected", status=exc.status, error=exc.message)
                state.frontend.metrics.rejected.labels(str(exc.status)).inc()
                return error_response(exc, rid)
            except (ClientGone, ClientDisconnect):
                log.info("client disconnected before the response")
                return Response(status_code=499)
            except Exception:
                log.exception("request handler failed")
                return error_response(ApiError(500, "internal server error"), rid)
        rid = reply.rid or rid
        if reply.stream is not None:
            headers = {"x-request-id": rid, "cache-control": "no-cache"}
            background = BackgroundTask(reply.close) if reply.close else None
            stream = _guarded(reply.stream, rid)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers, background=background)
        return json_response(reply.body, rid=rid)

    return endpoint


MAX_HEAD_BYTES = 4 << 20  # a request's line and headers (vLLM's h11 bound; uvicorn's httptools parser has none)
HEAD_TIMEOUT_S = 60.0  # from a connection (or a request's first byte) to its headers' end (nginx's default)


class BoundedHeadProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with bounds on a request's head: an audit's 256 MB header held
    the event loop for 73 s (parsing grows with its square), and 20,000 connections that never sent
    a whole head held every file descriptor; neither needs an API key. Past MAX_HEAD_BYTES before
    the headers end: a 431 and the connection closed; no headers' end within HEAD_TIMEOUT_S: closed."""

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        self._head_bytes, self._in_head = 0, True
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = self.loop.call_later(HEAD_TIMEOUT_S, self._head_too_slow)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        self._head_bytes, self._in_head = 0, True
        if self._head_timer is None:  # (the next request on a kept-alive connection)
            self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_too_slow)
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._stop_head_timer()
        super().on_headers_complete()

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self._in_head and not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                msg = b"request header fields too large"
                self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain\r\n"
                                     b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(msg), msg))
                self.transport.close()
                return
        super().data_received(data)


MAX_BODY = MAX_FRAME_BYTES  # bytes of a request body: larger is a 413 (1M-token prompts fit in a few MB)


def _too_large() -> ApiError:
    return ApiError(413, f"request body over {MAX_BODY >> 20} MiB", code="body_too_large")


async def read_body(request: Request) -> bytes:
    """The request's body, read at most MAX_BODY bytes far (a larger one is a 413 at once). A body
    declared as something other than JSON, or compressed, is a 415: a form or text/plain POST is
    what a browser sends another site without asking (FastAPI, vLLM's server, refuses it too)."""
    if request.method != "POST":  # a GET route has no body to declare
        return b""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media and media != "application/json" and not media.endswith("+json"):
        raise ApiError(415, f"content-type {media[:100]!r} is not JSON: send the body as application/json",
                       code="unsupported_media_type")
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise ApiError(415, f"content-encoding {encoding[:100]!r} is not supported: send the body uncompressed",
                       code="unsupported_media_type")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY:
        raise _too_large()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise _too_large()
        chunks.append(chunk)
    return b"".join(chunks)


def build_app(state: ServeState) -> Starlette:
    def card(name: str) -> dict[str, Any]:
        limits = state.frontend.limits()
        return {
            "id": name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "strata",
            "root": state.cfg.model or state.model_name,
            "max_model_len": limits.max_context if limits else None,
        }

    async def models(_request: Request) -> Response:
        return json_response({"object": "list", "data": [card(n) for n in state.served_names]})

    async def model(request: Request) -> Response:
        """OpenAI's GET /v1/models/{model} (`client.models.retrieve`): the served model by any name
        a request may use for it, else a 404."""
        try:
            check_model(request.path_params["model"], state.accepted_models)  # (one wording: vLLM's)
        except ApiError as exc:
            return error_response(exc)
        name = request.path_params["model"]
        return json_response(card(name if name in state.served_names else state.model_name))

    async def health(_request: Request) -> Response:
        if state.frontend.died is not None:
            message, code = state.frontend.down_reason()
            return json_response(error_body(503, message, code=code), 503)
        if state.frontend.ready:
            stats = state.frontend.stats
            return json_response({"status": "ok", "deterministic": bool(stats and stats.deterministic)})
        return json_response(error_body(503, "the scheduler is not ready"), 503)

    async def flush_cache(request: Request) -> Response:
        """SGLang's GET or POST /flush_cache[?timeout=S]: empty L1 and L2 (the L3 files stay: a store
        that engines share), only while nothing runs: a 409 at once, or once `timeout` seconds
        (SGLang's query parameter, default 0) went by without the engine going idle."""
        try:
            timeout_s = float(request.query_params.get("timeout", "0"))
        except ValueError:
            timeout_s = -1.0
        if not 0 <= timeout_s <= 3600:  # (also NaN)
            return error_response(ApiError(400, "timeout must be a number of seconds in [0, 3600]", "timeout"))
        deadline = time.monotonic() + timeout_s
        try:
            while not (done := await state.frontend.flush_cache()).ok and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        except ApiError as exc:
            return error_response(exc)
        if not done.ok:
            return json_response(error_body(409, f"cache not flushed: {done.message}", code="busy"), 409)
        emptied = "L1 and L2 are" if state.cfg.enable_hierarchical_cache else "L1 is"
        kept = " (L3 files are kept)" if state.cfg.l3_dir else ""
        return json_response({"status": "ok", "message": f"{emptied} empty{kept}"})

    async def version(_request: Request) -> Response:  # vLLM's and SGLang's GET /version
        return json_response({"version": VERSION})

    async def metrics(_request: Request) -> Response:
        body, content_type = state.frontend.metrics.render()
        return Response(body, media_type=content_type)

    routes = [
        Route("/v1/chat/completions", api_route(state, chat_completions), methods=["POST"]),
        Route("/v1/completions", api_route(state, completions), methods=["POST"]),
        Route("/v1/responses", api_route(state, responses), methods=["POST"]),
        Route("/generate", api_route(state, generate_http), methods=["POST"]),
        Route("/tokenize", api_route(state, tokenize), methods=["POST"]),
        Route("/detokenize", api_route(state, detokenize), methods=["POST"]),
        Route("/tokenizer_info", api_route(state, tokenizer_info), methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", api_route(state, health_generate), methods=["GET"]),
        Route("/get_model_info", api_route(state, model_info), methods=["GET"]),
        Route("/get_server_info", api_route(state, server_info), methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
        Route("/abort_request", api_route(state, abort_request), methods=["POST"]),
    ]
    handlers = {HTTPException: _http_exception, Exception: _unhandled}
    middleware = [Middleware(RequireKey, key=state.cfg.api_key)] if state.cfg.api_key else []
    if state.cfg.allowed_origins:  # outermost: a preflight (OPTIONS, never with a key) is answered here
        origins = [o.strip() for o in state.cfg.allowed_origins.split(",") if o.strip()]
        middleware.insert(0, Middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"],
                                        allow_headers=["*"], expose_headers=["x-request-id"]))
    return Starlette(routes=routes, exception_handlers=handlers, middleware=middleware)  # type: ignore[arg-type]


# what a load balancer and Prometheus read without the key (SGLang's middleware opens /health* and /metrics:
# its liveness probes call /health_generate)
OPEN_PATHS = ("/health", "/health_generate", "/metrics")


class RequireKey:
    """--api-key: every request but OPEN_PATHS carries `Authorization: Bearer KEY` (vLLM's and
    SGLang's form), else a 401 in OpenAI's error shape; compared in constant time."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            # the first Authorization header, as Starlette's request.headers reads it (a proxy may add one)
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                body = error_body(401, "a valid API key is required: Authorization: Bearer <key>",
                                  code="invalid_api_key")
                await json_response(body, 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _http_exception(_request: Request, exc: HTTPException) -> Response:
    # Unknown routes (404) and wrong methods (405, with the Allow header the router gives) in the
    # OpenAI error shape.
    response = json_response(error_body(exc.status_code, exc.detail or "error"), exc.status_code)
    response.headers.update(exc.headers or {})
    return response


async def _unhandled(_request: Request, exc: Exception) -> Response:
    log.error("unhandled exception", error=repr(exc))
    return json_response(error_body(500, "internal server error"), 500)
