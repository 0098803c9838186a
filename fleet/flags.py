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

Hook for the policy's ``accel`` uncertainty: the store does not record it per frame yet.
:func:`episode_uncertainty` is where it will be read (it returns None today); once it returns an
array, add a ``high_uncertainty`` check to :data:`CHECKS` (mean / peak uncertainty against a
threshold) and its name to :data:`FLAG_NAMES`, and :func:`refresh_flags` computes it for every
episode that lacks it, old ones included.

:func:`refresh_flags` computes the missing checks of closed episodes (the dashboard calls it lazily
for the episodes it shows; the collector may call it when an episode closes).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from fleet.db import Flag, MetadataDB
from fleet.meta import Controller
from fleet.store import Episode, EpisodeStore

log = logging.getLogger(__name__)

FLAG_NAMES: tuple[str, ...] = ("stillness", "jerk", "length_outlier", "takeovers")


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

    def __post_init__(self) -> None:
        for name in ("still_action", "still_s", "jerk_ratio", "jerk_floor", "length_z"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"{name}: expected a number > 0, got {v!r}")
        if not isinstance(self.min_task_episodes, int) or self.min_task_episodes < 2:
            raise ValueError(f"min_task_episodes: expected an integer >= 2, got {self.min_task_episodes!r}")


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


def episode_uncertainty(ep: Episode) -> np.ndarray | None:
    """The policy's per-frame ``accel`` uncertainty, when the store records it: not yet (None). The hook
    for a ``high_uncertainty`` check (module docstring)."""
    return None


CHECKS: dict[str, Callable[[Episode, Sequence[int], FlagThresholds], Flag]] = {
    "stillness": lambda ep, _lengths, th: stillness(ep, th),
    "jerk": lambda ep, _lengths, th: jerk(ep, th),
    "length_outlier": lambda ep, lengths, th: length_outlier(ep, lengths, th),
    "takeovers": lambda ep, _lengths, th: takeovers(ep, th),
}


def compute_flags(
    ep: Episode,
    task_lengths: Sequence[int],
    names: Iterable[str] = FLAG_NAMES,
    th: FlagThresholds = DEFAULT_THRESHOLDS,
) -> list[Flag]:
    """Every named check's result for one episode (raised or not), stamped with the time."""
    now = time.time()
    out = []
    for name in names:
        if name not in CHECKS:
            raise ValueError(f"flag: unknown check {name!r}; expected one of {', '.join(CHECKS)}")
        f = CHECKS[name](ep, task_lengths, th)
        out.append(Flag(f.name, f.score, f.detail, f.raised, now))
    return out


def refresh_flags(
    store: EpisodeStore,
    db: MetadataDB,
    episode_ids: Iterable[str] | None = None,
    th: FlagThresholds = DEFAULT_THRESHOLDS,
    unreadable: set[str] | None = None,
    pause: Callable[[], object] | None = None,
) -> dict[str, list[Flag]]:
    """Compute and store the checks that closed episodes (all, or ``episode_ids``) do not have yet;
    open and unknown episodes are skipped. Returns what it computed. Cached results are kept (a length
    outlier is judged against the task's lengths when it was computed). ``unreadable``: episodes whose
    frames could not be read are added to it and skipped next time (a caller that asks per request
    passes the same set, so a row without frames costs one warning, not one per request). ``pause``:
    called before each episode is read and before the results are written (a background caller waits
    there while requests are being served)."""
    if episode_ids is not None:  # the common, per-page case: nothing missing -> no table scan
        asked = [e for e in dict.fromkeys(episode_ids) if unreadable is None or e not in unreadable]
        known = db.flags(asked, raised_only=False)
        if all(n in known.get(e, {}) for e in asked for n in FLAG_NAMES):
            return {}
        episode_ids = asked
    index = db.closed_episode_index()
    lengths: dict[str, list[int]] = {}
    task_of: dict[str, str] = {}
    for eid, task, length in index:
        lengths.setdefault(task, []).append(length)
        task_of[eid] = task
    wanted = list(task_of) if episode_ids is None else [e for e in dict.fromkeys(episode_ids) if e in task_of]
    have = db.flags(wanted, raised_only=False)
    results: dict[str, list[Flag]] = {}
    for eid in wanted:
        missing = [n for n in FLAG_NAMES if n not in have[eid]]
        if not missing:
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
        results[eid] = compute_flags(ep, lengths[task_of[eid]], missing, th)
    if results:
        if pause is not None:
            pause()
        db.set_flags(results)
    return results
