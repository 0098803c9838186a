"""A running round's learning curve, live: the TensorBoard scalars its trainer writes into
``<train.out>/round-N/tb`` (every trainer logs ``train/loss`` and friends there), read incrementally.

Only where the dashboard sees the worker's files (one machine, or a shared volume); elsewhere the curve
is the one the round records in its metrics when it finishes. TensorBoard's writer flushes every few
logged points (or 2 minutes), so the live curve trails training by that much.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from fleet.db import RoundRecord

MAX_POINTS = 200
"""Points per scalar in an answer (evenly thinned, the last one always kept)."""
RELOAD_S = 1.0


def tb_dir(rec: RoundRecord) -> Path | None:
    train = rec.config.get("train") if isinstance(rec.config, dict) else None
    out = train.get("out") if isinstance(train, dict) else None
    return Path(out) / f"round-{rec.id}" / "tb" if out else None


def _thin(points: list[list[float]], n: int = MAX_POINTS) -> list[list[float]]:
    if len(points) <= n:
        return points
    step = len(points) / (n - 1)
    return [points[int(i * step)] for i in range(n - 1)] + [points[-1]]


class LiveCurves:
    """One incremental TensorBoard reader per round (reloaded at most every ``RELOAD_S``)."""

    def __init__(self) -> None:
        self._readers: dict[int, tuple[Any, float]] = {}
        self._lock = threading.Lock()

    def curve(self, rec: RoundRecord) -> dict[str, list[list[float]]] | None:
        """``{tag: [[step, value], ...]}`` of the round's scalars, or None when its logs are not here."""
        path = tb_dir(rec)
        if path is None or not path.is_dir():
            return None
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        with self._lock:
            acc, loaded = self._readers.get(rec.id, (None, 0.0))
            if acc is None:
                acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
            if time.monotonic() - loaded >= RELOAD_S:
                acc.Reload()
                loaded = time.monotonic()
            self._readers[rec.id] = (acc, loaded)
            if len(self._readers) > 32:
                self._readers.pop(next(iter(self._readers)))
            tags = acc.Tags().get("scalars", [])
            return {t: _thin([[float(e.step), float(e.value)] for e in acc.Scalars(t)]) for t in tags}
