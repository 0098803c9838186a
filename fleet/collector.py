"""Fleet collector: many robots stream frames, segments and outcomes into one episode store, exactly once.

Wire contract: ``packages/vla-rl-client/vla_rl_client/proto/collector.proto``. A robot opens a stream, says who it is (``Hello``: robot
id, task, robot spec), then sends episodes: ``StartEpisode``, ``SegmentMarker`` (who is in control from
which frame, and why), ``FrameBatch`` (consecutive frames with the index of the first, ``seq``) and
``EndEpisode`` (outcome). Every message is answered in order with an ``Ack`` (what is durable for that
episode) or a ``Reject`` (nothing of it was stored; the message names the field).

How "exactly once" and "ack only when durable" are kept, cheaply:

* **Write-ahead log, then Zarr.** An accepted message is appended to the episode's log
  (``<store>/wal/<episode_id>.wal``, see ``fleet/wal.py``: length + CRC32 + the message bytes; fsynced
  first with ``fsync=True``) and acknowledged. A store writer process (``fleet/store_writer.py``;
  ``store_writers``, default 1) then reads the log back and feeds the frames to the episode's
  :class:`~fleet.store.EpisodeWriter`, which writes chunk-aligned blocks and commits them in
  ``commit.json``. The collector tells it only "the log of E is written up to byte B"; frame data never
  crosses a pipe. Committing every small batch straight into Zarr would cost ~3 ms of CPU per array
  per commit (each partial chunk is read, decompressed, recompressed and rewritten: 12 arrays, ~40 ms
  per commit), far too much for 16 robots at 30 Hz with acks under 100 ms on two cores. And the Zarr
  writes (~0.5-0.6 ms of CPU per frame of two 224 px cameras) run beside the intake, not under its GIL:
  in one process both shared one core and acks queued for seconds at 16 robots x 30 Hz. The writer runs
  at a lower CPU priority (``store_writer_nice``, default 10): its work can wait (the log holds it, and
  backpressure bounds it), acks cannot, so when the cores are busy the intake goes first. A writer that
  dies is restarted and replays its episodes' logs from their Zarr commits.
* **Sequence numbers are frame indices.** A frame's seq is its index in its episode, so what is durable
  is one number per episode: ``committed`` = frames in the log (Zarr holds a prefix of them). A batch
  below it is a duplicate (acknowledged, dropped), one that overlaps it is trimmed, one beyond it is a
  gap and is refused (streams are ordered, so the reorder window is zero).
* **Restart = replay.** On start, every log of an open episode is replayed from the Zarr commit on
  (a torn last record, which was never acknowledged, is cut off); a robot that reconnects re-sends
  ``StartEpisode`` and everything not acknowledged, and duplicates are dropped against that state.
  Once an episode is closed in the store its log is deleted.
* **Backpressure.** Log bytes waiting for the store writers are bounded; past the bound a stream
  is not read until they catch up, so gRPC flow control slows the robots (whose clients keep what is
  not acknowledged) instead of the collector growing without bound.

Security: the stream and stats calls need ``authorization: Bearer <token>`` when a token is set;
without one the collector refuses to bind anything but loopback. Nothing is ever unpickled. With
``robot_tokens`` (``--robot-tokens-file``) each credential is bound to one robot id: its ``Hello`` may
only name that robot (else ``PERMISSION_DENIED``), and its ``GetStats`` shows that robot alone. The
shared token (if any) stays the operator's: it may speak as any robot. ``/metrics`` has no
authentication: it binds ``metrics_host`` (loopback by default) and ``metrics_robot_labels=False``
keeps robot ids out of it.

Limits (each a ``Collector`` argument and a ``vla-rl collect`` flag; a refusal names its limit):

* Every size a ``FrameBatch`` declares is checked before anything is counted or allocated
  (:func:`fleet.wal.batch_size`); undecodable messages get a ``Reject`` (``INVALID_ARGUMENT``), logged
  once per peer a minute.
* ``max_open_episodes_per_robot`` (16): more open at once is ``RESOURCE_EXHAUSTED``.
* ``episode_idle_timeout_s`` (1800): an episode without a message for that long is ended by the
  collector with outcome ``aborted`` (success false); its frames are kept.
* ``max_open_logs`` (256): log descriptors are a pool (least recently used closed, reopened on
  demand), so open episodes cost no descriptor and a restart with many logs needs none per log.
* ``max_camera_pixels`` (1280 x 720) per camera of a ``Hello``; ``max_buffered_bytes`` (1 GiB): the
  frame blocks a store writer holds, all episodes together (past it, least recently used episodes are
  flushed to Zarr and let go).
* A store write failing with ENOSPC / EDQUOT / EMFILE / ENFILE is retried with a backoff doubling up
  to ``store_retry_max_s`` (metric ``store_write_retries``); other store errors fail the episode.
* ``lease_ttl_s`` (30): on an object store, the collector holds ``<prefix>/.collector-lease``
  (:class:`fleet.objstore.StoreLease`), renewed every third of it; a second collector on the same
  prefix refuses to start naming the holder, and takes over only once the holder stopped renewing for
  that long.
* ``drain_timeout_s`` (5): the most :meth:`Collector.stop` (SIGTERM) takes. Past it the store writers
  are killed: everything acknowledged is in the log and is replayed on the next start; what was not
  acknowledged the robots resend.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import fcntl
import functools
import hmac
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from vla_rl_client.codec import from_tensor, to_tensor
from vla_rl_client.proto import collector_pb2 as pb
from vla_rl_client.spec import RobotSpec, SpecError
from vla_rl_client.wire import WireTensor, keep_freed_memory

from fleet.codecs import CameraCodecs
from fleet.db import MetadataDB
from fleet.objstore import StoreLease, is_remote
from fleet.store import EpisodeStore
from fleet.store_writer import DEFAULT_MAX_BUFFERED_BYTES, StoreWriter
from fleet.wal import (
    SEGMENT_KINDS,
    WAL_DIR,
    LogFiles,
    Unavailable,
    WriteAheadLog,
    batch_size,
    decode_frames,
    frames_declared,
    parse_message,
)
from vla_rl.core.secrets import read_secret_file
from vla_rl.core.version import __version__

log = logging.getLogger("vla_rl.collector")

DEFAULT_PORT = 50071
DEFAULT_MAX_BATCH_FRAMES = 64
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_PENDING_BYTES = 1024 * 1024 * 1024
DEFAULT_MAX_OPEN_EPISODES_PER_ROBOT = 16
DEFAULT_EPISODE_IDLE_TIMEOUT_S = 1800.0
DEFAULT_MAX_OPEN_LOGS = 256
DEFAULT_MAX_CAMERA_PIXELS = 1280 * 720
DEFAULT_DRAIN_TIMEOUT_S = 5.0
ABORTED = "aborted"  # outcome of an episode closed by the collector after episode_idle_timeout_s
HIDDEN_ROBOT = "all"  # the robot label of every metric with metrics_robot_labels=False
LOCK_FILE = "collector.lock"
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Collector"].full_name
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
SC = grpc.StatusCode


class RequestError(Exception):
    """A message is refused (a ``Reject`` with this code; nothing of it is stored)."""

    def __init__(self, code: grpc.StatusCode, message: str, episode_id: str = "") -> None:
        self.code = code
        self.message = message
        self.episode_id = episode_id
        super().__init__(f"{code.name}: {message}")


# ------------------------------------------------------------------------------------------ state
@dataclass
class _Episode:
    """One open episode: its log, the store writer that turns the log into Zarr, and what is durable."""

    id: str
    robot_id: str
    spec: RobotSpec
    wal: WriteAheadLog
    committed: int  # frames durable in the log (= the next seq expected)
    segments: int  # segments durable in the log
    last_ts: float
    writer: int = 0  # index of the store writer that owns it
    applied: int = 0  # log bytes the writer has applied
    stored: int = 0  # frames committed in Zarr
    ended: bool = False
    closed: bool = False
    error: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_op: float = field(default_factory=time.monotonic)
    flush_sent: int = -1  # ``committed`` when the last idle flush was asked for
    retry_at: float | None = None  # a failed store write is retried then (monotonic time)
    backoff_s: float = 0.0  # the last retry delay (doubles up to store_retry_max_s)


@dataclass
class _Session:
    """One stream: the robot it announced."""

    robot_id: str = ""
    identity: str | None = None  # the robot its credential is bound to (None: the shared token)
    peer: str = ""
    task: str = ""
    spec: RobotSpec | None = None
    raw: bytes | None = None  # the message being handled, as received
    cameras: dict[str, WireTensor] | None = None  # its cameras, when parse_message split them off


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


# ------------------------------------------------------------------------------------------ collector
class Collector:
    """The service behind ``vla-rl collect`` (use :meth:`start` / :meth:`stop`, or as a context manager)."""

    def __init__(
        self,
        store: str | os.PathLike[str],
        db_url: str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        token: str | None = None,
        fsync: bool = False,
        chunk_len: int = 128,
        camera_zstd_level: int | None = -3,
        camera_codec: str | None = None,
        max_batch_frames: int = DEFAULT_MAX_BATCH_FRAMES,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        store_writers: int = 1,
        store_writer_nice: int = 10,
        max_streams: int = 256,
        allowed_robots: set[str] | None = None,
        idle_flush_s: float = 5.0,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        metrics_robot_labels: bool = True,
        robot_tokens: Mapping[str, str] | None = None,
        max_open_episodes_per_robot: int = DEFAULT_MAX_OPEN_EPISODES_PER_ROBOT,
        episode_idle_timeout_s: float = DEFAULT_EPISODE_IDLE_TIMEOUT_S,
        max_open_logs: int = DEFAULT_MAX_OPEN_LOGS,
        max_camera_pixels: int = DEFAULT_MAX_CAMERA_PIXELS,
        max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        store_retry_max_s: float = 30.0,
        wal_dir: str | os.PathLike[str] | None = None,
        lease_ttl_s: float = 30.0,
    ) -> None:
        robot_tokens = dict(robot_tokens or {})
        if not token and not robot_tokens and host not in _LOOPBACK:
            raise ValueError(
                f"refusing to accept unauthenticated robots on {host}: pass a token or robot tokens"
            )
        for name, value, low in (
            ("max_open_episodes_per_robot", max_open_episodes_per_robot, 1),
            ("max_open_logs", max_open_logs, 1),
            ("max_camera_pixels", max_camera_pixels, 1),
            ("max_buffered_bytes", max_buffered_bytes, 1),
            ("episode_idle_timeout_s", episode_idle_timeout_s, 0.001),
            ("drain_timeout_s", drain_timeout_s, 0.0),
            ("store_retry_max_s", store_retry_max_s, 0.001),
            ("lease_ttl_s", lease_ttl_s, 0.001),
        ):
            if not value >= low:
                raise ValueError(f"{name}: expected at least {low}, got {value}")
        for rid, tok in robot_tokens.items():
            if not _ID_RE.match(rid) or not tok:
                raise ValueError(f"robot_tokens: expected robot id -> non-empty token, got {rid!r}")
        if store_writers < 0:
            raise ValueError(
                f"store_writers: expected 0 (a thread in this process) or more, got {store_writers}"
            )
        if not 0 <= store_writer_nice <= 19:
            raise ValueError(f"store_writer_nice: expected 0..19, got {store_writer_nice}")
        self.host, self.port = host, port
        self.token = token
        self.chunk_len = chunk_len
        self.camera_zstd_level = camera_zstd_level
        self.camera_codecs = CameraCodecs.parse(camera_codec)  # a bad value fails here, at start-up
        self.max_batch_frames = max_batch_frames
        self.max_message_bytes = max_message_bytes
        self.max_pending_bytes = max_pending_bytes
        self.max_streams = max_streams
        self.allowed_robots = allowed_robots
        self.idle_flush_s = idle_flush_s
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self.metrics_robot_labels = metrics_robot_labels
        # Bearer credential -> the robot it speaks for (hmac-compared in authorize).
        self.robot_tokens = robot_tokens
        self.max_open_episodes_per_robot = max_open_episodes_per_robot
        self.episode_idle_timeout_s = episode_idle_timeout_s
        self.max_camera_pixels = max_camera_pixels
        self.max_buffered_bytes = max_buffered_bytes
        self.drain_timeout_s = drain_timeout_s
        self.store_retry_max_s = store_retry_max_s
        self.log_files = LogFiles(max_open_logs)
        self._undecodable = _RateLimitedLog(60.0)  # per peer
        self._refused = _RateLimitedLog(10.0)  # per peer and code
        if is_remote(store):
            # An object store: the log (and the lock) stay on local disk, the DB is a server.
            if wal_dir is None:
                raise ValueError(
                    f"wal_dir: an object-store episode store ({store}) keeps its write-ahead log on local "
                    "disk: give a local directory (--wal-dir)"
                )
            if not db_url:
                raise ValueError(
                    f"db_url: an object-store episode store ({store}) has no SQLite file beside it: give "
                    "the metadata DB's URL (--db postgresql://...)"
                )
        self.db = MetadataDB(db_url) if db_url else MetadataDB.for_store(store)
        self.store = EpisodeStore(store, create=True, fsync=fsync, db=self.db)
        self.wal_dir = Path(wal_dir).absolute() if wal_dir is not None else self.store.root / WAL_DIR
        self.wal_dir.mkdir(parents=wal_dir is not None, exist_ok=True)
        # The lock beside what it guards: the store's folder, or (object store) the local log.
        self._lock_path = (self.store.root if self.store.remote is None else self.wal_dir) / LOCK_FILE
        self.fsync = fsync
        self.metrics = _Metrics()
        self.accounts: dict[str, RobotAccount] = collections.defaultdict(RobotAccount)
        self._connected: dict[str, int] = collections.defaultdict(int)
        self._episodes: dict[str, _Episode] = {}
        self._episodes_lock = threading.Lock()
        # One lock per episode id being started: two streams of one robot must not create or resume an
        # episode twice, while different episodes (a fleet starting together) are created in parallel.
        self._start_locks: dict[str, tuple[threading.Lock, int]] = {}  # eid -> (lock, threads using it)
        self._start_locks_guard = threading.Lock()
        self._pending_bytes = 0
        self._room = threading.Condition()
        self.store_writers = store_writers
        self.store_writer_nice = store_writer_nice
        self._writers: list[_WriterHandle] = []
        self._writer_deaths: list[float] = []
        self._dead_writers: set[int] = set()
        self._next_writer = 0
        self._stop = threading.Event()
        self._lock_fd: int | None = None
        self.lease_ttl_s = lease_ttl_s
        self.lease: StoreLease | None = None  # an object store's one-writer lease (see _lock_store)
        self._server: _AioServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._metrics_server: Any = None
        self._flusher: threading.Thread | None = None

    # -------------------------------------------------------------- lifecycle
    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> Collector:
        """Lock the store, replay the logs of open episodes, then serve (returns once the port is bound)."""
        self._lock_store()
        try:
            self._writers = [self._new_writer(i) for i in range(max(self.store_writers, 1))]
            self.recover()
        except BaseException:
            self._stop_writers()
            self._unlock_store()
            raise
        opts = [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", 4 * 1024 * 1024),
            ("grpc.so_reuseport", 0),
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ]
        # grpc.aio: every stream is a coroutine on one event loop thread. The thread-per-stream server
        # hands each message between threads (~17% more CPU per message, measured in isolation).
        self._loop = _aio_loop()
        try:
            self.port = self._run_in_loop(self._serve(opts))
        except BaseException:
            self._stop_writers()
            self._unlock_store()
            raise
        if self.metrics_port is not None:
            from prometheus_client import start_http_server

            # /metrics has no authentication: it binds metrics_host (loopback by default), and
            # metrics_robot_labels=False keeps robot ids out of it.
            self._metrics_server, _ = start_http_server(
                self.metrics_port, addr=self.metrics_host, registry=self.metrics.registry
            )
            self.metrics_port = self._metrics_server.server_port
        self._flusher = threading.Thread(
            target=self._flush_idle_loop, name="collector-idle-flush", daemon=True
        )
        self._flusher.start()
        if not self.token:
            log.warning("no token: any local process can stream into the store (pass --token)")
        log.info(
            "collector listening",
            extra={"address": self.address, "store": str(self.store.root), "metrics_port": self.metrics_port},
        )
        return self

    def _run_in_loop(self, coro: Coroutine[Any, Any, Any]) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _serve(self, opts: list[tuple[str, Any]]) -> int:
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        assert self._loop is not None
        server = grpc.aio.server(options=opts, maximum_concurrent_rpcs=self.max_streams)
        server.add_generic_rpc_handlers((_Service(self).handler(),))
        hs = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        try:
            port = server.add_insecure_port(f"{self.host}:{self.port}")
        except RuntimeError:
            port = 0
        if port == 0:
            raise OSError(f"could not bind the collector to {self.host}:{self.port}")
        await server.start()
        for name in ("", SERVICE_NAME):
            await hs.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server = _AioServer(server, self._loop)
        return port

    def stop(self, drain_timeout_s: float | None = None) -> None:
        """Stop taking messages, then write what was received into the store (episodes stay open), for
        at most ``drain_timeout_s`` (default: the collector's ``drain_timeout_s``) in all.

        Past the bound the store writers are killed. Nothing acknowledged is lost: it is in the
        write-ahead log, which the next start replays into Zarr. Messages not yet acknowledged are
        resent by the robots (their clients keep them) and duplicates are dropped.
        """
        bound = self.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        deadline = time.monotonic() + bound
        self._stop.set()
        if self._server is not None:
            self._server.stop(min(1.0, bound / 2)).wait(bound / 2 + 1.0)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        self._stop_writers(deadline)  # each flushes its open episodes, then exits (or is killed)
        with self._episodes_lock:
            eps = list(self._episodes.values())
        for ep in eps:
            if not ep.closed:
                ep.wal.close()
        self.db.close()
        self._unlock_store()

    def _stop_writers(self, deadline: float | None = None) -> None:
        self._stop.set()
        if deadline is None:
            deadline = time.monotonic() + self.drain_timeout_s
        for w in self._writers:
            w.post({"op": "stop"})
        for w in self._writers:
            w.join(max(deadline - time.monotonic(), 0.05))

    def __enter__(self) -> Collector:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _lock_store(self, wait_s: float = 5.0) -> None:
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        # Store writer processes inherit the lock, so a killed collector's writer still holds it until
        # it has noticed and exited (at most one block write later): wait that long, not forever.
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                os.close(fd)
                raise RuntimeError(
                    f"another collector is using {self.store.root} (two writers would corrupt open episodes)"
                ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd
        if self.store.remote is not None:
            # The local lock guards this machine's log only; collectors on two machines must not share
            # a prefix either: the lease object on the store refuses the second (fleet.objstore.StoreLease).
            try:
                self.lease = StoreLease(self.store.remote, self.wal_dir, self.lease_ttl_s).acquire()
            except BaseException:
                self._lock_fd = None
                os.close(fd)
                raise

    def _unlock_store(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    # -------------------------------------------------------------- recovery
    def recover(self) -> None:
        """Replay every log left by a previous run: open episodes come back with all their durable frames."""
        for path in sorted(self.wal_dir.glob("*.wal")):
            eid = path.stem
            try:
                meta = self.store.read_metadata(eid)
            except KeyError:
                log.warning(
                    "log without an episode (creation was interrupted); removed", extra={"episode": eid}
                )
                path.unlink()
                continue
            if meta.is_closed:
                # Closed in the store but the log survived (killed right after closing): the DB may not
                # have heard of the close yet (recording it again is harmless).
                self.db.record_episode_closed(meta)
                path.unlink()
                continue
            ep = self._resume(eid, meta.robot_id, meta.spec)
            log.info(
                "episode recovered",
                extra={"episode": eid, "robot": meta.robot_id, "frames": ep.committed, "ended": ep.ended},
            )

    def _resume(self, eid: str, robot_id: str, spec: RobotSpec) -> _Episode:
        """Open an episode that exists in the store: read what its log holds (caller holds no lock).

        A store writer then replays the log into Zarr from the commit on (what is committed is skipped).
        """
        meta = self.store.read_metadata(eid)
        # A collector killed between writing the episode's commit record and its DB row left it out of
        # the DB; (re)recording the open row from the store's committed state is idempotent.
        self.db.record_episode_open(meta, str(self.store.root))
        path = self.wal_dir / f"{eid}.wal"
        records: list[bytes] = []
        if path.exists():
            records, good = WriteAheadLog.read(path)
            if good < path.stat().st_size:
                log.warning(
                    "cut a torn record off the log (it was never acknowledged)",
                    extra={"episode": eid, "bytes": path.stat().st_size - good},
                )
                with open(path, "r+b") as f:
                    f.truncate(good)
        committed, segments, ended, last_ts = meta.length, len(meta.segments), False, -math.inf
        for raw in records:
            msg, _ = parse_message(raw)
            body = msg.WhichOneof("body")
            if body == "segment":
                segments = max(segments, msg.segment.index + 1)
            elif body == "frames":
                fb = msg.frames
                committed = max(committed, fb.seq + int(fb.action.shape[0]))
                last_ts = float(from_tensor(fb.timestamp, "frames.timestamp")[-1])
            elif body == "end":
                ended = True
        if last_ts == -math.inf and meta.length:  # no frames in the log: the last committed one's time
            last_ts = float(self.store.read_episode(eid, cameras=False).timestamp[-1])
        ep = _Episode(
            id=eid,
            robot_id=robot_id,
            spec=spec,
            wal=WriteAheadLog(path, self.fsync, self.log_files),
            committed=committed,
            segments=segments,
            last_ts=last_ts,
            ended=ended,
            writer=self._assign_writer(),
            stored=meta.length,
        )
        with self._episodes_lock:
            self._episodes[eid] = ep
            self.metrics.open_episodes.set(len(self._episodes))
        with ep.lock:
            self._hand_off(ep, ep.wal.size)
        return ep

    # -------------------------------------------------------------- handling messages
    def authorize(self, metadata: Any) -> str | None:
        """Check the caller's credential: the robot id it is bound to (a per-robot token), or None when
        it may speak as any robot (the shared token, or no authentication configured)."""
        if not self.token and not self.robot_tokens:
            return None
        got = ""
        for key, value in metadata or ():
            if key == "authorization":
                got = value if isinstance(value, str) else value.decode()
        presented = got.encode()
        if self.token and hmac.compare_digest(presented, f"Bearer {self.token}".encode()):
            return None
        robot = None
        for rid, tok in self.robot_tokens.items():  # every entry compared: the time says nothing
            if hmac.compare_digest(presented, f"Bearer {tok}".encode()):
                robot = rid
        if robot is not None:
            return robot
        raise RequestError(
            SC.UNAUTHENTICATED,
            "authorization: expected metadata 'authorization: Bearer <token>'"
            + (", got a wrong token" if got else ", got none"),
        )

    def _label(self, robot: str) -> str:
        """A metric's robot label (metrics_robot_labels=False: one label for all robots)."""
        return robot if self.metrics_robot_labels else HIDDEN_ROBOT

    def handle(
        self,
        session: _Session,
        msg: pb.RobotMessage,
        raw: bytes | None = None,
        cameras: dict[str, WireTensor] | None = None,
    ) -> pb.CollectorMessage:
        """One message of a stream -> its reply. Raises :class:`Unavailable` to end the stream.

        ``raw`` is the message as received; the log stores it as is (re-serialising a message with two
        224 px camera batches costs ~1 ms of CPU per frame). ``cameras``: see :func:`parse_message`.
        """
        session.raw, session.cameras = raw, cameras
        body = msg.WhichOneof("body")
        try:
            if body == "frames":
                # Every declared size against its bound before anything is counted or allocated.
                if frames_declared(msg) > self.max_batch_frames:
                    raise RequestError(
                        SC.RESOURCE_EXHAUSTED,
                        f"frames: at most {self.max_batch_frames} frames per batch (max_batch_frames), "
                        f"got {frames_declared(msg)}; split it",
                    )
                batch_size(msg.frames, self.max_batch_frames, cameras)
            if body == "hello":
                return self._hello(session, msg)
            if session.spec is None:
                raise RequestError(
                    SC.FAILED_PRECONDITION, "hello: expected a Hello (robot id, task, spec) first"
                )
            if body == "start":
                return self._start(session, msg)
            if body in ("frames", "segment", "end"):
                return self._episode_message(session, msg, body)
            raise RequestError(SC.INVALID_ARGUMENT, "body: expected hello, start, frames, segment or end")
        except RequestError as e:
            return self._reject(session, msg, e)
        except SpecError as e:
            return self._reject(session, msg, RequestError(SC.INVALID_ARGUMENT, str(e)))

    def undecodable(
        self, session: _Session, e: BaseException, msg: pb.RobotMessage | None = None
    ) -> pb.CollectorMessage:
        """The reply to a message that could not be decoded (logged once per peer per minute)."""
        body = msg.WhichOneof("body") if msg is not None else None
        where = f"{body}" if body else "message"
        text = f"{where}: not a RobotMessage that can be decoded ({type(e).__name__}: {str(e)[:200]})"
        robot = session.robot_id or "unknown"
        self.metrics.messages_rejected.labels(self._label(robot), SC.INVALID_ARGUMENT.name).inc()
        self._undecodable.warning(
            session.peer or robot, "undecodable message refused", robot=robot, error=text
        )
        return pb.CollectorMessage(
            reject=pb.Reject(
                msg_id=msg.msg_id if msg is not None else 0,
                episode_id=_episode_of(msg) if msg is not None else "",
                code=SC.INVALID_ARGUMENT.value[0],
                message=text,
            )
        )

    def _reject(self, session: _Session, msg: pb.RobotMessage, e: RequestError) -> pb.CollectorMessage:
        robot = session.robot_id or "unknown"
        code = e.code.name
        self.metrics.messages_rejected.labels(self._label(robot), code).inc()
        n = frames_declared(msg)
        if n > 0:  # frames_declared: 0 for a negative or absurd leading dim
            self.metrics.received.labels(self._label(robot)).inc(n)
            self.metrics.rejected.labels(self._label(robot), code).inc(n)
            self.accounts[robot].frames_received += n
            self.accounts[robot].frames_rejected += n
        eid = e.episode_id or _episode_of(msg)
        self._refused.warning(
            f"{session.peer or robot} {code}",
            "message refused",
            robot=robot,
            episode=eid,
            code=code,
            error=e.message,
        )
        return pb.CollectorMessage(
            reject=pb.Reject(msg_id=msg.msg_id, episode_id=eid, code=e.code.value[0], message=e.message)
        )

    def _hello(self, session: _Session, msg: pb.RobotMessage) -> pb.CollectorMessage:
        h = msg.hello
        if not _ID_RE.match(h.robot_id):
            raise RequestError(
                SC.INVALID_ARGUMENT, f"hello.robot_id: expected {_ID_RE.pattern}, got {h.robot_id!r}"
            )
        if session.identity is not None and h.robot_id != session.identity:
            raise RequestError(
                SC.PERMISSION_DENIED,
                f"hello.robot_id: this credential is robot {session.identity!r}'s, not {h.robot_id!r}'s",
            )
        if self.allowed_robots is not None and h.robot_id not in self.allowed_robots:
            raise RequestError(
                SC.PERMISSION_DENIED, f"hello.robot_id: {h.robot_id!r} is not a known robot of this collector"
            )
        if session.robot_id and session.robot_id != h.robot_id:
            raise RequestError(
                SC.FAILED_PRECONDITION, f"hello.robot_id: this stream is robot {session.robot_id!r}"
            )
        if not h.task or len(h.task) > 256:
            raise RequestError(SC.INVALID_ARGUMENT, "hello.task: expected a task id (1-256 characters)")
        try:
            spec = RobotSpec.from_json(h.robot_spec_json)
        except (ValueError, TypeError) as e:
            raise RequestError(
                SC.INVALID_ARGUMENT, f"hello.robot_spec_json: expected a robot spec, {e}"
            ) from None
        for cam in spec.cameras:
            if cam.height * cam.width > self.max_camera_pixels:
                raise RequestError(
                    SC.RESOURCE_EXHAUSTED,
                    f"hello.robot_spec_json: camera {cam.name!r} is {cam.width}x{cam.height} = "
                    f"{cam.height * cam.width} pixels; this collector takes at most max_camera_pixels="
                    f"{self.max_camera_pixels}",
                )
        # What one open episode makes a store writer hold: a chunk block of each array.
        frame = sum(3 * c.height * c.width for c in spec.cameras) + 4 * (spec.state_dim + 2 * spec.action_dim)
        block = self.chunk_len * (frame + 32)  # + reward, flags, controller, revision, timestamp
        if block > self.max_buffered_bytes:
            raise RequestError(
                SC.RESOURCE_EXHAUSTED,
                f"hello.robot_spec_json: one chunk of this robot's frames is {block} bytes (chunk_len="
                f"{self.chunk_len}); this collector holds at most max_buffered_bytes={self.max_buffered_bytes}",
            )
        if not session.robot_id:
            self._connected[h.robot_id] += 1
            self.accounts[h.robot_id].streams += 1
            self.metrics.connected.inc()
        session.robot_id, session.task, session.spec = h.robot_id, h.task, spec
        log.info("robot connected", extra={"robot": h.robot_id, "task": h.task})
        return pb.CollectorMessage(
            welcome=pb.Welcome(
                collector_version=__version__,
                max_batch_frames=self.max_batch_frames,
                max_message_bytes=self.max_message_bytes,
            )
        )

    def _start(self, session: _Session, msg: pb.RobotMessage) -> pb.CollectorMessage:
        s = msg.start
        eid = s.episode_id
        if not _ID_RE.match(eid):
            raise RequestError(
                SC.INVALID_ARGUMENT, f"start.episode_id: expected {_ID_RE.pattern}, got {eid!r}"
            )
        assert session.spec is not None
        with self._start_locks_guard:  # counted, so the entry goes only when no thread holds or waits
            start_lock, users = self._start_locks.get(eid, (threading.Lock(), 0))
            self._start_locks[eid] = (start_lock, users + 1)
        try:
            with start_lock:
                ep_or_ack = self._start_locked(session, msg, eid)
        except OSError as e:  # e.g. out of descriptors or disk: refuse this start, keep the stream
            log.error("could not open an episode", extra={"episode": eid, "error": str(e)})
            raise RequestError(
                SC.UNAVAILABLE, f"start: the collector cannot open episode {eid} now ({e}); retry later", eid
            ) from None
        finally:
            with self._start_locks_guard:
                users = self._start_locks[eid][1] - 1
                if users:
                    self._start_locks[eid] = (start_lock, users)
                else:
                    del self._start_locks[eid]
        if isinstance(ep_or_ack, pb.CollectorMessage):
            return ep_or_ack
        ep = ep_or_ack
        if ep.robot_id != session.robot_id:
            raise RequestError(
                SC.PERMISSION_DENIED, f"start.episode_id: {eid} belongs to robot {ep.robot_id!r}", eid
            )
        ep.last_op = time.monotonic()  # a robot that comes back keeps its episode from expiring
        return _ack(msg.msg_id, eid, ep.committed, ep.segments, ep.ended, ep.closed)

    def _start_locked(
        self, session: _Session, msg: pb.RobotMessage, eid: str
    ) -> _Episode | pb.CollectorMessage:
        """The open episode ``eid`` (resumed or created), or the ack of a closed one; the caller holds
        ``eid``'s start lock."""
        with self._episodes_lock:
            ep = self._episodes.get(eid)
        return ep if ep is not None else self._open_episode(session, msg, eid)

    def _check_open_cap(self, robot: str, eid: str) -> None:
        with self._episodes_lock:
            n = sum(1 for ep in self._episodes.values() if ep.robot_id == robot and not ep.closed)
        if n >= self.max_open_episodes_per_robot:
            raise RequestError(
                SC.RESOURCE_EXHAUSTED,
                f"start: robot {robot!r} has {n} open episodes, the most this collector keeps "
                f"(max_open_episodes_per_robot={self.max_open_episodes_per_robot}); end one first "
                f"(idle ones are closed as {ABORTED!r} after episode_idle_timeout_s="
                f"{self.episode_idle_timeout_s:g})",
                eid,
            )

    def _open_episode(
        self, session: _Session, msg: pb.RobotMessage, eid: str
    ) -> _Episode | pb.CollectorMessage:
        """Resume an episode the store has, or create it; a closed one is acknowledged as such."""
        assert session.spec is not None
        try:
            meta = self.store.read_metadata(eid)
        except KeyError:
            meta = None
        if meta is not None:
            if meta.robot_id != session.robot_id:
                raise RequestError(
                    SC.PERMISSION_DENIED, f"start.episode_id: {eid} belongs to robot {meta.robot_id!r}", eid
                )
            if meta.is_closed:
                return _ack(msg.msg_id, eid, meta.length, len(meta.segments), True, True)
            if meta.spec != session.spec:
                raise RequestError(
                    SC.FAILED_PRECONDITION, f"start: episode {eid} was recorded with another robot spec", eid
                )
            self._check_open_cap(session.robot_id, eid)
            return self._resume(eid, meta.robot_id, meta.spec)
        self._check_open_cap(session.robot_id, eid)
        if len(msg.start.instruction) > 2000:
            raise RequestError(SC.INVALID_ARGUMENT, "start.instruction: at most 2000 characters", eid)
        writer = self._assign_writer()  # before creating anything: it refuses when no writer is left
        leftover = self.store.episodes_dir / eid
        if self.store.remote is None and leftover.exists():
            # A folder without a commit record: a creation killed half-way. Nothing in it was ever
            # committed or acknowledged, and we hold the store lock, so it is safe to start over.
            shutil.rmtree(leftover)
        # Created here (commit.json, DB row) so the episode exists before its first ack; a store
        # writer resumes it when the first logged message reaches it.
        self.store.new_episode(
            session.spec,
            robot_id=session.robot_id,
            task=session.task,
            instruction=msg.start.instruction or None,
            chunk_len=self.chunk_len,
            episode_id=eid,
            camera_zstd_level=self.camera_zstd_level if session.spec.cameras else None,
            camera_codec=self.camera_codecs.restrict(session.spec.camera_names),
        )
        ep = _Episode(
            id=eid,
            robot_id=session.robot_id,
            spec=session.spec,
            wal=WriteAheadLog(self.wal_dir / f"{eid}.wal", self.fsync, self.log_files),
            committed=0,
            segments=0,
            last_ts=-math.inf,
            writer=writer,
        )
        with self._episodes_lock:
            self._episodes[eid] = ep
            self.metrics.open_episodes.set(len(self._episodes))
        return ep

    def _episode_message(self, session: _Session, msg: pb.RobotMessage, body: str) -> pb.CollectorMessage:
        part = getattr(msg, body)
        eid = part.episode_id
        with self._episodes_lock:
            ep = self._episodes.get(eid)
        if ep is None:
            meta = None
            if _ID_RE.match(eid):
                try:
                    meta = self.store.read_metadata(eid)
                except KeyError:
                    meta = None
            if meta is not None and meta.is_closed and meta.robot_id == session.robot_id:
                n = _frames_in(msg)
                if body == "frames" and msg.frames.seq + n > meta.length:
                    raise RequestError(
                        SC.FAILED_PRECONDITION,
                        f"frames: episode {eid} is closed ({meta.outcome}) with {meta.length} frames",
                        eid,
                    )
                self._count_duplicates(session.robot_id, n)
                return _ack(msg.msg_id, eid, meta.length, len(meta.segments), True, True, n)
            raise RequestError(
                SC.NOT_FOUND, f"{body}.episode_id: no open episode {eid!r} (send StartEpisode first)", eid
            )
        if ep.robot_id != session.robot_id:
            raise RequestError(
                SC.PERMISSION_DENIED, f"{body}.episode_id: {eid} belongs to robot {ep.robot_id!r}", eid
            )
        with ep.lock:
            if ep.error:  # the log holds the data; a restarted collector replays it
                raise Unavailable(f"episode {eid} cannot be written to the store: {ep.error}")
            if body == "frames":
                return self._frames(session, ep, msg)
            if body == "segment":
                return self._segment(ep, msg)
            return self._end(ep, msg)

    def _frames(self, session: _Session, ep: _Episode, msg: pb.RobotMessage) -> pb.CollectorMessage:
        fb = msg.frames
        t0 = time.perf_counter()
        robot = session.robot_id
        if _frames_in(msg) > self.max_batch_frames:
            raise RequestError(
                SC.RESOURCE_EXHAUSTED,
                f"frames: at most {self.max_batch_frames} frames per batch, got {_frames_in(msg)}; split it",
                ep.id,
            )
        if ep.ended:
            n = _frames_in(msg)
            if fb.seq + n <= ep.committed:
                self._count_duplicates(robot, n)
                return _ack(msg.msg_id, ep.id, ep.committed, ep.segments, ep.ended, ep.closed, n)
            raise RequestError(SC.FAILED_PRECONDITION, f"frames: episode {ep.id} has ended", ep.id)
        if fb.seq > ep.committed:
            raise RequestError(
                SC.OUT_OF_RANGE,
                f"frames.seq: expected {ep.committed} (the next frame of {ep.id}) or less, got {fb.seq}; "
                "frames in between were never received",
                ep.id,
            )
        if ep.segments == 0:
            raise RequestError(
                SC.FAILED_PRECONDITION,
                f"frames: send SegmentMarker 0 of {ep.id} before its first frame",
                ep.id,
            )
        raw, cams = session.raw, session.cameras
        if not fb.HasField("timestamp") and len(fb.action.shape) == 2:
            if cams is not None:  # the log gets a re-serialised message: take the cameras back into it
                assert raw is not None
                msg, cams = pb.RobotMessage.FromString(raw), None
                fb = msg.frames
            n = int(fb.action.shape[0])
            fb.timestamp.CopyFrom(to_tensor(np.full(n, max(time.time(), ep.last_ts), np.float64)))
            raw = None  # the log must hold the times we filled in
        batch = decode_frames(fb, ep.spec, self.max_batch_frames, -math.inf, cams)
        n = len(batch["action"])
        dup = ep.committed - fb.seq
        if dup < n and batch["timestamp"][dup] < ep.last_ts:
            raise RequestError(
                SC.INVALID_ARGUMENT,
                f"frames.timestamp: expected non-decreasing times (last stored {ep.last_ts:.6f}), got a time going back",
                ep.id,
            )
        acc = self.accounts[robot]
        acc.frames_received += n
        self.metrics.received.labels(self._label(robot)).inc(n)
        if dup >= n:
            self._count_duplicates(robot, n, counted=True)
            return _ack(msg.msg_id, ep.id, ep.committed, ep.segments, ep.ended, ep.closed, n)
        before = ep.wal.size
        ep.wal.append(raw if raw is not None else msg.SerializeToString())
        new = n - dup
        ep.committed += new
        ep.last_ts = float(batch["timestamp"][-1])
        acc.frames_committed += new
        self.metrics.committed.labels(self._label(robot)).inc(new)
        if dup:
            self._count_duplicates(robot, dup, counted=True)
        self.metrics.durable.observe(time.perf_counter() - t0)
        self._hand_off(ep, ep.wal.size - before)
        return _ack(msg.msg_id, ep.id, ep.committed, ep.segments, ep.ended, ep.closed, dup)

    def _segment(self, ep: _Episode, msg: pb.RobotMessage) -> pb.CollectorMessage:
        sm = msg.segment
        if sm.index < ep.segments:
            return _ack(msg.msg_id, ep.id, ep.committed, ep.segments, ep.ended, ep.closed)
        if sm.index > ep.segments:
            raise RequestError(
                SC.OUT_OF_RANGE,
                f"segment.index: expected {ep.segments} (the next segment), got {sm.index}",
                ep.id,
            )
        if ep.ended:
            raise RequestError(SC.FAILED_PRECONDITION, f"segment: episode {ep.id} has ended", ep.id)
        if sm.start != ep.committed:
            raise RequestError(
                SC.FAILED_PRECONDITION,
                f"segment.start: expected {ep.committed} (frames received so far), got {sm.start}",
                ep.id,
            )
        if sm.kind not in SEGMENT_KINDS:
            raise RequestError(
                SC.INVALID_ARGUMENT, "segment.kind: expected AUTONOMOUS, INTERVENTION or RESET", ep.id
            )
        if sm.controller not in (pb.POLICY, pb.HUMAN, pb.SCRIPTED):
            raise RequestError(
                SC.INVALID_ARGUMENT, "segment.controller: expected POLICY, HUMAN or SCRIPTED", ep.id
            )
        if len(sm.reason) > 1000:
            raise RequestError(SC.INVALID_ARGUMENT, "segment.reason: at most 1000 characters", ep.id)
        before = ep.wal.size
        ep.wal.append(msg.SerializeToString())
        ep.segments += 1
        self._hand_off(ep, ep.wal.size - before)
        return _ack(msg.msg_id, ep.id, ep.committed, ep.segments, ep.ended, ep.closed)

    def _end(self, ep: _Episode, msg: pb.RobotMessage) -> pb.CollectorMessage:
        e = msg.end
        if ep.ended:
            return _ack(msg.msg_id, ep.id, ep.committed, ep.segments, ep.ended, ep.closed)
        if e.length != ep.committed:
            raise RequestError(
                SC.FAILED_PRECONDITION,
                f"end.length: the robot sent {e.length} frames but the collector holds {ep.committed}; "
                "send the missing frames first",
                ep.id,
            )
        if not e.outcome or len(e.outcome) > 64:
            raise RequestError(
                SC.INVALID_ARGUMENT, "end.outcome: expected a short word (success, failure, ...)", ep.id
            )
        before = ep.wal.size
        ep.wal.append(msg.SerializeToString())
        ep.ended = True
        self._hand_off(ep, ep.wal.size - before)
        return _ack(msg.msg_id, ep.id, ep.committed, ep.segments, ep.ended, ep.closed)

    def _count_duplicates(self, robot: str, n: int, counted: bool = False) -> None:
        acc = self.accounts[robot]
        if not counted:
            acc.frames_received += n
            self.metrics.received.labels(self._label(robot)).inc(n)
        acc.frames_duplicate += n
        self.metrics.duplicate.labels(self._label(robot)).inc(n)

    # -------------------------------------------------------------- store writers
    def _new_writer(self, index: int) -> _WriterHandle:
        if self.store_writers == 0:
            return _ThreadWriter(
                self.store.root, self.fsync, self._on_report, self.max_buffered_bytes, self.wal_dir
            )
        share = max(self.max_buffered_bytes // self.store_writers, 1)  # the bound is for all writers
        assert self._lock_fd is not None
        return _ProcessWriter(
            index,
            self.store.root,
            self.fsync,
            self._lock_fd,
            self._on_report,
            self._writer_died,
            self.store_writer_nice,
            share,
            self.wal_dir,
        )

    def _assign_writer(self) -> int:
        alive = [i for i in range(len(self._writers)) if i not in self._dead_writers]
        if not alive:
            raise Unavailable("every store writer process has failed (see the collector's log)")
        self._next_writer += 1
        return alive[self._next_writer % len(alive)]

    def _hand_off(self, ep: _Episode, nbytes: int) -> None:
        """Tell the episode's writer that its log grew by ``nbytes`` (caller holds ``ep.lock``)."""
        with self._room:
            self._pending_bytes += nbytes
            self.metrics.pending.set(self._pending_bytes)
        ep.last_op = time.monotonic()
        if ep.wal.size > ep.applied and ep.retry_at is None:  # else the retry (backoff) posts it
            self._writers[ep.writer].post_data(ep.id, ep.wal.size)

    def _release(self, ep: _Episode, upto: int) -> None:
        """The writer has applied the log up to byte ``upto`` (caller holds ``ep.lock``)."""
        if upto > ep.applied:
            with self._room:
                self._pending_bytes -= upto - ep.applied
                self.metrics.pending.set(self._pending_bytes)
                self._room.notify_all()
            ep.applied = upto

    def _on_report(self, r: Mapping[str, Any]) -> None:
        """A store writer's report on one episode (see fleet/store_writer.py)."""
        with self._episodes_lock:
            ep = self._episodes.get(str(r.get("episode")))
        if ep is None:
            return  # closed already (a restarted writer reports it again)
        with ep.lock:
            if ep.closed:
                return
            if r.get("error") and r.get("retry"):
                # A full disk (or out of descriptors): the writer dropped its state of the episode and
                # replays the log from the Zarr commit when asked again, after a backoff.
                ep.backoff_s = min(max(2 * ep.backoff_s, 0.25), self.store_retry_max_s)
                ep.retry_at = time.monotonic() + ep.backoff_s
                self.metrics.store_retries.inc()
                log.warning(
                    "store write failed; retrying (the log keeps the data)",
                    extra={"episode": ep.id, "error": r["error"], "retry_in_s": ep.backoff_s},
                )
                return
            if r.get("error"):
                if ep.error is None:
                    log.error("could not write to the store", extra={"episode": ep.id, "error": r["error"]})
                ep.error = str(r["error"])  # its streams end; the log keeps the data for a restart
                self._release(ep, ep.wal.size)
                return
            if ep.backoff_s:
                log.info("store write succeeded after retries", extra={"episode": ep.id})
                ep.backoff_s = 0.0
            self._release(ep, int(r["applied"]))
            stored = int(r["stored"])
            if stored > ep.stored:
                self._stored(ep, stored - ep.stored)
                ep.stored = stored
            if r.get("closed"):
                self._closed(ep)

    def _closed(self, ep: _Episode) -> None:
        """The writer closed the episode in the store: record it in the DB, then drop its log."""
        try:
            meta = self.store.read_metadata(ep.id)
            self.db.record_episode_closed(meta)
        except Exception as e:  # the log stays: the next start records the close again
            ep.error = f"recording the closed episode in the metadata DB: {type(e).__name__}: {e}"
            log.exception("could not record a closed episode", extra={"episode": ep.id})
            return
        self._release(ep, ep.wal.size)
        ep.closed = True
        ep.wal.close(delete=True)
        with self._episodes_lock:
            self._episodes.pop(ep.id, None)
            self.metrics.open_episodes.set(len(self._episodes))
        self.accounts[ep.robot_id].episodes_closed += 1
        self.metrics.episodes.labels(self._label(ep.robot_id), meta.outcome or "").inc()
        log.info(
            "episode closed",
            extra={"episode": ep.id, "robot": ep.robot_id, "frames": meta.length, "outcome": meta.outcome},
        )

    def _writer_died(self, handle: _ProcessWriter) -> None:
        """A writer process exited unasked: start another, which replays its episodes' logs from their
        Zarr commits (nothing lost, nothing twice). Dying again and again is a failure: say so loudly."""
        if self._stop.is_set() or handle not in self._writers:
            return
        index = self._writers.index(handle)
        now = time.monotonic()
        self._writer_deaths = [t for t in self._writer_deaths if now - t < 60] + [now]
        new: _WriterHandle | None = None
        if len(self._writer_deaths) <= 5:
            try:
                new = self._new_writer(index)
            except OSError:
                log.exception("could not start a store writer process", extra={"writer": index})
        if new is None:
            self._dead_writers.add(index)  # new episodes go to the others; its own are refused
            why = f"the store writer process died {len(self._writer_deaths)} times in a minute"
        else:
            self._writers[index] = new  # from here on, every log append is posted to the new one
            self.metrics.writer_restarts.inc()
        with self._episodes_lock:
            eps = [ep for ep in self._episodes.values() if ep.writer == index]
        if new is None:
            log.critical(
                "store writer process keeps dying; its episodes are refused until the collector restarts",
                extra={"writer": index, "exit_code": handle.returncode, "episodes": len(eps)},
            )
        else:
            log.error(
                "store writer process died; restarting it (it replays the logs)",
                extra={"writer": index, "exit_code": handle.returncode, "episodes": len(eps)},
            )
        for ep in eps:
            with ep.lock:
                if ep.closed:
                    continue
                if new is None:
                    ep.error = why
                    self._release(ep, ep.wal.size)
                elif ep.wal.size:
                    new.post_data(ep.id, ep.wal.size)

    def _stored(self, ep: _Episode, n: int) -> None:
        if n > 0:
            self.accounts[ep.robot_id].frames_stored += n
            self.metrics.stored.labels(self._label(ep.robot_id)).inc(n)

    async def wait_for_room(self, context: grpc.aio.ServicerContext) -> None:
        """Hold a stream while the store writers are behind (gRPC flow control then slows the robot)."""
        if self._pending_bytes <= self.max_pending_bytes:
            return
        t0 = time.perf_counter()
        while self._pending_bytes > self.max_pending_bytes and not context.done() and not self._stop.is_set():
            await asyncio.sleep(0.01)
        self.metrics.backpressure.inc(time.perf_counter() - t0)

    def _flush_idle_loop(self) -> None:
        """Write out the buffered tail of episodes nobody sends to, so readers see it (durability has the
        log); retry failed store writes when their backoff is over; close episodes idle for longer than
        ``episode_idle_timeout_s`` as aborted."""
        while not self._stop.wait(0.25):
            now = time.monotonic()
            with self._episodes_lock:
                eps = list(self._episodes.values())
            self.metrics.open_logs.set(len(self.log_files))
            for ep in eps:
                with ep.lock:
                    if ep.closed or ep.error is not None:
                        continue
                    if ep.retry_at is not None:
                        if now >= ep.retry_at:
                            ep.retry_at = None
                            self._writers[ep.writer].post_data(ep.id, ep.wal.size)
                        continue
                    if not ep.ended and now - ep.last_op > self.episode_idle_timeout_s:
                        self._expire(ep)
                        continue
                    idle = now - ep.last_op > self.idle_flush_s
                    if idle and ep.stored < ep.committed and ep.flush_sent != ep.committed:
                        ep.flush_sent = ep.committed
                        self._writers[ep.writer].post({"op": "flush", "episode": ep.id})

    def _expire(self, ep: _Episode) -> None:
        """End an episode nobody has sent to for ``episode_idle_timeout_s`` (caller holds ``ep.lock``):
        its frames are kept, its outcome is ``aborted`` (success unknown, recorded as false)."""
        end = pb.RobotMessage(
            end=pb.EndEpisode(episode_id=ep.id, length=ep.committed, outcome=ABORTED, success=False)
        )
        before = ep.wal.size
        try:
            ep.wal.append(end.SerializeToString())
        except Unavailable as e:
            log.error(
                "could not close an idle episode; trying again", extra={"episode": ep.id, "error": str(e)}
            )
            return
        ep.ended = True
        self.metrics.episodes_expired.inc()
        log.warning(
            "idle episode closed as aborted",
            extra={
                "episode": ep.id,
                "robot": ep.robot_id,
                "frames": ep.committed,
                "idle_s": round(time.monotonic() - ep.last_op, 1),
                "episode_idle_timeout_s": self.episode_idle_timeout_s,
            },
        )
        self._hand_off(ep, ep.wal.size - before)

    def drain(self, timeout_s: float = 60.0) -> bool:
        """Wait until the store writers have applied every log received so far (for tests and tools)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._episodes_lock:
                busy = any(
                    ep.error is None and not ep.closed and ep.applied < ep.wal.size
                    for ep in self._episodes.values()
                )
            if not busy and self._pending_bytes == 0:
                return True
            time.sleep(0.01)
        return False

    # -------------------------------------------------------------- stats
    def stats(self, only: str | None = None) -> pb.StatsResponse:
        """Every robot's counters, or (``only``: a per-robot credential) that robot's alone, without the
        Prometheus text (which names the other robots)."""
        if only is None:
            out = pb.StatsResponse(prometheus_text=generate_latest(self.metrics.registry).decode())
        else:
            out = pb.StatsResponse()
        for robot, a in sorted(self.accounts.items()):
            if only is not None and robot != only:
                continue
            out.robots.append(
                pb.RobotStats(
                    robot_id=robot,
                    frames_received=a.frames_received,
                    frames_committed=a.frames_committed,
                    frames_stored=a.frames_stored,
                    frames_rejected=a.frames_rejected,
                    frames_duplicate=a.frames_duplicate,
                    episodes_closed=a.episodes_closed,
                    connected=self._connected.get(robot, 0) > 0,
                )
            )
        return out

    def disconnected(self, session: _Session) -> None:
        if session.robot_id:
            self._connected[session.robot_id] -= 1
            self.metrics.connected.dec()
            log.info("robot disconnected", extra={"robot": session.robot_id})


class _RateLimitedLog:
    """A warning logged at most once per key (a peer) per interval, with how many were held back; no
    traceback (an attacker's garbage must not flood the log)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def warning(self, key: str, message: str, **extra: Any) -> bool:
        now = time.monotonic()
        with self._lock:
            last, held = self._last.get(key, (-math.inf, 0))
            if now - last < self.interval_s:
                self._last[key] = (last, held + 1)
                return False
            if len(self._last) > 10_000:  # many peers: forget the old ones
                self._last = {k: v for k, v in self._last.items() if now - v[0] < self.interval_s}
            self._last[key] = (now, 0)
        log.warning(message, extra={**extra, "peer": key, "suppressed": held})
        return True


def _ack(
    msg_id: int, eid: str, committed: int, segments: int, ended: bool, closed: bool, duplicates: int = 0
) -> pb.CollectorMessage:
    return pb.CollectorMessage(
        ack=pb.Ack(
            msg_id=msg_id,
            episode_id=eid,
            committed=committed,
            segments=segments,
            ended=ended,
            closed=closed,
            duplicates=duplicates,
        )
    )


def _episode_of(msg: pb.RobotMessage) -> str:
    body = msg.WhichOneof("body")
    return getattr(msg, body).episode_id if body in ("start", "frames", "segment", "end") else ""


def _frames_in(msg: pb.RobotMessage) -> int:
    return frames_declared(msg)


class _Service:
    """The gRPC methods. ``Stream`` takes raw bytes (no request deserializer) so the log can keep them."""

    def __init__(self, c: Collector) -> None:
        self.c = c

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Stream": grpc.stream_stream_rpc_method_handler(
                    self.Stream,
                    request_deserializer=None,
                    response_serializer=pb.CollectorMessage.SerializeToString,
                ),
                "GetStats": grpc.unary_unary_rpc_method_handler(
                    self.GetStats,
                    request_deserializer=pb.StatsRequest.FromString,
                    response_serializer=pb.StatsResponse.SerializeToString,
                ),
            },
        )

    async def Stream(
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.CollectorMessage]:
        try:
            identity = self.c.authorize(context.invocation_metadata())
        except RequestError as e:
            await context.abort(e.code, e.message)
        session = _Session(identity=identity, peer=context.peer() or "")
        try:
            async for raw in request_iterator:
                await self.c.wait_for_room(context)
                try:
                    msg, cams = parse_message(raw)
                except Exception as e:  # protobuf's DecodeError; never crash a stream on bytes
                    yield self.c.undecodable(session, e)
                    continue
                try:
                    if msg.WhichOneof("body") == "start":
                        # Creating an episode (Zarr arrays, commit record) takes ~50 ms of file work;
                        # on the event loop, a fleet whose episodes start together stalled every
                        # robot's acks for seconds. A thread keeps the other streams flowing (starts
                        # are serialised by Collector._start_lock; the rest of handle is thread-safe).
                        reply = await asyncio.to_thread(self.c.handle, session, msg, raw, cams)
                    else:
                        reply = self.c.handle(session, msg, raw, cams)
                except (ValueError, TypeError, OverflowError, UnicodeError, IndexError) as e:
                    # Bytes that parse but that nothing above expected: a Reject, not a dead stream.
                    reply = self.c.undecodable(session, e, msg)
                except Unavailable as e:
                    log.error("cannot make a message durable; ending the stream", extra={"error": str(e)})
                    await context.abort(
                        SC.UNAVAILABLE, f"collector cannot write now ({e}); reconnect and resend"
                    )
                yield reply
        finally:
            self.c.disconnected(session)

    async def GetStats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        try:
            identity = self.c.authorize(context.invocation_metadata())
        except RequestError as e:
            await context.abort(e.code, e.message)
        return self.c.stats(only=identity)


