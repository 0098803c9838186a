"""Where secrets come from: the environment or a file, never a command-line flag by default.

A command line is visible to every user of the machine (``ps``, ``/proc/PID/cmdline``); the environment
of another user's process and a mode-0600 file are not. Imports nothing of ours.
"""

from __future__ import annotations

import os
from pathlib import Path


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
