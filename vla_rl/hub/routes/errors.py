"""Errors as the Hub answers them: a JSON body plus the ``X-Error-*`` headers the client reads."""

from __future__ import annotations

import errno
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from vla_rl.hub.storage import HubError

log = logging.getLogger("vla_rl.hub.server")

# A write that fails for lack of space (or quota) is the server's condition, not a bug: 507 says so.
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})

# The client maps a 401 on a repo URL to "repository not found" unless X-Error-Message is exactly this string.
INVALID_CREDENTIALS = "Invalid credentials in Authorization header"


class Unauthorized(HubError):
    status = 401


class NotImplementedHere(HubError):
    status = 501


def _ascii_header(text: str) -> str:
    return " ".join(text.encode("ascii", "replace").decode().split())[:500]


def error_response(
    status: int, message: str, code: str | None = None, extra: dict[str, str] | None = None
) -> JSONResponse:
    headers = {"X-Error-Message": _ascii_header(message)}
    if status == 401:
        headers["X-Error-Message"] = INVALID_CREDENTIALS
        headers["WWW-Authenticate"] = 'Bearer realm="vla-rl hub"'
    if code:
        headers["X-Error-Code"] = code
    headers.update(extra or {})
    return JSONResponse({"error": message}, status_code=status, headers=headers)


async def _hub_error(request: Request, exc: HubError) -> Response:
    return error_response(exc.status, exc.message, exc.code, exc.headers)


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    return error_response(exc.status_code, str(exc.detail))


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    return error_response(400, f"invalid request: {exc.errors()}")


async def _os_error(request: Request, exc: OSError) -> Response:
    if exc.errno in NO_SPACE:
        log.error("hub storage is full: %s", exc, extra={"path": request.url.path})
        return error_response(
            507, "Insufficient storage: the registry's disk is full; free space or move --data, then retry"
        )
    log.exception("storage error on %s", request.url.path, exc_info=exc)
    return error_response(500, f"storage error: {exc.strerror or type(exc).__name__}")


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s", request.url.path, exc_info=exc)
    return error_response(500, f"internal error ({type(exc).__name__}); see the registry's log")


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class RefuseControlCharacters:
    """ASGI middleware: a URL path with a control character (``%0a``, ``%00``...) is a 400 before routing.

    Starlette matches routes with ``re.match`` and a ``$`` anchor, and ``{path:path}`` is ``.*``, which stops
    at a newline: ``/org/name/resolve/main/a.txt%0a`` would otherwise be routed, and served, as ``a.txt``.
    No repo id, revision or file path may hold a control character, so none is lost by refusing them here.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and _CONTROL.search(scope.get("path", "")):
            await error_response(400, "control characters are not allowed in the URL path")(
                scope, receive, send
            )
            return
        await self.app(scope, receive, send)


def add_error_handlers(app: FastAPI) -> None:
    app.add_middleware(RefuseControlCharacters)
    app.add_exception_handler(HubError, _hub_error)  # type: ignore[arg-type]
    app.add_exception_handler(OSError, _os_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected)
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
