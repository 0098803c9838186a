"""Reading request bodies and query flags, and writing paginated answers, the way every route does."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from vla_rl.hub.storage import BadRequest, HubError

MAX_JSON_BYTES = 16 * 1024 * 1024


def truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def base_url(request: Request) -> str:
    return str(request.base_url).rstrip("/")


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HubError(f"request body over {limit} bytes", status=413)
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise HubError(f"request body over {limit} bytes", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request) -> Any:
    raw = await read_body(request, MAX_JSON_BYTES)
    try:
        return json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None


def paginated(request: Request, items: list[Any], page_size: int) -> Response:
    """Page ``p`` (query parameter, from 0) of ``items``, with a ``Link: rel="next"`` header if more follow."""
    raw_page = request.query_params.get("p", "0")
    page = int(raw_page) if raw_page.isdigit() else 0
    chunk = items[page * page_size : (page + 1) * page_size]
    headers = {}
    if (page + 1) * page_size < len(items):
        headers["Link"] = f'<{request.url.include_query_params(p=page + 1)}>; rel="next"'
    return JSONResponse(chunk, headers=headers)
