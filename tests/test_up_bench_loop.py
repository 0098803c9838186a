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

import bench.loop
from bench.loop import ALGOS, parser, prod_after, report, run_one, summarise_run
from vla_rl.up import UpConfig


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


def test_prod_after_a_promotion_is_the_held_out_report_not_the_gate() -> None:
    """The gate's number picked the promotion (a lucky draw is promoted more often): prod's number is the
    report's, on seeds the gate never saw; the gate's stands in only where no report was measured."""
    reported = {**_row(1, 0.60, 0.30, True, 0.30), "reported_success": 0.45, "reported_ci95": [0.3, 0.6]}
    rows = [reported, _row(2, 0.40, 0.45, False, 0.25), _row(3, 0.70, 0.45, True, 0.20)]
    prod, source = prod_after(rows)
    assert prod == [0.30, 0.45, 0.45, 0.70] and source == ["gate", "report", "report", "gate"]
    s = summarise_run(rows, minutes=30.0)
    assert s["prod_success"] == prod and s["prod_measured_on"] == source
    assert s["gain"] == pytest.approx(0.40) and not s["targets"]["rises_every_round"]
    per_round, _ = report([{"algo": "awr", "seed": 1, "rounds": rows, **s}])
    assert "60% (50%-70%)" in per_round and "45% (30%-60%)" in per_round  # the gate's and the report's


def test_prod_after_with_no_rounds_is_unknown() -> None:
    assert prod_after([]) == ([None], ["none"])


def test_the_lerobot_camera_loop_passes_through_to_up_and_is_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--policy / --image-size / --report-episodes reach `up`'s config, and the run's record carries them."""
    seen: list[UpConfig] = []

    def fake_run_up(cfg: UpConfig) -> None:
        seen.append(cfg)
        row = {**_row(1, 0.5, 0.3, True, 0.3), "reported_success": 0.4, "reported_ci95": [0.3, 0.5]}
        (cfg.workdir / "rounds.jsonl").parent.mkdir(parents=True, exist_ok=True)
        (cfg.workdir / "rounds.jsonl").write_text(json.dumps(row) + "\n")

    monkeypatch.setattr(bench.loop, "run_up", fake_run_up)
    argv = ["--policy", "smolvla", "--image-size", "96", "--task", "maniskill/PushCube-v1", "--robots", "2",
            "--rounds", "1", "--eval-episodes", "50", "--report-episodes", "30", "--work", str(tmp_path)]  # fmt: skip
    run = run_one("awr", 1, parser().parse_args(argv))
    (cfg,) = seen
    assert (cfg.policy, cfg.image_size, cfg.report_episodes, cfg.eval_episodes) == ("smolvla", 96, 30, 50)
    assert cfg.seed == 1 and cfg.workdir == tmp_path / "awr-seed1" and not cfg.continuous
    assert run["config"]["policy"] == "smolvla" and run["config"]["image_size"] == 96
    assert run["prod_success"] == [0.3, 0.4] and run["load_1min"]["samples"] >= 1
    assert run["load"] == run["load_1min"]  # every bench's `load` field; the earlier name kept
    assert parser().parse_args([]).policy == "flowvla"  # the default loop is unchanged
    with pytest.raises(SystemExit):
        parser().parse_args(["--policy", "act"])


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
