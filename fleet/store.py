"""Append-only Zarr v3 episode store.

Layout::

    <root>/zarr.json                      root group (attrs mark it as an episode store)
    <root>/episodes/zarr.json             plain group, so ``zarr.open_group(root)`` reaches every episode
    <root>/episodes/<episode_id>/         one zarr group per episode
        zarr.json                         group attrs: the episode's creation metadata (informational)
        commit.json                       the commit record: committed length + all metadata (authoritative)
        cameras/<name>                    uint8   [T, H, W, 3]
        state, action, proposed_action    float32 [T, S] / [T, A] / [T, A] (all-NaN row = no proposal)
        reward                            float32 [T]
        terminated, truncated             bool    [T]
        controller                        uint8   [T]  (:class:`Controller`)
        segment                           int32   [T]  (index into the segments list)
        revision                          int16   [T]  (index into the revisions table)
        timestamp                         float64 [T]  (unix seconds)
        uncertainty                       float32 [T]  (the policy's per-chunk score, NaN = none; optional)

``uncertainty`` is *optional*: episodes recorded before it existed have no such array, read it as None
(:attr:`Episode.uncertainty`), pass ``verify`` without it, and, resumed by a newer writer, stay without
it (their scores are dropped, not back-filled). Every episode created now has it (all NaN when nothing
was scored).

One group per episode means concurrent writers of *different* episodes, even in different processes,
never touch the same array (two processes appending to one zarr array corrupt it).

Commit protocol. A writer buffers validated frames in memory and writes them in chunk-aligned blocks
(one-frame appends rewrite the whole chunk and are ~50x slower). After a block's data is in every
array, the writer replaces ``commit.json`` atomically (temp file + optional fsync + ``os.replace``)
with the new committed length. Arrays may be longer than that: the writer grows them ahead of the
data, and a writer killed between writing data and committing leaves rows nobody committed. Readers
trust only ``commit.json``'s length, so such rows are never returned.

Why a separate file rather than zarr attributes: zarr 3.4's ``LocalStore`` does write each key through
a temp file and ``os.replace``, so ``zarr.json`` is atomic against a killed process, but it never
fsyncs and a killed write leaves ``*.partial`` files behind; a dedicated commit file lets us order
data before commit explicitly, fsync both when asked, and snapshot length, segments and revisions
together in one atomic write.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import numcodecs
import numpy as np
import zarr
from vla_rl_client.meta import (
    STORE_VERSION,
    Controller,
    EpisodeDB,
    EpisodeMeta,
    Segment,
    SegmentKind,
    new_episode_id,
)
from vla_rl_client.spec import RobotSpec, SpecError
from zarr.codecs import BytesCodec, ZstdCodec

from fleet.codecs import CameraCodecs, JpegCodec, encode_chunk, jpeg_codec, merge_chunk
from fleet.objstore import (
    ObjectStore,
    ReadCache,
    cache_dir_from_env,
    cache_max_bytes,
    is_remote,
    read_cached,
    write_cached,
)

log = logging.getLogger(__name__)

STORE_FORMAT = "vla-rl-episode-store"
COMMIT_FILE = "commit.json"
DEFAULT_CHUNK_LEN = 64
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_MAX_REVISIONS = int(np.iinfo(np.int16).max) + 1
FRAME_FIELDS = frozenset(
    [
        "cameras",
        "state",
        "action",
        "proposed_action",
        "reward",
        "terminated",
        "truncated",
        "controller",
        "revision",
        "timestamp",
        "uncertainty",
    ]
)
OPTIONAL_ARRAYS = frozenset(["uncertainty"])
"""Arrays an episode may lack (it was recorded before they existed): read as None, not an error."""


@dataclass
class Episode:
    """The committed frames of one episode as numpy arrays (leading dim = ``meta.length``)."""

    meta: EpisodeMeta
    cameras: dict[str, np.ndarray]
    state: np.ndarray
    action: np.ndarray
    proposed_action: np.ndarray
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    controller: np.ndarray
    segment: np.ndarray
    revision: np.ndarray
    timestamp: np.ndarray
    uncertainty: np.ndarray | None = None
    """float32 [T]: the policy's score of the chunk each frame's action came from (NaN: none);
    None for an episode recorded before the store kept it."""

    @property
    def length(self) -> int:
        return self.meta.length

    @property
    def has_proposal(self) -> np.ndarray:
        """bool [T]: whether the policy proposed an action at each frame."""
        return ~np.isnan(self.proposed_action).all(axis=1)


def _layout(spec: RobotSpec) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]:
    """Array name -> (per-frame shape, dtype) for every array of an episode with this spec."""
    out: dict[str, tuple[tuple[int, ...], np.dtype[Any]]] = {
        f"cameras/{c.name}": (c.shape, np.dtype(np.uint8)) for c in spec.cameras
    }
    out.update(
        state=((spec.state_dim,), np.dtype(np.float32)),
        action=((spec.action_dim,), np.dtype(np.float32)),
        proposed_action=((spec.action_dim,), np.dtype(np.float32)),
        reward=((), np.dtype(np.float32)),
        terminated=((), np.dtype(np.bool_)),
        truncated=((), np.dtype(np.bool_)),
        controller=((), np.dtype(np.uint8)),
        segment=((), np.dtype(np.int32)),
        revision=((), np.dtype(np.int16)),
        timestamp=((), np.dtype(np.float64)),
        uncertainty=((), np.dtype(np.float32)),
    )
    return out


@functools.cache
def _write_pool() -> futures.ThreadPoolExecutor:
    """Threads that write one block's arrays concurrently.

    Compression (zstd releases the GIL) and file writes of different arrays then overlap: ~1.6x
    more frames/s on 2 cores than writing one array after another.
    """
    return futures.ThreadPoolExecutor(
        max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="episode-store"
    )


class _BlockPool:
    """Pending-frame blocks of closed writers, for the next ones (a collector opens an episode every few
    seconds per robot). A fresh 20 MB block page-faults on its first pass: ~0.2 ms of CPU per frame."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._free: dict[tuple[tuple[int, ...], str], list[np.ndarray]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        with self._lock:
            free = self._free.get((shape, dtype.str))
            if free:
                block = free.pop()
                self._bytes -= block.nbytes
                return block
        return np.empty(shape, dtype)

    def give(self, block: np.ndarray) -> None:
        with self._lock:
            if self._bytes + block.nbytes <= self.max_bytes:
                self._free.setdefault((block.shape, block.dtype.str), []).append(block)
                self._bytes += block.nbytes


_BLOCKS = _BlockPool(512 * 1024 * 1024)


# A forked child inherits the pool object but not its threads: jobs would never run. Start afresh.
os.register_at_fork(after_in_child=_write_pool.cache_clear)


_TEMPLATE_LOCK = threading.Lock()


