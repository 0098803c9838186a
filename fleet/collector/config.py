"""The collector's configuration: every knob of ``vla-rl collect`` and :class:`~fleet.collector.Collector`,
typed and validated once (:class:`CollectorConfig`).

Secrets are not part of it: the shared token and the per-robot tokens are passed to the collector
beside its config (``Collector(config, token=..., robot_tokens=...)``), so a config can be written to a
file (:meth:`CollectorConfig.to_dict`) without them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from fleet.codecs import CameraCodecs
from fleet.objstore import is_remote
from vla_rl.core import configs

MB = 1024 * 1024
DEFAULT_PORT = 50071
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # fullmatch only: `$` lets "id\n" through
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
_ZSTD_LEVELS = (-(1 << 17), 22)  # zstd's fast (negative) levels up to its strongest


@dataclass(frozen=True)
class CollectorConfig:
    """How a fleet collector listens, what it accepts and how it writes the store (no secrets).

    Sizes are in MiB (``*_mb``; the collector uses the ``*_bytes`` properties), durations in seconds.
    """

    store: Path
    """Episode store directory (created if missing), or s3://BUCKET/PREFIX (S3 credentials and endpoint
    from the environment: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL; needs --wal-dir
    and --db)."""
    db: str | None = None
    """Metadata DB URL; None = the SQLite file inside the store."""
    wal_dir: Path | None = None
    """Local directory of the write-ahead logs (and the lock); None = <store>/wal. Required with an
    s3:// store: the log stays on local disk, only whole chunks and commit records are uploaded."""
    host: str = "127.0.0.1"
    """Bind address (anything but loopback needs a token)."""
    port: int = DEFAULT_PORT
    """gRPC port (0 = any free port; printed on start)."""
    fsync: bool = False
    """fsync every acknowledged message (power-loss safe, slower)."""
    metrics_port: int | None = None
    """Serve Prometheus /metrics on this port (no authentication: it lists robot ids unless
    --no-metrics-robot-labels)."""
    metrics_host: str = "127.0.0.1"
    """Bind address of /metrics (loopback by default; anything else exposes it to the network)."""
    metrics_robot_labels: bool = True
    """Label per-robot metrics with the robot id (off: one label 'all', no robot ids in /metrics)."""
    robots: str | None = None
    """Comma-separated robot ids to accept; None = any."""
    chunk_len: int = 128
    """Frames per Zarr chunk."""
    camera_zstd_level: int = -3
    """zstd level of lossless camera arrays (-3: fast; 1 or 3: smaller files for more CPU, each level's
    size and cost: docs/benchmarks.md, Fleet collector)."""
    camera_codec: str = "lossless"
    """Codec of the camera arrays: lossless (zstd), jpeg or jpeg:QUALITY (1-100; lower is smaller:
    docs/store.md, Camera codecs), per camera CAMERA=CODEC, comma-separated: e.g. jpeg:90,wrist=lossless."""
    max_batch_frames: int = 64
    """Largest FrameBatch accepted."""
    max_pending_mb: float = 1024
    """Frame MB waiting for the store before robots are slowed."""
    store_writers: int = 1
    """Processes writing the logged frames into Zarr beside the one taking messages (0 = a thread in
    the collector's process, which then shares its one core)."""
    store_writer_nice: int = 10
    """How much lower the store writers' CPU priority is (0-19): intake and acks go first."""
    max_open_episodes_per_robot: int = 16
    """Episodes one robot may have open at once (more: StartEpisode is refused, RESOURCE_EXHAUSTED)."""
    episode_idle_timeout_s: float = 1800.0
    """An open episode with no message for this long is closed with outcome 'aborted' (frames kept)."""
    max_open_logs: int = 256
    """Write-ahead log file descriptors kept open (least recently used closed first, reopened on demand)."""
    max_camera_pixels: int = 1280 * 720
    """Largest camera (height x width) a robot's Hello may announce (larger: RESOURCE_EXHAUSTED)."""
    max_value_abs: float = 1e6
    """Largest |value| of a frame's state, action, proposed action and reward (larger: the batch is refused,
    INVALID_ARGUMENT naming the field); actions must also lie in the robot spec's action_range."""
    max_buffered_mb: float = 1024
    """Frame MB the store writers hold in memory in all (past it, idle episodes are flushed to Zarr); a
    Hello whose one chunk (--chunk-len frames) is larger is refused."""
    drain_timeout_s: float = 5.0
    """Longest a stop (SIGTERM, Ctrl-C) takes: writing buffered frames to Zarr is cut off after it.
    Nothing acknowledged is lost (it is in the log, replayed on the next start); robots resend the rest."""
    max_message_mb: float = 64
    """Largest gRPC message a robot may send (told to robots in Welcome; larger: RESOURCE_EXHAUSTED)."""
    max_streams: int = 256
    """Robot streams (and stats calls) served at once (more: RESOURCE_EXHAUSTED)."""
    idle_flush_s: float = 5.0
    """An episode nobody has sent to for this long has its buffered tail written to Zarr, so readers
    see it (durability has the log)."""
    store_retry_max_s: float = 30.0
    """Longest backoff between retries of a store write that failed for a full disk (ENOSPC, EDQUOT) or
    too many open files (the log keeps the data meanwhile)."""
    lease_ttl_s: float = 30.0
    """s3:// store: the collector's lease on the prefix lasts this long, renewed every third of it; a
    second collector takes over only once the holder stopped renewing for that long."""

    def __post_init__(self) -> None:
        _check_types(self)
        object.__setattr__(self, "store", Path(self.store))
        if self.wal_dir is not None:
            object.__setattr__(self, "wal_dir", Path(self.wal_dir))
        for name in ("host", "metrics_host"):
            if not getattr(self, name):
                raise ValueError(f"{name}: expected a bind address such as 127.0.0.1, got an empty string")
        if self.db is not None and not self.db.strip():
            raise ValueError("db: expected a database URL, or None for the SQLite file inside the store")
        for name, port in (("port", self.port), ("metrics_port", self.metrics_port)):
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{name}: expected 0..65535 (0 = any free port), got {port}")
        for rid in self._robot_ids():
            if not _ID_RE.fullmatch(rid):
                raise ValueError(
                    f"robots: expected comma-separated robot ids ({_ID_RE.pattern}), got {rid!r}"
                )
        for name, low in (
            ("chunk_len", 1),
            ("max_batch_frames", 1),
            ("max_open_episodes_per_robot", 1),
            ("max_open_logs", 1),
            ("max_camera_pixels", 1),
            ("max_streams", 1),
            ("store_writers", 0),
            ("drain_timeout_s", 0.0),
            ("episode_idle_timeout_s", 0.001),
            ("idle_flush_s", 0.001),
            ("store_retry_max_s", 0.001),
            ("lease_ttl_s", 0.001),
        ):
            value = getattr(self, name)
            if not (value >= low and math.isfinite(value)):
                what = " (0 = a thread in the collector's process)" if name == "store_writers" else ""
                raise ValueError(f"{name}: expected at least {low}{what}, got {value}")
        if not (math.isfinite(self.max_value_abs) and self.max_value_abs > 0):
            raise ValueError(f"max_value_abs: expected a positive finite number, got {self.max_value_abs}")
        for name in ("max_pending_mb", "max_buffered_mb", "max_message_mb"):
            value = getattr(self, name)
            if not (math.isfinite(value) and round(value * MB) >= 1):
                raise ValueError(f"{name}: expected a positive size in MiB, got {value}")
        if not 0 <= self.store_writer_nice <= 19:
            raise ValueError(f"store_writer_nice: expected 0..19, got {self.store_writer_nice}")
        if not _ZSTD_LEVELS[0] <= self.camera_zstd_level <= _ZSTD_LEVELS[1]:
            raise ValueError(
                f"camera_zstd_level: expected {_ZSTD_LEVELS[0]}..{_ZSTD_LEVELS[1]}, got {self.camera_zstd_level}"
            )
        try:
            CameraCodecs.parse(self.camera_codec)
        except ValueError as e:
            raise ValueError(f"camera_codec: {str(e).removeprefix('--camera-codec: ')}") from None
        if is_remote(self.store):
            # An object store: the log (and the lock) stay on local disk, the DB is a server.
            if self.wal_dir is None:
                raise ValueError(
                    f"wal_dir: an object-store episode store ({self.store_location}) keeps its write-ahead "
                    "log on local disk: give a local directory (--wal-dir)"
                )
            if not self.db:
                raise ValueError(
                    f"db: an object-store episode store ({self.store_location}) has no SQLite file beside "
                    "it: give the metadata DB's URL (--db postgresql://...)"
                )

    # ------------------------------------------------------------------ derived
    @property
    def store_location(self) -> str:
        """The store as text: a folder, or an object store's ``s3://bucket/prefix`` (``Path`` keeps only
        one slash of ``s3://``)."""
        text = str(self.store)
        if is_remote(text) and not text.startswith("s3://"):
            return "s3://" + text.removeprefix("s3:/")
        return text

    @property
    def allowed_robots(self) -> frozenset[str] | None:
        """The robot ids :attr:`robots` names; None = any robot."""
        ids = self._robot_ids()
        return frozenset(ids) if ids else None

    @property
    def camera_codecs(self) -> CameraCodecs:
        return CameraCodecs.parse(self.camera_codec)

    @property
    def max_pending_bytes(self) -> int:
        return round(self.max_pending_mb * MB)

    @property
    def max_buffered_bytes(self) -> int:
        return round(self.max_buffered_mb * MB)

    @property
    def max_message_bytes(self) -> int:
        return round(self.max_message_mb * MB)

    def _robot_ids(self) -> list[str]:
        return [r.strip() for r in (self.robots or "").split(",") if r.strip()]

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict[str, Any]:
        """Every field of :class:`CollectorConfig` (not a subclass's: the CLI's secrets), JSON-safe as
        :func:`vla_rl.core.configs.to_dict` writes it, the store as its URL: what :meth:`from_dict` reads."""
        names = {f.name for f in dataclasses.fields(CollectorConfig)}
        out = {k: v for k, v in configs.to_dict(self).items() if k in names}
        return out | {"store": self.store_location}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """A config from :meth:`to_dict`'s form (:func:`vla_rl.core.configs.from_dict`: unknown keys are
        refused by name, values checked against the field types)."""
        if isinstance(data, dict) and "store" not in data:
            raise ValueError("store: required (an episode store folder or s3://BUCKET/PREFIX)")
        return configs.from_dict(cls, data, "collector config")


_KINDS: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "str": (str,),
    "Path": (str, Path),
}


def _check_types(cfg: CollectorConfig) -> None:
    """Each field holds what its annotation says (a JSON file or a caller may hand anything)."""
    for f in dataclasses.fields(CollectorConfig):
        value = getattr(cfg, f.name)
        parts = [p.strip() for p in str(f.type).split("|")]
        if value is None and "None" in parts:
            continue
        ok = tuple(t for p in parts for t in _KINDS.get(p, ()))
        if not isinstance(value, ok) or (isinstance(value, bool) and bool not in ok):
            raise ValueError(f"{f.name}: expected {f.type}, got {type(value).__name__} {value!r}")
