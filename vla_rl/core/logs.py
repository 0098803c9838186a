"""Structured logging for every vla-rl command: human-readable text or one JSON object per line.

Fields passed through ``extra={...}`` land as top-level keys in JSON mode and as ``key=value`` in
text mode, so ``log.info("recorded demos", extra={"episodes": 20})`` is greppable either way.

A text record is one line whatever its values hold: a value a client chose (a task, a robot id, an error
message quoting a request) may contain a newline, and written as is it would start a line of its own that
reads like another record. Control, line-separator and bidirectional-override characters in the message
and the values are written as escapes (``\\n``, ``\\u202e``), and a value with a space, a quote or an
``=`` is quoted, so ``key=value`` pairs cannot be forged either. Tracebacks keep their lines.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any

# Attributes every LogRecord has; anything else came from ``extra``.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


# C0 and C1 controls, line and paragraph separators, zero-width and bidirectional formatting characters.
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")
_NEEDS_QUOTES = re.compile(r'[\s"=]')


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD}


def _escape(text: str) -> str:
    """``text`` with every character that could break or disguise a log line written as an escape."""
    return _UNSAFE.sub(lambda m: f"\\u{ord(m[0]):04x}" if ord(m[0]) > 0xFF else f"\\x{ord(m[0]):02x}", text)


def _field(value: Any) -> str:
    """One ``key=value`` value: as is when plain, else quoted (JSON string syntax) and escaped."""
    text = str(value)
    if text and not _NEEDS_QUOTES.search(text) and not _UNSAFE.search(text):
        return text
    return _escape(json.dumps(text, ensure_ascii=False))


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **_extras(record),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        fields = " ".join(f"{_escape(str(k))}={_field(v)}" for k, v in _extras(record).items())
        line = f"{stamp} {record.levelname.lower():<7} {record.name}: {_escape(record.getMessage())}"
        line = f"{line}  {fields}" if fields else line
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    """Configure the root logger once, for a CLI process (logs go to stderr)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Simulator libraries are chatty at INFO.
    for noisy in ("mani_skill", "robosuite_logs", "sapien", "httpx", "urllib3", "sentence_transformers"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
