"""Auto-flags: cheap checks over a closed episode that point a reviewer at what to look at.

Each check is a pure function of an :class:`fleet.store.Episode` (and, for lengths, the task's length
distribution) returning a :class:`fleet.db.Flag`: a ``score`` (bigger = more suspicious), ``raised``
(the score passed the check's threshold, :class:`FlagThresholds`) and a short human ``detail`` for the
badge. Results are stored in the metadata DB (``episode_flags``), one row per check and episode, so
the episode list filters on them in SQL.

* ``stillness``: the longest stretch (seconds) in which every action dimension stays ~0
  (``max_d |a_t,d| < still_action``); raised at ``still_s`` seconds or more.
* ``jerk``: ``mean_t |Δ³a_t| / mean_t |Δ²a_t|`` over all dimensions (Δ = frame difference). Smooth
  motion scores near 0; white noise ~1.8 (the ratio of the two differences' standard deviations,
  sqrt(20/6)); raised above ``jerk_ratio`` when ``mean |Δ³a|`` also exceeds ``jerk_floor`` (so a robot
  that barely moves is not flagged for its sensor noise).
* ``length_outlier``: the robust z of the length within its task, ``|T - median| / (1.4826 MAD)``
  (the MAD floored at 5% of the median and 1 frame); needs ``min_task_episodes`` closed episodes of
  the task; raised above ``length_z``.
* ``takeovers``: the number of human segments; raised when > 0.
* ``high_uncertainty``: the peak of the simulated operator's one-sided CUSUM
  (:func:`fleet.uncertainty.cusum_path`, ``S = max(0, S + (x - mean) / std - k)``) over the episode's
  per-chunk ``accel`` scores (the policy server's ``uncertainty``, stored per frame:
  :func:`episode_uncertainty`), restarted at each segment as the operator's is after a handback;
  raised when it exceeds ``h``. ``mean``, ``std`` and ``h`` are the calibration of the episode's scoring
  revision (:func:`scoring_revision`: the one that produced most of its scored chunks; only its chunks
  are judged), split conformal on that revision's closed, successful episodes without a takeover
  (docs/algorithms.md §6a, :func:`load_calibration`, level ``uncertainty_alpha``; a member of that set is
  judged by the others). Too few of them (``ceil(1 / alpha - 1)``): not raised, "not enough successful
  episodes of REV to calibrate (M/needed)", or the fixed reference in :class:`FlagThresholds` when
  ``uncertainty_fallback``. A stored result is recomputed when the calibration has doubled (or, while
  provisional, grown): :func:`needs_recalibration`, on the basis stored with the result
  (``Flag.calibrated``, ``calibration_revision``, ``calibration_n``; never its detail). A chunk is a run
  of frames with the same finite score in one segment (two chunks in a row with bit-identical scores
  count once). Episodes without scores (recorded before the store kept them, human-only, a policy that
  cannot score) are not raised: "no uncertainty recorded". The operator acts on the alarm *before* executing the chunk that fires it,
  so an episode whose takeover came from the alarm may stay under ``h`` here (its ``takeovers`` flag
  says why).
* ``failure_score``: the peak of the learned failure predictor's per-chunk score (the policy server's
  ``failure``, P(failure or takeover soon), stored per frame: :attr:`fleet.store.Episode.failure`) over the
  episode's policy-controlled frames; raised above ``failure_floor``. Episodes without scores (recorded
  before the store kept them, human-only, a checkpoint without a predictor) are not raised: "no failure
  score recorded" (score 0).

``stillness``, ``jerk``, ``length_outlier`` and ``failure_score`` are also judged against the task's own
recent episodes (:mod:`fleet.flag_fleet`): raised only above the ``fleet_quantile`` (0.95) of the same metric
over the task's other newest ``fleet_window`` episodes as well as above the fixed threshold above (a floor),
once the task has ``fleet_min_episodes`` (20) others; each result stores the threshold it was judged by.

A new check: a function of the episode (and the task's lengths) returning a :class:`fleet.db.Flag`,
an entry in :data:`CHECKS` and its name in :data:`FLAG_NAMES`; :func:`refresh_flags` then computes it
for every closed episode that lacks it, old ones included (flags are rows: no migration).

:func:`refresh_flags` computes the missing checks of closed episodes (the dashboard calls it lazily
for the episodes it shows; the collector may call it when an episode closes).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from vla_rl_client.meta import Controller, EpisodeMeta

from fleet.db import Flag, MetadataDB
from fleet.flag_fleet import FLEET_CHECKS, judge_batch, needs_rejudging
from fleet.store import Episode, EpisodeStore
from fleet.uncertainty import calibrate_cusum, conformal_threshold, cusum_path, min_calibration_episodes

log = logging.getLogger(__name__)

FLAG_NAMES: tuple[str, ...] = (
    "stillness",
    "jerk",
    "length_outlier",
    "takeovers",
    "high_uncertainty",
    "failure_score",
)


@dataclass(frozen=True)
class FlagThresholds:
    """When each check raises its flag (see the module docstring)."""

    still_action: float = 0.02
    """An action is ~zero when every dimension is below this (actions are normalised to [-1, 1])."""
    still_s: float = 3.0
    """Seconds of ~zero action that raise ``stillness``."""
    jerk_ratio: float = 1.2
    """``mean |Δ³a| / mean |Δ²a|`` above this raises ``jerk`` (white noise ~1.8, smooth ~0)."""
    jerk_floor: float = 0.01
    """... when ``mean |Δ³a|`` is also above this."""
    length_z: float = 3.5
    """Robust z of the length within its task above this raises ``length_outlier``."""
    min_task_episodes: int = 5
    """Fewer closed episodes of the task: no length statistics (score 0, not raised)."""
    uncertainty_alpha: float = 0.1
    """Split-conformal level of the per-revision calibration: at most this share of a revision's
    successful episodes is raised (docs/algorithms.md §6a); needs ``ceil(1 / alpha - 1)`` of them (9 at 0.1)."""
    uncertainty_k: float = 0.25
    """CUSUM allowance per chunk, in reference stds (>= 0)."""
    uncertainty_max_calibration: int = 1000
    """A revision is calibrated on at most its newest this many successful episodes."""
    uncertainty_fallback: bool = False
    """A revision with too few successful episodes to calibrate: judge it with the fixed reference below
    (True) or not at all (False: score 0, "not enough successful episodes ...")."""
    # The fixed reference (the fallback, and what high_uncertainty uses when called without a
    # calibration) defaults to one small kinematic/Reach-v0 policy's calibration, that of
    # bench/results/uncertainty.json (how it was made: docs/benchmarks.md, Uncertainty alarm). It is
    # that model's: another policy's scores sit on another scale.
    uncertainty_mean: float = 0.596
    """Fixed reference mean of a chunk's ``accel`` score."""
    uncertainty_std: float = 0.189
    """Fixed reference std of a chunk's score (> 0)."""
    uncertainty_h: float = 3.52
    """Fixed threshold: peak CUSUM above this raises ``high_uncertainty`` (in reference stds; > 0)."""
    failure_floor: float = 0.5
    """A peak failure score above this raises ``failure_score`` (a probability: in (0, 1))."""
    fleet_quantile: float = 0.95
    """``stillness``, ``jerk``, ``length_outlier``, ``failure_score`` are raised only above this quantile of
    the same metric over the task's other recent episodes too (:mod:`fleet.flag_fleet`; in (0, 1))."""
    fleet_window: int = 500
    """... over the task's newest this many closed episodes."""
    fleet_min_episodes: int = 20
    """... once the task has this many other episodes (fewer: the fixed thresholds alone judge)."""

    def __post_init__(self) -> None:
        for name in (
            "still_action",
            "still_s",
            "jerk_ratio",
            "jerk_floor",
            "length_z",
            "uncertainty_std",
            "uncertainty_h",
        ):
            v = getattr(self, name)
            if not _is_number(v) or not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name}: expected a number > 0, got {v!r}")
        for name in ("uncertainty_mean", "uncertainty_k"):
            v = getattr(self, name)
            if not _is_number(v) or not math.isfinite(v) or (name == "uncertainty_k" and v < 0):
                what = "a number >= 0" if name == "uncertainty_k" else "a finite number"
                raise ValueError(f"{name}: expected {what}, got {v!r}")
        if not isinstance(self.min_task_episodes, int) or self.min_task_episodes < 2:
            raise ValueError(f"min_task_episodes: expected an integer >= 2, got {self.min_task_episodes!r}")
        a = self.uncertainty_alpha
        if not _is_number(a) or not 0.001 <= a < 1:
            raise ValueError(f"uncertainty_alpha: expected a number in [0.001, 1), got {a!r}")
        n = self.uncertainty_max_calibration
        if not isinstance(n, int) or isinstance(n, bool) or not 10 <= n <= 100_000:
            raise ValueError(f"uncertainty_max_calibration: expected an integer in [10, 100000], got {n!r}")
        if n < min_calibration_episodes(a):
            raise ValueError(
                f"uncertainty_max_calibration: expected at least {min_calibration_episodes(a)} "
                f"(what alpha {a} needs), got {n}"
            )
        f = self.failure_floor
        if not _is_number(f) or not 0 < f < 1:
            raise ValueError(f"failure_floor: expected a number in (0, 1), got {f!r}")
        q = self.fleet_quantile
        if not _is_number(q) or not 0 < q < 1:
            raise ValueError(f"fleet_quantile: expected a number in (0, 1), got {q!r}")
        for name, low in (("fleet_window", 2), ("fleet_min_episodes", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= 100_000:
                raise ValueError(f"{name}: expected an integer in [{low}, 100000], got {v!r}")
        if self.fleet_min_episodes > self.fleet_window:
            raise ValueError(
                f"fleet_min_episodes: expected at most fleet_window ({self.fleet_window}), "
                f"got {self.fleet_min_episodes}"
            )
        if not isinstance(self.uncertainty_fallback, bool):
            raise ValueError(
                f"uncertainty_fallback: expected true or false, got {self.uncertainty_fallback!r}"
            )


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


DEFAULT_THRESHOLDS = FlagThresholds()


def _longest_run(mask: np.ndarray) -> tuple[int, int]:
    """(start, length) of the longest run of True in ``mask`` ((0, 0) when none)."""
    if not mask.any():
        return 0, 0
    padded = np.concatenate([[False], mask, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    starts, ends = edges[::2], edges[1::2]
    k = int(np.argmax(ends - starts))
    return int(starts[k]), int(ends[k] - starts[k])


def stillness(ep: Episode, th: FlagThresholds = DEFAULT_THRESHOLDS) -> Flag:
    hz = float(ep.meta.spec.control_hz)
    action = np.asarray(ep.action, np.float64)
    still = (np.abs(action) < th.still_action).all(axis=1) if len(action) else np.zeros(0, bool)
    start, n = _longest_run(still)
    seconds = n / hz
    detail = f"no motion for {seconds:.1f} s (frames {start}-{start + n - 1})" if n else "always moving"
    return Flag("stillness", seconds, detail, raised=seconds >= th.still_s)


def jerk(ep: Episode, th: FlagThresholds = DEFAULT_THRESHOLDS) -> Flag:
    a = np.asarray(ep.action, np.float64)
    if len(a) < 4:
        return Flag("jerk", 0.0, f"too short to judge ({len(a)} frames)", raised=False)
    d2 = np.abs(np.diff(a, n=2, axis=0)).mean()
    d3 = np.abs(np.diff(a, n=3, axis=0)).mean()
    ratio = float(d3 / d2) if d2 > 0 else 0.0
    raised = ratio > th.jerk_ratio and d3 > th.jerk_floor
    return Flag("jerk", ratio, f"jerk ratio {ratio:.2f} (mean |Δ³a| {d3:.3f})", raised=raised)


def length_outlier(ep: Episode, task_lengths: Sequence[int], th: FlagThresholds = DEFAULT_THRESHOLDS) -> Flag:
    n = len(task_lengths)
    if n < th.min_task_episodes:
        return Flag("length_outlier", 0.0, f"only {n} closed episodes of the task", raised=False)
    lengths = np.asarray(task_lengths, np.float64)
    median = float(np.median(lengths))
    scale = max(1.4826 * float(np.median(np.abs(lengths - median))), 0.05 * median, 1.0)
    z = abs(ep.length - median) / scale
    kind = "long" if ep.length > median else "short"
    detail = (
        f"{ep.length} frames vs median {median:.0f} of {n} episodes of the task (robust z {z:.1f}, {kind})"
    )
    return Flag("length_outlier", float(z), detail, raised=z > th.length_z)


def takeovers(ep: Episode, th: FlagThresholds = DEFAULT_THRESHOLDS) -> Flag:
    human = [s for s in ep.meta.segments if s.controller == Controller.HUMAN]
    if not human:
        return Flag("takeovers", 0.0, "no takeover", raised=False)
    frames = sum((s.end if s.end is not None else ep.length) - s.start for s in human)
    reasons = sorted({s.reason for s in human if s.reason})
    why = f": {', '.join(reasons)}" if reasons else ""
    detail = f"{len(human)} takeover{'s' if len(human) > 1 else ''} ({frames} human frames){why}"
    return Flag("takeovers", float(len(human)), detail, raised=True)


def failure_score(ep: Episode, th: FlagThresholds = DEFAULT_THRESHOLDS) -> Flag:
    """The peak learned failure score over the episode's policy-controlled frames (each frame carries its
    chunk's score, so this is the peak per-chunk score)."""
    p = np.full(ep.length, np.nan) if ep.failure is None else np.asarray(ep.failure, np.float64)
    p = np.where(np.asarray(ep.controller) == int(Controller.POLICY), p, np.nan)
    if not np.isfinite(p).any():
        return Flag("failure_score", 0.0, "no failure score recorded", raised=False)
    t = int(np.nanargmax(p))
    peak = float(p[t])
    detail = f"peak failure score {peak:.2f} (frame {t})"
    return Flag("failure_score", peak, detail, raised=peak > th.failure_floor)


def episode_uncertainty(ep: Episode) -> np.ndarray | None:
    """The policy's per-frame ``accel`` uncertainty (float64 [T], NaN = frame not scored), or None for an
    episode recorded before the store kept it."""
    return None if ep.uncertainty is None else np.asarray(ep.uncertainty, np.float64)


def chunk_starts(u: np.ndarray, segment: np.ndarray) -> np.ndarray:
    """Indices of the frames that start a scored chunk: a finite score that differs from the previous
    frame's score (or follows an unscored frame), or that starts a segment."""
    if not len(u):
        return np.zeros(0, np.int64)
    prev_u = np.concatenate([[np.nan], u[:-1]])
    prev_seg = np.concatenate([[-1], segment[:-1]])
    return np.flatnonzero(np.isfinite(u) & ((u != prev_u) | (segment != prev_seg)))


def chunk_revisions(meta: EpisodeMeta, revision: np.ndarray, starts: np.ndarray) -> list[str]:
    """The checkpoint revision that produced each chunk (the revision of its first frame)."""
    table = list(meta.revisions)
    return [table[int(j)] if 0 <= int(j) < len(table) else "" for j in np.asarray(revision)[starts]]


def scoring_revision(revs: Sequence[str]) -> str:
    """The revision an episode is judged by: the one that produced most of its scored chunks (ties: the
    first to act)."""
    counts: dict[str, int] = {}
    for r in revs:
        counts[r] = counts.get(r, 0) + 1
    return max(counts, key=lambda r: counts[r])


@dataclass(frozen=True)
class CusumReference:
    """The CUSUM's reference statistics and threshold (:mod:`fleet.uncertainty`), in score units / stds."""

    mean: float
    std: float
    k: float
    h: float


@dataclass(frozen=True)
class RevisionCalibration:
    """One checkpoint revision's ``high_uncertainty`` calibration (docs/algorithms.md §6a): ``reference`` from
    :func:`fleet.uncertainty.calibrate_cusum` over ``peaks``' episodes (the revision's closed, successful
    episodes without a takeover that have scores; None when there are fewer than ``needed``), and each
    such episode's peak CUSUM under it (for judging one of them against the others)."""

    revision: str
    needed: int
    alpha: float
    peaks: dict[str, float]
    reference: CusumReference | None

    def for_episode(self, episode_id: str) -> tuple[CusumReference | None, int]:
        """The reference that judges ``episode_id`` and how many calibration episodes it rests on. An
        episode of the calibration set is judged as a new one would be, by the other episodes' conformal
        threshold (leave one out; the pooled mean/std keep it: one episode moves them little)."""
        if episode_id not in self.peaks:
            return self.reference, len(self.peaks)
        others = [p for e, p in self.peaks.items() if e != episode_id]
        if self.reference is None or len(others) < self.needed:
            return None, len(others)
        h = max(conformal_threshold(others, self.alpha), 1e-6)
        r = self.reference
        return CusumReference(r.mean, r.std, r.k, h), len(others)


def calibrate_revision(
    revision: str, episodes: dict[str, np.ndarray], th: FlagThresholds = DEFAULT_THRESHOLDS
) -> RevisionCalibration:
    """A revision's calibration from its successful episodes' per-chunk scores ``{episode_id: scores}``
    (episodes without a finite score are left out)."""
    scored = {e: x[np.isfinite(x)] for e, x in episodes.items() if np.isfinite(x).any()}
    needed = min_calibration_episodes(th.uncertainty_alpha)
    if len(scored) < needed:
        return RevisionCalibration(revision, needed, th.uncertainty_alpha, {e: 0.0 for e in scored}, None)
    cal = calibrate_cusum(list(scored.values()), alpha=th.uncertainty_alpha, k=th.uncertainty_k)
    ref = CusumReference(
        cal["uncertainty_mean"], cal["uncertainty_std"], cal["uncertainty_k"], cal["uncertainty_h"]
    )
    peaks = {e: float(cusum_path(x, ref.mean, ref.std, ref.k).max()) for e, x in scored.items()}
    return RevisionCalibration(revision, needed, th.uncertainty_alpha, peaks, ref)


def _rev_name(revision: str) -> str:
    return revision or "(no revision)"


def _not_enough(revision: str, m: int, needed: int) -> str:
    return f"not enough successful episodes of {_rev_name(revision)} to calibrate ({m}/{needed})"


def high_uncertainty(
    ep: Episode, th: FlagThresholds = DEFAULT_THRESHOLDS, calibration: RevisionCalibration | None = None
) -> Flag:
    """The peak per-chunk CUSUM of the episode (module docstring). With ``calibration`` (the episode's
    scoring revision's: :func:`refresh_flags` passes it), only that revision's chunks are judged, by its
    reference; without, every scored chunk by the fixed reference in ``th``. The result records what it
    was judged on (``Flag.calibrated`` / ``calibration_revision`` / ``calibration_n``)."""
    independent: dict[str, Any] = {"calibrated": False}  # judged by no revision's calibration: never stale
    u = episode_uncertainty(ep)
    starts = np.zeros(0, np.int64) if u is None else chunk_starts(u, np.asarray(ep.segment))
    if u is None or not len(starts):
        why = "" if u is None else " (no frame scored)"
        return Flag("high_uncertainty", 0.0, f"no uncertainty recorded{why}", raised=False, **independent)
    fixed = CusumReference(th.uncertainty_mean, th.uncertainty_std, th.uncertainty_k, th.uncertainty_h)
    ref, basis, others = fixed, "fixed thresholds", 0
    on: dict[str, Any] = independent
    if calibration is not None:
        revs = chunk_revisions(ep.meta, ep.revision, starts)
        keep = np.asarray([r == calibration.revision for r in revs], bool)
        others = int((~keep).sum())
        starts = starts[keep]
        cref, m = calibration.for_episode(ep.meta.episode_id)
        if not len(starts):
            return Flag(
                "high_uncertainty",
                0.0,
                f"no chunk of {_rev_name(calibration.revision)}",
                raised=False,
                **independent,
            )
        on = {
            "calibrated": cref is not None,
            "calibration_revision": calibration.revision,
            "calibration_n": m,
        }
        if cref is not None:
            ref, basis = cref, f"calibrated on {m} successful episodes of {_rev_name(calibration.revision)}"
        elif th.uncertainty_fallback:
            basis = f"fixed thresholds, {_not_enough(calibration.revision, m, calibration.needed)}"
        else:
            return Flag(
                "high_uncertainty",
                0.0,
                _not_enough(calibration.revision, m, calibration.needed),
                raised=False,
                **on,
            )
    seg = np.asarray(ep.segment)[starts]
    peak, at = 0.0, int(starts[0])
    for s in np.unique(seg):  # the CUSUM restarts at each segment, as the operator's after a handback
        idx = starts[seg == s]
        path = cusum_path(u[idx], ref.mean, ref.std, ref.k)
        j = int(np.argmax(path))
        if path[j] > peak:
            peak, at = float(path[j]), int(idx[j])
    scores = u[starts]
    skipped = f" ({others} chunks of other revisions not judged)" if others else ""
    detail = (
        f"peak CUSUM {peak:.2f} (threshold {ref.h:.2f}) at frame {at}; "
        f"{len(starts)} scored chunks{skipped}, mean score {scores.mean():.3f}, max {scores.max():.3f}; {basis}"
    )
    return Flag("high_uncertainty", peak, detail, raised=peak > ref.h, **on)


def calibration_basis(flag: Flag) -> tuple[str, int, bool] | None:
    """``(revision, episodes, calibrated)`` a stored ``high_uncertainty`` result was computed on (its
    ``calibration_revision``, ``calibration_n`` and ``calibrated`` columns; the detail text is for people
    and is not read), ``("", -1, False)`` for one stored without a basis (before the metadata DB kept it:
    recompute it), None when it does not depend on a calibration (no scores; fixed thresholds asked for)
    and for the other checks."""
    if flag.name != "high_uncertainty":
        return None
    if flag.calibrated is None:
        return "", -1, False
    if flag.calibration_revision is None or flag.calibration_n is None:
        return None
    return flag.calibration_revision, flag.calibration_n, flag.calibrated


def needs_recalibration(
    flag: Flag, counts: dict[str, tuple[int, float]], th: FlagThresholds = DEFAULT_THRESHOLDS
) -> bool:
    """Whether a stored ``high_uncertainty`` result is out of date: its revision has successful episodes
    that closed after it was computed (``counts``: :meth:`fleet.db.MetadataDB.calibration_counts`) and
    their number ``c`` reached twice the calibration's ``m`` episodes (at most ``log2`` recomputations
    per episode; none once ``m`` reaches ``uncertainty_max_calibration``), or, while it could not
    calibrate, grew at all (:func:`calibration_basis`). Results stored without a basis are out of date."""
    basis = calibration_basis(flag)
    if basis is None:
        return False
    rev, m, calibrated = basis
    if m < 0:
        return True
    c, newest = counts.get(rev, (0, 0.0))
    if newest <= flag.computed_at:
        return False
    if calibrated:
        return c >= 2 * m and m < th.uncertainty_max_calibration
    return c > m


class _ScoreCache:
    """Per-chunk scores of closed episodes by (store, episode, revision): they never change, so a
    revision's calibration re-reads only its new episodes (LRU, ``maxsize`` entries)."""

    def __init__(self, maxsize: int = 50_000) -> None:
        self.maxsize = maxsize
        self._d: OrderedDict[tuple[str, str, str], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, store: EpisodeStore, eid: str, rev: str) -> np.ndarray:
        key = (str(store.root), eid, rev)
        with self._lock:
            if key in self._d:
                self._d.move_to_end(key)
                return self._d[key]
        x = revision_chunk_scores(store, eid, rev)
        with self._lock:
            self._d[key] = x
            while len(self._d) > self.maxsize:
                self._d.popitem(last=False)
        return x


_SCORES = _ScoreCache()


def revision_chunk_scores(store: EpisodeStore, eid: str, revision: str) -> np.ndarray:
    """The per-chunk scores of ``revision`` in one episode (reads only the commit record and the
    ``uncertainty``, ``segment`` and ``revision`` arrays; empty when it has none)."""
    meta = store.read_metadata(eid)
    a = store.read_arrays(eid, ("uncertainty", "segment", "revision"))
    if "uncertainty" not in a:
        return np.zeros(0, np.float64)  # recorded before the store kept scores
    u, segment, revision_idx = np.asarray(a["uncertainty"], np.float64), a["segment"], a["revision"]
    starts = chunk_starts(u, segment)
    keep = np.asarray([r == revision for r in chunk_revisions(meta, revision_idx, starts)], bool)
    return u[starts[keep]] if len(starts) else np.zeros(0, np.float64)


def load_calibration(
    store: EpisodeStore, db: MetadataDB, revision: str, th: FlagThresholds = DEFAULT_THRESHOLDS
) -> RevisionCalibration:
    """``revision``'s calibration from its newest ``uncertainty_max_calibration`` closed, successful
    episodes without a takeover (the metadata DB picks them; their scores come from the store)."""
    ids = db.calibration_episode_ids(revision)[-th.uncertainty_max_calibration :] if revision else []
    scores: dict[str, np.ndarray] = {}
    for eid in ids:
        try:
            scores[eid] = _SCORES.get(store, eid, revision)
        except (KeyError, FileNotFoundError, ValueError) as e:
            log.warning(
                "auto-flags: cannot read a calibration episode", extra={"episode_id": eid, "error": str(e)}
            )
    return calibrate_revision(revision, scores, th)


def episode_scoring_revision(ep: Episode) -> str | None:
    """The revision that judges the episode's ``high_uncertainty`` (None: no scored chunk)."""
    u = episode_uncertainty(ep)
    if u is None:
        return None
    starts = chunk_starts(u, np.asarray(ep.segment))
    return scoring_revision(chunk_revisions(ep.meta, ep.revision, starts)) if len(starts) else None


CHECKS: dict[str, Callable[[Episode, Sequence[int], FlagThresholds, RevisionCalibration | None], Flag]] = {
    "stillness": lambda ep, _lengths, th, _cal: stillness(ep, th),
    "jerk": lambda ep, _lengths, th, _cal: jerk(ep, th),
    "length_outlier": lambda ep, lengths, th, _cal: length_outlier(ep, lengths, th),
    "takeovers": lambda ep, _lengths, th, _cal: takeovers(ep, th),
    "high_uncertainty": lambda ep, _lengths, th, cal: high_uncertainty(ep, th, cal),
    "failure_score": lambda ep, _lengths, th, _cal: failure_score(ep, th),
}


def compute_flags(
    ep: Episode,
    task_lengths: Sequence[int],
    names: Iterable[str] = FLAG_NAMES,
    th: FlagThresholds = DEFAULT_THRESHOLDS,
    calibration: RevisionCalibration | None = None,
) -> list[Flag]:
    """Every named check's result for one episode (raised or not), stamped with the time."""
    now = time.time()
    out = []
    for name in names:
        if name not in CHECKS:
            raise ValueError(f"flag: unknown check {name!r}; expected one of {', '.join(CHECKS)}")
        out.append(dataclasses.replace(CHECKS[name](ep, task_lengths, th, calibration), computed_at=now))
    return out


def _to_compute(db: MetadataDB, ids: Sequence[str], th: FlagThresholds) -> dict[str, list[str]]:
    """The checks each episode lacks or has out of date (:func:`needs_recalibration`, and for the checks
    judged against the fleet :func:`fleet.flag_fleet.needs_rejudging`), by episode."""
    have = db.flags(ids, raised_only=False)
    counts: dict[str, tuple[int, float]] | None = None
    tasks = db.episode_tasks([e for e in ids if have.get(e)]) if any(have.values()) else {}
    task_counts = db.task_closed_counts(tasks.values())
    out: dict[str, list[str]] = {}
    for eid in ids:
        known = have.get(eid, {})
        names = [n for n in FLAG_NAMES if n not in known]
        f = known.get("high_uncertainty")
        if f is not None and calibration_basis(f) is not None:
            counts = db.calibration_counts() if counts is None else counts
            if needs_recalibration(f, counts, th):
                names.append("high_uncertainty")
        count = task_counts.get(tasks.get(eid, ""))
        names += [n for n in FLEET_CHECKS if n in known and needs_rejudging(known[n], count, th)]
        if names:
            out[eid] = names
    return out


def refresh_flags(
    store: EpisodeStore,
    db: MetadataDB,
    episode_ids: Iterable[str] | None = None,
    th: FlagThresholds = DEFAULT_THRESHOLDS,
    unreadable: set[str] | None = None,
    pause: Callable[[], object] | None = None,
) -> dict[str, list[Flag]]:
    """Compute and store the checks that closed episodes (all, or ``episode_ids``) do not have yet, and
    the ``high_uncertainty`` results whose revision's calibration has grown (:func:`needs_recalibration`);
    open and unknown episodes are skipped. Returns what it computed. Other cached results are kept (a
    length outlier is judged against the task's lengths when it was computed). ``high_uncertainty`` is
    judged by the episode's scoring revision's calibration (:func:`load_calibration`, built once per call
    and revision). ``unreadable``: episodes whose frames could not be read are added to it and skipped
    next time (a caller that asks per request passes the same set, so a row without frames costs one
    warning, not one per request). ``pause``: called before each episode is read and before the results are
    written (a background caller waits there while requests are being served)."""
    if episode_ids is not None:  # the common, per-page case: nothing to do -> no table scan
        asked = [e for e in dict.fromkeys(episode_ids) if unreadable is None or e not in unreadable]
        if not _to_compute(db, asked, th):
            return {}
        episode_ids = asked
    index = db.closed_episode_index()
    lengths: dict[str, list[int]] = {}
    task_of: dict[str, str] = {}
    for eid, task, length in index:
        lengths.setdefault(task, []).append(length)
        task_of[eid] = task
    wanted = list(task_of) if episode_ids is None else [e for e in dict.fromkeys(episode_ids) if e in task_of]
    todo = _to_compute(db, wanted, th)
    calibrations: dict[str, RevisionCalibration] = {}
    results: dict[str, list[Flag]] = {}
    for eid in wanted:
        if eid not in todo:
            continue
        if pause is not None:
            pause()
        try:
            ep = store.read_episode(eid, cameras=False)
        except (KeyError, FileNotFoundError, ValueError) as e:
            log.warning("auto-flags: cannot read episode", extra={"episode_id": eid, "error": str(e)})
            if unreadable is not None:
                unreadable.add(eid)
            continue
        cal = None
        if "high_uncertainty" in todo[eid] and (rev := episode_scoring_revision(ep)) is not None:
            if rev not in calibrations:
                calibrations[rev] = load_calibration(store, db, rev, th)
            cal = calibrations[rev]
        results[eid] = compute_flags(ep, lengths[task_of[eid]], todo[eid], th, cal)
    if results:
        results = judge_batch(results, task_of, db, th)
        if pause is not None:
            pause()
        db.set_flags(results)
    return results
