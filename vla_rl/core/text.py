"""Text from outside, checked before it is stored, and stored text made safe to send.

One validator for every route and service that stores text someone else typed (a label's value and note,
a round's fields, ...): :func:`check_text` refuses what is not valid Unicode (a lone UTF-16 surrogate such
as ``"\\ud800"``, which JSON can spell but UTF-8 cannot encode: stored, it made every later answer that
carried it fail), control characters (C0 and C1, DEL; a tab and a newline only where ``multiline``), the
bidirectional embedding / override / isolate controls (they make a shown text read differently from what
it is), and text over ``max_chars``; each refusal is a ValueError ``"<field>: ..."`` naming the field, the
character (as ``U+XXXX``) and where it is. :func:`check_json_text` does the same for every string of a JSON
value (keys too) and can bound the value's size as JSON.

Reads must not fail on what a database already holds (written before these checks, or by another tool):
:func:`safe_json` replaces lone surrogates with U+FFFD in every string of a value about to be sent.
Imports only the standard library.
"""

from __future__ import annotations

import json
import re
from typing import Any

_SURROGATES = "\ud800-\udfff"
_BIDI = "\u202a-\u202e\u2066-\u2069"
_REFUSED = re.compile(f"[\x00-\x1f\x7f-\x9f{_SURROGATES}{_BIDI}]")
_REFUSED_MULTILINE = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f{_SURROGATES}{_BIDI}]")
_LONE = re.compile(f"[{_SURROGATES}]")
_BIDI_CHARS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
REPLACEMENT = "\ufffd"


def _why(ch: str, at: int, multiline: bool) -> str:
    code = f"U+{ord(ch):04X}"
    if "\ud800" <= ch <= "\udfff":
        return f"a lone UTF-16 surrogate ({code}) at character {at} is not valid Unicode"
    kind = "bidirectional control" if ch in _BIDI_CHARS else "control"
    allowed = "free text may hold tabs and newlines, no other" if multiline else "one line of text holds no"
    return f"the {kind} character {code} at character {at} is not allowed ({allowed} control characters)"


def check_text(value: Any, field: str, *, max_chars: int, multiline: bool = False) -> str:
    """``value`` if it is a string of at most ``max_chars`` characters without anything refused (module
    docstring; ``multiline`` allows tab and newline); else ValueError ``"<field>: ..."``."""
    if not isinstance(value, str):
        raise ValueError(f"{field}: expected text, got {type(value).__name__}")
    if len(value) > max_chars:
        raise ValueError(f"{field}: expected at most {max_chars} characters, got {len(value)}")
    bad = (_REFUSED_MULTILINE if multiline else _REFUSED).search(value)
    if bad is not None:
        raise ValueError(f"{field}: {_why(bad.group(), bad.start(), multiline)}")
    return value


def check_json_text(
    value: Any, field: str, *, max_chars: int, max_json_chars: int | None = None, multiline: bool = False
) -> Any:
    """``value`` (a JSON value: None, bool, number, string, list, dict with string keys) if every string
    in it (keys too) passes :func:`check_text` with ``max_chars`` and, given ``max_json_chars``, it is at
    most that many characters as JSON; else ValueError naming the path of the bad part (``config.train.data``,
    ``value[2]``)."""
    _walk(value, field, max_chars, multiline)
    if max_json_chars is not None:
        size = len(json.dumps(value, ensure_ascii=False))
        if size > max_json_chars:
            raise ValueError(f"{field}: expected at most {max_json_chars} characters as JSON, got {size}")
    return value


def _walk(value: Any, where: str, max_chars: int, multiline: bool) -> None:
    if isinstance(value, str):
        check_text(value, where, max_chars=max_chars, multiline=multiline)
    elif isinstance(value, dict):
        for k, v in value.items():
            check_text(k, f"{where} (a key)", max_chars=max_chars)
            _walk(v, f"{where}.{k}", max_chars, multiline)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _walk(v, f"{where}[{i}]", max_chars, multiline)
    elif value is not None and not isinstance(value, bool | int | float):
        raise ValueError(f"{where}: expected a JSON value, got {type(value).__name__}")


def safe_text(text: str) -> str:
    """``text`` with every lone surrogate replaced by U+FFFD (what can be encoded as UTF-8)."""
    return _LONE.sub(REPLACEMENT, text) if _LONE.search(text) else text


def safe_json(value: Any) -> Any:
    """A copy of ``value`` with :func:`safe_text` applied to every string in it (dict keys too)."""
    if isinstance(value, str):
        return safe_text(value)
    if isinstance(value, dict):
        return {safe_json(k): safe_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [safe_json(v) for v in value]
    return value
