"""bench/loop.py: how a run of `vla-rl up` is scored against issue 18's targets, and (slow) a whole tiny run.

The scoring is checked on hand-written round rows (the shape `up` writes to rounds.jsonl); the slow test
runs the bench end to end on the kinematic test bed with tiny recipes (a few minutes on 2 busy cores).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.loop import ALGOS, report, summarise_run


def _row(n: int, success: float | None, base: float, promoted: bool, intervention: float) -> dict[str, Any]:
    return {
        "round": n,
        "algo": "awr",
        "status": "succeeded" if success is not None else "failed",
        "success": success,
        "ci95": [max(0.0, (success or 0) - 0.1), min(1.0, (success or 0) + 0.1)],
        "base_success": base,
        "promoted": promoted,
        "minutes": 4.0,
        "fleet": {"episodes": 20, "success": 0.8, "intervention_rate": intervention, "takeovers_per_episode": 0.5,
                  "frames": 900},
    }  # fmt: skip


def test_a_run_that_meets_every_target() -> None:
    rows = [_row(1, 0.45, 0.30, True, 0.30), _row(2, 0.55, 0.45, True, 0.20), _row(3, 0.60, 0.55, True, 0.10)]
    s = summarise_run(rows, minutes=18.0)
    assert s["prod_success"] == [0.30, 0.45, 0.55, 0.60] and s["gain"] == pytest.approx(0.30)
    assert all(s["targets"].values()), s["targets"]
    assert s["minutes_rounds"] == 12.0


def test_prod_stays_when_a_round_is_not_promoted_or_fails() -> None:
    rows = [
        _row(1, 0.25, 0.30, False, 0.30),
        _row(2, None, 0.30, False, 0.35),
        _row(3, 0.50, 0.30, True, 0.25),
    ]
    s = summarise_run(rows, minutes=25.0)
    assert s["prod_success"] == [0.30, 0.30, 0.30, 0.50]
    t = s["targets"]
    assert t["base_in_range"] and t["intervention_falls"]
    assert not t["rises_every_round"] and not t["gain_at_least_25_points"] and not t["within_20_minutes"]
    assert summarise_run(rows, minutes=None)["targets"]["within_20_minutes"] is None  # --report-only


def test_report_has_a_row_per_round_and_a_summary_per_algorithm() -> None:
    rows = [_row(1, 0.45, 0.30, True, 0.30)]
    runs = [{"algo": a, "seed": 0, "rounds": rows, **summarise_run(rows, 9.0)} for a in ALGOS]
    per_round, summary = report(runs)
    assert per_round.count("\n") == 2 + 2 * len(ALGOS) - 1  # header, rule, (base + 1 round) per run
    assert "45% (35%-55%)" in per_round and "30% -> 45%" in summary and "+15 pts" in summary


@pytest.mark.slow
def test_the_bench_runs_up_and_writes_its_results(tmp_path: Path) -> None:
    out = tmp_path / "loop.json"
    argv = [
        sys.executable, "-m", "bench.loop", "--task", "kinematic/Reach-v0", "--robots", "2", "--episodes", "2",
        "--rounds", "1", "--base-demos", "4", "--base-steps", "20", "--base-preset", "kinematic-sft",
        "--round-steps", "20", "--eval-episodes", "4", "--algos", "sft", "--seeds", "0",
        "--work", str(tmp_path / "work"), "--out", str(out),
    ]  # fmt: skip
    r = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (run,) = json.loads(out.read_text())["results"]["runs"]
    assert run["algo"] == "sft" and len(run["rounds"]) == 1 and run["rounds"][0]["status"] == "succeeded"
    assert run["rounds"][0]["algo"] == "sft" and len(run["prod_success"]) == 2 and run["minutes"] > 0
    assert "prod autonomous success per round" in r.stdout