@functools.lru_cache(maxsize=64)
def _episode_template(
    spec_json: str, chunk_len: int, camera_zstd_level: int | None, camera_codecs: CameraCodecs
) -> tuple[dict[str, Any], dict[str, bytes]]:
    """What zarr writes for an empty episode of this spec and layout: the root group's document (its
    attributes are per episode) and every other metadata file, by path relative to the episode. A camera
    whose codec is JPEG gets :class:`~fleet.codecs.JpegCodec` as its serializer and no compressor; a
    lossless one zstd at ``camera_zstd_level`` (None: zarr's default)."""
    import tempfile

    spec = RobotSpec.from_json(spec_json)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "episode"
        group = zarr.open_group(root, mode="w-")
        for key, (shape, dtype) in _layout(spec).items():
            fill: float | int | bool = (
                math.nan if key in ("proposed_action", "uncertainty") else False if dtype == np.bool_ else 0
            )
            extra: dict[str, Any] = {}
            codec = camera_codecs.of(key.removeprefix("cameras/")) if key.startswith("cameras/") else None
            if codec is not None and codec.kind == "jpeg":
                extra.update(serializer=JpegCodec(quality=codec.quality), compressors=None)
            elif camera_zstd_level is not None and codec is not None:
                extra["compressors"] = ZstdCodec(level=camera_zstd_level)
            group.create_array(
                key,
                shape=(0, *shape),
                chunks=(chunk_len, *(max(d, 1) for d in shape)),
                dtype=dtype,
                fill_value=fill,
                **extra,
            )
        files = {
            str(p.relative_to(root)): p.read_bytes()
            for p in sorted(root.rglob("*"))
            if p.is_file() and p != root / "zarr.json"
        }
        root_doc = json.loads((root / "zarr.json").read_text())
    return root_doc, files


ChunkEncoder = Callable[[np.ndarray], bytes]


def _chunk_encoder(arr: zarr.Array) -> ChunkEncoder | None:
    """Encode one whole chunk exactly as zarr would for this array, or None if its codecs are not ours.

    The store writes whole chunks itself (see ``EpisodeWriter._write``): going through
    ``zarr.Array.__setitem__`` cost ~2.3x the compression itself for a 128-frame camera chunk (its
    async codec pipeline, chunk selection and copies), and the same fixed cost again for each of the
    ten small arrays: 0.8 -> 0.6 ms of CPU per frame of two 224 px cameras with this path. Only the layout :func:`_episode_template`
    creates qualifies (bytes + zstd, or JPEG frames, regular chunks); anything else falls back to zarr.
    """
    jpeg = jpeg_codec(arr)
    if jpeg is not None:
        return functools.partial(encode_chunk, quality=jpeg.quality)
    codecs = arr.metadata.codecs
    if (
        arr.metadata.zarr_format != 3
        or len(codecs) != 2
        or not isinstance(codecs[0], BytesCodec)
        or not isinstance(codecs[1], ZstdCodec)
    ):
        return None
    endian = codecs[0].endian  # None for one-byte types; "little"/"big" (an Endian str enum) otherwise
    dtype = arr.dtype
    if dtype.itemsize > 1:
        if endian is None:
            return None
        dtype = dtype.newbyteorder("<" if endian == "little" else ">")
    zstd = numcodecs.Zstd(level=codecs[1].level, checksum=codecs[1].checksum)

    def encode(block: np.ndarray) -> bytes:
        return bytes(zstd.encode(np.ascontiguousarray(block, dtype=dtype)))

    return encode


def _put_atomic(path: Path, data: bytes) -> None:
    """Write a chunk file via a temporary and a rename, as zarr does: a reader (or a resumed writer
    merging a partial chunk) never sees a torn chunk."""
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.partial")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
    os.replace(tmp, path)


def _array(group: zarr.Group, key: str) -> zarr.Array:
    arr = group.get(key)
    if not isinstance(arr, zarr.Array):
        raise KeyError(f"array {key!r} is missing from {group.store_path}")
    return arr


