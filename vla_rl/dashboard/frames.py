"""Camera frames straight from the Zarr store, one chunk at a time, and MP4s encoded on demand.

``EpisodeStore.read_episode`` reads every frame of every array; a page that shows frame 812 of one
camera needs one chunk of one array. :class:`FrameReader` opens the episode's camera arrays read-only
(zarr, the store's documented layout ``episodes/<id>/cameras/<name>``) and keeps decoded chunks in an
LRU bounded in bytes. It reads only rows below the episode's *committed* length (``commit.json``, read
first), so an open episode that a collector is still appending to shows exactly its committed frames:
a cached chunk that was partly committed when it was read is read again once a frame past it is asked.

:class:`VideoCache` encodes a camera as H.264 (yuv420p, ``+faststart``, a key frame every second for
quick seeks) with the ffmpeg that ``imageio-ffmpeg`` ships, into ``<workdir>/video/<episode>/``, keyed
by the committed length: a growing episode gets a new file, and the older ones are removed. At most
``encoders`` encodes run at once (each is an ffmpeg process and a whole camera in memory: one viewer
opening 8 videos started 6 at once); more requests wait for one to finish. The folder is bounded
(``max_bytes``): after each encode, the least recently used files (a cache hit counts as a use) are
removed until it fits again, the one just encoded always kept.
"""

from __future__ import annotations

import collections
import contextlib
import io
import logging
import os
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import zarr
from vla_rl_client.meta import EpisodeMeta

from fleet.codecs import stored_jpeg
from fleet.store import EpisodeStore

log = logging.getLogger("vla_rl.dashboard")


class FrameReader:
    """One camera frame at a time from the store, with an LRU of decoded chunks (``cache_bytes`` in all)."""

    def __init__(self, store: EpisodeStore, cache_bytes: int = 256 * 1024 * 1024) -> None:
        self.store = store
        self.cache_bytes = cache_bytes
        self._chunks: collections.OrderedDict[tuple[str, str, int], np.ndarray] = collections.OrderedDict()
        self._bytes = 0
        self._arrays: collections.OrderedDict[tuple[str, str], zarr.Array] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def _array(self, episode_id: str, camera: str, rows: int) -> zarr.Array:
        """The camera's zarr array, reopened when the cached handle is shorter than ``rows`` (a writer
        grows the array as it appends)."""
        key = (episode_id, camera)
        with self._lock:
            arr = self._arrays.get(key)
            if arr is not None:
                self._arrays.move_to_end(key)
        if arr is None or arr.shape[0] < rows:
            arr = self.store.read_array(episode_id, f"cameras/{camera}")  # local or s3:// alike
            with self._lock:
                self._arrays[key] = arr
                while len(self._arrays) > 256:
                    self._arrays.popitem(last=False)
        return arr

    def chunk(self, meta: EpisodeMeta, camera: str, index: int) -> np.ndarray:
        """Committed rows of chunk ``index`` of one camera (fewer than a chunk at the committed end)."""
        eid, n = meta.episode_id, meta.length
        key = (eid, camera, index)
        with self._lock:
            cached = self._chunks.get(key)
            if cached is not None:
                self._chunks.move_to_end(key)
        chunk_len = meta.chunk_len
        start, stop = index * chunk_len, min((index + 1) * chunk_len, n)
        if cached is not None and cached.shape[0] >= stop - start:
            self.hits += 1
            return cached
        self.misses += 1
        # One zarr chunk when the array's chunks are the episode's chunk_len (the store's layout); any
        # other layout still reads exactly these rows.
        block = np.asarray(self._array(eid, camera, stop)[start:stop])
        with self._lock:
            old = self._chunks.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._chunks[key] = block
            self._bytes += block.nbytes
            while self._bytes > self.cache_bytes and len(self._chunks) > 1:
                _, dropped = self._chunks.popitem(last=False)
                self._bytes -= dropped.nbytes
        return block

    def frame(self, meta: EpisodeMeta, camera: str, t: int) -> np.ndarray:
        """Frame ``t`` (0 <= t < committed length) of ``camera``: uint8 [H, W, 3]."""
        if not 0 <= t < meta.length:
            raise IndexError(f"t: expected a frame in 0..{meta.length - 1}, got {t}")
        index = t // meta.chunk_len
        return self.chunk(meta, camera, index)[t - index * meta.chunk_len]

    def stored_jpeg(self, meta: EpisodeMeta, camera: str, t: int, max_quality: int = 100) -> bytes | None:
        """Frame ``t``'s bytes exactly as the store holds them when ``camera`` is stored as JPEG (codec
        ``vla_rl.jpeg``) at no more than ``max_quality``; else None (a lossless camera, one stored
        better than asked, an empty row): :func:`fleet.codecs.stored_jpeg` on the cached array."""
        if not 0 <= t < meta.length:
            raise IndexError(f"t: expected a frame in 0..{meta.length - 1}, got {t}")
        return stored_jpeg(self._array(meta.episode_id, camera, t + 1), t, max_quality=max_quality)

    def frames(self, meta: EpisodeMeta, camera: str) -> np.ndarray:
        """Every committed frame of ``camera`` (uint8 [T, H, W, 3]), read directly (not through the LRU)."""
        arr = self._array(meta.episode_id, camera, meta.length)
        return np.asarray(arr[: meta.length])


