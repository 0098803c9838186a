"""Robot side of the fleet collector: stream episodes, keep what is not acknowledged, survive restarts.

    client = RobotClient("127.0.0.1:50071", robot_id="arm-7", spec=spec, task="maniskill/PushCube-v1")
    eid = client.start_episode()                      # segment 0: autonomous, policy in control
    client.add_frame(cameras=..., state=..., action=..., proposed_action=..., reward=r, revision=commit,
                     uncertainty=result.uncertainty,   # the scores of the chunk the action came from
                     failure=result.failure)
    client.begin_segment("intervention", "human", reason="no progress for 10 steps")
    ...
    client.end_episode("success")
    client.close()                                    # waits (bounded) until everything is acknowledged

The control loop never waits for the network: ``add_frame`` validates the frame against the spec (a bad
frame raises :class:`~vla_rl_client.spec.SpecError` at once, naming the field), buffers it and returns. A
background thread batches frames (``max_batch_frames`` or ``batch_interval_s``, whichever comes first),
streams them, and drops them from the buffer only when the collector acknowledges them as durable. If the
collector goes away, the thread reconnects with backoff and resends everything not acknowledged; the
collector drops what it already has, so nothing is lost or stored twice. The buffer is in memory and
bounded (``max_buffer_bytes``): when it is full, ``add_frame`` waits up to ``block_s`` and then raises
:class:`BufferFull`, so a robot offline for too long notices instead of silently losing frames.
With ``spool_dir``, every message is also appended to a file there before it can be sent, and the file
is deleted once its episode is acknowledged as ended: a robot process that dies loses nothing it had
sealed into a message (only the batch being filled, at most ``max_batch_frames``). The next client with
that ``spool_dir`` resends it and ends an unfinished episode as ``aborted``.

Needs numpy and grpcio only (no torch); messages use the same tensor codec as the policy client, except
that camera pixels are written onto the wire directly (see :mod:`vla_rl_client.wire`). ``close()`` leaves no
stream or thread behind, so a robot program exits as soon as it returns.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from vla_rl_client import __version__, wire
from vla_rl_client.codec import to_tensor
from vla_rl_client.frame import Frame
from vla_rl_client.meta import Controller, SegmentKind, new_episode_id
from vla_rl_client.proto import collector_pb2 as pb
from vla_rl_client.spec import MAX_SPEC_JSON_CHARS, RobotSpec, SpecError

log = logging.getLogger("vla_rl.robot_client")

__all__ = ["BufferFull", "ClientStats", "RobotClient"]

_KIND = {
    SegmentKind.AUTONOMOUS: pb.AUTONOMOUS,
    SegmentKind.INTERVENTION: pb.INTERVENTION,
    SegmentKind.RESET: pb.RESET,
}
_END = object()
_FATAL = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
_F32_MAX = float(np.finfo(np.float32).max)


def _failure_score(value: Any) -> float:
    """A frame's ``failure`` score as a float: a probability in [0, 1], or NaN for none (None or NaN)."""
    try:
        p = float("nan") if value is None else float(value)
    except (TypeError, ValueError):
        raise SpecError("failure", "a number in [0, 1] or None", repr(value)[:80]) from None
    if not (math.isnan(p) or 0.0 <= p <= 1.0):
        raise SpecError("failure", "a score in [0, 1], or None / NaN for none", repr(value)[:80])
    return p


class BufferFull(RuntimeError):
    """The unacknowledged-frames buffer stayed full for ``block_s``: the collector is unreachable or too slow."""


@dataclass
class _Item:
    """One message waiting for its acknowledgement, serialised once (it may be sent more than once)."""

    kind: str  # start | frames | segment | end
    data: bytes  # the RobotMessage as it goes on the wire
    msg_id: int
    nbytes: int
    seq_end: int = 0  # frames: seq + n
    index: int = 0  # segment index
    t_first: float = 0.0  # frames: perf_counter() when the batch's first frame was added
    frames: int = 0  # frames: how many
    frame_bytes: int = 0  # frames: what they count for in the buffer limit


@dataclass
class _Ep:
    id: str
    start: _Item
    pending: collections.deque[_Item] = field(default_factory=collections.deque)
    frames: int = 0  # frames added
    segments: int = 0  # segments begun
    controller: Controller = Controller.POLICY
    batch: list[tuple[Any, ...]] = field(default_factory=list)  # scalars of each batched frame
    batch_t0: float = 0.0
    batch_bytes: int = 0
    committed: int = 0
    ended_sent: bool = False
    last_ts: float = float("-inf")


