"""An operator desk that scales (issue 44 item 3): ``--robots`` robots and ``--operators`` operators (HELP's
12 and 2), with today's omniscient operator against operators that only answer the robots' help requests.

1. the policy under test: ``--base`` (a checkpoint), else scripted demos and an SFT of bench/uncertainty.py's
   preset (:func:`bench.uncertainty.base_checkpoint`);
2. the help signals, from the base's own rollouts (bench/failure.py's stages,
   :func:`bench.failure.rollout_sets`, cached in ``--work``): the accel CUSUM calibrated on the calibration
   episodes that succeeded, and the learned failure predictor fitted on the training episodes
   (:func:`bench.failure.fit_predictor`) and thresholded on the same successes, served as the policy
   server serves it (:meth:`server.slots.ServedVersion.failure_scores`);
3. the fleet, in lock-step in this process (the simulators in worker processes, :class:`sim.vector.
   VectorSimEnv`; one batched inference per step for the robots that need a chunk, as the server batches
   them), on held-out episode seeds (from 300000: robot i's j-th episode is ``300000 + i + j * robots``), the
   same seeds for every row, with the operator of each row:

   * **no operator**: the policy alone (what the operators add);
   * **omniscient** (today's rules): stall and drift read the simulator's state, every robot is watched;
     ``--operators`` seats, no queue, no reaction time (:class:`sim.operator.OperatorDesk`);
   * **accel alarm** / **learned predictor**: the requests mode (:mod:`sim.help_desk`): no simulator
     state, robots ask when their alarm fires (plus ``--spot-check-prob``), ``--operators`` operators answer
     by urgency, ``--reaction-s`` after picking a request. ``--desk memory`` (the default) keeps the queue
     in shared memory (:class:`sim.help_desk.HelpDesk`); ``--desk queue`` runs it through the product's help
     queue (:mod:`sim.help_queue_desk`: a collector on loopback and its metadata DB, the requests claimed and
     resolved by simulated operators ``sim-operator-K`` as a person on the dashboard would), dispatched in
     lock-step with the simulation.

   Time is the simulated clock (steps / control rate): robot-hours are the episodes' steps, operator-hours
   the operators times the run's duration (until the last robot finished its episodes).

Prints a table and writes bench/results/operators.json (``--out`` for another file).

    python -m bench.operators --task PickCube --base CHECKPOINT      # 12 robots, 2 operators
    python -m bench.operators --quick                                # kinematic Reach, a minute (tests)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import table, write_results
from bench.failure import fit_predictor, rollout_sets
from bench.uncertainty import EVAL_SEED, base_checkpoint, preset_value
from fleet.collector import Collector, CollectorConfig
from fleet.uncertainty import calibrate_cusum
from policies.failure import FailurePredictor
from policies.loading import load_policy
from server.slots import ServedVersion, initial_noise
from sim.help_desk import Desk, HelpDesk, operator_metrics
from sim.help_queue_desk import QueueDesk, SimOperators
from sim.operator import OperatorDesk, OperatorRules, SimulatedOperator
from sim.registry import resolve_task
from sim.vector import VectorSimEnv

MODES = ("no operator", "omniscient", "accel alarm", "learned predictor")
QUICK = dict(
    task="kinematic/Reach-v0",
    robots=4,
    operators=1,
    episodes=3,
    train_episodes=40,
    calib_episodes=80,
    alpha=0.2,
    demos=20,
    sft_steps=300,
    steps=200,
    hidden=[32],
)


@dataclass
class Robot:
    """One robot of the lock-step fleet: its operator, the chunk it is executing, its episodes."""

    operator: SimulatedOperator
    seed: int = 0
    t: int = 0
    chunk: np.ndarray | None = None
    k: int = 0
    done: list[dict[str, Any]] = field(default_factory=list)


def run_fleet(
    version: ServedVersion, task: str, rules: OperatorRules, args: argparse.Namespace
) -> dict[str, Any]:
    """``args.robots`` robots for ``args.episodes`` episodes each under ``rules``; the desk's metrics."""
    n, hz, n_exec = args.robots, float(version.spec.control_hz), max(1, version.n_exec)
    instruction = version.spec.instruction
    with contextlib.ExitStack() as stack, VectorSimEnv(task, num_envs=n, seed=EVAL_SEED, obs="state") as env:
        desk = make_desk(rules, args, stack)
        obs, info = env.reset(seed=EVAL_SEED)
        robots = [Robot(SimulatedOperator(task, rules, desk, robot=i)) for i in range(n)]
        for i, r in enumerate(robots):
            r.seed = int(info["episode_seed"][i])
            r.operator.reset(r.seed, env.max_episode_steps, now=0.0, episode_id=episode_id(i, r.seed))
        dense = np.full(n, np.nan)
        step = 0
        while any(len(r.done) < args.episodes for r in robots):
            now = step / hz
            live = [i for i, r in enumerate(robots) if len(r.done) < args.episodes]
            priv = [{k: v[i] for k, v in info["privileged"].items()} for i in range(n)]
            for i in live:
                if robots[i].operator.observe(robots[i].t, priv[i], float(dense[i]), now=now) is not None:
                    robots[i].chunk = None
            need = [
                i
                for i in live
                if not robots[i].operator.driving and (robots[i].chunk is None or robots[i].k >= n_exec)
            ]
            if need:
                _new_chunks(version, robots, need, obs["state"], instruction, now)
            actions = np.zeros((n, version.spec.action_dim), np.float32)
            for i in live:
                r = robots[i]
                if r.operator.driving:
                    actions[i] = r.operator.act(priv[i])
                else:
                    actions[i] = np.clip(r.chunk[r.k], -1.0, 1.0)  # type: ignore[index]
                    r.k += 1
            obs, _, terminated, truncated, info = env.step(actions)
            step += 1
            dense = np.asarray(info["dense_reward"], np.float64)
            for i in live:
                r = robots[i]
                r.t += 1
                if terminated[i] or truncated[i]:
                    _end_episode(r, bool(info["success"][i]), int(info["episode_seed"][i]), step / hz, args)
                    dense[i] = np.nan
        stats = desk.stats() if isinstance(desk, Desk) else None
    episodes = [e for r in robots for e in r.done]
    busy_s = stats.busy_s if stats else sum(e["human_steps"] for e in episodes) / hz
    metrics = operator_metrics(
        episodes, sum(e["steps"] for e in episodes) / hz, step / hz, args.operators, busy_s, stats
    )
    reasons = Counter(reason.split(":")[0] for e in episodes for reason in e["reasons"])
    return {**metrics, "reasons": dict(reasons), "desk": stats.to_dict() if stats else None}


