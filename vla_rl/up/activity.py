"""How productive and how busy ``vla-rl up``'s fleet was over a stretch of wall-clock time (a round's, or
the whole run's), from the metadata DB: successful episodes per hour, robot utilisation and interventions
per robot-hour, the numbers that tell a fleet that stops while a round trains (batch) from one that never
stops (``--continuous``).

A round's window runs from the end of the round before it (or the fleet's start) to its own end: the
windows of one run are contiguous, so the run's numbers are their sums (:func:`overall`). An episode counts
(a success, its takeovers) in the window its robot finished it in; its working time counts where it was
spent (an episode running across two windows is split between them). An episode's working time is what
its frames' timestamps span (:func:`work_span`); a robot's reset between two episodes is not working
time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vla_rl_client.meta import EpisodeRecord

    from fleet.db import MetadataDB
    from fleet.store import EpisodeStore

HOUR_S = 3600.0

HEADER = ["round", "window min", "episodes", "successful / h", "utilisation", "interventions / robot-h"]

NOTE = (
    "window: from the end of the round before (or the fleet's start) to the round's end; utilisation: the "
    "share of the window the robots spent in episodes; interventions: the operator's takeovers per hour of "
    "robot work"
)
"""Printed under the activity table: what its columns mean."""


def fleet_activity(
    db: MetadataDB, store: EpisodeStore, start: float, end: float, robots: int, robot_prefix: str
) -> dict[str, Any]:
    """The fleet's work in the wall-clock window ``[start, end]`` (unix seconds): ``robots`` robots named
    ``robot_prefix-*``, their episodes in ``store``. The window, raw sums (so windows add up) and the rates
    derived from them. Call it once the episodes that ran in the window are closed (:func:`wait_closed`):
    one still open is left out."""
    from fleet.selection import Selection

    window = {"start": start, "end": end, "seconds": max(0.0, end - start), "robots": robots}
    if end <= start:
        return rates({**window, "episodes": 0, "successes": 0, "interventions": 0, "busy_seconds": 0.0})
    # an episode that ran in the window closed at or after the window's start
    recs = db.select_records(Selection(robots=(f"{robot_prefix}-*",), closed_since=start))
    spans = {r.id: work_span(store, r.id) for r in recs}
    ended = [r for r in recs if start < spans[r.id][1] <= end]  # (start, end]: counted once
    return rates(
        {
            **window,
            "episodes": len(ended),
            "successes": sum(bool(r.success) for r in ended),
            "interventions": _takeovers(ended),
            "busy_seconds": sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans.values()),
        }
    )


def work_span(store: EpisodeStore, episode_id: str) -> tuple[float, float]:
    """When the robot worked on the episode, from its frames' timestamps (the robot's clock at each step):
    its last frame's time, less the frames' span stretched by one step (the first frame is stamped after
    the first step). Not the collector's creation and close times: a store writer closes an episode
    seconds after the robot finished it when it is busy."""
    ts = store.read_arrays(episode_id, ["timestamp"])["timestamp"]
    if len(ts) == 0:
        return 0.0, 0.0
    first, last = float(ts[0]), float(ts[-1])
    n = len(ts)
    return last - (last - first) * n / max(n - 1, 1), last


def wait_closed(db: MetadataDB, start: float, end: float, robot_prefix: str, timeout_s: float = 60.0) -> bool:
    """Wait until every episode robots ``robot_prefix-*`` started in ``[start, end]`` is closed in the DB
    (the robots finish what they were doing at ``end``, the store writers catch up); whether they all
    were within ``timeout_s`` (an episode of a robot that died stays open)."""
    deadline = time.monotonic() + timeout_s
    while True:
        open_ = [
            r
            for r in db.episodes(status="open")
            if r.robot_id.startswith(f"{robot_prefix}-") and start <= r.created_at <= end
        ]
        if not open_:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)


def _takeovers(recs: Sequence[EpisodeRecord]) -> int:
    """The operator's takeovers (intervention segments) in these episodes."""
    from vla_rl_client.meta import SegmentKind

    return sum(1 for r in recs for s in r.segments if s.kind == SegmentKind.INTERVENTION)


def rates(sums: dict[str, Any]) -> dict[str, Any]:
    """``sums`` (:func:`fleet_activity`'s raw sums) with the rates: successful episodes per wall-clock hour,
    utilisation (the robots' working share of the window) and interventions per hour of robot work (None
    where a denominator is 0)."""
    hours, busy_hours = sums["seconds"] / HOUR_S, sums["busy_seconds"] / HOUR_S
    robot_s = sums["seconds"] * sums["robots"]
    return {
        **sums,
        "successes_per_hour": sums["successes"] / hours if hours > 0 else None,
        "utilisation": min(1.0, sums["busy_seconds"] / robot_s) if robot_s > 0 else None,
        "interventions_per_robot_hour": sums["interventions"] / busy_hours if busy_hours > 0 else None,
    }


def overall(activities: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The run's activity from its rounds' (contiguous windows of the same fleet, in order): sums, then
    rates; None for no rounds."""
    if not activities:
        return None
    keys = ("seconds", "episodes", "successes", "interventions", "busy_seconds")
    sums: dict[str, Any] = {k: sum(a[k] for a in activities) for k in keys}
    window = {"start": activities[0]["start"], "end": activities[-1]["end"]}
    return rates({**window, **sums, "robots": activities[0]["robots"]})


def activity_cells(label: object, a: dict[str, Any]) -> list[object]:
    """One row of the activity table (columns: :data:`HEADER`)."""

    def num(x: float | None, fmt: str) -> str:
        return "n/a" if x is None else format(x, fmt)

    return [
        label,
        f"{a['seconds'] / 60:.1f}",
        a["episodes"],
        num(a["successes_per_hour"], ".0f"),
        num(a["utilisation"], ".0%"),
        num(a["interventions_per_robot_hour"], ".1f"),
    ]
