"""Batch vs continuous `vla-rl up` on the same machine and settings (issue 44 item 4): the fleet's successful
episodes per wall-clock hour, robot utilisation and interventions per robot-hour.

Runs :func:`vla_rl.up.run_up` twice, one after the other (never in parallel: they would share the cores),
each in a fresh workdir under ``--work``: first batch (``continuous=False``: the fleet collects its
episodes, stops, the round trains), then continuous (the fleet keeps working under prod while the round
trains on its snapshot). Same task, robots, episodes per round trigger, rounds, base, round recipe, seed.
The numbers are each round's window and the run's (:mod:`vla_rl.up.activity`): a window runs from the end
of the round before (or the fleet's start) to the round's end, so the base's training and the services'
start-up are outside both. The defaults keep the base and the rounds small (a weak base from 10 demos and
300 SFT steps, rounds of 300 steps, 10 gate episodes): this measures the fleet, not learning. Writes
bench/results/continuous.json after each run and prints a table.

    python -m bench.continuous                      # PickCube, 4 robots, 2 rounds of awr (300 steps)
    python -m bench.continuous --task kinematic/Reach-v0 --base-preset kinematic-sft --base-demos 10 \
        --base-steps 200 --out /tmp/c.json           # the kinematic test bed (0.3 s episodes)
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

from bench.common import table, write_results
from vla_rl.up import UpConfig, run_up
from vla_rl.up.activity import overall

MODES = ("batch", "continuous")


def _config(mode: str, args: argparse.Namespace) -> UpConfig:
    return UpConfig(
        task=args.task,
        robots=args.robots,
        episodes=args.episodes,
        rounds=args.rounds,
        algo=args.algo,
        preset=args.preset,
        round_steps=args.round_steps,
        base_demos=args.base_demos,
        base_steps=args.base_steps,
        base_preset=args.base_preset,
        eval_episodes=args.eval_episodes,
        gate_alpha=args.gate_alpha,
        report_episodes=0,
        continuous=mode == "continuous",
        trainer_nice=args.trainer_nice,
        workdir=args.work / mode,
        seed=args.seed,
        progress=False,
        dashboard=False,
    )


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One fresh run of ``up`` in ``mode`` (``--report-only``: none, the rounds its workdir holds): its
    rows, its activity overall and its wall time."""
    cfg = _config(mode, args)
    minutes = None
    if args.report_only:
        rows = [json.loads(line) for line in (cfg.workdir / "rounds.jsonl").read_text().splitlines()]
    else:
        if cfg.workdir.exists():
            shutil.rmtree(cfg.workdir)
        t0 = time.monotonic()
        rows = run_up(cfg)
        minutes = (time.monotonic() - t0) / 60
    return {
        "mode": mode,
        "minutes_total": minutes,
        "rounds": [
            {k: r[k] for k in ("round", "status", "promoted", "minutes", "fleet", "activity", "success")}
            for r in rows
        ],
        "overall": overall([r["activity"] for r in rows]),
    }


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def report(runs: list[dict[str, Any]]) -> str:
    """One row per run and round, and the run's overall."""
    rows = []
    for run in runs:
        for label, a in [*((r["round"], r["activity"]) for r in run["rounds"]), ("all", run["overall"])]:
            if a is None:
                continue
            rows.append(
                [
                    run["mode"],
                    label,
                    f"{a['seconds'] / 60:.1f}",
                    a["episodes"],
                    a["successes"],
                    _num(a["successes_per_hour"], ".0f"),
                    _num(a["utilisation"], ".0%"),
                    _num(a["interventions_per_robot_hour"], ".0f"),
                ]
            )
    header = [
        "mode",
        "round",
        "min",
        "episodes",
        "successes",
        "successful / h",
        "utilisation",
        "interv. / robot-h",
    ]
    return table(rows, header)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="maniskill/PickCube-v1")
    p.add_argument("--robots", type=int, default=4)
    p.add_argument("--episodes", type=int, default=5, help="episodes per robot that trigger a round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--algo", default="awr")
    p.add_argument("--preset", default=None)
    p.add_argument("--round-steps", type=int, default=300)
    p.add_argument("--base-demos", type=int, default=10)
    p.add_argument("--base-steps", type=int, default=300)
    p.add_argument("--base-preset", default=None, help="SFT recipe of the base (e.g. kinematic-sft)")
    p.add_argument("--eval-episodes", type=int, default=10)
    p.add_argument("--gate-alpha", type=float, default=1.0, help="1: promote on the success gap alone")
    p.add_argument("--trainer-nice", type=int, default=UpConfig.trainer_nice)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--work", type=Path, default=Path("runs/bench_continuous"))
    p.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: report the rounds the workdirs hold (e.g. of an interrupted bench; no total time)",
    )
    p.add_argument(
        "--out", type=Path, default=None, help="results file (default bench/results/continuous.json)"
    )
    args = p.parse_args()
    params = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    runs: list[dict[str, Any]] = []
    path = None
    for mode in args.modes:
        runs.append(run_mode(mode, args))
        path = write_results("continuous", {"params": params, "runs": runs}, args.out)
    print(report(runs))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
