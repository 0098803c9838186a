"""The API's one error shape: ``{"detail": {"field", "message", "expected"}}`` with a 4xx/5xx status,
and the one JSON response class every answer goes through (:class:`SafeJSONResponse`).

Route code raises :class:`ApiError`; FastAPI's own validation errors, HTTP errors and the DB or store
going away mid-request are turned into the same shape by :func:`install_handlers` (never a traceback).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vla_rl.core.text import safe_json

log = logging.getLogger("vla_rl.dashboard")


class SafeJSONResponse(JSONResponse):
    """JSON that always encodes: text a DB already holds may carry a lone UTF-16 surrogate (stored before
    text was checked, or by another tool), which UTF-8 cannot encode; such a string is sent with U+FFFD in
    its place instead of failing the whole answer (an episode with one bad label used to answer 500 to
    everyone). Clean content takes the plain path."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return super().render(safe_json(content))


class ApiError(Exception):
    """A request that cannot be served: ``status``, the ``field`` at fault (a body or query field, or
    ``store`` / ``db`` / ``hub`` / ``authorization``), what is wrong and what was expected."""

    def __init__(self, status: int, field: str | None, message: str, expected: str | None = None) -> None:
        super().__init__(message)
        self.status, self.field, self.message, self.expected = status, field, message, expected

    def body(self) -> dict[str, Any]:
        return {"detail": {"field": self.field, "message": self.message, "expected": self.expected}}


def error_response(e: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return SafeJSONResponse(e.body(), status_code=e.status, headers=headers)


def _loc_field(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    return ".".join(parts) or "body"


def install_handlers(app: FastAPI, db_down: Any) -> None:
    """Error handlers: ApiError, validation (422 naming the field), HTTP errors (404, 405, ...), and
    ``db_down(exc) -> ApiError | None`` for exceptions that mean the DB or store is unreachable."""

    @app.exception_handler(ApiError)
    async def _api(_: Request, e: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return error_response(e, headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {"loc": ("body",), "msg": "invalid request"}
        field = _loc_field(first.get("loc", ()))
        expected = first.get("type")
        ctx = first.get("ctx") or {}
        if ctx:
            expected = ", ".join(f"{k} {v}" for k, v in ctx.items() if isinstance(v, str | int | float))
        # a field validator's ValueError (vla_rl.dashboard.fields) already starts with the field's name
        msg = str(first.get("msg")).removeprefix("Value error, ")
        head = msg.partition(":")[0]
        named = " " not in head and (field.startswith(head) or head.startswith(field))
        message = msg if named else f"{field}: {msg}"
        return error_response(ApiError(422, field, message, expected or None))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if isinstance(e.detail, dict):
            return SafeJSONResponse({"detail": e.detail}, status_code=e.status_code)
        message = str(e.detail) if e.detail else "error"
        if e.status_code == 404:
            message = f"no such page or resource: {request.url.path}"
        return error_response(ApiError(e.status_code, None, message))

    @app.exception_handler(Exception)
    async def _other(request: Request, e: Exception) -> JSONResponse:
        mapped = db_down(e)
        if mapped is not None:
            return error_response(mapped)
        log.error("dashboard request failed", exc_info=e, extra={"path": request.url.path})
        return error_response(
            ApiError(500, None, f"internal error ({type(e).__name__}); the dashboard's log has the details")
        )
