"""Checking a store: every committed episode's arrays, segments, revisions, times and values, and (with a
metadata DB) its row (:meth:`EpisodeStore.verify`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import zarr
from vla_rl_client.meta import Controller, EpisodeDB, EpisodeMeta

from fleet.objstore import ObjectStore
from fleet.store.layout import COMMIT_FILE, OPTIONAL_ARRAYS, _array, _layout, failure_scores_valid

log = logging.getLogger("fleet.store")  # one logger for the whole store, as before the split


class _Verify:
    """:meth:`EpisodeStore.verify` (a mixin of :class:`~fleet.store.store.EpisodeStore`)."""

    remote: ObjectStore | None
    episodes_dir: Path

    def read_metadata(self, episode_id: str) -> EpisodeMeta:
        raise NotImplementedError

    def _remote_metas(self, episode_ids: Sequence[str] | None = None) -> dict[str, EpisodeMeta]:
        raise NotImplementedError

    def _group(self, episode_id: str, mode: str, cached: bool = False) -> zarr.Group:
        raise NotImplementedError

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
        if "failure" in v and not failure_scores_valid(v["failure"]):
            out.append("failure has scores outside [0, 1] in committed frames")
        if meta.is_closed and (meta.outcome is None or meta.success is None or meta.closed is None):
            out.append("closed without outcome/success/closed time")
        if db is not None and meta.is_closed:
            out.extend(_check_db(meta, db))
        return out


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
