"""Requests waiting for a batch (:class:`_Pending`, with its :class:`RTCRequest`), the bounded fair queue
they wait in and how a batch is picked from it (:class:`BatchQueue`), what the batcher hands back (:class:`_Result`) and the latency window
GetInfo reports."""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from dataclasses import dataclass, field

import grpc
import numpy as np

from server.config import DEFAULT_MAX_PEER_QUEUED
from vla_rl.core.rpc import RequestError


@dataclass(frozen=True)
class RTCRequest:
    """A request's real-time chunking: ``queued`` float32 [n, A] env-unit actions still queued for the
    steps from its observation's on, ``delay`` of them executed before the reply arrives."""

    delay: int
    queued: np.ndarray


@dataclass(frozen=True)
class RTCReport:
    """How real-time chunking shaped a reply (``ActResponse.rtc``)."""

    mode: str  # "guided" or "trained"
    delay: int
    queued: int
    execution_horizon: int = 0  # guided only
    max_guidance_weight: float = 0.0  # guided only


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
    rtc: RTCRequest | None = None  # real-time chunking asked for (None: a plain chunk)
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
    failure: float = float("nan")  # the failure predictor's score; NaN = none served
    failure_alarm: bool = False
    batch_us: int = 0  # forming the batch (initial noise, stacking)
    prefix_us: int = 0  # of inference_us: the model's encode_prefix; 0 = the model does not split
    denoise_us: int = 0  # of inference_us: the rest of the forward; 0 = the model does not split
    done_ns: int = 0  # time.perf_counter_ns() when the result was handed over (the handler's wake-up starts)
    rtc: RTCReport | None = None  # how real-time chunking shaped the chunk (None: it did not)


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


