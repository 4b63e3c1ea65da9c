"""The ASGI application: routes, static web app, error mapping, and the request guard."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Sequence
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from trainguard._errors import TrainguardError
from trainguard.ui._registry import Registry
from trainguard.ui._routes import ROUTES

log = logging.getLogger("trainguard.ui")
STATIC_DIR = Path(__file__).parent / "static"
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")

# Everything the page loads comes from this server: no CDN, no inline script, no framing.
_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        b"connect-src 'self'; object-src 'none'; frame-ancestors 'none'; base-uri 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
]


def _error(status: int, kind: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"type": kind, "message": message, "status": status}}, status_code=status)


class _Guard:
    """Refuses traversal before routing, checks the Host header, adds security headers.

    Refused: encoded slashes or backslashes (``%2f``, ``%5c``), NUL, and ``.``/``..`` path
    segments after decoding (``%2e%2e``). The Host check stops a web page from another site
    reaching this server through DNS rebinding.
    """

    def __init__(self, app, allowed_hosts: Sequence[str] | None):
        self.app = app
        self.allowed_hosts = {h.lower() for h in allowed_hosts} if allowed_hosts else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await refusal(scope, receive, self._with_headers(send))
            return
        await self.app(scope, receive, self._with_headers(send))

    def _refusal(self, scope) -> Response | None:
        raw = scope.get("raw_path") or scope["path"].encode("utf-8", "replace")
        low = raw.lower()
        path = scope["path"]
        if b"%2f" in low or b"%5c" in low or b"%00" in low or b"\\" in raw or "\x00" in path or "\\" in path:
            return _error(400, "PathRefused", "encoded slashes, backslashes and NUL are refused in paths")
        if any(seg in (".", "..") for seg in path.split("/")):
            return _error(400, "PathRefused", "'.' and '..' path segments are refused")
        if self.allowed_hosts is not None:
            host = ""
            for k, v in scope.get("headers", []):
                if k == b"host":
                    host = v.decode("latin-1").lower()
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if name not in self.allowed_hosts:
                return _error(400, "HostRefused", f"host {host!r} is not served here")
        return None

    @staticmethod
    def _with_headers(send):
        async def wrapped(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                names = {k.lower() for k, _ in headers}
                headers += [(k, v) for k, v in _HEADERS if k not in names]
                message = dict(message, headers=headers)
            await send(message)

        return wrapped


async def _trainguard_error(request: Request, exc: TrainguardError) -> JSONResponse:
    return _error(exc.http_status, type(exc).__name__, str(exc))


async def _key_error(request: Request, exc: KeyError) -> JSONResponse:
    msg = exc.args[0] if exc.args and isinstance(exc.args[0], str) else f"not found: {exc}"
    return _error(404, "NotFound", msg)


async def _value_error(request: Request, exc: ValueError) -> JSONResponse:
    return _error(400, "BadRequest", str(exc))


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    what = "no such route" if exc.status_code == 404 else str(exc.detail)
    return _error(exc.status_code, "HTTPError", f"{what}: {request.url.path}")


async def _server_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("trainguard ui: unexpected error on %s", request.url.path)
    return _error(
        500, "InternalError", f"{type(exc).__name__}: the server failed on this request; see its log"
    )


async def _index(request: Request) -> Response:
    return FileResponse(STATIC_DIR / "index.html", headers={"cache-control": "no-cache"})


def create_app(logdir: str | os.PathLike, *, allowed_hosts: Sequence[str] | None = None) -> Starlette:
    """The web debugger for the runs under ``logdir`` as an ASGI app.

    ``allowed_hosts``: Host header values accepted (None accepts any; :func:`serve` passes the
    loopback names when it binds to loopback). Raises RunNotFound when ``logdir`` is missing.
    """
    registry = Registry(logdir)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        registry.close()

    app = Starlette(
        routes=[
            Route("/", _index),
            *ROUTES,
            Mount("/static", StaticFiles(directory=STATIC_DIR, follow_symlink=False), name="static"),
        ],
        exception_handlers={
            TrainguardError: _trainguard_error,
            KeyError: _key_error,
            ValueError: _value_error,
            HTTPException: _http_error,
            Exception: _server_error,
        },
        middleware=[Middleware(_Guard, allowed_hosts=allowed_hosts)],
        lifespan=lifespan,
    )
    app.state.registry = registry
    return app


def bind(host: str = "127.0.0.1", port: int = 6007) -> socket.socket:
    """A listening socket, or a TrainguardError that says why (port in use, bad host)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio turns Nagle off only on accepted sockets that say TCP,
    # and with Nagle on, every response waits ~40 ms for the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise TrainguardError(
            f"cannot listen on {host}:{port}: {exc.strerror}; pick another --port or --host"
        ) from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def serve(
    logdir: str | os.PathLike, *, host: str = "127.0.0.1", port: int = 6007, sock: socket.socket | None = None
) -> None:
    """Serve the web debugger until interrupted (blocks). Binds loopback unless told otherwise."""
    import uvicorn

    hosts = None
    if host in LOOPBACK:
        hosts = list(LOOPBACK)
    app = create_app(logdir, allowed_hosts=hosts)
    sock = sock or bind(host, port)
    config = uvicorn.Config(app, log_level="warning", lifespan="on", access_log=False)
    server = uvicorn.Server(config)
    server.run(sockets=[sock])
