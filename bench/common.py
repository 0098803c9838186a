"""Shared bits for bench scripts: machine description, result files, tables, and the machine's load.

Every bench records its run's load the same way: a ``load`` field in its results, the
:meth:`LoadSampler.summary` of the 1-minute load average sampled while it ran (on a shared machine the
numbers mean little without it); :func:`loadavg` is the 1/5/15-minute triple at one instant, for the
before / after fields some results also keep."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": round(mem_gb, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def write_results(name: str, results: Any, out: Path | None = None) -> Path:
    path = out or RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({"bench": name, "machine": machine(), "results": results}, indent=2, default=str)
    )
    return path


def cached(path: Path, fn: Callable[[], Any]) -> Any:
    """``fn()``'s JSON-able result, computed once: read from ``path`` when an earlier run left it there."""
    if path.exists():
        return json.loads(path.read_text())
    res = fn()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2, default=str))
    return res


def table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [[str(x) for x in r] for r in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(header)]
    line = lambda r: "| " + " | ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])


def loadavg() -> list[float]:
    """The machine's 1, 5 and 15-minute load averages now, rounded to 2 decimals."""
    return [round(x, 2) for x in os.getloadavg()]


class LoadSampler:
    """The machine's 1-minute load average, sampled every ``every_s`` seconds in a daemon thread while a
    run goes on (``with LoadSampler() as load: ...``; then ``load.summary()``)."""

    def __init__(self, every_s: float = 30.0) -> None:
        if not every_s > 0:
            raise ValueError(f"every_s: expected > 0 seconds, got {every_s}")
        self.every_s = every_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="load-sampler", daemon=True)

    def _loop(self) -> None:
        while True:
            self.samples.append(os.getloadavg()[0])
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])

    def summary(self) -> dict[str, Any]:
        """Min, mean and max of the samples (None where none was taken) and how many."""
        xs = self.samples
        if not xs:
            return {"min": None, "mean": None, "max": None, "samples": 0}
        return {"min": min(xs), "mean": statistics.fmean(xs), "max": max(xs), "samples": len(xs)}
