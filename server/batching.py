"""Requests waiting for a batch (:class:`_Pending`), what the batcher hands back (:class:`_Result`) and
the latency window GetInfo reports."""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class _Pending:
    """One decoded request waiting for its batch."""

    state: np.ndarray
    cameras: dict[str, np.ndarray]
    instruction: str
    seed: int
    noise: np.ndarray | None
    deadline: float | None  # time.monotonic() after which nobody waits for the answer
    enqueued_ns: int
    peer: str = ""  # the connection it came on: one robot, for the adaptive batching wait
    future: concurrent.futures.Future[_Result] = field(default_factory=concurrent.futures.Future)


@dataclass(frozen=True)
class _Result:
    actions: np.ndarray
    commit: str
    n_exec: int
    batch_size: int
    queue_us: int
    inference_us: int
    uncertainty: float = float("nan")  # NaN = not available
    uncertainty_kind: str = ""


class LatencyWindow:
    """Answered requests' latencies over the last ``window_s`` seconds: p50 / p99 in ms and the request
    rate (over the last ``rate_window_s``), for GetInfo. Bounded: at most ``max_samples`` are kept (the
    oldest dropped first), so a busy server's window is the newest ``max_samples`` requests."""

    def __init__(self, window_s: float = 60.0, rate_window_s: float = 10.0, max_samples: int = 8192) -> None:
        self.window_s, self.rate_window_s = window_s, rate_window_s
        self._samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=max_samples)
        self._lock = threading.Lock()

    def add(self, latency_ms: float, now: float | None = None) -> None:
        with self._lock:
            self._samples.append((time.monotonic() if now is None else now, latency_ms))

    def summary(self, now: float | None = None) -> tuple[float, float, float]:
        """(p50 ms, p99 ms, requests per second); zeros when nothing was answered in the window."""
        now = time.monotonic() if now is None else now
        with self._lock:
            while self._samples and self._samples[0][0] < now - self.window_s:
                self._samples.popleft()
            samples = list(self._samples)
        if not samples:
            return 0.0, 0.0, 0.0
        lat = np.array([ms for _, ms in samples])
        recent = sum(1 for t, _ in samples if t >= now - self.rate_window_s)
        return float(np.percentile(lat, 50)), float(np.percentile(lat, 99)), recent / self.rate_window_s
