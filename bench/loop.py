"""The improvement loop's learning target: `vla-rl up` on PickCube, per round, for two round algorithms.

For each round algorithm (``--algos``) and seed (``--seeds``), run :func:`vla_rl.up.run_up` in a fresh
workdir (``--work``/<algo>-seed<S>) with the issue's settings: ``--task maniskill/PickCube-v1 --robots 4
--rounds 3``, the weak base `up` seeds itself (SFT on 25 noisy demos), every other knob `up`'s default.
The whole loop runs as `up` runs it (registry, policy server following prod, collector, round worker,
simulated fleet + operator, each its own process). Per round it reports:

* autonomous success on the held-out eval seeds (100000 + i, the same every round, never a fleet or demo
  seed) of the round's candidate with its 95% Wilson interval: the gate's number, the one the promotion
  was decided on;
* ``prod``'s success after the round: round 0 is the base on the gate's seeds (the base was not selected
  on them); a promoted round's is its candidate's on the report's seeds, which the gate never saw (a
  promotion picks the lucky draws of the gate's seeds, so the gate's number overstates what it promoted);
  a round not promoted keeps what prod was. Where a round has no report (``--report-episodes 0``, or a run
  from before the report existed) its gate number stands in, and ``prod_measured_on`` says so;
* the fleet's success with the operator, its intervention rate (share of frames the operator drove) and
  takeovers per episode, over the fleet batch collected *before* the round (under the previous prod);
* the round's wall time (fleet batch + training + evaluation), and the run's total (base included).

Round algorithms (``ALGOS``):

* ``awr`` (up's default): intervention-aware advantage-weighted regression from prod; an episode's outcome
  is credited only to the frames the policy drove and never across a takeover, and the operator's frames
  are positive behaviour cloning (``human_weight`` 1), as in HG-DAgger / LWD-style learning from
  interventions;
* ``sft``: plain SFT from scratch on the successful episodes (the demos and the fleet's successes, the
  operator's corrections in them included), as many steps as the base.

The targets (issue 18): base in 25-45%; autonomous success (prod) rises every round; round 3 >= base + 25
points; the fleet's intervention rate falls; a run <= 20 min on the 2-core machine. They are checked per
run and written with the numbers. Writes bench/results/loop.json after every run (a partial file survives
an interrupted bench) and prints a markdown table.

    python -m bench.loop                                   # 2 algorithms x 3 seeds (hours on 2 cores)
    python -m bench.loop --algos awr --seeds 0             # one run (what docs/benchmarks.md reports)
    python -m bench.loop --task kinematic/Reach-v0 --robots 2 --episodes 2 --rounds 1 --base-demos 4 \\
        --base-steps 20 --base-preset kinematic-sft --round-steps 20 --eval-episodes 4 --out /tmp/l.json
    # the loop on a small LeRobot SmolVLA from a 64 px camera (docs/benchmarks.md, `up --policy smolvla`)
    python -m bench.loop --policy smolvla --task maniskill/PushCube-v1 --image-size 64 --robots 2 \\
        --episodes 10 --rounds 3 --eval-episodes 50 --report-episodes 50 --algos awr --seeds 1 2 \\
        --out bench/results/loop_smolvla.json

``--policy`` and ``--image-size`` pass through to `up` (``flowvla`` acts from the state and ignores the
image size; ``smolvla`` / ``pi0`` / ``pi05`` act from the task's camera). Each run also records the
machine's 1-minute load average, sampled while it ran: on a shared machine the minutes mean little
without it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import LoadSampler, table, write_results
from policies.lerobot_flow import FLOW_TYPES
from vla_rl.up import UpConfig, run_up

ALGOS: dict[str, dict[str, Any]] = {
    "awr": dict(algo="awr"),
    "sft": dict(algo="sft", data="success=true", round_steps="base"),
}
TARGET_GAIN, TARGET_MINUTES, BASE_RANGE = 0.25, 20.0, (0.25, 0.45)


def _config(algo: str, seed: int, args: argparse.Namespace, work: Path) -> UpConfig:
    spec = dict(ALGOS[algo])
    steps = spec.pop("round_steps", None)
    if steps == "base":
        steps = args.base_steps
    if args.round_steps is not None:
        steps = args.round_steps
    kw: dict[str, Any] = dict(
        task=args.task,
        policy=args.policy,
        image_size=args.image_size,
        robots=args.robots,
        rounds=args.rounds,
        episodes=args.episodes,
        base_demos=args.base_demos,
        base_steps=args.base_steps,
        base_preset=args.base_preset,
        eval_episodes=args.eval_episodes,
        report_episodes=args.report_episodes,
        workdir=work,
        seed=seed,
        progress=False,
        dashboard=False,
        round_steps=steps,
        continuous=False,  # the loop: the fleet's batch, then the round
        **spec,
    )
    return UpConfig(**kw)


def prod_after(rows: list[dict[str, Any]]) -> tuple[list[float | None], list[str]]:
    """``prod``'s autonomous success after each round (index 0: the base) and what each number was
    measured on: ``gate`` (the base's, or a promoted candidate's without a report), ``report`` (a promoted
    candidate's on seeds its gate never saw) or ``none`` (unknown). A round not promoted, or not
    succeeded, keeps what prod was."""
    prod: list[float | None] = [rows[0].get("base_success") if rows else None]
    source = ["gate" if prod[0] is not None else "none"]
    for r in rows:
        if not (r["status"] == "succeeded" and r.get("success") is not None and r["promoted"]):
            prod.append(prod[-1])
            source.append(source[-1])
        elif r.get("reported_success") is not None:
            prod.append(r["reported_success"])
            source.append("report")
        else:
            prod.append(r["success"])
            source.append("gate")
    return prod, source


def summarise_run(rows: list[dict[str, Any]], minutes: float | None) -> dict[str, Any]:
    """Per-round prod success (round 0 = the base; :func:`prod_after`) and the issue's targets for one run
    of `up`; ``minutes`` = the whole run (base included), None where unknown (--report-only)."""
    prod, source = prod_after(rows)
    base = prod[0]
    interventions = [r["fleet"]["intervention_rate"] for r in rows]
    known = [p for p in prod if p is not None]
    met = {
        "base_in_range": base is not None and BASE_RANGE[0] <= base <= BASE_RANGE[1],
        "rises_every_round": len(known) == len(prod) and all(b > a for a, b in itertools.pairwise(prod)),
        "gain_at_least_25_points": len(known) == len(prod) and prod[-1] - prod[0] >= TARGET_GAIN,
        "intervention_falls": None not in interventions and interventions[-1] < interventions[0],
        "within_20_minutes": None if minutes is None else minutes <= TARGET_MINUTES,
    }
    return {
        "base_success": base,
        "prod_success": prod,
        "prod_measured_on": source,
        "gain": prod[-1] - prod[0] if len(known) == len(prod) else None,
        "fleet_intervention_rate": interventions,
        "minutes": minutes,
        "minutes_rounds": sum(r["minutes"] for r in rows),
        "targets": met,
    }


def run_one(algo: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    work = args.work / f"{algo}-seed{seed}"
    if work.exists() and not (args.resume or args.report_only):
        if not (work / "up.json").exists():
            raise SystemExit(f"{work} exists and is not an up workdir; pick another --work")
        shutil.rmtree(work)
    cfg = _config(algo, seed, args, work)
    minutes, load = None, None
    if not args.report_only:
        t0 = time.monotonic()
        with LoadSampler() as sampler:
            run_up(cfg)
        minutes, load = (time.monotonic() - t0) / 60, sampler.summary()
    # every round of the workdir (with --resume, earlier runs' too), the last record of each
    by_round = {r["round"]: r for r in map(json.loads, (work / "rounds.jsonl").read_text().splitlines())}
    rows = [by_round[k] for k in sorted(by_round)]
    return {
        "algo": algo,
        "seed": seed,
        "config": vars(cfg),
        "load": load,
        "load_1min": load,  # the same summary, by the name earlier results gave it
        "rounds": rows,
        **summarise_run(rows, minutes),
    }


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def _with_ci(rate: float | None, ci95: list[float | None] | None) -> str:
    """``rate`` with its 95% interval, or "n/a" where not measured."""
    lo, hi = ci95 or (None, None)
    if rate is None:
        return "n/a"
    return _pct(rate) if lo is None or hi is None else f"{_pct(rate)} ({_pct(lo)}-{_pct(hi)})"


def report(runs: list[dict[str, Any]]) -> tuple[str, str]:
    """Per-round rows of every run, and a per-algorithm summary over seeds."""
    per_round = []
    for run in runs:
        per_round.append(
            [run["algo"], run["seed"], 0, "base", "", _pct(run["base_success"]), "", "", "", "", "", ""]
        )
        for i, r in enumerate(run["rounds"], 1):
            ok = r["status"] == "succeeded"
            f = r["fleet"]
            per_round.append(
                [
                    run["algo"],
                    run["seed"],
                    i,
                    _with_ci(r["success"], r.get("ci95")) if ok else r["status"],
                    _with_ci(r.get("reported_success"), r.get("reported_ci95")) if ok else "",
                    _pct(run["prod_success"][i]),
                    "yes" if r["promoted"] else "no",
                    _pct(f["success"]),
                    _pct(f["intervention_rate"]),
                    "n/a" if f["takeovers_per_episode"] is None else f"{f['takeovers_per_episode']:.2f}",
                    f["frames"],
                    f"{r['minutes']:.1f}",
                ]
            )
    header = [
        "algo",
        "seed",
        "round",
        "candidate at the gate (95% CI)",
        "held-out report (95% CI)",
        "prod after",
        "promoted",
        "fleet success (before)",
        "intervention (before)",
        "takeovers/ep",
        "frames",
        "min",
    ]
    summary = []
    for algo in dict.fromkeys(r["algo"] for r in runs):
        mine = [r for r in runs if r["algo"] == algo]

        def mean(xs: list[float | None]) -> str:
            vals = [x for x in xs if x is not None]
            return _pct(statistics.fmean(vals)) if vals else "n/a"

        n_rounds = max(len(r["prod_success"]) for r in mine)
        prod = " -> ".join(
            mean([r["prod_success"][i] if i < len(r["prod_success"]) else None for r in mine])
            for i in range(n_rounds)
        )
        gains = [r["gain"] for r in mine if r["gain"] is not None]
        summary.append(
            [
                algo,
                len(mine),
                prod,
                f"{100 * statistics.fmean(gains):+.0f} pts" if gains else "n/a",
                f"{statistics.fmean(r['minutes'] or r['minutes_rounds'] for r in mine):.1f}",
                ", ".join(k for k in mine[0]["targets"] if all(r["targets"][k] for r in mine)) or "none",
            ]
        )
    s_header = [
        "algo",
        "seeds",
        "prod autonomous success per round (mean)",
        "gain",
        "min / run",
        "targets met",
    ]
    return table(per_round, header), table(summary, s_header)


def parser() -> argparse.ArgumentParser:
    """The bench's flags (``python -m bench.loop --help``)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="maniskill/PickCube-v1")
    p.add_argument(
        "--policy",
        default=UpConfig.policy,
        choices=["flowvla", *FLOW_TYPES],
        help="the policy the loop improves (`vla-rl up --policy`): flowvla from the state, or a small LeRobot "
        "flow VLA from the camera",
    )
    p.add_argument(
        "--image-size", type=int, default=UpConfig.image_size, help="camera px of a LeRobot policy's loop"
    )
    p.add_argument("--robots", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--episodes", type=int, default=UpConfig.episodes, help="episodes per robot per round")
    p.add_argument("--algos", nargs="+", default=list(ALGOS), choices=list(ALGOS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--base-demos", type=int, default=UpConfig.base_demos)
    p.add_argument("--base-steps", type=int, default=UpConfig.base_steps)
    p.add_argument("--base-preset", default=None, help="SFT recipe of the base (e.g. kinematic-sft)")
    p.add_argument("--round-steps", type=int, default=None, help="training steps of every round's algorithm")
    p.add_argument("--eval-episodes", type=int, default=UpConfig.eval_episodes, help="the gate's episodes")
    p.add_argument(
        "--report-episodes",
        type=int,
        default=UpConfig.report_episodes,
        help="episodes a promoted candidate is scored on again, on seeds its gate never saw (prod's number)",
    )
    p.add_argument("--work", type=Path, default=Path("runs/bench_loop"))
    p.add_argument("--resume", action="store_true", help="resume workdirs of an earlier bench run")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: report the rounds the workdirs hold (e.g. of an interrupted bench; no total time)",
    )
    p.add_argument("--out", type=Path, default=None, help="results file (default bench/results/loop.json)")
    return p


def main() -> None:
    args = parser().parse_args()
    runs: list[dict[str, Any]] = []
    params = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    path = None
    for algo in args.algos:
        for seed in args.seeds:
            runs.append(run_one(algo, seed, args))
            path = write_results("loop", {"params": params, "runs": runs}, args.out)
    rounds, summary = report(runs)
    print(rounds)
    print()
    print(summary)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
