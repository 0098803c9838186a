"""The collector itself: start, drain, stop, the store lock and lease, recovery, the store writer pool's
bookkeeping, and :func:`serve` (what ``vla-rl collect`` runs). See :mod:`fleet.collector`."""

from __future__ import annotations

import asyncio
import collections
import fcntl
import logging
import math
import os
import threading
import time
from collections.abc import Coroutine, Mapping
from typing import Any

import grpc
from prometheus_client import generate_latest
from vla_rl_client.codec import from_tensor
from vla_rl_client.proto import collector_pb2 as pb
from vla_rl_client.spec import RobotSpec
from vla_rl_client.wire import keep_freed_memory

from fleet.collector import help as help_calls
from fleet.collector.config import _ID_RE, _LOOPBACK, CollectorConfig
from fleet.collector.episodes import ABORTED, _Episode, _EpisodeIntake
from fleet.collector.metrics import RobotAccount, _Metrics
from fleet.collector.rpc import SERVICE_NAME, _aio_loop, _AioServer, _Service, _Session, authorize
from fleet.collector.writers import _ProcessWriter, _ThreadWriter, _WriterHandle
from fleet.db import MetadataDB
from fleet.objstore import StoreLease
from fleet.store import EpisodeStore
from fleet.wal import (
    WAL_DIR,
    LogFiles,
    Unavailable,
    WriteAheadLog,
    parse_message,
)
from vla_rl.core.rpc import RateLimitedLog, SigtermFlag, wait_for_stop

log = logging.getLogger("vla_rl.collector")

LOCK_FILE = "collector.lock"


