"""Request fields checked at the edge, so a bad request is a 422 naming its field, never a 500.

Text a route stores (a label's key, value and note, a round's fields, a ref) goes through the one
validator, :mod:`vla_rl.core.text` (valid Unicode, no control characters, bounded length), as pydantic
annotations on the request models: ``Line`` (one line), ``Text`` (tabs and newlines allowed),
``JSON_LINES`` / ``JSON_TEXT`` (every string of a JSON value). Numbers from outside that reach a query
are bounded to what a metadata DB's 64-bit integer holds (``RowId``, ``FRAME_MAX``; a larger one made
SQLite raise OverflowError). A ref the page asks to move is checked by :func:`movable_ref`.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Path
from pydantic import AfterValidator, ValidationInfo

from fleet.selection import MAX_DB_INT
from vla_rl.core.text import check_json_text, check_text
from vla_rl.dashboard.errors import ApiError
from vla_rl.hub.naming import validate_client_revision

MAX_TEXT_CHARS = 4096
"""Longest text of any stored request field (each field's own ``max_length`` is usually tighter)."""


def _line(value: str, info: ValidationInfo) -> str:
    return check_text(value, info.field_name or "text", max_chars=MAX_TEXT_CHARS)


def _text(value: str, info: ValidationInfo) -> str:
    return check_text(value, info.field_name or "text", max_chars=MAX_TEXT_CHARS, multiline=True)


def _json_lines(value: Any, info: ValidationInfo) -> Any:
    return check_json_text(value, info.field_name or "value", max_chars=MAX_TEXT_CHARS)


def _json_text(value: Any, info: ValidationInfo) -> Any:
    return check_json_text(value, info.field_name or "value", max_chars=MAX_TEXT_CHARS, multiline=True)


Line = Annotated[str, AfterValidator(_line)]
"""One line of text (no control character at all)."""
Text = Annotated[str, AfterValidator(_text)]
"""Free text: tabs and newlines allowed, no other control character."""
JSON_LINES = AfterValidator(_json_lines)
"""For ``Annotated[<a JSON type>, JSON_LINES]``: every string of the value (keys too) is one line."""
JSON_TEXT = AfterValidator(_json_text)
"""For ``Annotated[<a JSON type>, JSON_TEXT]``: every string of the value is free text (keys one line)."""

RowId = Annotated[int, Path(ge=1, le=MAX_DB_INT, description="a row id (1 .. 2^63-1)")]
"""A round number or label id in a path."""
FRAME_MAX = MAX_DB_INT
"""Largest frame index a request may name (a span's start and end)."""


def movable_ref(ref: str, field: str = "ref") -> str:
    """``ref`` if Promote / Rollback may move it: a valid branch or tag name (no ``..``, no control
    characters, at most 255 characters) other than ``main``, whose history must stay; else 422."""
    try:
        validate_client_revision(ref)
    except ValueError as e:
        raise ApiError(422, field, f"{field}: {e}", "a tag or branch name such as prod") from None
    if ref == "main":
        raise ApiError(
            422,
            field,
            f"{field}: main cannot be moved (it keeps the history)",
            "a tag or branch such as prod",
        )
    return ref