def episode_id(robot: int, seed: int) -> str:
    """What robot ``robot``'s episode on ``seed`` is called at the help queue (there is no store here)."""
    return f"bench-{robot}-{seed}"


def make_desk(rules: OperatorRules, args: argparse.Namespace, stack: contextlib.ExitStack) -> Any:
    """The row's desk: the omniscient operator's seats, or the requests mode's help desk (``--desk``): in
    shared memory, or the product's help queue behind a collector on loopback (its store and DB in a
    temporary folder, gone with ``stack``) worked in lock-step by simulated operators."""
    if not rules.requests:
        return OperatorDesk(args.operators)
    if args.desk == "memory":
        return HelpDesk(args.robots, args.operators, rules.reaction_s)
    store = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-operators-"))) / "store"
    collector = stack.enter_context(Collector(CollectorConfig(store=store, port=0, chunk_len=16)))
    operators = SimOperators(collector.address, args.operators)
    stack.callback(operators.stop)
    robot_ids = [f"bench-{i}" for i in range(args.robots)]
    desk = QueueDesk(collector.address, robot_ids, reaction_s=rules.reaction_s, operators=operators)
    stack.callback(desk.close)
    return desk


def _new_chunks(
    version: ServedVersion, robots: list[Robot], need: list[int], states: np.ndarray, instr: str, now: float
) -> None:
    """One batched inference (chunk, accel, failure predictor) for the robots in ``need``; each robot's
    operator sees its chunk's scores before the chunk runs."""
    x = np.asarray(states[need], np.float32)
    noise = np.stack(
        [initial_noise(robots[i].seed * 1000 + robots[i].t, *version.noise_shape) for i in need]  # type: ignore[misc]
    )
    acts, scores = version.infer_scored(x, {}, [instr] * len(need), noise)
    failure = version.failure_scores(x, {}, [instr] * len(need), scores)
    for j, i in enumerate(need):
        r = robots[i]
        r.chunk, r.k = acts[j], 0
        alarm, p = (bool(failure[1][j]), float(failure[0][j])) if failure else (False, float("nan"))
        if r.operator.observe_chunk(r.t, float(scores[j]), alarm, p, now=now) is not None:
            r.chunk = None  # taken over before the chunk runs


def _end_episode(r: Robot, success: bool, next_seed: int, now: float, args: argparse.Namespace) -> None:
    op = r.operator
    op.end_episode(now=now)
    r.done.append(
        {
            "seed": r.seed,
            "success": success,
            "steps": r.t,
            "takeovers": op.takeovers,
            "human_steps": op.human_steps,
            "requests": op.requests,
            "reasons": list(op.reasons),
        }
    )
    r.seed, r.t, r.chunk, r.k = next_seed, 0, None, 0
    if len(r.done) < args.episodes:
        op.reset(next_seed, op.max_steps, now=now, episode_id=episode_id(op.robot, next_seed))


