"""The collector's write-ahead log and the decoding of what robots send: the part of the fleet collector
that the store writers (``fleet/store_writer.py``) share with it.

A log is one file per open episode, ``<store>/wal/<episode_id>.wal``, of records
``[u32 length][u32 crc32][payload]`` (:func:`vla_rl_client.wire.parse_records`) holding ``RobotMessage`` bytes
exactly as received (see ``fleet/collector/`` for how it makes "ack only when durable" and "exactly
once" cheap).
:func:`parse_message` reads such bytes (camera pixels as views, see ``packages/vla-rl-client/vla_rl_client/wire.py``) and
:func:`decode_frames` validates a ``FrameBatch`` against the robot's spec into ``EpisodeWriter`` input.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from vla_rl_client import wire
from vla_rl_client.codec import from_tensor
from vla_rl_client.frame import FRAME_FIELDS
from vla_rl_client.meta import EpisodeMeta, SegmentKind
from vla_rl_client.proto import collector_pb2 as pb
from vla_rl_client.spec import RobotSpec, SpecError
from vla_rl_client.wire import WireTensor

from fleet.store.layout import failure_scores_valid

WAL_DIR = "wal"  # under the store's root
SEGMENT_KINDS = {  # SegmentMarker.kind -> the store's kind
    pb.AUTONOMOUS: SegmentKind.AUTONOMOUS,
    pb.INTERVENTION: SegmentKind.INTERVENTION,
    pb.RESET: SegmentKind.RESET,
}


class Unavailable(Exception):
    """The collector cannot make this message durable now (disk error): end the stream, the client retries."""


# ------------------------------------------------------------------------------------------ write-ahead log
class LogFiles:
    """A bounded pool of open log file descriptors (least recently used closed first; reopened on demand).

    A collector with one descriptor per open episode ran out of them (``Too many open files``) and then
    could not even restart. Logs are opened for appending, so a closed one reopens at its end.
    """

    def __init__(self, max_open: int = 256) -> None:
        if max_open < 1:
            raise ValueError(f"max_open_logs: expected at least 1, got {max_open}")
        self.max_open = max_open
        self._open: collections.OrderedDict[WriteAheadLog, None] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.reopened = 0

    @contextlib.contextmanager
    def fd(self, wal: WriteAheadLog) -> Iterator[int]:
        """``wal``'s descriptor, open for the duration (the caller holds the log's own lock)."""
        with self._lock:
            if wal._fd is None:
                self._evict(self.max_open - 1)
                wal._fd = os.open(wal.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                self.reopened += wal._opened
                wal._opened = 1
            self._open[wal] = None
            self._open.move_to_end(wal)
            wal._busy += 1
        try:
            yield wal._fd
        finally:
            with self._lock:
                wal._busy -= 1

    def _evict(self, keep: int) -> None:
        for w in list(self._open):
            if len(self._open) <= keep:
                return
            if w._busy == 0 and w._fd is not None:
                os.close(w._fd)
                w._fd = None
                del self._open[w]

    def forget(self, wal: WriteAheadLog) -> None:
        with self._lock:
            self._open.pop(wal, None)
            if wal._fd is not None:
                os.close(wal._fd)
                wal._fd = None

    def __len__(self) -> int:
        return len(self._open)


class WriteAheadLog:
    """Append-only records ``[u32 length][u32 crc32][payload]`` in one file per open episode.

    Its descriptor comes from a shared :class:`LogFiles` pool and is open only while it is among the
    pool's most recently used (an idle episode costs no descriptor).
    """

    def __init__(self, path: Path, fsync: bool, files: LogFiles | None = None) -> None:
        self.path = path
        self.fsync = fsync
        self.files = files if files is not None else LogFiles(1)
        self._fd: int | None = None
        self._busy = 0
        self._opened = 0
        try:
            self.size = path.stat().st_size
        except FileNotFoundError:
            path.touch()
            self.size = 0

    @staticmethod
    def read(path: Path) -> tuple[list[bytes], int]:
        """Every intact record, and the byte offset where they end (a torn tail starts there)."""
        return WriteAheadLog.parse(path.read_bytes())

    @staticmethod
    def records(path: Path, start: int, end: int, *, torn_ok: bool = False) -> Iterator[bytes]:
        """The records in bytes ``[start, end)`` of the log at ``path`` (``start`` on a record boundary), read
        one at a time: a reader holds one record in memory, however far behind it is. At the first record
        that is not intact before ``end``: RuntimeError, or the end when ``torn_ok`` (a torn tail, cut by a
        kill, was never acknowledged)."""
        head_size = wire.RECORD_HEAD.size
        with open(path, "rb") as f:
            f.seek(start)
            pos = start
            while pos < end:
                head = f.read(head_size)
                n, crc = wire.RECORD_HEAD.unpack(head) if len(head) == head_size else (-1, 0)
                payload = f.read(n) if 0 <= n <= end - pos - head_size else b""
                if n < 0 or len(payload) != n or zlib.crc32(payload) != crc:
                    if torn_ok:
                        return
                    raise RuntimeError(f"log {path.name}: no intact record at byte {pos} of {end}")
                yield payload
                pos += head_size + n

    @staticmethod
    def parse(data: bytes) -> tuple[list[bytes], int]:
        """The intact records at the start of ``data`` (log bytes from a record boundary), and where they end."""
        return wire.parse_records(data)

    def append(self, payload: bytes) -> None:
        """Write one record; on failure cut the file back so no partial record stays behind."""
        start = self.size
        head = wire.record_head(payload)
        try:
            with self.files.fd(self) as fd:
                try:
                    # One system call, no copy into a buffer (O_APPEND: at the end).
                    done = os.writev(fd, (head, payload))
                    if done < len(head) + len(payload):  # a short write: rare, finish it
                        rest = memoryview(head + payload)[done:]
                        while rest:
                            rest = rest[os.write(fd, rest) :]
                    # Now in the page cache: survives a killed process.
                    if self.fsync:
                        os.fdatasync(fd)  # on the disk: survives power loss (one per message, not per frame)
                except OSError:
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, start)
                    raise
        except OSError as e:
            raise Unavailable(f"write-ahead log {self.path.name}: {e}") from e
        self.size = start + len(head) + len(payload)

    def close(self, delete: bool = False) -> None:
        self.files.forget(self)
        if delete:
            self.path.unlink(missing_ok=True)


@dataclass(frozen=True)
class LogBacklog:
    """What the write-ahead logs hold that the Zarr store does not have yet: acknowledged, durable, and
    applied by the next collector that starts (by design: a stop cuts the store writers off)."""

    episodes: int = 0
    """Open episodes whose log is ahead of their Zarr commit."""
    frames: int = 0
    """Acknowledged frames only in a log."""
    ends: int = 0
    """Episode ends only in a log (the episode is still open in the store)."""


def log_backlog(wal_dir: Path, committed: Callable[[str], EpisodeMeta | None]) -> LogBacklog:
    """Scan every log in ``wal_dir`` against ``committed`` (episode id -> its committed metadata, None when
    the store has no such episode): frames and ends past each open episode's commit. A log reads one
    record at a time; its torn tail, never acknowledged, is not counted."""
    episodes = frames = ends = 0
    for path in sorted(wal_dir.glob("*.wal")):
        meta = committed(path.stem)
        if meta is None or meta.is_closed:
            continue  # no episode (creation interrupted), or closed: nothing of it waits
        top, ended = meta.length, False
        for raw in WriteAheadLog.records(path, 0, path.stat().st_size, torn_ok=True):
            msg, _ = parse_message(raw)
            body = msg.WhichOneof("body")
            if body == "frames":
                top = max(top, msg.frames.seq + frames_declared(msg))
            ended = ended or body == "end"
        if top > meta.length or ended:
            episodes += 1
            frames += top - meta.length
            ends += ended
    return LogBacklog(episodes, frames, ends)


# ------------------------------------------------------------------------------------------ decoding
def parse_message(raw: bytes) -> tuple[pb.RobotMessage, dict[str, WireTensor] | None]:
    """A received message, and for a ``FrameBatch`` its cameras as views of ``raw`` (see packages/vla-rl-client/vla_rl_client/wire.py).

    The cameras are None when the message was parsed whole (then they are in the message).
    Raises protobuf's ``DecodeError`` for bytes that are not a ``RobotMessage``.
    """
    split = wire.split_cameras(raw)
    if split is None:
        return pb.RobotMessage.FromString(raw), None
    small, cameras = split
    return pb.RobotMessage.FromString(small), cameras


# FrameBatch's tensor fields besides the cameras: the store's frame fields, less the two that are not tensors.
_TENSOR_FIELDS = tuple(sorted(FRAME_FIELDS - {"cameras", "revision"}))
MAX_DIM = 1 << 31  # any one declared dimension


def batch_size(
    msg: pb.FrameBatch, max_frames: int, wire_cameras: Mapping[str, WireTensor] | None = None
) -> int:
    """The number of frames a ``FrameBatch`` declares, after checking every declared shape against bounds.

    Nothing is allocated or counted from a batch before this passes: each tensor's dims must be
    non-negative, at most 8 of them, each below 2**31, with the batch's leading dim N (1..``max_frames``)
    first. Raises :class:`SpecError` naming the field. Data sizes are checked later by
    :func:`decode_frames` (against these shapes).
    """
    if not msg.HasField("action"):
        raise SpecError("frames.action", "float32 [N, action_dim]", "nothing (missing)")
    dims = list(msg.action.shape)
    if len(dims) != 2 or any(not 0 <= d < MAX_DIM for d in dims):
        raise SpecError("frames.action", "float32 [N, action_dim] with N >= 1", f"shape {dims}")
    n = dims[0]
    if n < 1:
        raise SpecError("frames", "at least one frame", "an empty batch")
    if n > max_frames:
        raise SpecError("frames", f"at most {max_frames} frames per batch", f"{n} frames")
    tensors: list[tuple[str, Any]] = [
        (f"frames.{name}", getattr(msg, name)) for name in _TENSOR_FIELDS if msg.HasField(name)
    ]
    cams: Mapping[str, Any] = msg.cameras if wire_cameras is None else wire_cameras
    tensors += [(f"frames.cameras.{k}", t) for k, t in cams.items()]
    for key, t in tensors:
        shape = list(t.shape)
        if not shape or len(shape) > 8 or any(not 0 <= d < MAX_DIM for d in shape) or shape[0] != n:
            raise SpecError(
                key, f"a tensor of at most 8 non-negative dims, leading dim {n}", f"shape {shape}"
            )
    if len(msg.revision) > n:
        raise SpecError("frames.revision", f"no, one or {n} strings", f"{len(msg.revision)} strings")
    return n


def frames_declared(msg: pb.RobotMessage) -> int:
    """Frames a message declares for accounting: 0 unless it is a batch whose leading dim is sane."""
    if msg.WhichOneof("body") != "frames":
        return 0
    dims = list(msg.frames.action.shape)
    return dims[0] if len(dims) == 2 and 0 <= dims[0] < MAX_DIM else 0


def decode_frames(
    msg: pb.FrameBatch,
    spec: RobotSpec,
    max_frames: int,
    last_ts: float,
    wire_cameras: Mapping[str, WireTensor] | None = None,
) -> dict[str, Any]:
    """A validated ``FrameBatch`` as ``EpisodeWriter.add_frames`` input; :class:`SpecError` names the field.

    ``wire_cameras`` (from :func:`parse_message`) replaces ``msg.cameras``; its arrays are read-only
    views of the received bytes.
    """
    if not msg.HasField("action"):
        raise SpecError("frames.action", f"float32 [N, {spec.action_dim}]", "nothing (missing)")
    dims = list(msg.action.shape)
    if len(dims) != 2:
        raise SpecError("frames.action", f"float32 [N, {spec.action_dim}]", f"shape {dims}")
    n = dims[0]
    if n < 1:
        raise SpecError("frames", "at least one frame", "an empty batch")
    if n > max_frames:
        raise SpecError("frames", f"at most {max_frames} frames per batch", f"{n} frames")
    A, S = spec.action_dim, spec.state_dim

    def tensor(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        return from_tensor(_Once(getattr(msg, name)), f"frames.{name}", dtype=dtype, shape=shape)

    def finite(name: str, arr: np.ndarray) -> np.ndarray:
        if not np.isfinite(arr).all():
            raise SpecError(f"frames.{name}", "finite values", "NaN or inf")
        return arr

    wire_cams: Mapping[str, Any] = msg.cameras if wire_cameras is None else wire_cameras
    extra = set(wire_cams) - set(spec.camera_names)
    if extra:
        raise SpecError(
            f"frames.cameras.{sorted(extra)[0]}",
            f"only cameras {list(spec.camera_names)}",
            "an unknown camera",
        )
    cameras = {}
    for cam in spec.cameras:
        key = f"frames.cameras.{cam.name}"
        if cam.name not in wire_cams:
            raise SpecError(key, f"uint8 [{n}, {cam.height}, {cam.width}, 3]", "nothing (camera missing)")
        t = wire_cams[cam.name]
        cameras[cam.name] = from_tensor(
            _Once(t) if wire_cameras is None else t, key, dtype="uint8", shape=(n, *cam.shape)
        )
    out: dict[str, Any] = {
        "cameras": cameras,
        "state": finite("state", tensor("state", "float32", (n, S))),
        "action": finite("action", tensor("action", "float32", (n, A))),
    }
    if msg.HasField("proposed_action"):
        p = tensor("proposed_action", "float32", (n, A))
        ok = np.isnan(p).all(axis=1) | np.isfinite(p).all(axis=1)
        if not ok.all():
            raise SpecError(
                "frames.proposed_action",
                "finite rows, or all-NaN rows for no proposal",
                f"a partly NaN row ({int(np.argmin(ok))})",
            )
        out["proposed_action"] = p
    if msg.HasField("reward"):
        out["reward"] = finite("reward", tensor("reward", "float32", (n,)))
    for name in ("terminated", "truncated"):
        if msg.HasField(name):
            out[name] = tensor(name, "bool", (n,))
    if msg.HasField("controller"):
        c = tensor("controller", "uint8", (n,))
        if (c > 2).any():
            raise SpecError(
                "frames.controller", "codes 0 (policy), 1 (human) or 2 (scripted)", f"{int(c.max())}"
            )
        out["controller"] = c
    if msg.HasField("uncertainty"):
        u = tensor("uncertainty", "float32", (n,))
        if np.isinf(u).any():
            raise SpecError("frames.uncertainty", "finite scores, or NaN for no score", "inf")
        out["uncertainty"] = u
    if msg.HasField("failure"):  # unset (an older robot, or nothing scored): NaN for every frame
        f = tensor("failure", "float32", (n,))
        if not failure_scores_valid(f):
            raise SpecError(
                "frames.failure", "scores in [0, 1], or NaN for no score", "a value outside [0, 1]"
            )
        out["failure"] = f
    revs = list(msg.revision)
    if len(revs) not in (0, 1, n):
        raise SpecError("frames.revision", f"no, one or {n} strings", f"{len(revs)} strings")
    if any(len(r) > 256 for r in revs):
        raise SpecError("frames.revision", "at most 256 characters", "a longer string")
    out["revision"] = revs if len(revs) == n else (revs[0] if revs else "")
    if not msg.HasField("timestamp"):
        raise SpecError(
            "frames.timestamp", f"float64 [{n}]", "nothing (the collector fills it in on arrival)"
        )
    ts = finite("timestamp", tensor("timestamp", "float64", (n,)))
    if ts[0] < last_ts or (np.diff(ts) < 0).any():
        raise SpecError(
            "frames.timestamp", f"non-decreasing times (last stored {last_ts:.6f})", "a time going back"
        )
    out["timestamp"] = ts
    return out


class _Once:
    """A wire tensor whose bytes are read once: every access of a protobuf bytes field makes a new copy,
    and ``from_tensor`` reads ``data`` twice (length check, then the array); what that cost per camera
    batch: docs/store.md, Write-path costs behind the design."""

    __slots__ = ("data", "dtype", "shape")

    def __init__(self, t: Any) -> None:
        self.dtype, self.shape, self.data = t.dtype, t.shape, t.data
