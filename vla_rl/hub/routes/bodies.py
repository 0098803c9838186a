"""Reading request bodies and query values, and writing paginated answers, the way every route does.

Every body is read under a limit from :class:`vla_rl.hub.limits.Limits` (a 413 names the setting), and
every parse runs in the threadpool, so a large or hostile body never stalls the event loop that answers the
other requests. Malformed input (bad JSON, nesting too deep for the parser, non-ASCII digits) is a 400.
Unknown fields are ignored, as on the Hub (the client adds fields across versions); a missing or mistyped
known field is a 400. Page numbers are ASCII digits up to :data:`MAX_PAGE`; a page past the end is empty.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from vla_rl.hub.limits import Limits
from vla_rl.hub.storage import BadRequest, HubError

_UINT = re.compile(r"[0-9]{1,18}")  # ASCII digits only: str.isdigit() also accepts '²', which int() refuses
MAX_PAGE = 10**9


def limits_of(request: Request) -> Limits:
    return request.app.state.hub.settings.limits


def too_large(limit: int, name: str, what: str = "request body over {limit} bytes") -> HubError:
    """The 413 for a body over ``limit``, naming the setting (``vla-rl hub serve`` flag) that sets it."""
    flag = "--" + name.replace("_", "-")
    return HubError(
        f"{what.format(limit=limit)} ({name}; raise it with 'vla-rl hub serve {flag}'; "
        "large files go through LFS)",
        status=413,
        code="PayloadTooLarge",
    )


def parse_uint(value: str, what: str) -> int:
    """A non-negative integer given as ASCII digits (at most 18), else BadRequest naming ``what``."""
    if not _UINT.fullmatch(value):
        raise BadRequest(f"invalid {what} {value[:40]!r}: expected a non-negative integer")
    return int(value)


def truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def base_url(request: Request) -> str:
    return str(request.base_url).rstrip("/")


def _check_declared(request: Request, limit: int, name: str) -> None:
    declared = request.headers.get("content-length")
    if declared is not None and _UINT.fullmatch(declared) and int(declared) > limit:
        raise too_large(limit, name)


async def stream_body(request: Request, limit: int, name: str) -> AsyncIterator[bytes]:
    """The body's chunks as they arrive; 413 as soon as more than ``limit`` bytes are declared or sent."""
    _check_declared(request, limit, name)
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise too_large(limit, name)
        if chunk:
            yield chunk


async def read_body(request: Request, limit: int | None = None, name: str = "max_json_bytes") -> bytes:
    """The whole body (for small bodies only), at most ``limit`` bytes (default: ``max_json_bytes``)."""
    if limit is None:
        limit = limits_of(request).max_json_bytes
    chunks = [chunk async for chunk in stream_body(request, limit, name)]
    return b"".join(chunks)


async def stream_lines(
    request: Request, limit: int, name: str, max_line: int, line_name: str
) -> AsyncIterator[bytes]:
    """The non-blank lines of an NDJSON body as they arrive, each at most ``max_line`` bytes (413 naming
    ``line_name`` otherwise). Only the current chunk and line are held, never the whole body."""
    buf = bytearray()
    async for chunk in stream_body(request, limit, name):
        start = len(buf)
        buf += chunk
        pos = 0
        while (nl := buf.find(b"\n", max(start, pos))) >= 0:
            with memoryview(buf) as view:
                line = bytes(view[pos:nl])  # one copy; the buffer is trimmed once per chunk, not per line
            pos = nl + 1
            if line and not line.isspace():
                yield line
        if pos:
            del buf[:pos]
        if len(buf) > max_line:
            raise too_large(max_line, line_name)
    if buf and not buf.isspace():
        yield bytes(buf)


def loads(raw: bytes | str, what: str = "request body") -> Any:
    """json.loads with every way it fails on bad input as a 400 (blocking: call it in the threadpool)."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"{what} is not valid JSON: {e}") from None
    except RecursionError:
        raise BadRequest(f"{what} is nested too deeply") from None


async def read_json(request: Request) -> Any:
    """The JSON body (``{}`` when empty), at most ``max_json_bytes``, parsed in the threadpool."""
    raw = await read_body(request)
    return await run_in_threadpool(loads, raw or b"{}")


def page_of(request: Request) -> int:
    """The page a listing asks for (query ``p``, from 0)."""
    page = parse_uint(request.query_params.get("p", "0") or "0", "page number 'p'")
    if page > MAX_PAGE:
        raise BadRequest(f"page number 'p' must be <= {MAX_PAGE}")
    return page


def page_response(request: Request, chunk: list[Any], page: int, more: bool, **next_params: str) -> Response:
    """One page of a listing, with a ``Link: rel="next"`` header (carrying ``next_params``) if more follow."""
    headers = {}
    if more:
        url = request.url.include_query_params(p=page + 1, **next_params)
        headers["Link"] = f'<{url}>; rel="next"'
    return JSONResponse(chunk, headers=headers)
