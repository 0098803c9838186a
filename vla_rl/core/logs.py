"""Structured logging for every vla-rl command: human-readable text or one JSON object per line.

Fields passed through ``extra={...}`` land as top-level keys in JSON mode and as ``key=value`` in
text mode, so ``log.info("recorded demos", extra={"episodes": 20})`` is greppable either way.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

# Attributes every LogRecord has; anything else came from ``extra``.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD}


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
        fields = " ".join(f"{k}={v}" for k, v in _extras(record).items())
        line = f"{stamp} {record.levelname.lower():<7} {record.name}: {record.getMessage()}"
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