@dataclass
class ClientStats:
    frames_added: int = 0
    frames_acked: int = 0
    messages_sent: int = 0
    messages_resent: int = 0
    duplicates_dropped_by_collector: int = 0
    reconnects: int = 0
    rejects: int = 0
    pending_frames: int = 0
    pending_bytes: int = 0
    connected: bool = False
    last_error: str = ""
    # send -> durable ack of each FrameBatch, and the age of its oldest frame at the ack (adds the batching wait)
    ack_latency_s: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=200_000))
    ack_at_s: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=200_000))
    """time.time() of each frames ack, paired with ``ack_latency_s`` (to split warm-up from steady state)."""
    frame_age_at_ack_s: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=200_000)
    )


class _Connection:
    def __init__(self, gen: int) -> None:
        self.gen = gen
        self.outq: queue.Queue[Any] = queue.Queue()
        self.welcome = threading.Event()
        self.dead = threading.Event()
        self.call: Any = None
        self.reader: threading.Thread | None = None


class _Spool:
    """Unacknowledged messages on disk, one file per episode (``<dir>/<episode>.spool``): length + CRC32 +
    the message as sent. Written before a message can be sent, deleted once its episode is acknowledged
    as ended, so a robot process that dies loses nothing it had sealed into a message."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, Any] = {}

    def append(self, eid: str, data: bytes) -> None:
        f = self._files.get(eid)
        if f is None:
            f = self._files[eid] = open(self.root / f"{eid}.spool", "ab", buffering=0)  # noqa: SIM115
        os.writev(f.fileno(), (wire.record_head(data), data))

    def done(self, eid: str) -> None:
        f = self._files.pop(eid, None)
        if f is not None:
            f.close()
        (self.root / f"{eid}.spool").unlink(missing_ok=True)

    def load(self) -> list[tuple[str, list[bytes]]]:
        """Every spooled episode (oldest first) with its intact records; a torn last record is cut off."""
        out = []
        for path in sorted(self.root.glob("*.spool"), key=lambda p: p.stat().st_mtime):
            data = path.read_bytes()
            records, pos = wire.parse_records(data)
            if pos < len(data):
                with open(path, "r+b") as f:
                    f.truncate(pos)
            out.append((path.stem, records))
        return out


class RobotClient:
    """Streams one robot's episodes to a collector (see the module docstring). Thread-safe."""

    def __init__(
        self,
        address: str,
        robot_id: str,
        spec: RobotSpec,
        task: str,
        *,
        token: str | None = None,
        max_batch_frames: int = 8,
        batch_interval_s: float = 0.05,
        max_buffer_bytes: int = 1024 * 1024 * 1024,
        block_s: float = 30.0,
        max_message_bytes: int = 32 * 1024 * 1024,
        reconnect_backoff_s: tuple[float, float] = (0.1, 2.0),
        spool_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        spec_json = spec.to_json()
        if len(spec_json) > MAX_SPEC_JSON_CHARS:  # the collector would refuse its Hello
            raise ValueError(
                f"spec: {len(spec_json)} characters as JSON; a robot spec (names, instruction, extras) may "
                f"have at most {MAX_SPEC_JSON_CHARS}"
            )
        self.address = address
        self.robot_id = robot_id
        self.spec = spec
        self.task = task
        self.max_batch_frames = max_batch_frames
        self.batch_interval_s = batch_interval_s
        self.max_buffer_bytes = max_buffer_bytes
        self.block_s = block_s
        self.max_message_bytes = max_message_bytes
        self._backoff = reconnect_backoff_s
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._hello = pb.RobotMessage(
            hello=pb.Hello(
                robot_id=robot_id, task=task, robot_spec_json=spec_json, client_version=__version__
            )
        ).SerializeToString()
        self._cond = threading.Condition()
        self._eps: dict[str, _Ep] = {}
        self._current: _Ep | None = None
        self._unsent: collections.deque[_Item] = collections.deque()
        self._inflight: dict[int, tuple[float, str, float]] = {}  # msg_id -> (sent, body, first frame added)
        self._ids = itertools.count(1)
        self._spool = _Spool(Path(spool_dir)) if spool_dir is not None else None
        self._conn: _Connection | None = None
        self._live: set[_Connection] = set()  # connections not dropped yet
        self._gens = itertools.count(1)
        self._closing = False
        self._stopped = threading.Event()
        self.stats = ClientStats()
        self.errors: list[str] = []
        self.fatal: str | None = None
        self._channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.max_receive_message_length", 4 * 1024 * 1024),
                ("grpc.keepalive_time_ms", 10_000),
                ("grpc.keepalive_timeout_ms", 5_000),
                ("grpc.initial_reconnect_backoff_ms", int(reconnect_backoff_s[0] * 1000)),
                ("grpc.min_reconnect_backoff_ms", int(reconnect_backoff_s[0] * 1000)),
                ("grpc.max_reconnect_backoff_ms", int(reconnect_backoff_s[1] * 1000)),
            ],
        )
        # Messages are serialised when they are built (see packages/vla-rl-client/vla_rl_client/wire.py), so the stream sends bytes as they are.
        self._stream = self._channel.stream_stream(
            f"/{pb.DESCRIPTOR.services_by_name['Collector'].full_name}/Stream",
            request_serializer=None,
            response_deserializer=pb.CollectorMessage.FromString,
        )
        # The pixels of the frames being batched, copied in by add_frame (reused: no allocation per frame).
        b = max_batch_frames
        self._cam_buf = {c.name: np.empty((b, *c.shape), np.uint8) for c in spec.cameras}
        self._vec_buf = {
            "state": np.empty((b, spec.state_dim), np.float32),
            "action": np.empty((b, spec.action_dim), np.float32),
            "proposed_action": np.empty((b, spec.action_dim), np.float32),
        }
        self._cam_heads: dict[tuple[str, int], bytes] = {}
        if self._spool is not None:
            with self._cond:
                self._restore_spool(self._spool)
        self._pump = threading.Thread(target=self._run, name=f"robot-client-{robot_id}", daemon=True)
        self._pump.start()

    # ------------------------------------------------------------------ robot API
    def start_episode(
        self,
        episode_id: str | None = None,
        instruction: str = "",
        kind: SegmentKind | str = SegmentKind.AUTONOMOUS,
        controller: Controller | str | int = Controller.POLICY,
        reason: str | None = None,
    ) -> str:
        """Open an episode (its id is returned) with segment 0 of ``kind`` under ``controller``."""
        eid = episode_id or new_episode_id(self.robot_id)
        with self._cond:
            if self._current is not None:
                raise RuntimeError(f"episode {self._current.id} is still open: end it first")
            if eid in self._eps:
                raise ValueError(f"episode {eid} was already started by this client")
            ep = _Ep(eid, self._item("start", start=pb.StartEpisode(episode_id=eid, instruction=instruction)))
            self._eps[eid] = ep
            self._current = ep
            if self._spool is not None:
                self._spool.append(eid, ep.start.data)
            self._unsent.append(ep.start)
            self._cond.notify_all()
        self.begin_segment(kind, controller, reason)
        return eid

    def begin_segment(
        self,
        kind: SegmentKind | str,
        controller: Controller | str | int,
        reason: str | None = None,
    ) -> int:
        """From the next frame on, ``controller`` is in control (a takeover, a handback, a reset); returns its index."""
        try:
            seg_kind = SegmentKind(kind)
        except ValueError:
            raise SpecError("segment.kind", f"one of {[k.value for k in SegmentKind]}", repr(kind)) from None
        ctrl = Controller.parse(controller)
        with self._cond:
            ep = self._need_episode()
            self._seal(ep)
            index = ep.segments
            marker = pb.SegmentMarker(
                episode_id=ep.id,
                index=index,
                start=ep.frames,
                kind=_KIND[seg_kind],
                controller=int(ctrl),
                reason=reason or "",
            )
            ep.segments += 1
            ep.controller = ctrl
            item = self._item("segment", segment=marker)
            item.index = index
            self._queue(ep, item)
        return index

    def add_frame(self, *args: Any, **fields: Any) -> int:
        """``add(Frame(...))``: the frame's fields by keyword (``cameras=..., state=..., action=...``, see
        :class:`~vla_rl_client.frame.Frame`); returns its sequence number (index in the episode)."""
        return self.add(Frame(*args, **fields))

    def add(self, frame: Frame) -> int:
        """Validate and buffer one frame; returns its sequence number (index in the episode).

        ``frame.uncertainty``: the policy server's score of the chunk the action came from
        (``ActResult.uncertainty``; None or NaN: none, e.g. a human's frame). ``frame.failure``: the learned
        failure predictor's score of that chunk (``ActResult.failure``, in [0, 1]; None or NaN: none). A
        batch without any score of a kind does not send that field.
        """
        cameras, state, action = frame.cameras, frame.state, frame.action
        proposed_action, reward, uncertainty = frame.proposed_action, frame.reward, frame.uncertainty
        spec = self.spec
        spec.check_images(cameras)
        spec.check_state(state)
        spec.check_action(action)
        spec.check_action_range(action)
        if proposed_action is None:
            proposed = np.full(spec.action_dim, np.nan, np.float32)
        else:
            spec.check_action(proposed_action, name="proposed_action", finite=False)
            if not (np.isnan(proposed_action).all() or np.isfinite(proposed_action).all()):
                raise SpecError(
                    "proposed_action", "finite values, or all NaN for no proposal", "a partly NaN row"
                )
            proposed = proposed_action
        if not np.isfinite(reward):
            raise SpecError("reward", "a finite number", repr(reward))
        try:
            score = float("nan") if uncertainty is None else float(uncertainty)
        except (TypeError, ValueError):
            raise SpecError("uncertainty", "a number or None", repr(uncertainty)[:80]) from None
        if abs(score) > _F32_MAX:  # sent as float32, that would be inf: the collector refuses it
            raise SpecError(
                "uncertainty", "a finite float32 score, or None / NaN for none", repr(uncertainty)
            )
        p_fail = _failure_score(frame.failure)
        frame_bytes = sum(int(c.nbytes) for c in cameras.values()) + state.nbytes + 2 * action.nbytes + 32
        deadline = time.monotonic() + self.block_s
        with self._cond:
            ep = self._need_episode()
            while self.stats.pending_bytes + frame_bytes > self.max_buffer_bytes:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BufferFull(
                        f"{self.stats.pending_bytes} bytes wait for the collector at {self.address} "
                        f"(limit {self.max_buffer_bytes}); last error: {self.stats.last_error or 'none'}"
                    )
                self._cond.wait(min(left, 0.1))
            ts = time.time() if frame.timestamp is None else float(frame.timestamp)
            ts = max(
                ts, ep.last_ts
            )  # the store needs non-decreasing times; a clock step back must not lose frames
            ep.last_ts = ts
            ctrl = ep.controller if frame.controller is None else Controller.parse(frame.controller)
            if not ep.batch:
                ep.batch_t0 = time.perf_counter()
                self._cond.notify_all()  # the sender times the batch from now
            # Copied now (the caller may reuse its arrays), into the batch's buffers.
            k = len(ep.batch)
            for name, img in cameras.items():
                self._cam_buf[name][k] = img
            vec = self._vec_buf
            vec["state"][k], vec["action"][k], vec["proposed_action"][k] = state, action, proposed
            ep.batch.append(
                (
                    float(reward),
                    bool(frame.terminated),
                    bool(frame.truncated),
                    int(ctrl),
                    frame.revision,
                    ts,
                    score,
                    p_fail,
                )
            )
            ep.batch_bytes += frame_bytes
            seq = ep.frames
            ep.frames += 1
            self.stats.frames_added += 1
            self.stats.pending_frames += 1
            self.stats.pending_bytes += frame_bytes
            # Seal at the frame limit, or early for big frames so a message stays well under the gRPC limit.
            if (
                len(ep.batch) >= self.max_batch_frames
                or self.batch_interval_s <= 0
                or ep.batch_bytes >= self.max_message_bytes // 4
            ):
                self._seal(ep)
        return seq

    def end_episode(self, outcome: str = "success", success: bool | None = None) -> None:
        """Close the current episode with its outcome (``success`` defaults to outcome == "success")."""
        with self._cond:
            ep = self._need_episode()
            self._seal(ep)
            end = pb.EndEpisode(episode_id=ep.id, length=ep.frames, outcome=outcome)
            if success is not None:
                end.success = bool(success)
            ep.ended_sent = True
            self._queue(ep, self._item("end", end=end))
            self._current = None

    @property
    def episode_id(self) -> str | None:
        return self._current.id if self._current else None

    def flush(self, timeout_s: float | None = 30.0) -> bool:
        """Send what is batched and wait until the collector acknowledged everything; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            if self._current is not None:
                self._seal(self._current)
            while self._outstanding():
                if self.fatal:
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(0.1 if left is None else min(left, 0.1))
        return True

    def close(self, timeout_s: float = 30.0) -> bool:
        """Flush (bounded by ``timeout_s``) and disconnect; returns whether everything was acknowledged."""
        ok = self.flush(timeout_s)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        # Leave no call or thread of this client behind, or the interpreter may wait for them at exit
        # (a robot process was once seen hanging in teardown for minutes after close() returned): the
        # sender stops; every stream gets its end-of-requests and is cancelled; the channel closes;
        # the readers (which see the cancellation) finish.
        self._pump.join(10.0)
        with self._cond:
            conns = list(self._live)
        for conn in conns:
            self._drop(conn)
        self._channel.close()
        for conn in conns:
            if conn.reader is not None:
                conn.reader.join(5.0)
        return ok

    def __enter__(self) -> RobotClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ spool
    def _restore_spool(self, spool: _Spool) -> None:
        """Take back what a previous process of this robot spooled and never got acknowledged.

        Its episodes are resent as they were; one it did not end is ended here as ``aborted`` at the
        frames it had sealed (frames still being batched when it died were never spooled).
        """
        loaded = spool.load()
        top = max((pb.RobotMessage.FromString(d).msg_id for _, recs in loaded for d in recs), default=0)
        self._ids = itertools.count(top + 1)  # ids stay unique: acks and rejects are matched by them
        for eid, records in loaded:
            ep: _Ep | None = None
            for data in records:
                msg = pb.RobotMessage.FromString(data)
                body = msg.WhichOneof("body")
                if body == "start":
                    ep = _Ep(eid, _Item("start", data, msg.msg_id, len(data)))
                    continue
                if ep is None:
                    break  # cannot happen: the start is spooled first
                item = _Item(body or "", data, msg.msg_id, len(data))
                if body == "frames":
                    n = int(msg.frames.action.shape[0])
                    item.seq_end, item.frames, item.frame_bytes = msg.frames.seq + n, n, len(data)
                    item.t_first = time.perf_counter()
                    ep.frames = max(ep.frames, item.seq_end)
                    self.stats.pending_frames += n
                    self.stats.pending_bytes += len(data)
                elif body == "segment":
                    item.index = msg.segment.index
                    ep.segments = max(ep.segments, item.index + 1)
                elif body == "end":
                    ep.ended_sent = True
                ep.pending.append(item)
            if ep is None:
                spool.done(eid)
                continue
            self._eps[eid] = ep
            self._unsent.append(ep.start)
            self._unsent.extend(ep.pending)
            if not ep.ended_sent:
                end = pb.EndEpisode(episode_id=eid, length=ep.frames, outcome="aborted", success=False)
                ep.ended_sent = True
                self._queue(ep, self._item("end", end=end))
            log.warning(
                "resending spooled episode of a previous run",
                extra={"robot": self.robot_id, "episode": eid, "frames": ep.frames},
            )

    # ------------------------------------------------------------------ buffering
    def _need_episode(self) -> _Ep:
        if self._current is None:
            raise RuntimeError("no open episode: call start_episode() first")
        return self._current

    def _outstanding(self) -> bool:
        # An ended episode stays in _eps until its end is acknowledged.
        return any(ep is not self._current or ep.pending or ep.batch for ep in self._eps.values())

    def _queue(self, ep: _Ep, item: _Item) -> None:
        if self._spool is not None:
            self._spool.append(ep.id, item.data)  # before it can be sent: a crash keeps it
        ep.pending.append(item)
        self._unsent.append(item)
        self._cond.notify_all()

    def _seal(self, ep: _Ep) -> None:
        """Turn the frames batched so far into one FrameBatch message (caller holds the lock)."""
        frames, ep.batch = ep.batch, []
        nbytes, ep.batch_bytes = ep.batch_bytes, 0
        if not frames:
            return
        n = len(frames)
        seq = ep.frames - n
        reward, terminated, truncated, controller, revs, times, scores, fails = zip(*frames, strict=True)
        fb = pb.FrameBatch(episode_id=ep.id, seq=seq)
        for key, buf in self._vec_buf.items():
            getattr(fb, key).CopyFrom(to_tensor(buf[:n]))
        fb.reward.CopyFrom(to_tensor(np.array(reward, np.float32)))
        fb.terminated.CopyFrom(to_tensor(np.array(terminated, np.bool_)))
        fb.truncated.CopyFrom(to_tensor(np.array(truncated, np.bool_)))
        fb.controller.CopyFrom(to_tensor(np.array(controller, np.uint8)))
        fb.timestamp.CopyFrom(to_tensor(np.array(times, np.float64)))
        # Unset = no score for any frame: old collectors never see the fields.
        for name, values in (("uncertainty", scores), ("failure", fails)):
            col = np.array(values, np.float32)
            if not np.isnan(col).all():
                getattr(fb, name).CopyFrom(to_tensor(col))
        if any(revs):
            fb.revision.extend(revs if len(set(revs)) > 1 else revs[:1])
        # The pixels bypass protobuf: one copy, from the batch buffers into the message (packages/vla-rl-client/vla_rl_client/wire.py).
        cams = []
        for cam in self.spec.cameras:
            head = self._cam_heads.get((cam.name, n))
            if head is None:
                head = self._cam_heads[(cam.name, n)] = wire.camera_entry(
                    cam.name, (n, *cam.shape), n * cam.height * cam.width * 3
                )
            cams.append((head, self._cam_buf[cam.name][:n].data))
        msg_id = next(self._ids)
        data = wire.frames_message(msg_id, fb.SerializeToString(), cams)
        item = _Item("frames", data, msg_id, len(data), seq + n, 0, ep.batch_t0, n, nbytes)
        self._queue(ep, item)

    def _item(self, kind: str, **body: Any) -> _Item:
        """A small message (start, segment, end), serialised with its id."""
        msg_id = next(self._ids)
        data = pb.RobotMessage(msg_id=msg_id, **body).SerializeToString()
        return _Item(kind, data, msg_id, len(data))

    # ------------------------------------------------------------------ network
    def _run(self) -> None:
        backoff = self._backoff[0]
        while True:
            with self._cond:
                if self._closing or self.fatal:
                    break
            conn = self._connect()
            if conn is not None and self._pump_connection(conn):
                backoff = self._backoff[0]
            with self._cond:
                if self._closing or self.fatal:
                    break
                self._cond.wait(backoff)
            backoff = min(backoff * 2, self._backoff[1])
        if self._conn is not None:
            self._drop(self._conn)
        self._stopped.set()

    def _connect(self) -> _Connection | None:
        conn = _Connection(next(self._gens))
        conn.outq.put(self._hello)
        with self._cond:
            if self._closing:
                return None
            try:
                conn.call = self._stream(
                    iter(conn.outq.get, _END), metadata=self._metadata, wait_for_ready=True
                )
            except (grpc.RpcError, ValueError) as e:  # ValueError: the channel is closed
                self.stats.last_error = str(e)
                return None
            self._live.add(conn)
        conn.reader = threading.Thread(
            target=self._read, args=(conn,), name=f"robot-client-read-{self.robot_id}", daemon=True
        )
        conn.reader.start()
        # Nothing but the Hello goes out before the Welcome: a refused Hello must not get the data refused.
        while not conn.welcome.wait(0.1):
            if conn.dead.is_set() or self._closing:
                self._drop(conn)
                return None
        with self._cond:
            self._conn = conn
            self.stats.connected = True
            if conn.gen > 1:
                self.stats.reconnects += 1
            # Resend everything not acknowledged, each episode from its StartEpisode on.
            self._unsent.clear()
            resent = 0
            for ep in self._eps.values():
                self._unsent.append(ep.start)
                self._unsent.extend(ep.pending)
                resent += len(ep.pending)
            if conn.gen > 1:
                self.stats.messages_resent += resent
        return conn

    def _pump_connection(self, conn: _Connection) -> bool:
        """Send queued messages until the connection dies (False) or the client closes (True)."""
        while True:
            with self._cond:
                while not self._unsent and not conn.dead.is_set() and not self._closing:
                    cur = self._current
                    if (
                        cur is not None
                        and cur.batch
                        and time.monotonic() - cur.batch_t0 >= self.batch_interval_s
                    ):
                        self._seal(cur)
                        continue
                    self._cond.wait(self.batch_interval_s if cur is not None and cur.batch else 0.5)
                if conn.dead.is_set():
                    self._drop(conn)
                    return False
                if self._closing:
                    self._drop(conn)
                    return True
                out = list(self._unsent)
                self._unsent.clear()
                now = time.perf_counter()
                for it in out:
                    # A resent message keeps its id: acks of the dropped connection were forgotten (_drop).
                    self._inflight[it.msg_id] = (now, it.kind, it.t_first if it.frames else now)
                    self.stats.messages_sent += 1
                    conn.outq.put(it.data)

    def _drop(self, conn: _Connection) -> None:
        conn.outq.put(_END)
        if conn.call is not None:
            conn.call.cancel()
        with self._cond:
            self._live.discard(conn)
            if self._conn is conn:
                self._conn = None
                self.stats.connected = False
            self._inflight.clear()

    def _read(self, conn: _Connection) -> None:
        try:
            for resp in conn.call:
                body = resp.WhichOneof("body")
                if body == "welcome":
                    w = resp.welcome
                    with self._cond:
                        self.max_batch_frames = max(
                            1, min(self.max_batch_frames, w.max_batch_frames or self.max_batch_frames)
                        )
                    conn.welcome.set()
                elif body == "ack":
                    self._on_ack(resp.ack)
                elif body == "reject":
                    self._on_reject(resp.reject, conn)
        except grpc.RpcError as e:
            code = e.code()  # type: ignore[attr-defined]
            if code != grpc.StatusCode.CANCELLED:
                self.stats.last_error = f"{code.name}: {e.details()}"  # type: ignore[attr-defined]
                log.warning(
                    "collector stream ended", extra={"robot": self.robot_id, "error": self.stats.last_error}
                )
            if code in _FATAL:
                with self._cond:
                    self.fatal = self.stats.last_error
        finally:
            conn.dead.set()
            with self._cond:
                self._cond.notify_all()

    def _on_ack(self, ack: pb.Ack) -> None:
        now = time.perf_counter()
        with self._cond:
            sent = self._inflight.pop(ack.msg_id, None)
            if sent is not None and sent[1] == "frames":
                self.stats.ack_latency_s.append(now - sent[0])
                self.stats.ack_at_s.append(time.time())
                self.stats.frame_age_at_ack_s.append(now - sent[2])
            self.stats.duplicates_dropped_by_collector += ack.duplicates
            ep = self._eps.get(ack.episode_id)
            if ep is None:
                return
            ep.committed = max(ep.committed, ack.committed)
            while ep.pending:
                it = ep.pending[0]
                done = (
                    (it.kind == "frames" and it.seq_end <= ack.committed)
                    or (it.kind == "segment" and it.index < ack.segments)
                    or (it.kind == "end" and (ack.ended or ack.closed))
                )
                if not done:
                    break
                ep.pending.popleft()
                self._release(it, acked=True)
            if (ack.ended or ack.closed) and ep is not self._current:
                for it in ep.pending:
                    self._release(it, acked=True)
                ep.pending.clear()
                ep.ended_sent = True
                del self._eps[ep.id]
                if self._spool is not None:
                    self._spool.done(ep.id)
            self._cond.notify_all()

    def _release(self, it: _Item, acked: bool) -> None:
        """Forget a message's frames (acknowledged, or refused) in the buffer accounting."""
        if it.kind == "frames":
            self.stats.frames_acked += it.frames if acked else 0
            self.stats.pending_frames -= it.frames
            self.stats.pending_bytes -= it.frame_bytes

    def _on_reject(self, rej: pb.Reject, conn: _Connection) -> None:
        """A refused message can never succeed as it is: drop it and keep its error (nothing was stored)."""
        code = grpc.StatusCode.UNKNOWN
        for c in grpc.StatusCode:
            if c.value[0] == rej.code:
                code = c
        err = f"{code.name}: {rej.message}"
        log.error(
            "collector refused a message",
            extra={"robot": self.robot_id, "episode": rej.episode_id, "error": err},
        )
        with self._cond:
            self.stats.rejects += 1
            self.stats.last_error = err
            self.errors.append(err)
            self._inflight.pop(rej.msg_id, None)
            ep = self._eps.get(rej.episode_id)
            if ep is not None:
                for it in list(ep.pending):
                    if it.msg_id == rej.msg_id:
                        ep.pending.remove(it)
                        self._release(it, acked=False)
            self._cond.notify_all()