def mode_rules(mode: str, cal: dict[str, float], args: argparse.Namespace) -> OperatorRules:
    """Each row's operator (see the module docstring)."""
    asks = dict(mode="requests", reaction_s=args.reaction_s, spot_check_prob=args.spot_check_prob)
    return {
        "no operator": lambda: OperatorRules(max_takeovers=0),
        "omniscient": lambda: OperatorRules(),
        "accel alarm": lambda: OperatorRules(**asks, **cal),  # type: ignore[arg-type]
        "learned predictor": lambda: OperatorRules(**asks, failure_alarm=True),  # type: ignore[arg-type]
    }[mode]()


def signals(
    args: argparse.Namespace, version: ServedVersion, task: str, work: Path
) -> tuple[dict[str, float], FailurePredictor, dict[str, Any]]:
    """The CUSUM's calibration and the fitted predictor (served by ``version`` from now on), from the
    base's own train / calibration rollouts."""
    n = {"train_episodes": args.train_episodes, "calib_episodes": args.calib_episodes, "episodes": 0}
    sets = rollout_sets(args, version, task, n, work)
    train, calib = sets["train"], sets["calib"]
    ok = [e for e in calib if e.success]
    try:
        cal = calibrate_cusum([list(e.chunk_scores.values()) for e in ok], alpha=args.alpha, k=args.k)
    except ValueError as e:
        raise SystemExit(
            f"{e}: {len(ok)}/{len(calib)} calibration episodes succeeded; run more (--calib-episodes) "
            "or a stronger base"
        ) from None
    hz = float(version.spec.control_hz)
    dim = len(next(iter(train[0].chunk_features.values())))
    head, h, losses = fit_predictor(args, train, calib, hz, False, dim)
    if h >= 1.0 - 1e-6:
        print(
            f"warning: the predictor saturates on successful calibration episodes (threshold {h}): it will "
            "never alarm; fit a smaller head (--hidden, --steps)",
            flush=True,
        )
    predictor = FailurePredictor(head, h, args.alpha, {"fit": "bench/operators.py"})
    version.failure = predictor
    info = {
        "autonomous_success": {k: sum(e.success for e in v) / max(len(v), 1) for k, v in sets.items() if v},
        "calibration_successes": len(ok),
        "cusum": cal,
        "predictor_threshold": h,
        "predictor_final_loss": float(losses[-1]) if len(losses) else None,
    }
    return cal, predictor, info


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    task = resolve_task(args.task).name
    work = args.work / task.replace("/", "_")
    work.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    args.sft = {**preset_value(argparse.Namespace(), task, "sft"), **args.sft_override}
    ckpt = args.base or base_checkpoint(args, task, work)
    timings["base_s"] = time.perf_counter() - t0
    version = ServedVersion(load_policy(ckpt, device="cpu"))

    t0 = time.perf_counter()
    cal: dict[str, float] = {}
    info: dict[str, Any] = {}
    if set(args.modes) & {"accel alarm", "learned predictor"}:  # the baselines need no help signal
        cal, _, info = signals(args, version, task, work)
    timings["signals_s"] = time.perf_counter() - t0
    rows = {}
    for mode in args.modes:
        t0 = time.perf_counter()
        rows[mode] = run_fleet(version, task, mode_rules(mode, cal, args), args)
        timings[f"fleet {mode}_s"] = time.perf_counter() - t0
        print(f"{mode}: {json.dumps({k: v for k, v in rows[mode].items() if k != 'desk'})}", flush=True)
    return {
        "task": task,
        "settings": {
            "base": str(ckpt),
            "robots": args.robots,
            "operators": args.operators,
            "episodes_per_robot": args.episodes,
            "eval_seeds": [EVAL_SEED, EVAL_SEED + args.robots * args.episodes - 1],
            "train_episodes": args.train_episodes,
            "calib_episodes": args.calib_episodes,
            "reaction_s": args.reaction_s,
            "desk": args.desk,
            "spot_check_prob": args.spot_check_prob,
            "alpha": args.alpha,
            "cusum_k": args.k,
            "horizon_s": args.horizon_s,
            "hidden": list(args.hidden),
            "fit_steps": args.steps,
            "control_hz": float(version.spec.control_hz),
            "n_exec": version.n_exec,
            "omniscient_rules": OperatorRules().to_dict(),
        },
        "signals": info,
        "modes": rows,
        "seconds": timings,
    }


