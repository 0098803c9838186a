"""Appending frames to one open episode: :class:`EpisodeWriter` (validate, buffer, write chunk-aligned
blocks, commit)."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any, Protocol, Self

import numpy as np
import zarr
from vla_rl_client.frame import FRAME_FIELDS, Frame
from vla_rl_client.meta import Controller, EpisodeDB, EpisodeMeta, Segment, SegmentKind
from vla_rl_client.spec import RobotSpec, SpecError

from fleet.codecs import encode_chunk, jpeg_codec, merge_chunk
from fleet.objstore import ObjectStore
from fleet.store.layout import (
    _BLOCKS,
    _MAX_REVISIONS,
    OPTIONAL_ARRAYS,
    _array,
    _chunk_encoder,
    _fsync_dir,
    _layout,
    _put_atomic,
    _scalars,
    _write_pool,
    failure_scores_valid,
)


class _StoreFiles(Protocol):
    """What a writer uses of its :class:`~fleet.store.store.EpisodeStore`."""

    fsync: bool
    remote: ObjectStore | None
    episodes_dir: Path

    def _put_commit(self, meta: EpisodeMeta, ep_dir: Path) -> None: ...


class EpisodeWriter:
    """Appends frames to one open episode. Get one from :meth:`EpisodeStore.create_episode`.

    Frames are validated on entry (a bad frame raises :class:`SpecError` naming the field and leaves
    the writer and the store untouched), buffered, and written one chunk-aligned block at a time.
    :meth:`flush` writes and commits whatever is buffered; :meth:`close` flushes and records the
    outcome. Used as a context manager, an episode left unclosed (an exception, or a forgotten
    ``close``) is closed with outcome ``"aborted"``.
    """

    def __init__(
        self, store: _StoreFiles, meta: EpisodeMeta, group: zarr.Group, db: EpisodeDB | None
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
        # the fill value) costs a pass over megabytes per chunk (measured: docs/store.md, Write-path costs
        # behind the design).
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
    def add_frame(self, *args: Any, **fields: Any) -> int:
        """``add(Frame(...))``: the frame's fields by keyword (``cameras=..., state=..., action=...``, see
        :class:`~vla_rl_client.frame.Frame`); returns its index in the episode."""
        return self.add(Frame(*args, **fields))

    def add(self, frame: Frame) -> int:
        """Validate and buffer one frame; returns its index in the episode.

        ``action`` is what was executed, ``proposed_action`` what the policy proposed (None or an
        all-NaN row: no proposal). ``controller`` defaults to the current segment's controller,
        ``revision`` is the checkpoint revision that produced the action ("" for none), ``timestamp``
        defaults to now and may not go backwards. ``uncertainty`` is the policy's score of the chunk
        the action came from, ``failure`` the failure predictor's (in [0, 1]); None or NaN: none.
        """
        return self._add(frame.fields(), None)

    def add_frames(self, batch: Mapping[str, Any]) -> int:
        """Validate and buffer N frames given as stacked arrays; returns the index of the first.

        Keys: ``cameras`` ({name: uint8 [N,H,W,3]}), ``state`` [N,S], ``action`` [N,A] (float32) and,
        optionally, ``proposed_action`` ([N,A] float32, all-NaN rows = none), ``reward`` [N],
        ``terminated``/``truncated`` (bool [N]), ``controller`` (one value or [N]), ``revision`` (one
        string or N strings), ``timestamp`` ([N] float), ``uncertainty`` ([N] float, NaN = no score),
        ``failure`` ([N] float in [0, 1], NaN = no score).
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
        fail = frame.get("failure")
        if fail is None:
            fail = np.full(rows, np.nan, np.float32)
        else:
            fail = _scalars("failure", fail, n, "fiu").astype(np.float32).reshape(rows)
            if not failure_scores_valid(fail):
                raise SpecError("failure", "scores in [0, 1], or NaN for none", "a value outside [0, 1]")

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
            failure=fail,
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