class JpegCache:
    """Encoded JPEGs by (episode, camera, frame, quality), ``max_bytes`` in all, least recently used out.
    A committed frame never changes, so an entry never goes stale (seeking back costs no encode)."""

    def __init__(self, max_bytes: int = 64 * 1024 * 1024) -> None:
        self.max_bytes = max_bytes
        self._items: collections.OrderedDict[tuple[str, str, int, int], bytes] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, reader: FrameReader, meta: EpisodeMeta, camera: str, t: int, quality: int) -> bytes:
        key = (meta.episode_id, camera, t, quality)
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
                return hit
        # A camera stored as JPEG at no more than this quality: its frame's bytes as they are (no decode,
        # no re-encode, no second generation of loss).
        stored = reader.stored_jpeg(meta, camera, t, max_quality=quality)
        jpeg = stored if stored is not None else encode_jpeg(reader.frame(meta, camera, t), quality)
        with self._lock:
            if key not in self._items:
                self._items[key] = jpeg
                self._bytes += len(jpeg)
            while self._bytes > self.max_bytes and self._items:
                _, old = self._items.popitem(last=False)
                self._bytes -= len(old)
        return jpeg


def _used(path: Path) -> bool:
    """Whether ``path`` is there, marking it used now: its access time, what :meth:`VideoCache.prune`
    orders by (its modification time stays the encode's)."""
    try:
        os.utime(path, ns=(time.time_ns(), path.stat().st_mtime_ns))
    except FileNotFoundError:
        return False
    return True


def encode_jpeg(frame: np.ndarray, quality: int = 85) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(frame)).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


class VideoCache:
    """MP4 files of whole cameras, encoded on first request (one encoder per file at a time, at most
    ``encoders`` in all), the folder kept under ``max_bytes`` (least recently used files out first)."""

    def __init__(
        self, root: Path, reader: FrameReader, max_bytes: int = 2048 * 1024 * 1024, encoders: int = 2
    ) -> None:
        if encoders < 1 or max_bytes < 1:
            raise ValueError(f"encoders, max_bytes: expected >= 1, got {encoders}, {max_bytes}")
        self.root = root
        self.reader = reader
        self.max_bytes = max_bytes
        self._locks: dict[Path, threading.Lock] = {}
        self._guard = threading.Lock()
        self._encoders = threading.BoundedSemaphore(encoders)
        self.encoding = self.max_encoding = 0  # encodes running now / at most so far

    def path(self, meta: EpisodeMeta, camera: str) -> Path:
        return self.root / meta.episode_id / f"{camera}-{meta.length}.mp4"

    def get(self, meta: EpisodeMeta, camera: str) -> Path:
        """The cached MP4 of ``camera`` at the episode's committed length, encoding it if needed."""
        path = self.path(meta, camera)
        if _used(path):
            return path
        with self._guard:
            lock = self._locks.setdefault(path, threading.Lock())
        with lock:
            if not _used(path):
                with self._encoders:
                    self._count(+1)
                    try:
                        self._encode(meta, camera, path)
                    finally:
                        self._count(-1)
                self.prune(keep=path)
        with self._guard:
            self._locks.pop(path, None)
        return path

    def _count(self, step: int) -> None:
        with self._guard:
            self.encoding += step
            self.max_encoding = max(self.max_encoding, self.encoding)

    def prune(self, keep: Path | None = None) -> list[Path]:
        """Remove the least recently used videos until the folder holds at most ``max_bytes`` (never
        ``keep``, nor a file being written); returns what was removed."""
        files = []
        for p in self.root.glob("*/*.mp4"):
            if p.name.startswith(".") or p == keep:
                continue
            with contextlib.suppress(FileNotFoundError):  # another request's prune took it
                st = p.stat()
                files.append((st.st_atime, st.st_size, p))
        total = sum(size for _, size, _ in files)
        with contextlib.suppress(FileNotFoundError):
            total += keep.stat().st_size if keep is not None else 0
        removed = []
        for _, size, p in sorted(files):
            if total <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # the episode's folder, once empty
                p.parent.rmdir()
            total -= size
            removed.append(p)
        if removed:
            log.info("video cache pruned", extra={"removed": len(removed), "bytes": total})
        return removed

    def _encode(self, meta: EpisodeMeta, camera: str, path: Path) -> None:
        import imageio_ffmpeg

        frames = self.reader.frames(meta, camera)
        if frames.shape[0] == 0:
            raise IndexError("t: the episode has no committed frames yet")
        h, w = frames.shape[1:3]
        pad_h, pad_w = h % 2, w % 2  # yuv420p needs even sizes
        fps = max(1.0, float(meta.spec.control_hz or 10.0))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.stem}.{uuid.uuid4().hex}.mp4")
        writer = imageio_ffmpeg.write_frames(
            str(tmp),
            (w + pad_w, h + pad_h),
            fps=fps,
            codec="libx264",
            pix_fmt_in="rgb24",
            pix_fmt_out="yuv420p",
            quality=None,
            macro_block_size=1,
            ffmpeg_log_level="error",
            output_params=[
                "-movflags",
                "+faststart",
                "-g",
                str(round(fps)),
                "-crf",
                "20",
                "-preset",
                "veryfast",
            ],
        )
        try:
            writer.send(None)
            for f in frames:
                if pad_h or pad_w:
                    f = np.pad(f, ((0, pad_h), (0, pad_w), (0, 0)), mode="edge")
                writer.send(np.ascontiguousarray(f))
            writer.close()
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        for old in path.parent.glob(f"{camera}-*.mp4"):  # shorter encodings of a then-open episode
            if old != path:
                old.unlink(missing_ok=True)
        log.info("encoded video", extra={"episode": meta.episode_id, "camera": camera, "frames": len(frames)})
