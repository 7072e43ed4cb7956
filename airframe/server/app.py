"""The FastAPI app: state, loading in the background, API-key check, error handlers, metrics.

`create_app(engine)` serves an engine that is already loaded; `create_app(factory)` calls
`factory()` in a thread so that the server answers /health (503, then 200) while the model loads.
"""

from __future__ import annotations

import hmac
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import ApiError, from_validation, overloaded
from .metrics import Metrics
from .queue import BatchingQueue, RequestQueue
from .routes import ENDPOINTS, health_router, router


LOCAL_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
WILDCARD_ADDRESSES = ("0.0.0.0", "::", "")


@dataclass
class ServerOptions:
    api_key: str | None = None  # when set, every endpoint but /health needs "Authorization: Bearer KEY"
    max_queue: int = 64  # requests that may wait behind the running ones; more get 503
    # Run as many requests at once as the backend has K/V slots, decoded in one batch per step
    # (BatchingQueue); off: one at a time, each on the backend's fastest single-stream path.
    batching: bool = False
    aliases: tuple[str, ...] = ()  # more names for the model in /v1/models and `model`
    strict_model: bool = False  # refuse (404) a `model` that is neither the id nor an alias
    model_id: str | None = None  # the id to serve under; default: the engine's model_id
    cors_origins: tuple[str, ...] = ()  # browser origins allowed besides http(s)://localhost and 127.0.0.1
    # The address the server listens on. With no api_key and a specific address (not 0.0.0.0 or
    # ::), a request's Host header must be a localhost name, that address or one of allowed_hosts:
    # a web page that rebinds its own DNS name to 127.0.0.1 is refused. None: Host is not checked.
    bind_host: str | None = None
    allowed_hosts: tuple[str, ...] = ()  # more Host names to accept ("*": any)


@dataclass
class ServerState:
    options: ServerOptions
    engine: Any = None
    queue: RequestQueue | BatchingQueue | None = None
    load_error: str | None = None
    loaded: threading.Event = field(default_factory=threading.Event)  # set on success or failure
    started: int = field(default_factory=lambda: int(time.time()))
    metrics: Metrics = field(init=False)

    def __post_init__(self):
        self.metrics = Metrics(
            queue_depth=lambda: self.queue.depth if self.queue else 0,
            running=lambda: self.queue.running if self.queue else 0,
            slots=lambda: self.queue.slots if self.queue else 0,
        )

    @property
    def model_id(self) -> str:
        return self.options.model_id or self.engine.model_id

    def serve(self, engine) -> None:
        self.open_queue(engine)
        self.engine = engine  # only now do requests get past ready_engine
        self.loaded.set()

    def open_queue(self, engine) -> None:
        if engine is not None and self.queue is None:
            common = dict(on_finish=self.metrics.observe_finish, on_skip=lambda job: self.metrics.cancelled.inc())
            if self.options.batching and engine.backend.n_slots > 1:
                self.queue = BatchingQueue(engine, self.options.max_queue, on_step=self.metrics.observe_step, **common)
            else:
                self.queue = RequestQueue(engine, self.options.max_queue, **common)

    def fail(self, error: BaseException) -> None:
        self.load_error = f"loading the model failed: {error}"
        self.loaded.set()

    def ready_engine(self):
        """The engine, or a 503 while it loads (or after it failed to load)."""
        if self.engine is None:
            raise overloaded(self.load_error or "the model is still loading; retry in a moment")
        if self.queue is None:
            raise overloaded("the server is shutting down")
        return self.engine

    def check_key(self, request: Request) -> None:
        key = self.options.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(
                401, "missing or wrong API key: send the header 'Authorization: Bearer KEY' with the key given to --api-key",
                type="authentication_error", code="invalid_api_key",
            )

    def close(self) -> None:
        """Stop the worker (at shutdown); a later startup of the same app opens a new queue."""
        queue, self.queue = self.queue, None
        if queue is not None:
            queue.close()


def _load(state: ServerState, factory: Callable[[], Any]) -> None:
    try:
        state.serve(factory())
    except Exception as e:  # noqa: BLE001 - reported by /health and by `airframe serve`
        state.fail(e)


def allowed_hosts(options: ServerOptions) -> frozenset[str] | None:
    """The Host names a request may name, lower case and without port; None: any."""
    if options.api_key is not None or options.bind_host is None or "*" in options.allowed_hosts:
        return None
    if options.bind_host.strip("[]") in WILDCARD_ADDRESSES:
        return None
    return frozenset(h.lower().strip("[]") for h in (*LOCAL_HOSTS, options.bind_host, *options.allowed_hosts))


def _host_name(header: str) -> str:
    """The name in a Host header: example.com:8080 -> example.com, [::1]:8080 -> ::1."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


class _CheckHost:
    """ASGI middleware: refuse (403) a request whose Host header names another machine (see
    ServerOptions.bind_host); a request without one is not from a browser and passes."""

    def __init__(self, app, allowed: frozenset[str] | None):
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.allowed is not None:
            header = dict(scope["headers"]).get(b"host")
            name = None if header is None else _host_name(header.decode("latin-1"))
            if name is not None and name.rstrip(".") not in self.allowed:
                error = ApiError(403, f"Host {header.decode('latin-1')[:80]!r} is not this server's: expected one of "
                                 f"{', '.join(sorted(self.allowed))} (add names with --allowed-host, or set "
                                 f"--api-key)", code="host_not_allowed")
                return await error.response()(scope, receive, send)
        return await self.app(scope, receive, send)


class _CountRequests:
    """ASGI middleware: count every answered request by endpoint and status code."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500  # what uvicorn answers if the app raises before starting a response

        async def send_and_note(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
            self.metrics.requests.inc(endpoint, str(status))


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        return from_validation(exc, request.headers.get("content-type")).response()

    @app.exception_handler(Exception)
    async def unexpected(request, exc: Exception):
        # A bug, not a bad request: still answered in OpenAI's shape (and logged by uvicorn).
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error", code="internal_error").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind).response()


def create_app(engine_or_factory, options: ServerOptions | None = None) -> FastAPI:
    """The OpenAI-compatible app around one engine (or a callable that loads one)."""
    state = ServerState(options or ServerOptions())

    @asynccontextmanager
    async def lifespan(app):
        state.open_queue(state.engine)
        yield
        state.close()

    app = FastAPI(title="airframe", summary="OpenAI-compatible server for GGUF models", version="0.1.0", lifespan=lifespan)
    app.state.airframe = state
    app.include_router(health_router)
    app.include_router(router)
    _install_error_handlers(app)
    app.add_middleware(_CheckHost, allowed=allowed_hosts(state.options))
    app.add_middleware(_CountRequests, metrics=state.metrics)
    # Browser front ends on this machine may call the API; other origins only when named.
    app.add_middleware(CORSMiddleware, allow_origins=list(state.options.cors_origins),
                       allow_origin_regex=LOCAL_ORIGINS, allow_methods=["GET", "POST", "OPTIONS"],
                       allow_headers=["*"])
    if hasattr(engine_or_factory, "stream_ids"):
        state.serve(engine_or_factory)
    else:
        threading.Thread(target=_load, args=(state, engine_or_factory), name="airframe-load", daemon=True).start()
    return app
