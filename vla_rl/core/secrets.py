"""Where secrets come from: the environment or a file, never a command-line flag by default.

A command line is visible to every user of the machine (``ps``, ``/proc/PID/cmdline``); the environment
of another user's process and a mode-0600 file are not. Imports nothing of ours.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# scheme://user:PASSWORD@host... (a password ends at the first '@', as SQLAlchemy reads a URL)
_USERINFO_PASSWORD = re.compile(r"^(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:/@?#]*):(?P<password>[^@]*)@")
# ?password=... / &password=... (libpq takes the password as a query parameter too)
_QUERY_PASSWORD = re.compile(r"(?P<sep>[?&])password=[^&#]*", re.IGNORECASE)


def env_secret(*names: str) -> str | None:
    """The first of these environment variables that is set and non-empty."""
    return next((os.environ[n] for n in names if os.environ.get(n)), None)


def read_secret_file(path: str | os.PathLike[str]) -> str:
    """The secret kept in ``path``: one non-empty line, whitespace stripped. ValueError says what is wrong
    (unreadable, empty, more than one line)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or e
        raise ValueError(f"{path}: cannot read it ({type(e).__name__}: {reason})") from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path}: empty; put the secret alone on its first line")
    if len(lines) > 1:
        raise ValueError(f"{path}: expected the secret alone on one line, found {len(lines)} lines")
    return lines[0]


def shown_url(url: str) -> str:
    """``url`` as it may be shown, logged or returned: a password in it (``scheme://user:PASSWORD@host``,
    or a ``password=`` query parameter) replaced by ``***``. Any text works (nothing is parsed that could
    fail): a URL without a password comes back unchanged."""
    masked = _USERINFO_PASSWORD.sub(r"\g<head>:***@", url, count=1)
    return _QUERY_PASSWORD.sub(r"\g<sep>password=***", masked)


def url_without_password(url: str) -> str:
    """``url`` with its password removed (not masked: what a record may keep and a reader that has the
    credentials, e.g. a round worker's own DB connection, can match against its own URL)."""
    bare = _USERINFO_PASSWORD.sub(r"\g<head>@", url, count=1)
    bare = _QUERY_PASSWORD.sub(lambda m: "?" if m["sep"] == "?" else "", bare)
    return bare.replace("?&", "?").rstrip("?")