@functools.cache
def _aio_loop() -> asyncio.AbstractEventLoop:
    """The event loop of every collector in this process (grpc.aio binds itself to one loop; never closed)."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="collector-grpc", daemon=True).start()
    return loop


os.register_at_fork(after_in_child=_aio_loop.cache_clear)  # the loop's thread does not survive a fork


class _AioServer:
    """The aio server, stopped from any thread: ``stop(grace).wait()`` as with a ``grpc.Server``."""

    def __init__(self, server: grpc.aio.Server, loop: asyncio.AbstractEventLoop) -> None:
        self.server, self.loop = server, loop

    def stop(self, grace: float | None) -> _Stopping:
        return _Stopping(asyncio.run_coroutine_threadsafe(self.server.stop(grace), self.loop))


class _Stopping:
    def __init__(self, fut: concurrent.futures.Future[None]) -> None:
        self.fut = fut

    def wait(self, timeout: float | None = None) -> bool:
        try:
            self.fut.result(timeout)
        except concurrent.futures.TimeoutError:
            return False
        return True


class _WriterHandle:
    """One store writer, fed ops (see fleet/store_writer.py). Data ops are coalesced per episode (each
    says "the log is written up to byte B"), so a writer that falls behind gets one op per episode, not
    a growing queue; senders never block."""

    def __init__(self, on_report: Callable[[Mapping[str, Any]], None]) -> None:
        self._on_report = on_report
        self._cv = threading.Condition()
        self._data: dict[str, int] = {}
        self._ops: list[dict[str, Any]] = []

    def post_data(self, episode_id: str, end: int) -> None:
        with self._cv:
            self._data[episode_id] = max(end, self._data.get(episode_id, 0))
            self._cv.notify()

    def post(self, op: dict[str, Any]) -> None:
        with self._cv:
            self._ops.append(op)
            self._cv.notify()

    def _take(self) -> list[dict[str, Any]]:
        with self._cv:
            while not self._data and not self._ops:
                self._cv.wait()
            ops = [{"op": "data", "episode": e, "end": b} for e, b in self._data.items()] + self._ops
            self._data, self._ops = {}, []
        return ops

    def _report(self, r: Mapping[str, Any]) -> None:
        try:
            self._on_report(r)
        except Exception:  # a bookkeeping bug must not stop the writer's reports
            log.exception("could not handle a store writer report", extra={"report": dict(r)})

    def join(self, timeout_s: float) -> None:
        raise NotImplementedError


class _ThreadWriter(_WriterHandle):
    """The store writer in this process (``store_writers=0``: tests, debugging)."""

    def __init__(
        self,
        root: Path | str,
        fsync: bool,
        on_report: Callable[[Mapping[str, Any]], None],
        max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
        wal_dir: Path | None = None,
    ) -> None:
        super().__init__(on_report)
        self._sw = StoreWriter(root, fsync, max_buffered_bytes, wal_dir=wal_dir)
        self._thread = threading.Thread(target=self._loop, name="collector-store", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            for op in self._take():
                for r in self._sw.handle(op):
                    self._report(r)
                if op["op"] == "stop":
                    return

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        if self._thread.is_alive():  # past drain_timeout_s: stop between records (the log keeps the rest)
            log.error("store writer did not stop in time; abandoning its work (the log keeps it)")
            self._sw.aborted = True
            self._thread.join(1.0)


class _ProcessWriter(_WriterHandle):
    """A ``python -m fleet.store_writer`` process: JSON ops on its stdin, JSON reports on its stdout.

    It inherits the store lock, so no new collector can start writing the store while it still runs.
    """

    def __init__(
        self,
        index: int,
        root: Path | str,
        fsync: bool,
        lock_fd: int,
        on_report: Callable[[Mapping[str, Any]], None],
        on_exit: Callable[[_ProcessWriter], None],
        nice: int = 0,
        max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
        wal_dir: Path | None = None,
    ) -> None:
        super().__init__(on_report)
        self._on_exit = on_exit
        repo = str(Path(__file__).resolve().parents[1])
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
        }
        cmd = [sys.executable, "-m", "fleet.store_writer", "--store", str(root), "--nice", str(nice)]
        cmd += ["--fsync"] if fsync else []
        cmd += ["--max-buffered-bytes", str(max_buffered_bytes)]
        cmd += ["--wal-dir", str(wal_dir)] if wal_dir is not None else []
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(lock_fd,), env=env
        )
        self._stopping = False
        name = f"collector-store-{index}"
        self._sender = threading.Thread(target=self._send_loop, name=name + "-send", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name=name + "-read", daemon=True)
        self._sender.start()
        self._reader.start()

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def _send_loop(self) -> None:
        assert self.proc.stdin is not None
        while True:
            ops = self._take()
            try:
                self.proc.stdin.write(b"".join(json.dumps(op).encode() + b"\n" for op in ops))
                self.proc.stdin.flush()
            except OSError:  # the process is gone; the reader notices and a new one replays
                return
            if any(op["op"] == "stop" for op in ops):
                self._stopping = True
                with contextlib.suppress(OSError):
                    self.proc.stdin.close()
                return

    def _read_loop(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                r = json.loads(line)
            except ValueError:
                log.error("store writer said something that is not a report", extra={"line": line[:200]})
                continue
            self._report(r)
        self.proc.wait()
        if not self._stopping or self.proc.returncode != 0:
            self._on_exit(self)

    def join(self, timeout_s: float) -> None:
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.error(
                "store writer did not stop within drain_timeout_s; killing it (the log keeps its work)",
                extra={"pid": self.proc.pid},
            )
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout_s)

    def kill(self) -> None:
        """SIGKILL the process (tests: a writer dying mid-stream)."""
        self.proc.kill()


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The shared collector token kept in a file (see :func:`vla_rl.core.secrets.read_secret_file`)."""
    try:
        return read_secret_file(path)
    except ValueError as e:
        raise ValueError(f"token_file: {e}") from None


