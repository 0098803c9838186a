"""The per-episode state machine: every message of a stream (hello, start, frames, segment, end) -> an
``Ack`` or a ``Reject``, and the open episodes' state (:class:`_Episode`)."""

from __future__ import annotations

import logging
import math
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from vla_rl_client.codec import to_tensor
from vla_rl_client.proto import collector_pb2 as pb
from vla_rl_client.spec import MAX_SPEC_JSON_CHARS, RobotSpec, SpecError
from vla_rl_client.wire import WireTensor

from fleet.codecs import CameraCodecs
from fleet.collector.config import _ID_RE, CollectorConfig
from fleet.collector.metrics import HIDDEN_ROBOT, RobotAccount, _Metrics
from fleet.collector.rpc import SC, RequestError, _episode_of, _Session, undecodable_reject
from fleet.store import EpisodeStore
from fleet.store.layout import block_bytes
from fleet.wal import (
    SEGMENT_KINDS,
    LogFiles,
    Unavailable,
    WriteAheadLog,
    batch_size,
    decode_frames,
    frames_declared,
)
from vla_rl.core.rpc import RateLimitedLog, Undecodable, echo
from vla_rl.core.version import __version__

log = logging.getLogger("vla_rl.collector")

ABORTED = "aborted"  # outcome of an episode closed by the collector after episode_idle_timeout_s


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


def check_values(batch: dict[str, Any], spec: RobotSpec, max_abs: float) -> None:
    """Finite is not enough: refuse values no robot reports (beyond +-``max_abs``, the ``max_value_abs``
    knob) and actions outside the spec's ``action_range``, before anything is logged. A 3e38 would be
    stored, trained on and overflow every statistic over it; :class:`SpecError` names the field."""
    spec.check_action_range(batch["action"], name="frames.action")
    for name in ("state", "action", "proposed_action", "reward"):
        arr = batch.get(name)
        if arr is None or not np.size(arr):
            continue
        big = np.abs(arr) > max_abs  # NaN (a proposal's "none") compares False
        if big.any():
            at = np.argwhere(big)[0]
            raise SpecError(
                f"frames.{name}",
                f"values within +-{max_abs:g} (max_value_abs)",
                f"{float(arr[tuple(at)]):.6g} (frame {int(at[0])})",
            )


def _frames_in(msg: pb.RobotMessage) -> int:
    return frames_declared(msg)


