"""How productive and how busy ``vla-rl up``'s fleet was over a stretch of wall-clock time (a round's, or
the whole run's), from the metadata DB: successful episodes per hour, robot utilisation and interventions
per robot-hour, the numbers that tell a fleet that stops while a round trains (batch) from one that never
stops (``--continuous``).

A round's window runs from the end of the round before it (or the fleet's start) to its own end: the
windows of one run are contiguous, so the run's numbers are their sums (:func:`overall`). An episode counts
(a success, its takeovers) in the window it closed in; its working time counts where it was spent (an
episode running across two windows is split between them; one still running at a window's end counts up
to it). An episode's working time is the collector's record of it, from its creation (the robot's first
message of the episode) to its close; a robot's reset between two episodes is not working time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vla_rl.up.continuous import after

if TYPE_CHECKING:
    from vla_rl_client.meta import EpisodeRecord

    from fleet.db import MetadataDB

HOUR_S = 3600.0

HEADER = ["round", "window min", "episodes", "successful / h", "utilisation", "interventions / robot-h"]

NOTE = (
    "window: from the end of the round before (or the fleet's start) to the round's end; utilisation: the "
    "share of the window the robots spent in episodes; interventions: the operator's takeovers per hour of "
    "robot work"
)
"""Printed under the activity table: what its columns mean."""


def fleet_activity(
    db: MetadataDB, start: float, end: float, robots: int, robot_prefix: str
) -> dict[str, Any]:
    """The fleet's work in the wall-clock window ``[start, end]`` (unix seconds): ``robots`` robots named
    ``robot_prefix-*``. The window, raw sums (so windows add up) and the rates derived from them."""
    from fleet.selection import Selection

    window = {"start": start, "end": end, "seconds": max(0.0, end - start), "robots": robots}
    if end <= start:
        return rates({**window, "episodes": 0, "successes": 0, "interventions": 0, "busy_seconds": 0.0})
    robots_sel = (f"{robot_prefix}-*",)
    # closed in (start, end]: contiguous windows count each episode once
    closed = db.select_records(Selection(robots=robots_sel, closed_since=after(start), closed_until=end))
    # running at `end`: still open, or closed since (the DB hears of a close a moment after the store)
    later = db.select_records(Selection(robots=robots_sel, until=end, closed_since=after(end)))
    running = [
        r
        for r in db.episodes(status="open")
        if r.robot_id.startswith(f"{robot_prefix}-") and start <= r.created_at <= end
    ]
    busy = sum(_overlap(r, start, end) for r in [*closed, *later, *running])
    return rates(
        {
            **window,
            "episodes": len(closed),
            "successes": sum(bool(r.success) for r in closed),
            "interventions": _takeovers(closed),
            "busy_seconds": busy,
        }
    )


def _overlap(r: EpisodeRecord, start: float, end: float) -> float:
    """Seconds of episode ``r`` (created -> closed, or -> ``end`` while it runs) within ``[start, end]``."""
    closed = end if r.closed_at is None else r.closed_at
    return max(0.0, min(closed, end) - max(r.created_at, start))


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