class BatchQueue:
    """The requests of one model waiting for a batch, and how a batch is picked from them.

    Bounded: ``max_queue`` requests in all and ``max_peer_queued`` per connection (peer); past either,
    :meth:`submit` raises RESOURCE_EXHAUSTED at once (backpressure, not unbounded latency). :meth:`take`
    gathers up to ``max_batch`` requests, waiting at most ``max_wait_us`` after the oldest arrived; with
    ``adaptive_wait`` it goes at once when every connection active within ``activity_window_s`` already
    has a request queued (waiting longer cannot grow the batch). When more wait than fit, the connections
    served least recently go first (:meth:`_pick`).

    ``cond`` is the queue's lock (reentrant): a holder of it knows no batch is being taken meanwhile, so
    :class:`server.slots.ModelSlot` swaps versions under it and reads the serving version in the same
    hold as :meth:`take`.
    """

    USAGE_HALF_LIFE_S = 1.0

    def __init__(
        self,
        name: str,
        *,
        max_batch: int,
        max_wait_us: int,
        max_queue: int,
        adaptive_wait: bool = True,
        activity_window_s: float = 1.0,
        max_peer_queued: int = DEFAULT_MAX_PEER_QUEUED,
    ) -> None:
        if max_batch < 1 or max_queue < 1 or max_wait_us < 0:
            raise ValueError(
                f"need max_batch >= 1, max_queue >= 1, max_wait_us >= 0; got {max_batch}, {max_queue}, {max_wait_us}"
            )
        self.name = name
        self.max_batch, self.max_wait_us, self.max_queue = max_batch, max_wait_us, max_queue
        self.adaptive_wait, self.activity_window_s = adaptive_wait, activity_window_s
        self.max_peer_queued = max_peer_queued
        self.rejected_full = 0  # requests refused RESOURCE_EXHAUSTED
        self.cond = threading.Condition(threading.RLock())
        self._queue: collections.deque[_Pending] = collections.deque()
        self._usage: dict[str, tuple[float, float]] = {}  # peer -> (decayed requests served, at time)
        self._last_seen: dict[str, float] = {}  # peer -> time.monotonic() of its last request
        self._queued_peers: collections.Counter[str] = collections.Counter()
        self._closed = False

    def submit(self, item: _Pending) -> None:
        """Queue ``item`` or raise RESOURCE_EXHAUSTED at once (UNAVAILABLE once closed)."""
        with self.cond:
            if self._closed:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, "server shutting down")
            if len(self._queue) >= self.max_queue:
                self.rejected_full += 1
                raise RequestError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"model {self.name!r}: request queue full ({self.max_queue} waiting); retry with backoff",
                )
            if self._queued_peers[item.peer] >= self.max_peer_queued:
                self.rejected_full += 1
                raise RequestError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"model {self.name!r}: this connection already has {self.max_peer_queued} requests "
                    "waiting (max_peer_queued); retry with backoff",
                )
            self._queue.append(item)
            self._last_seen[item.peer] = time.monotonic()
            self._queued_peers[item.peer] += 1
            self.cond.notify()

    def close(self) -> list[_Pending]:
        """Take no more requests; wake :meth:`take` (it returns None) and return what was waiting."""
        with self.cond:
            self._closed = True
            pending = list(self._queue)
            self._queue.clear()
            self.cond.notify_all()
        return pending

    def __len__(self) -> int:
        """Requests waiting for a batch (not yet picked for inference)."""
        with self.cond:
            return len(self._queue)

    def active_clients(self) -> int:
        """Connections that sent a request within the last ``activity_window_s`` (or have one queued)."""
        with self.cond:
            self._forget_idle_peers()
            return len(self._last_seen)

    def _forget_idle_peers(self) -> None:
        cutoff = time.monotonic() - self.activity_window_s
        for peer in [p for p, t in self._last_seen.items() if t < cutoff and not self._queued_peers[p]]:
            del self._last_seen[peer]
            del self._queued_peers[peer]

    def _nobody_else_expected(self) -> bool:
        """Every recently active connection already has a request queued: waiting longer cannot grow the
        batch (a closed-loop robot sends its next request only after this reply), so dispatch now."""
        self._forget_idle_peers()
        return all(self._queued_peers[p] for p in self._last_seen)

    def claim_lone(self, peer: str) -> bool:
        """Whether a request from ``peer`` may skip the queue and run at once: adaptive wait is on, nothing
        is queued and no other connection was active within ``activity_window_s`` (the batch it would
        get is itself alone). If so it counts as served, as if :meth:`take` had picked it."""
        with self.cond:
            if not self.adaptive_wait or self._queue or self._closed:
                return False
            self._forget_idle_peers()
            if any(p != peer for p in self._last_seen):
                return False
            now = time.monotonic()
            self._last_seen[peer] = now
            self._usage[peer] = (self._usage_of(peer, now) + 1.0, now)
            return True

    def take(self) -> list[_Pending] | None:
        """The next batch (blocks until a request waits); None once closed."""
        with self.cond:
            while not self._queue and not self._closed:
                self.cond.wait()
            if self._closed:
                return None
            # Gather up to max_batch, waiting at most max_wait_us after the oldest request arrived: a
            # crowd fills the batch without waiting. With adaptive_wait a lone robot (or a batch that
            # already holds every active robot) goes at once instead of paying max_wait_us.
            until = self._queue[0].enqueued_ns / 1e9 + self.max_wait_us / 1e6
            while len(self._queue) < self.max_batch and not self._closed:
                if self.adaptive_wait and self._nobody_else_expected():
                    break
                remaining = until - time.perf_counter_ns() / 1e9
                if remaining <= 0:
                    break
                self.cond.wait(remaining)
            batch = self._pick(min(self.max_batch, len(self._queue)))
            for item in batch:
                self._queued_peers[item.peer] -= 1
            return batch

    def _usage_of(self, peer: str, now: float) -> float:
        value, at = self._usage.get(peer, (0.0, now))
        return value * 0.5 ** ((now - at) / self.USAGE_HALF_LIFE_S)

    def _pick(self, n: int) -> list[_Pending]:
        """Take ``n`` queued requests. When more are waiting than fit, the connections served least
        recently (decayed count, half-life USAGE_HALF_LIFE_S) go first, FIFO among equals: a flood of
        requests from some connections (e.g. streams that never read their replies) cannot push a robot
        asking at its control rate behind them."""
        now = time.monotonic()
        if n >= len(self._queue):
            batch = list(self._queue)
            self._queue.clear()
        else:
            batch = self._least_served(n, now)
        for item in batch:
            self._usage[item.peer] = (self._usage_of(item.peer, now) + 1.0, now)
        return batch

    def _least_served(self, n: int, now: float) -> list[_Pending]:
        if len(self._usage) > 4 * self.max_queue:
            self._usage = {
                p: (self._usage_of(p, now), now) for p in self._usage if self._usage_of(p, now) > 0.01
            }
        items = list(self._queue)
        order = sorted(range(len(items)), key=lambda i: (self._usage_of(items[i].peer, now), i))
        chosen = set(order[:n])
        self._queue = collections.deque(it for i, it in enumerate(items) if i not in chosen)
        return [it for i, it in enumerate(items) if i in chosen]
