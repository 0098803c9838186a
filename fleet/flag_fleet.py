"""Auto-flags judged against the fleet: a check raises only on the episodes that stand out from their task.

A fixed threshold on a metric flags whatever a policy does all the time: on a fresh fleet a jittery policy
gets ``jerk`` on nearly every episode, which points an operator at nothing. So the metric checks
(:data:`FLEET_CHECKS`: ``stillness``, ``jerk``, ``length_outlier``, ``failure_score``) are judged by the
task's own recent episodes: an episode is raised when its check passes the fixed threshold (now a floor, the
check's own rule, :class:`fleet.flags.FlagThresholds`) **and** its score is above the ``fleet_quantile``
(0.95) of the same metric over the task's other newest ``fleet_window`` (500) closed episodes (the
``q``-quantile taken as the ``ceil(q m)``-th smallest of their ``m`` scores). On a fleet where every episode
is equally jerky, about 5% are raised; an episode far above its peers is raised however noisy the peers are.
The check's threshold (``max(floor, quantile)``), how many episodes it rested on and whether it was calibrated
are stored with the result (``Flag.threshold``, ``reference_n``, ``calibrated``), and its detail says so.

With fewer than ``fleet_min_episodes`` (20) other episodes of the task the fixed threshold alone judges
(``calibrated`` False, as before calibration existed). A stored result is judged again once its task has
more closed episodes (while provisional: once they are enough to calibrate; calibrated: twice as many,
until the window is full):
:func:`needs_rejudging`. ``takeovers`` (a fact, not a metric) and ``high_uncertainty`` (calibrated per
checkpoint revision already) are not judged here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from fleet.db import Flag, MetadataDB


class FlagThresholds(Protocol):
    """What is read here of :class:`fleet.flags.FlagThresholds` (and the floors, by name)."""

    fleet_quantile: float
    fleet_window: int
    fleet_min_episodes: int


FLEET_CHECKS: dict[str, str] = {
    "stillness": "still_s",
    "jerk": "jerk_ratio",
    "length_outlier": "length_z",
    "failure_score": "failure_floor",
}
"""The checks judged against the fleet, and the :class:`~fleet.flags.FlagThresholds` field of each one's
fixed threshold (the floor)."""


def fleet_quantile(scores: Sequence[float], q: float) -> float:
    """The ``q``-quantile of ``scores`` as one of them: the ``ceil(q m)``-th smallest of the ``m``."""
    s = np.sort(np.asarray(scores, np.float64))
    return float(s[min(len(s), max(1, math.ceil(q * len(s)))) - 1])


def judge(flag: Flag, others: Sequence[float], task: str, th: FlagThresholds) -> Flag:
    """``flag`` (a :data:`FLEET_CHECKS` result, raised by its fixed rule) judged against ``others``, the
    same check's scores on the task's other recent episodes: raised only above their quantile too."""
    floor = float(getattr(th, FLEET_CHECKS[flag.name]))
    m = len(others)
    if m < th.fleet_min_episodes:
        basis = f"fixed threshold {floor:g} (only {m} other episodes of {task}; {th.fleet_min_episodes} calibrate)"
        return dataclasses.replace(
            flag, detail=f"{flag.detail}; {basis}", threshold=floor, reference_n=m, calibrated=False
        )
    q = fleet_quantile(others, th.fleet_quantile)
    basis = (
        f"threshold {max(floor, q):.3g}: above the {100 * th.fleet_quantile:g}th percentile {q:.3g} of {m} "
        f"other episodes of {task} (floor {floor:g})"
    )
    return dataclasses.replace(
        flag,
        detail=f"{flag.detail}; {basis}",
        raised=flag.raised and flag.score > q,
        threshold=max(floor, q),
        reference_n=m,
        calibrated=True,
    )


def judge_batch(
    results: Mapping[str, list[Flag]], task_of: Mapping[str, str], db: MetadataDB, th: FlagThresholds
) -> dict[str, list[Flag]]:
    """Every :data:`FLEET_CHECKS` result of a refresh judged against its task: the reference is the batch's
    own scores of the task plus the stored ones of its other newest closed episodes, at most
    ``fleet_window`` in all (the batch first: it is what just closed); each episode is judged by the others."""
    refs: dict[tuple[str, str], dict[str, float]] = {}
    for eid, flags in results.items():
        for f in flags:
            if f.name in FLEET_CHECKS:
                refs.setdefault((task_of[eid], f.name), {})[eid] = float(f.score)
    for (task, name), ref in refs.items():
        for eid, score in db.flag_scores(name, task, th.fleet_window):
            if len(ref) >= th.fleet_window:
                break
            ref.setdefault(eid, score)
    out: dict[str, list[Flag]] = {}
    for eid, flags in results.items():
        judged = []
        for f in flags:
            if f.name in FLEET_CHECKS:
                ref = refs[(task_of[eid], f.name)]
                others = [x for e, x in ref.items() if e != eid][: th.fleet_window]
                f = judge(f, others, task_of[eid], th)
            judged.append(f)
        out[eid] = judged
    return out


def needs_rejudging(flag: Flag, count: tuple[int, float] | None, th: FlagThresholds) -> bool:
    """Whether a stored :data:`FLEET_CHECKS` result is out of date, given its task's ``count`` (closed
    episodes, newest ``closed_at``: :meth:`fleet.db.MetadataDB.task_closed_counts`): stored before results
    kept their threshold; or episodes closed after it and there are more others than it rested on
    (provisional, once they are enough to calibrate) or twice as many (calibrated, while under
    ``fleet_window``)."""
    if flag.name not in FLEET_CHECKS:
        return False
    if flag.reference_n is None or flag.calibrated is None:
        return True
    n, newest = count or (0, 0.0)
    if newest <= flag.computed_at:
        return False
    others = n - 1
    if not flag.calibrated:  # judged again once the task has enough to calibrate (until then: the same)
        return others >= th.fleet_min_episodes and others > flag.reference_n
    return others >= 2 * flag.reference_n and flag.reference_n < th.fleet_window