def _group_doc(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """A Zarr v3 group's metadata document (what ``zarr.open_group`` writes)."""
    return {"zarr_format": 3, "node_type": "group", "attributes": dict(attributes)}


def _create_group_doc(directory: Path, doc: Mapping[str, Any]) -> bool:
    """Create ``directory/zarr.json`` unless it exists; returns whether this call created it.

    Safe with concurrent creators: the document is written to a temporary file and hard-linked into
    place, which fails (harmlessly) if another process got there first, so an existing document is never
    overwritten and a reader never sees a torn one.
    """
    target = directory / "zarr.json"
    tmp = directory / f".zarr.json.{uuid.uuid4().hex}.tmp"
    tmp.write_text(json.dumps(doc, indent=2), encoding="utf-8")
    try:
        os.link(tmp, target)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def outcome_known(meta: EpisodeMeta) -> bool:
    """Whether a closed episode's outcome was decided: ``"unknown"`` (e.g. a LeRobot dataset without
    ``next.success``) is not a failure, and success rates count only known outcomes."""
    return meta.is_closed and meta.outcome not in (None, "unknown") and meta.success is not None


def _check_id(what: str, value: str) -> str:
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise ValueError(f"{what} must match {_ID_RE.pattern}, got {value!r}")
    return value


def _write_json_atomic(path: Path, data: Mapping[str, Any], fsync: bool) -> None:
    """Replace ``path`` with ``data`` so that readers see the old or the new file, never a mix."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, sort_keys=True)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _scalars(name: str, value: Any, n: int | None, kind: str) -> np.ndarray:
    """A per-frame scalar field as an array of shape (n,) (or () for one frame) with dtype kind in ``kind``."""
    arr = np.asarray(value)
    want = () if n is None else (n,)
    if arr.dtype.kind not in kind or arr.shape != want:
        what = {"b": "bool", "fiu": "a real number"}[kind]
        raise SpecError(name, f"{what} of shape {list(want)}", f"{arr.dtype.name} of shape {list(arr.shape)}")
    return arr


class EpisodeWriter:
    """Appends frames to one open episode. Get one from :meth:`EpisodeStore.create_episode`.

    Frames are validated on entry (a bad frame raises :class:`SpecError` naming the field and leaves
    the writer and the store untouched), buffered, and written one chunk-aligned block at a time.
    :meth:`flush` writes and commits whatever is buffered; :meth:`close` flushes and records the
    outcome. Used as a context manager, an episode left unclosed (an exception, or a forgotten
    ``close``) is closed with outcome ``"aborted"``.
    """

    def __init__(
        self, store: EpisodeStore, meta: EpisodeMeta, group: zarr.Group, db: EpisodeDB | None
    ) -> None:
        self._store = store
        self._meta = meta
        self._dir = store.episodes_dir / meta.episode_id
        self._db = db
        # An optional array an older episode lacks stays absent (see the module docstring).
        self._layout = {
            k: v
            for k, v in _layout(meta.spec).items()
            if k not in OPTIONAL_ARRAYS or isinstance(group.get(k), zarr.Array)
        }
        # Camera chunks are never all zero in practice, and checking (zarr skips writing chunks that equal
        # the fill value) costs a pass over megabytes per chunk: ~15% of image write time.
        self._arrays: dict[str, zarr.Array] = {
            k: _array(group, k).with_config({"write_empty_chunks": True})
            if k.startswith("cameras/")
            else _array(group, k)
            for k in self._layout
        }
        # Direct chunk writes assume one chunk spans a block of rows and each frame whole.
        self._encoders = {
            k: _chunk_encoder(a)
            if a.chunks[0] == meta.chunk_len and tuple(a.chunks[1:]) == tuple(a.shape[1:])
            else None
            for k, a in self._arrays.items()
        }
        self._capacity = 0
        self._length = 0
        # Frames not yet written, copied straight into one reused block per array (rows [0, _n_pending)):
        # a list of per-batch copies joined by np.concatenate cost two more copies of every pixel, and
        # fresh buffers page-fault on every chunk.
        self._pending: dict[str, np.ndarray] = {}
        self._n_pending = 0
        self._revisions: list[str] = []
        self._revision_index: dict[str, int] = {}
        self._segments: list[Segment] = []
        self._last_timestamp = -math.inf
        self._closed = False

    def _restore(self) -> None:
        """Pick up an open episode's committed state (see :meth:`EpisodeStore.resume_episode`)."""
        meta = self._meta
        n = meta.length
        self._length = n
        # A writer killed while writing a chunk leaves its temporary file (up to a chunk, megabytes).
        # (An object store has none: a PUT is all or nothing.)
        if self._store.remote is None:
            for tmp in self._dir.rglob("*.partial"):
                tmp.unlink(missing_ok=True)
        # Arrays may be longer than the commit (grown ahead) and, after a writer killed in the middle of
        # growing or trimming them, of different lengths: bring them to one length, which close() trims.
        rows = {k: a.shape[0] for k, a in self._arrays.items()}
        cap = max(rows.values())
        for key, (shape, _) in self._layout.items():
            if rows[key] != cap:
                self._arrays[key].resize((cap, *shape))
        self._capacity = cap
        self._revisions = list(meta.revisions)
        self._revision_index = {r: i for i, r in enumerate(self._revisions)}
        segs = list(meta.segments)
        if segs and segs[-1].end is not None:  # cannot happen for an open episode; reopen defensively
            last = segs[-1]
            segs[-1] = Segment(last.index, last.kind, last.controller, last.start, None, last.reason)
        self._segments = segs
        self._last_timestamp = float(self._arrays["timestamp"][n - 1]) if n else -math.inf

    # ------------------------------------------------------------------ properties
    @property
    def episode_id(self) -> str:
        return self._meta.episode_id

    @property
    def spec(self) -> RobotSpec:
        return self._meta.spec

    @property
    def num_frames(self) -> int:
        """Frames accepted so far (committed + buffered)."""
        return self._length + self._n_pending

    @property
    def committed(self) -> int:
        """Frames a reader can see now."""
        return self._length

    @property
    def segments(self) -> tuple[Segment, ...]:
        """Segments begun so far (the last one still open, ``end`` None)."""
        return tuple(self._segments)

    @property
    def segment_index(self) -> int:
        """Index of the current segment, -1 before the first one."""
        return len(self._segments) - 1

    # ------------------------------------------------------------------ segments
    def begin_segment(
        self,
        kind: SegmentKind | str = SegmentKind.AUTONOMOUS,
        controller: Controller | str | int = Controller.POLICY,
        reason: str | None = None,
    ) -> int:
        """End the current segment at the current frame and start a new one; returns its index.

        Frames added afterwards belong to it. If frames arrive before any segment was begun, an
        autonomous segment controlled by the first frame's controller is started implicitly.
        """
        self._check_open()
        try:
            seg_kind = SegmentKind(kind)
        except ValueError:
            kinds = "|".join(k.value for k in SegmentKind)
            raise SpecError("segment.kind", f"one of {kinds}", repr(kind)) from None
        ctrl = Controller.parse(controller)
        if reason is not None and not isinstance(reason, str):
            raise SpecError("segment.reason", "a string or None", type(reason).__name__)
        self._end_segment()
        self._segments.append(Segment(len(self._segments), seg_kind, ctrl, self.num_frames, None, reason))
        return len(self._segments) - 1

    def _end_segment(self) -> None:
        if self._segments and self._segments[-1].end is None:
            last = self._segments[-1]
            self._segments[-1] = Segment(
                last.index, last.kind, last.controller, last.start, self.num_frames, last.reason
            )

    # ------------------------------------------------------------------ frames
    def add_frame(
        self,
        cameras: Mapping[str, np.ndarray],
        state: np.ndarray,
        action: np.ndarray,
        proposed_action: np.ndarray | None = None,
        reward: float = 0.0,
        terminated: bool = False,
        truncated: bool = False,
        controller: Controller | str | int | None = None,
        revision: str = "",
        timestamp: float | None = None,
        uncertainty: float | None = None,
    ) -> int:
        """Validate and buffer one frame; returns its index in the episode.

        ``action`` is what was executed, ``proposed_action`` what the policy proposed (None or an
        all-NaN row: no proposal). ``controller`` defaults to the current segment's controller,
        ``revision`` is the checkpoint revision that produced the action ("" for none), ``timestamp``
        defaults to now and may not go backwards. ``uncertainty`` is the policy's score of the chunk
        the action came from (None or NaN: none).
        """
        frame = {
            "cameras": cameras,
            "state": state,
            "action": action,
            "proposed_action": proposed_action,
            "reward": reward,
            "terminated": terminated,
            "truncated": truncated,
            "controller": controller,
            "revision": revision,
            "timestamp": timestamp,
            "uncertainty": uncertainty,
        }
        return self._add(frame, None)

    def add_frames(self, batch: Mapping[str, Any]) -> int:
        """Validate and buffer N frames given as stacked arrays; returns the index of the first.

        Keys: ``cameras`` ({name: uint8 [N,H,W,3]}), ``state`` [N,S], ``action`` [N,A] (float32) and,
        optionally, ``proposed_action`` ([N,A] float32, all-NaN rows = none), ``reward`` [N],
        ``terminated``/``truncated`` (bool [N]), ``controller`` (one value or [N]), ``revision`` (one
        string or N strings), ``timestamp`` ([N] float), ``uncertainty`` ([N] float, NaN = no score).
        The whole batch is checked before any frame is buffered.
        """
        action = batch.get("action")
        if not (isinstance(action, np.ndarray) and action.ndim == 2):
            got = f"shape {list(action.shape)}" if isinstance(action, np.ndarray) else type(action).__name__
            raise SpecError("action", f"float32 [N, {self.spec.action_dim}]", got)
        return self._add(batch, len(action)) if len(action) else self.num_frames

    def _add(self, frame: Mapping[str, Any], n: int | None) -> int:
        """Validate a frame (n=None) or a batch of n, then buffer it. Nothing changes on error."""
        self._check_open()
        unknown = set(frame) - FRAME_FIELDS
        if unknown:
            raise SpecError(
                sorted(unknown)[0], f"one of the frame fields {sorted(FRAME_FIELDS)}", "an unknown key"
            )
        spec = self.spec
        rows = 1 if n is None else n
        zeros = 0.0 if n is None else np.zeros(n, np.float32)
        falses = False if n is None else np.zeros(n, bool)
        cameras = frame.get("cameras", {})
        if not isinstance(cameras, Mapping):
            raise SpecError("cameras", "a mapping camera name -> image", type(cameras).__name__)
        spec.check_images(cameras, batch=n)
        spec.check_state(frame.get("state"), batch=n)
        spec.check_action(frame.get("action"), batch=n)
        proposed = frame.get("proposed_action")
        if proposed is None:
            proposed = np.full((rows, spec.action_dim), np.nan, np.float32)
        else:
            spec.check_action(proposed, name="proposed_action", batch=n, finite=False)
            p = proposed.reshape(rows, spec.action_dim)
            partial = ~(np.isnan(p).all(axis=1) | np.isfinite(p).all(axis=1))
            if partial.any():
                at = "" if n is None else f" (row {int(np.argmax(partial))})"
                raise SpecError(
                    "proposed_action",
                    "finite values, or all NaN for no proposal",
                    f"a partly NaN/inf row{at}",
                )
        rew = _scalars("reward", frame.get("reward", zeros), n, "fiu")
        if not np.isfinite(rew).all():
            raise SpecError("reward", "a finite number", "NaN or inf")
        term = _scalars("terminated", frame.get("terminated", falses), n, "b")
        trunc = _scalars("truncated", frame.get("truncated", falses), n, "b")
        ctrl = self._controllers(frame.get("controller"), rows, n)
        rev_idx, new_revs = self._revision_indices(frame.get("revision", ""), rows, n)
        ts = self._timestamps(frame.get("timestamp"), rows, n)
        unc = frame.get("uncertainty")
        if unc is None:
            unc = np.full(rows, np.nan, np.float32)
        else:
            unc = _scalars("uncertainty", unc, n, "fiu").astype(np.float32).reshape(rows)
            if np.isinf(unc).any():
                raise SpecError("uncertainty", "finite scores, or NaN for none", "inf")

        # Everything is valid: buffer (copies, so callers may reuse their arrays).
        if not self._segments:
            self.begin_segment(SegmentKind.AUTONOMOUS, Controller(int(ctrl[0])))
        for r in new_revs:
            self._revision_index[r] = len(self._revisions)
            self._revisions.append(r)
        first = self.num_frames
        block: dict[str, np.ndarray] = {f"cameras/{k}": v for k, v in cameras.items()}
        block.update(
            state=frame["state"],
            action=frame["action"],
            proposed_action=proposed,
            reward=rew,
            terminated=term,
            truncated=trunc,
            controller=ctrl,
            segment=np.full(rows, self.segment_index, np.int32),
            revision=rev_idx,
            timestamp=ts,
            uncertainty=unc,
        )
        self._reserve(self._n_pending + rows)
        at = self._n_pending
        for key, (shape, _) in self._layout.items():
            self._pending[key][at : at + rows] = np.reshape(block[key], (rows, *shape))
        self._n_pending += rows
        self._last_timestamp = float(ts[-1])
        total = self.num_frames
        boundary = total - total % self._meta.chunk_len
        if boundary > self._length:
            self._write(boundary - self._length)
        return first

    def _controllers(self, value: Any, rows: int, n: int | None) -> np.ndarray:
        if value is None:
            default = self._segments[-1].controller if self._segments else Controller.POLICY
            return np.full(rows, int(default), np.uint8)
        if n is None or isinstance(value, str | int | np.integer):
            return np.full(rows, int(Controller.parse(value)), np.uint8)
        arr = np.asarray(value)
        if arr.shape != (n,):
            raise SpecError("controller", f"one value or shape [{n}]", f"shape {list(arr.shape)}")
        return np.array(
            [int(Controller.parse(v.item() if isinstance(v, np.generic) else v)) for v in arr], np.uint8
        )

    def _revision_indices(self, value: Any, rows: int, n: int | None) -> tuple[np.ndarray, list[str]]:
        """Indices into the revisions table, and the revisions this adds to it (not yet added)."""
        if isinstance(value, str):
            names = [value] * rows
        elif n is not None and isinstance(value, Sequence | np.ndarray):
            names = [v.item() if isinstance(v, np.generic) else v for v in value]
        else:
            names = []
        if len(names) != rows or not all(isinstance(v, str) for v in names):
            raise SpecError("revision", "a string (or one string per frame)", repr(value)[:80])
        new: list[str] = []
        idx = np.empty(rows, np.int16)
        for i, name in enumerate(names):
            j = self._revision_index.get(name)
            if j is None:
                if name not in new:
                    new.append(name)
                j = len(self._revisions) + new.index(name)
            if j >= _MAX_REVISIONS:
                raise SpecError(
                    "revision", f"at most {_MAX_REVISIONS} distinct revisions per episode", "more"
                )
            idx[i] = j
        return idx, new

    def _timestamps(self, value: Any, rows: int, n: int | None) -> np.ndarray:
        if value is None:
            return np.full(rows, max(time.time(), self._last_timestamp), np.float64)
        arr = _scalars("timestamp", value, n, "fiu").astype(np.float64).reshape(rows)
        if not np.isfinite(arr).all():
            raise SpecError("timestamp", "finite unix seconds", "NaN or inf")
        if arr[0] < self._last_timestamp or (np.diff(arr) < 0).any():
            raise SpecError(
                "timestamp",
                f"non-decreasing times (last was {self._last_timestamp})",
                "a time going backwards",
            )
        return arr

    # ------------------------------------------------------------------ writing
    def _reserve(self, rows: int) -> None:
        """Make the pending blocks hold at least ``rows`` rows (a chunk, more if one batch spans chunks)."""
        have = len(self._pending["action"]) if self._pending else 0
        if rows <= have:
            return
        cap = max(rows, self._meta.chunk_len, 2 * have)
        for key, (shape, dtype) in self._layout.items():
            block = _BLOCKS.take((cap, *shape), dtype)
            if self._n_pending:
                block[: self._n_pending] = self._pending[key][: self._n_pending]
            if key in self._pending:
                _BLOCKS.give(self._pending[key])
            self._pending[key] = block

    def _release_blocks(self) -> None:
        for block in self._pending.values():
            _BLOCKS.give(block)
        self._pending = {}

    def _write(self, n: int) -> None:
        """Write the first ``n`` buffered frames at [committed, committed + n), then commit them."""
        start, end = self._length, self._length + n
        if end > self._capacity:
            # Grow ahead (doubling, whole chunks) so that resizing, which rewrites every array's
            # zarr.json, happens O(log T) times; rows past the committed length are never read.
            cl = self._meta.chunk_len
            cap = max(end, 2 * self._capacity)
            cap = -(-cap // cl) * cl
            for key, (shape, _) in self._layout.items():
                self._arrays[key].resize((cap, *shape))
            self._capacity = cap
        # The buffer is only trimmed once every array holds the block, so a failed write can be retried.
        jobs = [_write_pool().submit(self._write_rows, k, a, start, end) for k, a in self._pending.items()]
        futures.wait(jobs)
        for job in jobs:
            job.result()  # re-raise the first failure; nothing is committed then
        left = self._n_pending - n
        if left:
            for a in self._pending.values():
                a[:left] = a[n : n + left]  # numpy copies via a temporary where the ranges overlap
        self._n_pending = left
        if self._store.fsync and self._store.remote is None:  # a PUT is durable when it returns
            self._fsync_rows(start, end)
        self._length = end
        self._commit()

    def _write_rows(self, key: str, block: np.ndarray, start: int, end: int) -> None:
        """Rows [start, end) of one array from ``block[: end - start]``: whole chunks straight to their
        files, partial chunks (an episode's last, or after a mid-chunk flush) through zarr."""
        arr, encode = self._arrays[key], self._encoders[key]
        cl = self._meta.chunk_len
        jpeg = jpeg_codec(arr) if encode is not None else None
        if jpeg is not None:
            self._write_jpeg_rows(key, arr, block, start, end, jpeg.quality)
            return
        first, last = -(-start // cl) * cl, end // cl * cl  # the whole chunks inside [start, end)
        if encode is None or first >= last:
            arr[start:end] = block[: end - start]
            return
        if start < first:
            arr[start:first] = block[: first - start]
        adir = self._dir / key
        tail = (0,) * (arr.ndim - 1)
        remote = self._store.remote
        for row in range(first, last, cl):
            chunk = block[row - start : row - start + cl]
            ckey = arr.metadata.encode_chunk_key((row // cl, *tail))
            if remote is None:
                _put_atomic(adir / ckey, encode(chunk))
            else:  # one PUT per whole chunk (atomic for readers)
                remote.put(f"episodes/{self.episode_id}/{key}/{ckey}", encode(chunk))
        if last < end:
            arr[last:end] = block[last - start : end - start]

    def _write_jpeg_rows(
        self, key: str, arr: zarr.Array, block: np.ndarray, start: int, end: int, quality: int
    ) -> None:
        """Rows [start, end) of a JPEG camera, every chunk written by the store: a partial chunk keeps the
        JPEGs of the rows it already has byte for byte (zarr would decode and re-encode them: a second
        generation of loss at every mid-chunk flush)."""
        cl = self._meta.chunk_len
        remote = self._store.remote
        for c in range(start // cl, (end - 1) // cl + 1):
            lo, hi = max(start, c * cl), min(end, (c + 1) * cl)
            frames = block[lo - start : hi - start]
            ckey = arr.metadata.encode_chunk_key((c, 0, 0, 0))
            rel = f"episodes/{self.episode_id}/{key}/{ckey}"
            if hi - lo == cl:
                data = encode_chunk(frames, quality)
            else:
                try:
                    old = (self._dir / key / ckey).read_bytes() if remote is None else remote.get(rel)
                except FileNotFoundError:
                    old = None
                data = merge_chunk(old, lo - c * cl, frames, cl, quality)
            if remote is None:
                _put_atomic(self._dir / key / ckey, data)
            else:
                remote.put(rel, data)

    def _fsync_rows(self, start: int, end: int) -> None:
        """fsync the chunk files holding rows [start, end) and every array's metadata, before the commit."""
        cl = self._meta.chunk_len
        dirs: set[Path] = set()
        for key, arr in self._arrays.items():
            adir = self._dir / key
            files = [adir / "zarr.json"]
            for c in range(start // cl, (end - 1) // cl + 1):
                files.append(adir / arr.metadata.encode_chunk_key((c,) + (0,) * (arr.ndim - 1)))
            for f in files:
                if f.exists():  # a chunk of a zero-width array is never written
                    fd = os.open(f, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                    dirs.add(f.parent)
        for d in dirs:
            _fsync_dir(d)

    def _snapshot(self, **final: Any) -> EpisodeMeta:
        """Metadata as of the committed length: segments that start after it are left out."""
        n = self._length
        segs = tuple(
            s
            if s.end is not None and s.end <= n
            else Segment(s.index, s.kind, s.controller, s.start, None, s.reason)
            for s in self._segments
            if s.start <= n
        )
        d = self._meta.to_dict() | {
            "length": n,
            "revisions": list(self._revisions),
            "segments": [s.to_dict() for s in segs],
        }
        return EpisodeMeta.from_dict(d | final)

    def _commit(self, **final: Any) -> None:
        self._meta = self._snapshot(**final)
        self._store._put_commit(self._meta, self._dir)

    def flush(self) -> int:
        """Write and commit every buffered frame (e.g. before acknowledging them); returns the committed length."""
        self._check_open()
        if self._n_pending:
            self._write(self._n_pending)
        return self._length

    def close(
        self, outcome: str = "success", success: bool | None = None, episode_seed: int | None = None
    ) -> EpisodeMeta:
        """Flush, end the last segment, trim the arrays and commit the final metadata.

        ``success`` defaults to ``outcome == "success"``. ``episode_seed``: a simulated episode's reset
        seed (kept in the metadata, so the episode can be replayed). Records the episode in the DB if the
        writer has one. Returns the final metadata.
        """
        self._check_open()
        if not isinstance(outcome, str) or not outcome:
            raise ValueError(f"outcome must be a non-empty string, got {outcome!r}")
        if episode_seed is not None and (
            isinstance(episode_seed, bool)
            or not isinstance(episode_seed, (int, np.integer))
            or episode_seed < 0
        ):
            raise ValueError(f"episode_seed: expected a non-negative integer or None, got {episode_seed!r}")
        self.flush()
        self._release_blocks()
        self._end_segment()
        if self._capacity != self._length:
            for key, (shape, _) in self._layout.items():
                self._arrays[key].resize((self._length, *shape))
            self._capacity = self._length
        self._commit(
            status="closed",
            outcome=outcome,
            success=(outcome == "success") if success is None else bool(success),
            closed=time.time(),
            **({} if episode_seed is None else {"episode_seed": int(episode_seed)}),
        )
        self._closed = True
        if self._db is not None:
            self._db.record_episode_closed(self._meta)
        return self._meta

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"episode {self.episode_id} is closed")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._closed:
            self.close(outcome="aborted", success=False)


class EpisodeStore:
    """A directory of episodes (see the module docstring for layout and commit protocol), or the same
    layout under an object-store prefix (``s3://bucket/prefix``, see :mod:`fleet.objstore`).

    ``EpisodeStore(root)`` opens an existing store; ``create=True`` creates it if missing.
    ``fsync=True`` makes every commit durable against power loss (data files, then the commit file,
    are fsynced); without it commits are still atomic against a killed process. ``db``, if given, is
    the default metadata DB that writers record episodes in.

    On an object store, ``root`` is the URL (a str), ``remote`` its :class:`~fleet.objstore.ObjectStore`
    (None for a directory), and closed episodes are read through a local cache, ``cache_dir`` (default
    ``$VLA_RL_STORE_CACHE``, else ``~/.cache/vla-rl/store``; ``"off"`` for none): closed episodes never
    change, so a second read of one downloads nothing. The cache stays under ``cache_max_gb`` (default
    ``$VLA_RL_STORE_CACHE_MAX_GB``, else 20), evicting whole episodes least recently used first
    (:class:`~fleet.objstore.ReadCache`).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        create: bool = False,
        *,
        fsync: bool = False,
        db: EpisodeDB | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_max_gb: float | None = None,
    ) -> None:
        self.fsync = fsync
        self._db = db
        self.remote: ObjectStore | None = None
        self.cache_dir: Path | None = None
        self.read_cache: ReadCache | None = None
        if is_remote(root):
            self._open_remote(root, create, cache_dir)
            if self.cache_dir is not None:
                self.read_cache = ReadCache(self.cache_dir, cache_max_bytes(cache_max_gb))
            return
        self.root: Any = Path(root).absolute()
        self.episodes_dir = self.root / "episodes"
        marker = self.root / "zarr.json"
        if not marker.exists():
            if not create:
                what = "does not exist" if not self.root.exists() else "is not an episode store"
                raise FileNotFoundError(
                    f"no episode store at {self.root}: the directory {what} (pass create=True to make one)"
                )
            self.root.mkdir(parents=True, exist_ok=True)
            doc = _group_doc({"format": STORE_FORMAT, "version": STORE_VERSION})
            _create_group_doc(self.root, doc)
        attrs = json.loads(marker.read_text()).get("attributes", {})
        if attrs.get("format") != STORE_FORMAT:
            raise ValueError(f"{self.root} is a zarr group but not an episode store (attributes: {attrs})")
        if attrs.get("version") != STORE_VERSION:
            raise ValueError(
                f"{self.root}: store version {attrs.get('version')} is not supported (want {STORE_VERSION})"
            )
        self.episodes_dir.mkdir(exist_ok=True)
        if not (self.episodes_dir / "zarr.json").exists():  # stores made before it was written
            try:
                _create_group_doc(self.episodes_dir, _group_doc({}))
            except OSError as e:  # e.g. a read-only store: readers through EpisodeStore do not need it
                log.warning(
                    "cannot write %s (%s): generic zarr tools will not see the episodes",
                    self.episodes_dir / "zarr.json",
                    e,
                )

    def _open_remote(
        self, root: str | os.PathLike[str], create: bool, cache_dir: str | os.PathLike[str] | None
    ) -> None:
        remote = self.remote = ObjectStore(root, writable=create)
        self.root = remote.url
        self.episodes_dir = Path(remote.url.removeprefix("s3://")) / "episodes"  # names only; never opened
        self.cache_dir = cache_dir_from_env(cache_dir)
        self._closed_metas: dict[str, EpisodeMeta] = {}
        try:
            doc = json.loads(remote.get("zarr.json"))
        except FileNotFoundError:
            if not create:
                raise FileNotFoundError(
                    f"no episode store at {remote.url}: nothing there (pass create=True to make one)"
                ) from None
            doc = _group_doc({"format": STORE_FORMAT, "version": STORE_VERSION})
            remote.put_many({"zarr.json": json.dumps(doc, indent=2).encode()})
        attrs = doc.get("attributes", {})
        if attrs.get("format") != STORE_FORMAT:
            raise ValueError(f"{remote.url} is a zarr group but not an episode store (attributes: {attrs})")
        if attrs.get("version") != STORE_VERSION:
            raise ValueError(
                f"{remote.url}: store version {attrs.get('version')} is not supported (want {STORE_VERSION})"
            )
        if create and not remote.exists("episodes/zarr.json"):
            remote.put("episodes/zarr.json", json.dumps(_group_doc({}), indent=2).encode())

    def __repr__(self) -> str:
        return f"EpisodeStore({str(self.root)!r})"

    def _group(self, episode_id: str, mode: str, cached: bool = False) -> zarr.Group:
        """An episode's zarr group; ``cached``: through the local read cache (closed episodes only)."""
        if self.remote is None:
            return zarr.open_group(self.episodes_dir / episode_id, mode=mode)  # type: ignore[arg-type]
        store = self.remote.zarr_store(
            f"episodes/{episode_id}",
            read_only=mode == "r",
            cache=self.read_cache if cached else None,
        )
        # zarr_format=3: without it zarr also looks for v2 documents (three more GETs per episode).
        return zarr.open_group(store, mode=mode, zarr_format=3)  # type: ignore[arg-type]

    def _put_commit(self, meta: EpisodeMeta, ep_dir: Path) -> None:
        """Replace an episode's commit record (after its data: see the module docstring)."""
        if self.remote is None:
            _write_json_atomic(ep_dir / COMMIT_FILE, meta.to_dict(), self.fsync)
        else:
            body = json.dumps(meta.to_dict(), sort_keys=True).encode()
            self.remote.put(f"episodes/{meta.episode_id}/{COMMIT_FILE}", body)

    @property
    def db(self) -> EpisodeDB | None:
        """The metadata DB that writers record episodes in unless told otherwise (set at construction)."""
        return self._db

    # ------------------------------------------------------------------ writing
    def create_episode(
        self,
        spec: RobotSpec,
        *,
        robot_id: str,
        task: str,
        instruction: str | None = None,
        chunk_len: int = DEFAULT_CHUNK_LEN,
        episode_id: str | None = None,
        db: EpisodeDB | None = None,
        camera_zstd_level: int | None = None,
        camera_codec: str | CameraCodecs | None = None,
    ) -> EpisodeWriter:
        """Create an empty episode (see :meth:`new_episode`) and return its writer."""
        meta = self.new_episode(
            spec,
            robot_id=robot_id,
            task=task,
            instruction=instruction,
            chunk_len=chunk_len,
            episode_id=episode_id,
            db=db,
            camera_zstd_level=camera_zstd_level,
            camera_codec=camera_codec,
        )
        group = self._group(meta.episode_id, "r+")
        return EpisodeWriter(self, meta, group, db if db is not None else self.db)

    def new_episode(
        self,
        spec: RobotSpec,
        *,
        robot_id: str,
        task: str,
        instruction: str | None = None,
        chunk_len: int = DEFAULT_CHUNK_LEN,
        episode_id: str | None = None,
        db: EpisodeDB | None = None,
        camera_zstd_level: int | None = None,
        camera_codec: str | CameraCodecs | None = None,
    ) -> EpisodeMeta:
        """Create an empty, open episode (its arrays, commit record and DB row) without opening a writer:
        what a caller that hands the episode to another process (the fleet collector) needs.

        ``instruction`` defaults to the spec's; ``episode_id`` defaults to ``<UTC time>-<robot>-<random>``
        (sortable by creation time). ``db`` overrides the store's DB for this episode.
        ``camera_zstd_level`` sets the zstd level of the camera arrays (None: zarr's default, level 3).
        Rendered frames at level 1 or -1 compress 2-10x faster for a slightly larger file, which is what
        a collector taking many cameras at once needs (see docs/fleet.md). ``camera_codec`` picks each
        camera's codec (``"jpeg:85"``, ``"lossless,wrist=jpeg:80"``: see :mod:`fleet.codecs`; None:
        lossless); it is recorded in the camera arrays' metadata, so readers need nothing.
        """
        codecs = CameraCodecs.parse(camera_codec).check(spec.camera_names)
        if not isinstance(robot_id, str) or not robot_id:
            raise ValueError(f"robot_id must be a non-empty string, got {robot_id!r}")
        if not isinstance(task, str) or not task:
            raise ValueError(f"task must be a non-empty string, got {task!r}")
        if not isinstance(chunk_len, int) or chunk_len < 1:
            raise ValueError(f"chunk_len must be a positive int, got {chunk_len!r}")
        if episode_id is None:
            episode_id = new_episode_id(robot_id)
        _check_id("episode_id", episode_id)
        ep_dir = self.episodes_dir / episode_id
        if self.remote is not None:
            # No exclusive mkdir on S3: an episode exists once it has a commit record. (One collector
            # writes a store; left-overs of an interrupted creation have none and are overwritten.)
            if self.remote.exists(f"episodes/{episode_id}/{COMMIT_FILE}"):
                raise ValueError(f"episode {episode_id!r} already exists in {self.root}")
        else:
            try:
                ep_dir.mkdir()  # exclusive: two writers can never share an episode
            except FileExistsError:
                raise ValueError(f"episode {episode_id!r} already exists in {self.root}") from None
        meta = EpisodeMeta(
            episode_id=episode_id,
            robot_id=robot_id,
            task=task,
            instruction=spec.instruction if instruction is None else instruction,
            spec=spec,
            chunk_len=chunk_len,
            created=time.time(),
        )
        # The arrays' metadata documents are the same for every episode of one spec and layout: write
        # the ones zarr produced once (cached) instead of creating ~12 arrays through zarr each time
        # (~50 ms, which stalled a collector whose fleet starts episodes together).
        with _TEMPLATE_LOCK:  # a fleet starting together must not build the same template 16 times
            root_doc, files = _episode_template(spec.to_json(), chunk_len, camera_zstd_level, codecs)
        attributes = {"vla_rl": meta.to_dict() | {"see": COMMIT_FILE}}
        group_doc = json.dumps({**root_doc, "attributes": attributes}, indent=2)
        if self.remote is not None:
            objects = {f"episodes/{episode_id}/{rel}": data for rel, data in files.items()}
            objects[f"episodes/{episode_id}/zarr.json"] = group_doc.encode()
            self.remote.put_many(objects)  # concurrently; the commit record only once all are in
        else:
            for rel, data in files.items():
                (ep_dir / rel).parent.mkdir(parents=True, exist_ok=True)
                (ep_dir / rel).write_bytes(data)
            (ep_dir / "zarr.json").write_text(group_doc)
        self._put_commit(meta, ep_dir)
        db = db if db is not None else self.db
        if db is not None:
            db.record_episode_open(meta, str(self.root))
        return meta

    def resume_episode(self, episode_id: str, db: EpisodeDB | None = None) -> EpisodeWriter:
        """A writer that continues an open episode after its previous writer went away (e.g. was killed).

        It starts from the committed length: rows a killed writer wrote but never committed are
        overwritten, its last segment stays open, and later timestamps must not go back before the last
        committed one. The caller must make sure the old writer is really gone (two writers of one
        episode corrupt it); the fleet collector holds a lock on the store for that.
        """
        meta = self.read_metadata(episode_id)
        if meta.is_closed:
            raise ValueError(f"episode {episode_id!r} is closed ({meta.outcome}); it cannot be resumed")
        group = self._group(episode_id, "r+")
        writer = EpisodeWriter(self, meta, group, db if db is not None else self.db)
        writer._restore()
        return writer

    # ------------------------------------------------------------------ reading
    def episode_ids(self) -> list[str]:
        """Ids of all episodes with a commit record (open and closed), sorted."""
        if self.remote is not None:
            return sorted(self._remote_metas())
        return sorted(p.parent.name for p in self.episodes_dir.glob(f"*/{COMMIT_FILE}"))

    def read_metadata(self, episode_id: str) -> EpisodeMeta:
        """The episode's committed metadata (cheap: reads only ``commit.json``)."""
        _check_id("episode_id", episode_id)
        if self.remote is not None:
            meta = self._remote_metas([episode_id]).get(episode_id)
            if meta is None:
                raise KeyError(f"no episode {episode_id!r} in {self.root}")
            return meta
        path = self.episodes_dir / episode_id / COMMIT_FILE
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise KeyError(f"no episode {episode_id!r} in {self.root}") from None
        return EpisodeMeta.from_dict(json.loads(text))

    def _remote_metas(self, episode_ids: Sequence[str] | None = None) -> dict[str, EpisodeMeta]:
        """Commit records on the object store (all episodes: one listing), fetched concurrently.

        A closed episode's record never changes: it is kept in memory and in the read cache, so
        listing a store of closed episodes again costs one LIST and no GETs.
        """
        assert self.remote is not None
        ids = self.remote.list_dir("episodes") if episode_ids is None else list(episode_ids)
        out: dict[str, EpisodeMeta] = {}
        fetch: list[str] = []
        cache = self.remote.cache_root(self.cache_dir) / "episodes" if self.cache_dir else None
        for eid in ids:
            if eid in self._closed_metas:
                out[eid] = self._closed_metas[eid]
            elif eid == "zarr.json" or _ID_RE.match(eid) is None:
                continue  # zarr.json and other objects beside the episode folders
            elif cache is not None and (body := read_cached(cache / eid / COMMIT_FILE)) is not None:
                meta = EpisodeMeta.from_dict(json.loads(body))
                out[eid] = self._closed_metas[eid] = meta
            else:
                fetch.append(eid)
        got = self.remote.get_many(f"episodes/{eid}/{COMMIT_FILE}" for eid in fetch)
        for eid in fetch:
            body = got.get(f"episodes/{eid}/{COMMIT_FILE}")
            if body is None:
                continue  # no commit record: creation was interrupted (or not an episode)
            meta = EpisodeMeta.from_dict(json.loads(body))
            out[eid] = meta
            if meta.is_closed:
                self._closed_metas[eid] = meta
                if cache is not None:
                    with contextlib.suppress(FileNotFoundError):  # evicted while written: not kept
                        write_cached(cache / eid / COMMIT_FILE, body)
        return out

    def read_array(self, episode_id: str, key: str, cached: bool = False) -> zarr.Array:
        """One array of an episode opened read-only (``cameras/<name>``, ``action``, ...), on a local or an
        object store, for readers that fetch chunk by chunk (the dashboard). Rows past the commit record's
        ``length`` may be in flight: read :meth:`read_metadata` first and only up to its length.
        ``cached``: through the local read cache (closed episodes only)."""
        return _array(self._group(episode_id, "r", cached=cached), key)

    def read_arrays(self, episode_id: str, keys: Sequence[str]) -> dict[str, np.ndarray]:
        """Some of an episode's committed arrays (``uncertainty``, ``segment``, ...), opening it once; an
        optional array the episode lacks is left out of the result (auto-flags' calibration reads)."""
        meta = self.read_metadata(episode_id)
        group = self._group(episode_id, "r", cached=meta.is_closed)
        out: dict[str, np.ndarray] = {}
        for key in keys:
            arr = group.get(key)
            if isinstance(arr, zarr.Array):
                out[key] = arr[: meta.length]
            elif key not in OPTIONAL_ARRAYS:
                raise KeyError(f"array {key!r} is missing from episode {episode_id!r}")
        return out

    def read_episode(self, episode_id: str, cameras: bool = True) -> Episode:
        """Committed frames of one episode (``cameras=False`` skips the images, leaving ``cameras`` empty).

        The commit record is read before the arrays, so every row it counts is already written even
        while a writer is appending.
        """
        meta = self.read_metadata(episode_id)
        group = self._group(episode_id, "r", cached=meta.is_closed)
        n = meta.length
        data: dict[str, np.ndarray] = {}
        for key in _layout(meta.spec):
            if key.startswith("cameras/") and not cameras:
                continue
            if key in OPTIONAL_ARRAYS:
                arr = group.get(key)
                if isinstance(arr, zarr.Array):
                    data[key] = arr[:n]
                continue
            data[key] = _array(group, key)[:n]
        return Episode(
            meta=meta,
            cameras={c: data[f"cameras/{c}"] for c in meta.spec.camera_names if cameras},
            state=data["state"],
            action=data["action"],
            proposed_action=data["proposed_action"],
            reward=data["reward"],
            terminated=data["terminated"],
            truncated=data["truncated"],
            controller=data["controller"],
            segment=data["segment"],
            revision=data["revision"],
            timestamp=data["timestamp"],
            uncertainty=data.get("uncertainty"),
        )

    def iter_episodes(
        self, task: str | None = None, closed_only: bool = True, cameras: bool = True
    ) -> Iterator[Episode]:
        """Episodes in id order, optionally only one task's, by default only closed ones."""
        metas = self._remote_metas() if self.remote is not None else None
        for eid in self.episode_ids() if metas is None else sorted(metas):
            meta = self.read_metadata(eid) if metas is None else metas[eid]
            if (task is None or meta.task == task) and (meta.is_closed or not closed_only):
                yield self.read_episode(eid, cameras=cameras)

    def info(self) -> dict[str, Any]:
        """Summary: episode/frame counts, bytes on disk, and per-task counts and success rates.

        Per task and per robot, ``closed`` splits into ``known`` outcomes and ``unknown`` ones (outcome
        ``"unknown"``, see :func:`outcome_known`); ``successes`` and ``success_rate`` (successes / known,
        None without any known outcome) count only the known ones."""
        tasks: dict[str, dict[str, Any]] = {}
        n_open = frames = 0
        if self.remote is not None:
            metas = [m for _, m in sorted(self._remote_metas().items())]
        else:
            metas = [self.read_metadata(eid) for eid in self.episode_ids()]
        for m in metas:
            t = tasks.setdefault(
                m.task, {"episodes": 0, "closed": 0, "known": 0, "unknown": 0, "successes": 0, "frames": 0}
            )
            t["episodes"] += 1
            t["frames"] += m.length
            frames += m.length
            if m.is_closed:
                t["closed"] += 1
                _count_outcome(t, m)
            else:
                n_open += 1
        for t in tasks.values():
            t["success_rate"] = t["successes"] / t["known"] if t["known"] else None
        if self.remote is not None:
            size = self.remote.size()
        else:
            size = sum(f.stat().st_size for f in self.root.rglob("*") if f.is_file())
        return {
            "root": str(self.root),
            "episodes": len(metas),
            "open_episodes": n_open,
            "frames": frames,
            "bytes": size,
            "tasks": dict(sorted(tasks.items())),
            "robots": _robot_summary(metas),
        }

    # ------------------------------------------------------------------ checking
    def verify(self, db: EpisodeDB | None = None) -> list[str]:
        """Check every episode; returns the problems found (empty: the store is consistent).

        Open episodes and rows beyond the committed length (left by a killed writer, or grown ahead)
        are not problems; they are logged at INFO level. With ``db``, every closed episode must also
        have a DB row with the same length, outcome, success and segments.
        """
        problems: list[str] = []
        if self.remote is not None:
            names = [n for n in self.remote.list_dir("episodes") if n != "zarr.json"]
            committed = set(self._remote_metas(names))
        else:
            names = sorted(p.name for p in self.episodes_dir.iterdir() if p.is_dir())
            committed = {n for n in names if (self.episodes_dir / n / COMMIT_FILE).exists()}
        for name in names:
            if name not in committed:
                log.info("%s: no commit record (creation was interrupted); ignored", name)
                continue
            problems.extend(f"{name}: {p}" for p in self._verify_episode(name, db))
        return problems

    def _verify_episode(self, eid: str, db: EpisodeDB | None) -> list[str]:
        try:
            meta = self.read_metadata(eid)
        except (ValueError, KeyError, TypeError) as e:
            return [f"unreadable commit record: {e}"]
        if meta.episode_id != eid:
            return [f"commit record names episode {meta.episode_id!r}"]
        n = meta.length
        try:
            group = self._group(eid, "r")  # never the read cache: check what is stored
        except Exception as e:  # any zarr failure to open means the episode is unreadable
            return [f"cannot open zarr group: {e}"]
        out: list[str] = []
        layout = _layout(meta.spec)
        rows: dict[str, int] = {}
        for key, (shape, dtype) in layout.items():
            arr = group.get(key)
            if arr is None and key in OPTIONAL_ARRAYS:
                continue  # an episode recorded before the array existed
            if not isinstance(arr, zarr.Array):
                out.append(f"array {key} is missing")
                continue
            rows[key] = arr.shape[0]
            if arr.dtype != dtype or tuple(arr.shape[1:]) != shape:
                out.append(
                    f"array {key} is {arr.dtype}{list(arr.shape)}, spec wants {dtype}[T, {list(shape)}]"
                )
            elif arr.shape[0] < n:
                out.append(f"array {key} has {arr.shape[0]} rows, fewer than the {n} committed")
            elif meta.is_closed and arr.shape[0] != n:
                out.append(f"closed episode: array {key} has {arr.shape[0]} rows, length is {n}")
        if out:
            return out
        extra = max(rows.values()) - n
        partial = 0 if self.remote else sum(1 for _ in (self.episodes_dir / eid).rglob("*.partial"))
        if not meta.is_closed:
            log.info("%s: open, %d committed frames (+%d uncommitted rows ignored)", eid, n, extra)
        if partial:
            log.info("%s: %d leftover *.partial files from an interrupted write (ignored)", eid, partial)

        v = {k: _array(group, k)[:n] for k in layout if not k.startswith("cameras/") and k in rows}
        if not np.isin(v["controller"], [int(c) for c in Controller]).all():
            out.append(
                f"controller holds invalid codes {sorted(set(v['controller'].tolist()) - {int(c) for c in Controller})}"
            )
        out.extend(_check_segments(meta, v["segment"]))
        if n and not ((v["revision"] >= 0) & (v["revision"] < len(meta.revisions))).all():
            out.append(f"revision indices outside the table of {len(meta.revisions)}")
        ts = v["timestamp"]
        if not np.isfinite(ts).all():
            out.append("timestamp has NaN/inf")
        elif (np.diff(ts) < 0).any():
            out.append("timestamps go backwards")
        for key in ("state", "action", "reward"):
            if not np.isfinite(v[key]).all():
                out.append(f"{key} has NaN/inf in committed frames")
        p = v["proposed_action"]
        if n and not (np.isnan(p).all(axis=1) | np.isfinite(p).all(axis=1)).all():
            out.append("proposed_action has partly NaN rows")
        if "uncertainty" in v and np.isinf(v["uncertainty"]).any():
            out.append("uncertainty has inf in committed frames")
        if meta.is_closed and (meta.outcome is None or meta.success is None or meta.closed is None):
            out.append("closed without outcome/success/closed time")
        if db is not None and meta.is_closed:
            out.extend(_check_db(meta, db))
        return out


def _count_outcome(counts: dict[str, Any], m: EpisodeMeta) -> None:
    if outcome_known(m):
        counts["known"] += 1
        counts["successes"] += int(bool(m.success))
    else:
        counts["unknown"] += 1


def _robot_summary(metas: Sequence[EpisodeMeta]) -> dict[str, dict[str, Any]]:
    """Per robot: episodes, success, and how its frames split into segment kinds (who was in control).

    ``intervention_rate`` is the fraction of frames in intervention segments (the frames a LeRobot
    export marks ``intervention``); ``takeovers`` counts
    intervention segments; ``episodes_with_intervention`` the episodes that had at least one.
    """
    robots: dict[str, dict[str, Any]] = {}
    for m in metas:
        r = robots.setdefault(
            m.robot_id,
            {
                "episodes": 0,
                "closed": 0,
                "known": 0,
                "unknown": 0,
                "successes": 0,
                "frames": 0,
                "segments": {k.value: 0 for k in SegmentKind},
                "frames_by_kind": {k.value: 0 for k in SegmentKind},
                "episodes_with_intervention": 0,
            },
        )
        r["episodes"] += 1
        r["frames"] += m.length
        if m.is_closed:
            r["closed"] += 1
            _count_outcome(r, m)
        for seg in m.segments:
            r["segments"][seg.kind.value] += 1
            r["frames_by_kind"][seg.kind.value] += (m.length if seg.end is None else seg.end) - seg.start
        r["episodes_with_intervention"] += int(any(g.kind == SegmentKind.INTERVENTION for g in m.segments))
    for r in robots.values():
        r["success_rate"] = r["successes"] / r["known"] if r["known"] else None
        r["intervention_rate"] = r["frames_by_kind"]["intervention"] / r["frames"] if r["frames"] else None
        r["takeovers"] = r["segments"]["intervention"]
    return dict(sorted(robots.items()))


def _check_segments(meta: EpisodeMeta, seg: np.ndarray) -> list[str]:
    """Segments list contiguous and consistent with the per-frame segment index."""
    out: list[str] = []
    n = meta.length
    segs = meta.segments
    if n and not segs:
        return ["frames but no segments"]
    for i, s in enumerate(segs):
        if s.index != i:
            out.append(f"segment {i} has index {s.index}")
        if i and (segs[i - 1].end is None or segs[i - 1].end != s.start):
            out.append(f"segment {i} starts at {s.start}, previous ends at {segs[i - 1].end}")
        if s.end is not None and not s.start <= s.end <= n:
            out.append(f"segment {i} spans [{s.start}, {s.end}) outside [0, {n}]")
    if segs and segs[0].start != 0:
        out.append(f"first segment starts at {segs[0].start}")
    if meta.is_closed and segs and segs[-1].end != n:
        out.append(f"closed episode: last segment ends at {segs[-1].end}, length is {n}")
    if out or not n:
        return out
    if (np.diff(seg) < 0).any():
        return ["segment index decreases"]
    if seg.min() < 0 or seg.max() >= len(segs):
        return [f"segment index outside the {len(segs)} segments"]
    starts = np.array([s.start for s in segs])
    ends = np.array([n if s.end is None else s.end for s in segs])
    t = np.arange(n)
    if not ((starts[seg] <= t) & (t < ends[seg])).all():
        out.append("per-frame segment index disagrees with the segments list")
    return out


def _check_db(meta: EpisodeMeta, db: EpisodeDB) -> list[str]:
    rec = db.episode(meta.episode_id)
    if rec is None:
        return ["closed episode has no DB row"]
    out = []
    if rec.status != "closed":
        out.append(f"DB status is {rec.status!r}")
    for name, mine, theirs in (
        ("length", meta.length, rec.length),
        ("outcome", meta.outcome, rec.outcome),
        ("success", meta.success, rec.success),
        ("segments", [s.to_dict() for s in meta.segments], [s.to_dict() for s in rec.segments]),
    ):
        if mine != theirs:
            out.append(f"DB {name} {theirs!r} differs from store {mine!r}")
    return out