# ------------------------------------------------------------------------------------------ collector
class Collector(_EpisodeIntake):
    """The service behind ``vla-rl collect`` (use :meth:`start` / :meth:`stop`, or as a context manager)."""

    def __init__(
        self,
        config: CollectorConfig,
        *,
        token: str | None = None,
        robot_tokens: Mapping[str, str] | None = None,
    ) -> None:
        """``config``: every knob (see :class:`CollectorConfig`); ``token``: the shared credential (its
        holder may speak as any robot); ``robot_tokens``: robot id -> that robot's own credential. The
        secrets are kept apart from the config, which can be saved."""
        robot_tokens = dict(robot_tokens or {})
        if not token and not robot_tokens and config.host not in _LOOPBACK:
            raise ValueError(
                f"refusing to accept unauthenticated robots on {config.host}: pass a token or robot tokens"
            )
        for rid, tok in robot_tokens.items():
            if not _ID_RE.fullmatch(rid) or not tok:
                raise ValueError(f"robot_tokens: expected robot id -> non-empty token, got {rid!r}")
        self.config = config
        self.host, self.port = config.host, config.port  # port: the bound one once started (0 = any)
        self.metrics_port = config.metrics_port  # likewise
        self.token = token
        # Bearer credential -> the robot it speaks for (hmac-compared in authorize).
        self.robot_tokens = robot_tokens
        self.camera_codecs = config.camera_codecs
        self.allowed_robots = config.allowed_robots
        self.log_files = LogFiles(config.max_open_logs)
        self._undecodable = RateLimitedLog(log, 60.0)  # per peer
        self._refused = RateLimitedLog(log, 10.0)  # per peer and code
        store = config.store_location
        self.db = MetadataDB(config.db) if config.db else MetadataDB.for_store(store)
        self.store = EpisodeStore(store, create=True, fsync=config.fsync, db=self.db)
        wal_dir = config.wal_dir
        self.wal_dir = wal_dir.absolute() if wal_dir is not None else self.store.root / WAL_DIR
        self.wal_dir.mkdir(parents=wal_dir is not None, exist_ok=True)
        # The lock beside what it guards: the store's folder, or (object store) the local log.
        self._lock_path = (self.store.root if self.store.remote is None else self.wal_dir) / LOCK_FILE
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
        self._writers: list[_WriterHandle] = []
        self._writer_deaths: list[float] = []
        self._dead_writers: set[int] = set()
        self._next_writer = 0
        self._stop = threading.Event()
        self._lock_fd: int | None = None
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
            self._writers = [self._new_writer(i) for i in range(max(self.config.store_writers, 1))]
            self.recover()
        except BaseException:
            self._stop_writers()
            self._unlock_store()
            raise
        opts = [
            ("grpc.max_receive_message_length", self.config.max_message_bytes),
            ("grpc.max_send_message_length", 4 * 1024 * 1024),
            ("grpc.so_reuseport", 0),
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ]
        # grpc.aio: every stream is a coroutine on one event loop thread. The thread-per-stream server
        # hands each message between threads, which costs CPU per message (measured: docs/benchmarks.md,
        # Fleet collector).
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
                self.metrics_port, addr=self.config.metrics_host, registry=self.metrics.registry
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
        server = grpc.aio.server(options=opts, maximum_concurrent_rpcs=self.config.max_streams)
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
        bound = self.config.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
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
            deadline = time.monotonic() + self.config.drain_timeout_s
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
                self.lease = StoreLease(self.store.remote, self.wal_dir, self.config.lease_ttl_s).acquire()
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
            wal=WriteAheadLog(path, self.config.fsync, self.log_files),
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

    def authorize(self, metadata: Any) -> str | None:
        """The robot id the caller's credential is bound to, or None when it may speak as any robot (see
        :func:`fleet.collector.rpc.authorize`)."""
        return authorize(metadata, self.token, self.robot_tokens)

    # -------------------------------------------------------------- store writers
    def _new_writer(self, index: int) -> _WriterHandle:
        if self.config.store_writers == 0:
            return _ThreadWriter(
                self.store.root,
                self.config.fsync,
                self._on_report,
                self.config.max_buffered_bytes,
                self.wal_dir,
            )
        share = max(
            self.config.max_buffered_bytes // self.config.store_writers, 1
        )  # the bound is for all writers
        assert self._lock_fd is not None
        return _ProcessWriter(
            index,
            self.store.root,
            self.config.fsync,
            self._lock_fd,
            self._on_report,
            self._writer_died,
            self.config.store_writer_nice,
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
                ep.backoff_s = min(max(2 * ep.backoff_s, 0.25), self.config.store_retry_max_s)
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
        if self._pending_bytes <= self.config.max_pending_bytes:
            return
        t0 = time.perf_counter()
        while (
            self._pending_bytes > self.config.max_pending_bytes
            and not context.done()
            and not self._stop.is_set()
        ):
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
                    if not ep.ended and now - ep.last_op > self.config.episode_idle_timeout_s:
                        self._expire(ep)
                        continue
                    idle = now - ep.last_op > self.config.idle_flush_s
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
                "episode_idle_timeout_s": self.config.episode_idle_timeout_s,
            },
        )
        self._hand_off(ep, ep.wal.size - before)

    def drain(self, timeout_s: float = 60.0) -> bool:
        """Wait until the store writers have applied every log received so far, and every episode whose
        end was received is closed: in the store and in the metadata DB (for tests and tools). An episode
        that failed (its error is logged) is not waited for. False if that took longer than ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._episodes_lock:
                # An ended episode stays busy until _closed has recorded it in the DB: the writer's last
                # report releases its log bytes first, then the DB row is written.
                busy = any(
                    ep.error is None and not ep.closed and (ep.applied < ep.wal.size or ep.ended)
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

    # -------------------------------------------------------------- help queue
    def request_help(self, ask: pb.HelpAsk, identity: str | None) -> pb.HelpState:
        return help_calls.request_help(self.db, ask, identity, self.allowed_robots)

    def get_help(self, query: pb.HelpQuery, identity: str | None) -> pb.HelpState:
        return help_calls.get_help(self.db, query, identity, self.allowed_robots)

    def claim_help(self, claim: pb.HelpClaim, identity: str | None) -> pb.HelpState:
        return help_calls.claim_help(self.db, claim, identity)

    def resolve_help(self, done: pb.HelpResolve, identity: str | None) -> pb.HelpState:
        return help_calls.resolve_help(self.db, done, identity)

    def disconnected(self, session: _Session) -> None:
        if session.robot_id:
            self._connected[session.robot_id] -= 1
            self.metrics.connected.dec()
            log.info("robot disconnected", extra={"robot": session.robot_id})


def serve(
    config: CollectorConfig, *, token: str | None = None, robot_tokens: Mapping[str, str] | None = None
) -> None:
    """Run a collector until interrupted or SIGTERM (what ``vla-rl collect`` runs); stopping takes at most
    ``config.drain_timeout_s`` (see :meth:`Collector.stop`)."""
    keep_freed_memory()
    # Before the line tools wait for: a SIGTERM right after it must stop in order, not kill.
    with SigtermFlag() as sigterm:
        c = Collector(config, token=token, robot_tokens=robot_tokens).start()
        print(f"collector listening on {c.address}", flush=True)  # tools wait for this line
        try:
            wait_for_stop(lambda: True, sigterm, poll_s=0.2, logger=log)
        finally:
            log.info("stopping collector")
            c.stop()  # drains the store writers itself, within drain_timeout_s
