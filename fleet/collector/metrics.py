"""The collector's Prometheus metrics and per-robot accounts (``GetStats``)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

HIDDEN_ROBOT = "all"  # the robot label of every metric with metrics_robot_labels=False


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        p = "vla_rl_collector_"
        self.received = Counter(p + "frames_received", "frames received (any outcome)", ["robot"], registry=r)
        self.committed = Counter(
            p + "frames_committed", "frames made durable and acknowledged", ["robot"], registry=r
        )
        self.stored = Counter(
            p + "frames_stored", "frames written into the Zarr arrays", ["robot"], registry=r
        )
        self.writer_restarts = Counter(
            p + "store_writer_restarts", "store writer processes restarted after dying", registry=r
        )
        self.rejected = Counter(
            p + "frames_rejected", "frames in refused batches", ["robot", "code"], registry=r
        )
        self.duplicate = Counter(
            p + "frames_duplicate", "frames dropped as already stored", ["robot"], registry=r
        )
        self.messages_rejected = Counter(
            p + "messages_rejected", "refused messages", ["robot", "code"], registry=r
        )
        self.episodes = Counter(
            p + "episodes_closed", "episodes closed in the store", ["robot", "outcome"], registry=r
        )
        self.connected = Gauge(p + "robots_connected", "open robot streams", registry=r)
        self.pending = Gauge(p + "pending_bytes", "log bytes waiting for the store writers", registry=r)
        self.open_episodes = Gauge(p + "open_episodes", "episodes open in this collector", registry=r)
        self.backpressure = Counter(
            p + "backpressure_seconds", "time streams waited for the store", registry=r
        )
        self.store_retries = Counter(
            p + "store_write_retries",
            "store writes that failed with a retryable OS error (ENOSPC, ...) and were retried",
            registry=r,
        )
        self.episodes_expired = Counter(
            p + "episodes_expired", "idle episodes closed as aborted (episode_idle_timeout_s)", registry=r
        )
        self.open_logs = Gauge(p + "open_log_files", "write-ahead log descriptors held open", registry=r)
        self.durable = Histogram(
            p + "commit_seconds",
            "message received -> durable (log written)",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
            registry=r,
        )


@dataclass
class RobotAccount:
    frames_received: int = 0
    frames_committed: int = 0
    frames_stored: int = 0
    frames_rejected: int = 0
    frames_duplicate: int = 0
    episodes_closed: int = 0
    streams: int = 0