def report(r: dict[str, Any]) -> str:
    def opt(x: Any, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    rows = [
        [
            mode,
            f"{m['successes']}/{m['episodes']} ({m['success_rate']:.0%})",
            f"{m['interventions_per_robot_hour']:.0f}",
            f"{m['successful_episodes_per_operator_hour']:.0f}",
            f"{m['operator_utilisation']:.0%}",
            opt(m["requests"], "d"),
            f"{m['failures_without_takeover']}/{m['failures']}",
            opt(m["requests_unanswered"], "d"),
            opt(m["mean_wait_s"], ".2f"),
        ]
        for mode, m in r["modes"].items()
    ]
    head = [
        "operator",
        "success",
        "interventions / robot-h",
        "successes / operator-h",
        "utilisation",
        "requests",
        "failures never taken over",
        "requests unanswered",
        "mean wait (s)",
    ]
    s = r["settings"]
    return "\n".join(
        [
            f"{r['task']}: {s['robots']} robots, {s['operators']} operators, {s['episodes_per_robot']} "
            f"episodes each on seeds {s['eval_seeds'][0]}-{s['eval_seeds'][1]}, reaction {s['reaction_s']:g} s, "
            f"help desk: {s.get('desk', 'memory')}",
            "",
            table(rows, head),
        ]
    )


def merge(r: dict[str, Any], files: list[Path]) -> None:
    """Add the rows of earlier results files (rows of the same fleet run separately, e.g. in parallel)
    that this run did not compute; refuses files whose fleet differs."""
    same = ("base", "robots", "operators", "episodes_per_robot", "eval_seeds", "control_hz")
    for f in files:
        other = json.loads(f.read_text())["results"]
        diff = [k for k in same if other["settings"][k] != r["settings"][k]]
        if other["task"] != r["task"] or diff:
            raise SystemExit(f"--merge {f}: another fleet ({diff or 'task'} differ)")
        for mode, row in other["modes"].items():
            r["modes"].setdefault(mode, row)
            r["seconds"].setdefault(f"fleet {mode}_s", other["seconds"].get(f"fleet {mode}_s"))
        r["merged"] = [*r.get("merged", []), str(f)]
    r["modes"] = {m: r["modes"][m] for m in MODES if m in r["modes"]}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="PickCube", help="a task id or short name (PickCube: ManiSkill, state)")
    p.add_argument("--base", type=Path, default=None, help="the policy under test; default: demos + SFT")
    p.add_argument("--robots", type=int, default=12)
    p.add_argument("--operators", type=int, default=2)
    p.add_argument("--episodes", type=int, default=4, help="held-out episodes per robot and row")
    p.add_argument("--reaction-s", type=float, default=0.5, help="from picking a request to the takeover")
    p.add_argument("--spot-check-prob", type=float, default=0.0, help="random requests per robot-step")
    p.add_argument(
        "--desk",
        choices=("memory", "queue"),
        default="memory",
        help="the requests rows' help desk: shared memory, or the product's help queue (collector + DB)",
    )
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--train-episodes", type=int, default=60, help="fit episodes (seeds from 100000)")
    p.add_argument("--calib-episodes", type=int, default=40, help="calibration episodes (from 200000)")
    p.add_argument("--demos", type=int, default=None, help="without --base: scripted demos")
    p.add_argument("--noise", type=float, default=None, help="without --base: the demos' noise")
    p.add_argument("--sft-steps", type=int, default=None, help="without --base: SFT steps")
    p.add_argument("--sft", dest="sft_override", type=json.loads, default={}, help="SFT fields, JSON")
    p.add_argument("--group", type=int, default=None, help="rollout episodes in lock-step")
    p.add_argument("--alpha", type=float, default=0.1, help="conformal level of both alarms")
    p.add_argument("--k", type=float, default=0.25, help="CUSUM allowance in reference stds")
    p.add_argument("--horizon-s", type=float, default=1.0, help="the predictor's positive window")
    p.add_argument("--hidden", type=int, nargs="+", default=[16], help="the predictor's MLP")
    p.add_argument(
        "--steps", type=int, default=300, help="predictor updates (few: a saturated head's threshold is 1)"
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--work", type=Path, default=Path("runs/bench_operators"))
    p.add_argument("--reuse", action="store_true", help="reuse the base and rollouts left in --work")
    p.add_argument("--quick", action="store_true", help="kinematic Reach, 4 robots, 1 operator (tests)")
    p.add_argument("--merge", type=Path, nargs="*", default=[], help="add the rows of these results files")
    p.add_argument("--out", type=Path, default=None, help="results file (bench/results/operators.json)")
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            if k not in ("demos", "sft_steps") or getattr(args, k) is None:
                setattr(args, k, v)
    for name in ("robots", "operators", "episodes", "train_episodes", "calib_episodes"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    t0 = time.perf_counter()
    r = run(args)
    r["seconds"]["total_s"] = time.perf_counter() - t0
    merge(r, args.merge)
    print(report(r))
    print(f"\nwrote {write_results('operators', r, args.out)}")
    return r


if __name__ == "__main__":
    main()