class _EpisodeIntake:
    """The message handlers of :class:`~fleet.collector.collector.Collector` (a mixin: the collector holds
    the state they read and the store writers they hand the log to)."""

    config: CollectorConfig
    store: EpisodeStore
    camera_codecs: CameraCodecs
    allowed_robots: frozenset[str] | None
    wal_dir: Path
    log_files: LogFiles
    metrics: _Metrics
    accounts: dict[str, RobotAccount]
    _connected: dict[str, int]
    _episodes: dict[str, _Episode]
    _episodes_lock: threading.Lock
    _start_locks: dict[str, tuple[threading.Lock, int]]
    _start_locks_guard: threading.Lock
    _undecodable: RateLimitedLog
    _refused: RateLimitedLog

    def _resume(self, eid: str, robot_id: str, spec: RobotSpec) -> _Episode:
        raise NotImplementedError

    def _assign_writer(self) -> int:
        raise NotImplementedError

    def _hand_off(self, ep: _Episode, nbytes: int) -> None:
        raise NotImplementedError

    def _label(self, robot: str) -> str:
        """A metric's robot label (metrics_robot_labels=False: one label for all robots)."""
        return robot if self.config.metrics_robot_labels else HIDDEN_ROBOT

    def handle(
        self,
        session: _Session,
        msg: pb.RobotMessage,
        raw: bytes | None = None,
        cameras: dict[str, WireTensor] | None = None,
    ) -> pb.CollectorMessage:
        """One message of a stream -> its reply. Raises :class:`Unavailable` to end the stream.

        ``raw`` is the message as received; the log stores it as is (re-serialising a message with camera
        batches costs CPU per frame: docs/store.md, Write-path costs behind the design). ``cameras``: see
        :func:`parse_message`.
        """
        session.raw, session.cameras = raw, cameras
        body = msg.WhichOneof("body")
        try:
            if body == "frames":
                # Every declared size against its bound before anything is counted or allocated.
                if frames_declared(msg) > self.config.max_batch_frames:
                    raise RequestError(
                        SC.RESOURCE_EXHAUSTED,
                        f"frames: at most {self.config.max_batch_frames} frames per batch (max_batch_frames), "
                        f"got {frames_declared(msg)}; split it",
                    )
                batch_size(msg.frames, self.config.max_batch_frames, cameras)
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
        self,
        session: _Session,
        e: BaseException,
        msg: pb.RobotMessage | None = None,
        raw: bytes | None = None,
    ) -> pb.CollectorMessage:
        """The reply to a message that could not be decoded (``msg``: None when its bytes ``raw`` did not
        parse), counted and logged once per peer per minute."""
        reply = undecodable_reject(e, msg, raw)
        robot = session.robot_id or "unknown"
        self.metrics.messages_rejected.labels(self._label(robot), SC.INVALID_ARGUMENT.name).inc()
        self._undecodable.warning(
            session.peer or robot,
            "undecodable",
            "undecodable message refused",
            robot=robot,
            error=reply.reject.message,
        )
        return reply

    def undecodable_request(self, peer: str, identity: str | None, request: Undecodable) -> RequestError:
        """The refusal (``INVALID_ARGUMENT``, naming the field) of a ``GetStats`` request that does not parse,
        logged with the undecodable messages (once per peer per minute)."""
        robot = identity or "unknown"
        self._undecodable.warning(
            peer or robot, "undecodable", "undecodable request refused", robot=robot, error=request.message
        )
        return RequestError(SC.INVALID_ARGUMENT, request.message)

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
            session.peer or robot,
            code,
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
        if not _ID_RE.fullmatch(h.robot_id):
            raise RequestError(
                SC.INVALID_ARGUMENT, f"hello.robot_id: expected {_ID_RE.pattern}, got {echo(h.robot_id)}"
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
        if len(h.robot_spec_json) > MAX_SPEC_JSON_CHARS:
            raise RequestError(
                SC.RESOURCE_EXHAUSTED,
                f"hello.robot_spec_json: {len(h.robot_spec_json)} characters; a robot spec (its names, "
                f"instruction and extras) may have at most {MAX_SPEC_JSON_CHARS}",
            )
        try:
            spec = RobotSpec.from_json(h.robot_spec_json)
        except (ValueError, TypeError) as e:
            raise RequestError(
                SC.INVALID_ARGUMENT, f"hello.robot_spec_json: expected a robot spec, {e}"
            ) from None
        for cam in spec.cameras:
            if cam.height * cam.width > self.config.max_camera_pixels:
                raise RequestError(
                    SC.RESOURCE_EXHAUSTED,
                    f"hello.robot_spec_json: camera {cam.name!r} is {cam.width}x{cam.height} = "
                    f"{cam.height * cam.width} pixels; this collector takes at most max_camera_pixels="
                    f"{self.config.max_camera_pixels}",
                )
        # What one open episode makes a store writer hold: a chunk block of each array.
        block = block_bytes(spec, self.config.chunk_len)
        if block > self.config.max_buffered_bytes:
            raise RequestError(
                SC.RESOURCE_EXHAUSTED,
                f"hello.robot_spec_json: one chunk of this robot's frames is {block} bytes (chunk_len="
                f"{self.config.chunk_len}); this collector holds at most max_buffered_bytes={self.config.max_buffered_bytes}",
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
                max_batch_frames=self.config.max_batch_frames,
                max_message_bytes=self.config.max_message_bytes,
            )
        )

    def _start(self, session: _Session, msg: pb.RobotMessage) -> pb.CollectorMessage:
        s = msg.start
        eid = s.episode_id
        if not _ID_RE.fullmatch(eid):
            raise RequestError(
                SC.INVALID_ARGUMENT, f"start.episode_id: expected {_ID_RE.pattern}, got {echo(eid)}"
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
        if n >= self.config.max_open_episodes_per_robot:
            raise RequestError(
                SC.RESOURCE_EXHAUSTED,
                f"start: robot {robot!r} has {n} open episodes, the most this collector keeps "
                f"(max_open_episodes_per_robot={self.config.max_open_episodes_per_robot}); end one first "
                f"(idle ones are closed as {ABORTED!r} after episode_idle_timeout_s="
                f"{self.config.episode_idle_timeout_s:g})",
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
            chunk_len=self.config.chunk_len,
            episode_id=eid,
            camera_zstd_level=self.config.camera_zstd_level if session.spec.cameras else None,
            camera_codec=self.camera_codecs.restrict(session.spec.camera_names),
        )
        ep = _Episode(
            id=eid,
            robot_id=session.robot_id,
            spec=session.spec,
            wal=WriteAheadLog(self.wal_dir / f"{eid}.wal", self.config.fsync, self.log_files),
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
            if _ID_RE.fullmatch(eid):
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
                SC.NOT_FOUND, f"{body}.episode_id: no open episode {echo(eid)} (send StartEpisode first)", eid
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
        if _frames_in(msg) > self.config.max_batch_frames:
            raise RequestError(
                SC.RESOURCE_EXHAUSTED,
                f"frames: at most {self.config.max_batch_frames} frames per batch, got {_frames_in(msg)}; split it",
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
        batch = decode_frames(fb, ep.spec, self.config.max_batch_frames, -math.inf, cams)
        check_values(batch, ep.spec, self.config.max_value_abs)
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
