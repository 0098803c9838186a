"""What ``vla-rl up`` reports per round: the fleet's batch summarised from the metadata DB, the round's
row (printed as a line, appended to ``rounds.jsonl``, returned by :func:`vla_rl.up.run_up`) and its cells
in the table printed at the end."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vla_rl_client.meta import EpisodeRecord

    from fleet.db import MetadataDB, RoundRecord


def fleet_summary(db: MetadataDB, since: float, robot_prefix: str) -> dict[str, Any]:
    """Success, intervention rate and takeovers of the closed episodes of robots ``robot_prefix*``
    created since ``since``: one selection in the metadata DB (the collector records every episode there
    once the store holds it)."""
    from fleet.selection import Selection

    return summarise(db.select_records(Selection(robots=(f"{robot_prefix}*",), since=since)))


def summarise(recs: Sequence[EpisodeRecord]) -> dict[str, Any]:
    """:func:`fleet_summary` of these closed episodes."""
    from vla_rl_client.meta import SegmentKind

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


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


HEADER = [
    "round",
    "algo",
    "autonomous success (95% CI)",
    "gate: candidate vs base (p)",
    "fleet success",
    "intervention",
    "takeovers/ep",
    "frames",
    "min",
    "promoted",
]


NOTE = (
    "autonomous success: the promoted checkpoint on report seeds its gate never saw (not measured: not "
    "promoted, or --report-episodes 0); gate: the success on the gate's seeds that the promotion was decided "
    "on, and the paired test's one-sided p-value"
)
"""Printed under the table: what its two success columns mean."""


def round_row(
    rid: int,
    rec: RoundRecord,
    fleet: dict[str, Any],
    minutes: float,
    prod_revision: str,
    events: Sequence[str],
) -> dict[str, Any]:
    """The row of finished round ``rid``: its outcome (``rec``), the fleet's batch before it (``fleet``, a
    :func:`fleet_summary`), its minutes, where ``prod`` points after it and the supervisor's events so far
    (restarts; the first line of the round's error, if it has one). ``success``, ``ci95`` and
    ``base_success`` are the gate's; ``reported_success`` and ``reported_ci95`` the promoted checkpoint's
    on seeds the gate did not see (None: not measured)."""
    m = rec.metrics
    return {
        "round": rid,
        "algo": rec.algo,
        "status": rec.status,
        "success": m.get("success"),
        "ci95": m.get("ci95") or [None, None],
        "base_success": m.get("base_success"),
        "p_value": m.get("p_value"),
        "reported_success": m.get("reported_success"),
        "reported_ci95": m.get("reported_ci95") or [None, None],
        "fleet": fleet,
        "minutes": minutes,
        "promoted": rec.promoted,
        "prod_revision": prod_revision,
        "error": (rec.error or "").splitlines()[0] if rec.error else None,
        "restarts": list(events),
    }


def _with_ci(rate: float | None, ci95: Sequence[float | None]) -> str:
    lo, hi = ci95
    if rate is None:
        return "not measured"
    return f"{rate:.0%}" if lo is None or hi is None else f"{rate:.0%} ({lo:.0%}-{hi:.0%})"


def _reported(row: dict[str, Any]) -> str:
    """A succeeded round's reported success (held-out seeds) with its 95% interval; else its status and
    error."""
    if row["status"] != "succeeded":
        return f"{row['status']}: {row['error']}"
    return _with_ci(row.get("reported_success"), row.get("reported_ci95") or [None, None])


def _gate(row: dict[str, Any]) -> str:
    """The gate's numbers: candidate vs base on the gate's seeds, and the paired test's p-value."""
    p = row.get("p_value")
    return f"{_pct(row['success'])} vs {_pct(row['base_success'])}" + ("" if p is None else f" (p {p:.2g})")


def round_line(row: dict[str, Any]) -> str:
    """The line printed as a round finishes."""
    fleet = row["fleet"]
    if row["status"] == "succeeded":
        outcome = f"success {_reported(row)} on held-out seeds, gate {_gate(row)}"
    else:
        outcome = f"{_reported(row)}, base {_pct(row['base_success'])}"
    return (
        f"round {row['round']}: {row['algo']} {outcome}, fleet success {_pct(fleet['success'])} with "
        f"{_pct(fleet['intervention_rate'])} of frames by the operator, promoted: "
        f"{'yes' if row['promoted'] else 'no'} ({row['minutes']:.1f} min)"
    )


def round_cells(row: dict[str, Any]) -> list[object]:
    """The round's cells in the table printed at the end (columns: :data:`HEADER`); a round that did not
    succeed says so and is detailed below the table."""
    fleet = row["fleet"]
    takeovers = fleet["takeovers_per_episode"]
    return [
        row["round"],
        row["algo"],
        _reported(row) if row["status"] == "succeeded" else f"{row['status']} (below)",
        _gate(row) if row["status"] == "succeeded" else "n/a",
        _pct(fleet["success"]),
        _pct(fleet["intervention_rate"]),
        "n/a" if takeovers is None else f"{takeovers:.2f}",
        fleet["frames"],
        f"{row['minutes']:.1f}",
        "yes" if row["promoted"] else "no",
    ]
