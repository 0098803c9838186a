"""What ``vla-rl up`` reports per round: the fleet's batch summarised from the metadata DB, and the
round table's header."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleet.db import MetadataDB


def fleet_summary(db: MetadataDB, since: float, robot_prefix: str) -> dict[str, Any]:
    """Success, intervention rate and takeovers of the closed episodes of robots ``robot_prefix*``
    created since ``since``: one selection in the metadata DB (the collector records every episode there
    once the store holds it)."""
    from vla_rl_client.meta import SegmentKind

    from fleet.selection import Selection

    recs = db.select_records(Selection(robots=(f"{robot_prefix}*",), since=since))
    frames = sum(r.length for r in recs)
    human = sum(
        (s.end if s.end is not None else r.length) - s.start
        for r in recs
        for s in r.segments
        if s.kind == SegmentKind.INTERVENTION
    )
    takeovers = sum(1 for r in recs for s in r.segments if s.kind == SegmentKind.INTERVENTION)
    n = len(recs)
    return {
        "episodes": n,
        "success": sum(bool(r.success) for r in recs) / n if n else None,
        "intervention_rate": human / frames if frames else None,
        "takeovers_per_episode": takeovers / n if n else None,
        "frames": frames,
    }


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


HEADER = [
    "round",
    "algo",
    "autonomous success (95% CI)",
    "base",
    "fleet success",
    "intervention",
    "takeovers/ep",
    "frames",
    "min",
    "promoted",
]