def load_robot_tokens(path: str | os.PathLike[str]) -> dict[str, str]:
    """Per-robot credentials: a JSON object ``{"robot_id": "token"}`` or lines ``robot_id: token``
    (``#`` comments and blank lines ignored). Each token must be unique: it is the robot's identity."""
    text = Path(path).read_text()
    out: dict[str, str] = {}
    if text.lstrip().startswith("{"):
        data = json.loads(text)
        if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
            raise ValueError(f"robot_tokens_file: {path}: expected a JSON object robot id -> token")
        out = {str(k): v.strip() for k, v in data.items()}
    else:
        for i, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            rid, sep, tok = line.partition(":")
            if not sep or not rid.strip() or not tok.strip():
                raise ValueError(f"robot_tokens_file: {path}:{i}: expected 'robot_id: token'")
            if rid.strip() in out:
                raise ValueError(f"robot_tokens_file: {path}:{i}: robot {rid.strip()!r} listed twice")
            out[rid.strip()] = tok.strip()
    for rid, tok in out.items():
        if not _ID_RE.match(rid) or len(tok) < 16:
            raise ValueError(
                f"robot_tokens_file: {path}: robot {rid!r}: expected an id {_ID_RE.pattern} and a token "
                "of at least 16 characters"
            )
    if len(set(out.values())) != len(out):
        raise ValueError(f"robot_tokens_file: {path}: two robots share a token")
    return out


def serve(store: str | os.PathLike[str], db_url: str | None = None, **kwargs: Any) -> None:
    """Run a collector until interrupted or SIGTERM (what ``vla-rl collect`` runs); stopping takes at most
    ``drain_timeout_s`` (see :meth:`Collector.stop`)."""
    keep_freed_memory()
    import signal

    stop = threading.Event()
    # Before the line tools wait for: a SIGTERM right after it must drain, not kill.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    c = Collector(store, db_url, **kwargs).start()
    print(f"collector listening on {c.address}", flush=True)  # tools wait for this line
    try:
        while not stop.wait(0.2):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        log.info("stopping collector")
        c.stop()
