"""The store's layout and the pieces every part of it shares: constants, the frame fields, the arrays of a
spec, :class:`Episode`, block buffers, chunk encoders, atomic files and group documents."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import threading
import uuid
from collections.abc import Callable, Mapping
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import zarr
from vla_rl_client.frame import Frame
from vla_rl_client.meta import EpisodeMeta
from vla_rl_client.spec import RobotSpec, SpecError
from zarr.codecs import BytesCodec, ZstdCodec

from fleet.codecs import CameraCodecs, JpegCodec, encode_chunk, jpeg_codec

STORE_FORMAT = "vla-rl-episode-store"
COMMIT_FILE = "commit.json"
DEFAULT_CHUNK_LEN = 64
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # fullmatch only: `$` lets "id\n" through
_MAX_REVISIONS = int(np.iinfo(np.int16).max) + 1
OPTIONAL_ARRAYS = frozenset(["uncertainty", "failure"])
"""Arrays an episode may lack (it was recorded before they existed): read as None, not an error."""


def failure_scores_valid(scores: np.ndarray) -> bool:
    """Whether every per-frame ``failure`` score is a probability in [0, 1] or NaN (no score)."""
    s = np.asarray(scores)
    return bool((np.isnan(s) | ((s >= 0) & (s <= 1))).all())


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
    failure: np.ndarray | None = None
    """float32 [T]: the learned failure predictor's score (in [0, 1]) of the chunk each frame's action came
    from (NaN: none). The store reads it as all NaN for an episode recorded before it kept the score;
    None only for an episode built by hand without it."""

    @property
    def length(self) -> int:
        return self.meta.length

    def frame(self, i: int) -> Frame:
        """Frame ``i`` as a robot would have added it (views into the arrays; the revision by name)."""
        return Frame(
            cameras={k: v[i] for k, v in self.cameras.items()},
            state=self.state[i],
            action=self.action[i],
            proposed_action=self.proposed_action[i],
            reward=float(self.reward[i]),
            terminated=bool(self.terminated[i]),
            truncated=bool(self.truncated[i]),
            controller=int(self.controller[i]),
            revision=self.meta.revisions[int(self.revision[i])],
            timestamp=float(self.timestamp[i]),
            uncertainty=None if self.uncertainty is None else float(self.uncertainty[i]),
            failure=None if self.failure is None else float(self.failure[i]),
        )

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
        failure=((), np.dtype(np.float32)),
    )
    return out


@functools.cache
def _write_pool() -> futures.ThreadPoolExecutor:
    """Threads that write one block's arrays concurrently.

    Compression (zstd releases the GIL) and file writes of different arrays then overlap, so a block is
    written faster than one array after another (measured: docs/store.md, Write-path costs behind the
    design).
    """
    return futures.ThreadPoolExecutor(
        max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="episode-store"
    )


class _BlockPool:
    """Pending-frame blocks of closed writers, for the next ones (a collector opens an episode every few
    seconds per robot). A fresh 20 MB block page-faults on its first pass, which costs CPU on every frame
    written into it (measured: docs/store.md, Write-path costs behind the design)."""

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

    @property
    def held_bytes(self) -> int:
        """Bytes of the free blocks kept for reuse: memory the process holds though no episode uses it."""
        with self._lock:
            return self._bytes

    def clear(self) -> None:
        """Let every kept block go (a holder with a memory bound needs the room for live blocks)."""
        with self._lock:
            self._free.clear()
            self._bytes = 0


def block_bytes(spec: RobotSpec, chunk_len: int) -> int:
    """What an episode writer of ``spec`` holds for a block of ``chunk_len`` frames: one row of every array
    per frame (the pending buffers of :class:`~fleet.store.EpisodeWriter`)."""
    row = sum(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize for shape, dtype in _layout(spec).values())
    return chunk_len * row


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
                math.nan
                if key in ("proposed_action", "uncertainty", "failure")
                else False
                if dtype == np.bool_
                else 0
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
    ``zarr.Array.__setitem__`` cost more than the compression itself for a 128-frame camera chunk (its
    async codec pipeline, chunk selection and copies), and the same fixed cost again for each of the
    ten small arrays (measured: docs/experiment-log.md, Collector: what changed on 2026-11-30). Only the
    layout :func:`_episode_template` creates qualifies (bytes + zstd, or JPEG frames, regular chunks);
    anything else falls back to zarr.
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
    if not isinstance(value, str) or not _ID_RE.fullmatch(value):
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
