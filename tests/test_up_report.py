"""What `vla-rl up` prints and records for a round: its row, its line and its cells in the final table
(in-process, no services)."""

from __future__ import annotations

import json

import pytest

from fleet.db import RoundRecord
from vla_rl.up.report import HEADER, round_cells, round_line, round_row

FLEET = {
    "episodes": 8,
    "success": 0.5,
    "intervention_rate": 0.25,
    "takeovers_per_episode": 0.75,
    "frames": 400,
}


def _record(status: str, metrics: dict[str, object], error: str | None = None) -> RoundRecord:
    return RoundRecord(
        id=3,
        algo="awr",
        task="kinematic/Reach-v0",
        base_ref="hub://up/policy@prod",
        base_revision="abc",
        status=status,
        config={},
        data={},
        metrics=metrics,
        checkpoint_ref=None,
        checkpoint_revision=None,
        promoted=status == "succeeded",
        error=error,
        created_at=0.0,
        finished_at=1.0,
    )


def test_a_succeeded_rounds_row_line_and_cells() -> None:
    metrics = {
        "success": 0.62,
        "ci95": [0.48, 0.74],
        "base_success": 0.4,
        "p_value": 0.0213,
        "reported_success": 0.55,
        "reported_ci95": [0.34, 0.74],
    }
    events = ["collector exited with code -9; restarting it (restart 1)"]
    row = round_row(3, _record("succeeded", metrics), FLEET, 5.25, "f00d", events)
    events.append("later")  # the row keeps the events as they were when the round finished
    assert row == {
        "round": 3,
        "algo": "awr",
        "status": "succeeded",
        **metrics,  # the gate's success, interval, base and p-value; the held-out success and interval
        "fleet": FLEET,
        "minutes": 5.25,
        "promoted": True,
        "prod_revision": "f00d",
        "error": None,
        "restarts": ["collector exited with code -9; restarting it (restart 1)"],
    }
    json.dumps(row)  # rounds.jsonl holds it
    assert round_line(row) == (
        "round 3: awr success 55% (34%-74%) on held-out seeds, gate 62% vs 40% (p 0.021), fleet success 50% "
        "with 25% of frames by the operator, promoted: yes (5.2 min)"
    )
    cells = round_cells(row)
    assert len(cells) == len(HEADER)
    assert cells == [
        3,
        "awr",
        "55% (34%-74%)",
        "62% vs 40% (p 0.021)",
        "50%",
        "25%",
        "0.75",
        400,
        "5.2",
        "yes",
    ]


def test_a_round_not_promoted_reports_its_success_as_not_measured() -> None:
    """The gate's numbers are shown, labelled as the gate's; the held-out success was not measured (only a
    promoted candidate is scored again), and the table says so rather than showing the gate's number."""
    metrics = {"success": 0.58, "ci95": [0.44, 0.71], "base_success": 0.52, "p_value": 0.125}
    metrics |= {"reported_success": None, "report_episodes": 0}
    row = round_row(3, _record("succeeded", metrics), FLEET, 5.0, "f00d", [])
    assert row["reported_success"] is None and row["success"] == 0.58
    assert round_cells(row)[2:4] == ["not measured", "58% vs 52% (p 0.12)"]
    assert "success not measured on held-out seeds, gate 58% vs 52% (p 0.12)" in round_line(row)


def test_a_failed_round_says_why_and_an_empty_batch_reads_n_a() -> None:
    error = "ValueError: the data selection is empty\nTraceback (most recent call last): ..."
    empty = {
        "episodes": 0,
        "success": None,
        "intervention_rate": None,
        "takeovers_per_episode": None,
        "frames": 0,
    }
    row = round_row(3, _record("failed", {}, error), empty, 0.5, "f00d", [])
    assert row["error"] == "ValueError: the data selection is empty" and row["ci95"] == [None, None]
    assert row["success"] is None and not row["promoted"]
    assert round_line(row) == (
        "round 3: awr failed: ValueError: the data selection is empty, base n/a, fleet success n/a with n/a "
        "of frames by the operator, promoted: no (0.5 min)"
    )
    assert round_cells(row) == [3, "awr", "failed (below)", "n/a", "n/a", "n/a", "n/a", 0, "0.5", "no"]


@pytest.mark.parametrize("status", ["failed", "cancelled"])
def test_only_a_succeeded_round_shows_a_success_rate(status: str) -> None:
    row = round_row(1, _record(status, {"success": 0.9, "ci95": [0.8, 0.95]}), FLEET, 1.0, "f00d", [])
    assert f"{status}: None" in round_line(row) and "90%" not in round_line(row)
    assert round_cells(row)[2] == f"{status} (below)"
