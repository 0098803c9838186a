"""Can the robot ask for help at least a second before it fails? The learned failure predictor against the
``accel`` CUSUM alarm and the stall rule, on the same held-out episodes (issue 44: flag >= 80% of failing
episodes >= 1 s before the failure at <= 5% false alarms on successful ones).

1. the policy under test: ``--demos`` scripted demonstrations and an SFT on them
   (:func:`bench.uncertainty.base_checkpoint`, the same presets as bench/uncertainty.py);
2. roll it out alone (the policy server's scored inference, :func:`bench.uncertainty.rollout`, keeping each
   decision's ``features(prefix)``) on ``--train-episodes`` (seeds from 100000), ``--calib-episodes``
   (200000) and ``--episodes`` (300000): three disjoint sets, each cached in ``--work`` as it finishes
   (:func:`rollout_sets`: ``--reuse`` resumes a run from the sets it cached);
3. **fit** the predictor (:func:`vla_rl.train.failure.fit_head`) on the training episodes' decisions,
   labelled as a store's rows are (:func:`vla_rl.train.failure.failure_labels`: a failed episode's
   decisions within ``--horizon-s`` of its end positive, a successful episode's negative); once on
   features + accel (what the server serves), once with time in episode too (offline only);
4. **calibrate** every detector on the calibration episodes that succeeded, at the same level ``--alpha``:
   the CUSUM's reference and h (:func:`fleet.uncertainty.calibrate_cusum`), the predictor's threshold
   (:func:`vla_rl.train.failure.calibrate_threshold`: split conformal on peak scores);
5. **evaluate** on the held-out episodes: a failing episode counts as flagged when the first alarm comes at
   least ``--lead-s`` before its end (the time limit); any alarm on a successful one is a false alarm.
   The stall rule and the CUSUM are replayed through :class:`sim.operator.SimulatedOperator` as
   bench/uncertainty.py does. 95% Wilson intervals.

Prints a markdown table and writes bench/results/failure.json (``--out`` for another file).

    python -m bench.failure --task PickCube           # maniskill/PickCube-v1, state observations
    python -m bench.failure --task PickCube --obs rgb --image-size 64   # from the 64 px camera
    python -m bench.failure                           # kinematic/Reach-v0 (quick)
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import table, write_results
from bench.uncertainty import (
    CALIB_SEED,
    EVAL_SEED,
    Episode,
    add_obs_args,
    auroc,
    base_checkpoint,
    check_obs_args,
    first_takeover,
    for_task,
    preset,
    preset_value,
    rollout,
    work_dir,
)
from fleet.uncertainty import calibrate_cusum, cusum_path
from policies.failure import FailureHead, FailureHeadConfig, head_inputs
from policies.loading import load_policy
from server.slots import ServedVersion
from sim.operator import OperatorRules
from sim.registry import resolve_task
from vla_rl.evaluation import wilson_interval
from vla_rl.hub.storage import atomic_write
from vla_rl.train.failure import calibrate_threshold, failure_labels, first_alarm, fit_head

TRAIN_SEED = 100_000
EPISODES: dict[str, dict[str, int]] = {
    "kinematic/Reach-v0": dict(train_episodes=300, calib_episodes=150, episodes=300),
    "maniskill/PickCube-v1": dict(train_episodes=150, calib_episodes=80, episodes=120),
}
CAMERA_EPISODES: dict[str, dict[str, int]] = {
    "maniskill/PickCube-v1": dict(train_episodes=120, calib_episodes=80, episodes=120),
    "maniskill/PushCube-v1": dict(train_episodes=120, calib_episodes=80, episodes=120),
}
"""``--obs rgb``'s set sizes (a camera rollout costs more per step; other tasks: the state sizes;
:func:`bench.uncertainty.for_task` picks)."""


def episode_json(ep: Episode) -> dict[str, Any]:
    """An episode as plain JSON (arrays as lists), for the rollout cache."""
    return {
        "seed": ep.seed,
        "max_steps": ep.max_steps,
        "privileged": [{k: np.asarray(v).tolist() for k, v in p.items()} for p in ep.privileged],
        "dense": ep.dense,
        "chunk_scores": {str(t): v for t, v in ep.chunk_scores.items()},
        "success": ep.success,
        "length": ep.length,
        "chunk_features": {str(t): np.asarray(v).tolist() for t, v in ep.chunk_features.items()},
    }


def episode_from_json(d: dict[str, Any]) -> Episode:
    return Episode(
        seed=int(d["seed"]),
        max_steps=int(d["max_steps"]),
        privileged=[{k: np.asarray(v) for k, v in p.items()} for p in d["privileged"]],
        dense=[float(x) for x in d["dense"]],
        chunk_scores={int(t): float(v) for t, v in d["chunk_scores"].items()},
        success=bool(d["success"]),
        length=int(d["length"]),
        chunk_features={int(t): np.asarray(v, np.float32) for t, v in d["chunk_features"].items()},
    )


SETS: tuple[tuple[str, int, str], ...] = (
    ("train", TRAIN_SEED, "train_episodes"),
    ("calib", CALIB_SEED, "calib_episodes"),
    ("eval", EVAL_SEED, "episodes"),
)
"""The rollout sets in the order they are rolled out: name, first seed, and the count's key."""


def rollout_sets(
    args: argparse.Namespace, version: ServedVersion, task: str, n: dict[str, int], work: Path
) -> dict[str, list[Episode]]:
    """The train / calibration / evaluation rollouts. Each set is cached in ``work/rollouts_<set>.json``
    as soon as it is rolled out, so a run killed in a later set loses only that one; with ``--reuse`` a
    set whose cache holds the same policy (its commit) and seeds is read back instead of rolled out again
    (an interrupted run resumes; the analysis can be rerun, e.g. at another alpha). ``rollouts.json``,
    where earlier runs cached the three sets at once, is still read with ``--reuse`` when it holds the same
    counts, and removed once a set is rolled out anew (it then no longer describes this policy's sets)."""
    combined = work / "rollouts.json"
    if args.reuse and (old := _combined_cache(combined, n)) is not None:
        return old
    group = preset_value(args, task, "group")
    sets = {}
    for name, seed, key in SETS:
        seeds = [seed + i for i in range(n[key])]
        cache = work / f"rollouts_{name}.json"
        cached = _cached_set(cache, version.commit, seed, len(seeds)) if args.reuse else None
        if cached is None:
            sets[name] = rollout(version, task, seeds, group, features=True)
            payload = {
                "commit": version.commit,
                "seeds": [seed, len(seeds)],
                "episodes": [episode_json(e) for e in sets[name]],
            }
            atomic_write(cache, json.dumps(payload).encode())
            combined.unlink(missing_ok=True)
        else:
            sets[name] = cached
        how = "rolled out" if cached is None else f"read from {cache.name}"
        print(
            f"{name}: {n[key]} episodes, {sum(e.success for e in sets[name])} successful ({how})", flush=True
        )
    return sets


def _cached_set(path: Path, commit: str, first_seed: int, count: int) -> list[Episode] | None:
    """The episodes ``path`` caches, if they are the policy ``commit``'s on exactly the ``count`` seeds from
    ``first_seed`` (a set of 0 episodes, as bench/operators' quick run asks for, included)."""
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    if saved["commit"] != commit or saved["seeds"] != [first_seed, count]:
        return None
    return [episode_from_json(e) for e in saved["episodes"]]


def _combined_cache(path: Path, n: dict[str, int]) -> dict[str, list[Episode]] | None:
    """The three sets of an earlier run's ``rollouts.json``, if it holds the counts ``n``."""
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    if saved["episodes"] != n:
        return None
    return {k: [episode_from_json(e) for e in v] for k, v in saved["sets"].items()}


def decisions(ep: Episode) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An episode's decision steps, their features ``[n, F]`` and accel scores ``[n]``."""
    steps = np.array(sorted(ep.chunk_scores), np.int64)
    feats = np.stack([ep.chunk_features[t] for t in steps])
    return steps, feats, np.array([ep.chunk_scores[t] for t in steps], np.float32)


def episode_inputs(ep: Episode, hz: float, use_time: bool) -> tuple[np.ndarray, torch.Tensor]:
    steps, feats, unc = decisions(ep)
    return steps, head_inputs(feats, unc, steps / hz if use_time else None)


def training_rows(
    eps: list[Episode],
    horizon_steps: int,
    hz: float,
    use_time: bool,
    inputs: Callable[[Episode], tuple[np.ndarray, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, np.ndarray]:
    """Every decision of ``eps`` with its label (autonomous episodes: the failing stretch is the whole
    failed episode, its event the end); ``inputs``: an episode's ``(steps, x)`` other than the served
    inputs (:func:`episode_inputs`)."""
    xs, ys = [], []
    for ep in eps:
        steps, x = episode_inputs(ep, hz, use_time) if inputs is None else inputs(ep)
        y, _ = failure_labels(np.zeros(ep.length, np.uint8), ep.success, horizon_steps)
        xs.append(x)
        ys.append(y[steps])
    return torch.cat(xs), np.concatenate(ys)


def predictor_scores(
    head: FailureHead, ep: Episode, hz: float, use_time: bool
) -> tuple[np.ndarray, np.ndarray]:
    steps, x = episode_inputs(ep, hz, use_time)
    with torch.no_grad():
        return steps, torch.sigmoid(head(x)).numpy()


def predictor_first_alarm(head: FailureHead, ep: Episode, h: float, hz: float, use_time: bool) -> int | None:
    steps, p = predictor_scores(head, ep, hz, use_time)
    i = first_alarm(p, h)
    return None if i is None else int(steps[i])


def early_stats(eps: list[Episode], alarms: list[int | None], lead_steps: int, hz: float) -> dict[str, Any]:
    """Failing episodes flagged at least ``lead_steps`` before their end, and false alarms on successes,
    with 95% Wilson intervals; leads in seconds."""
    fails = [(e, s) for e, s in zip(eps, alarms, strict=True) if not e.success]
    succ = [s for e, s in zip(eps, alarms, strict=True) if e.success]
    leads = [(e.length - s) / hz for e, s in fails if s is not None]
    early = sum(lead >= lead_steps / hz for lead in leads)
    false = sum(s is not None for s in succ)
    return {
        "failures": len(fails),
        "flagged_early": early,
        "flag_early_rate": early / max(len(fails), 1),
        "flag_early_ci95": wilson_interval(early, len(fails)),
        "flagged_any": len(leads),
        "lead_s_median": float(np.median(leads)) if leads else None,
        "successes": len(succ),
        "false_alarms": false,
        "false_alarm_rate": false / max(len(succ), 1),
        "false_alarm_ci95": wilson_interval(false, len(succ)),
    }


def fit_predictor(
    args: argparse.Namespace, train: list[Episode], calib: list[Episode], hz: float, use_time: bool, dim: int
) -> tuple[FailureHead, float, list[float]]:
    """The head fitted on ``train`` and its threshold from ``calib``'s successes; also the losses."""
    horizon_steps = max(1, round(args.horizon_s * hz))
    x, y = training_rows(train, horizon_steps, hz, use_time)
    cfg = FailureHeadConfig(dim, tuple(args.hidden), args.horizon_s, use_time)
    head, losses = fit_head(x, y, cfg, steps=args.steps, batch_size=256, lr=args.lr, seed=0)
    peaks = [float(predictor_scores(head, e, hz, use_time)[1].max()) for e in calib if e.success]
    return head, calibrate_threshold(peaks, args.alpha), losses


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    task = resolve_task(args.task).name
    sizes = for_task(task, args.obs, EPISODES, CAMERA_EPISODES)
    n = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in sizes.items()}
    work = work_dir(args, task)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    args.sft = {**preset(task, args.obs)["sft"], **args.sft_override}
    ckpt = base_checkpoint(args, task, work)
    timings["demos_and_sft_s"] = time.perf_counter() - t0
    version = ServedVersion(load_policy(ckpt, device="cpu"))
    hz = float(version.spec.control_hz)
    lead_steps = round(args.lead_s * hz)

    t0 = time.perf_counter()
    sets = rollout_sets(args, version, task, n, work)
    timings["rollouts_s"] = time.perf_counter() - t0
    train, calib, evals = sets["train"], sets["calib"], sets["eval"]
    dim = len(next(iter(train[0].chunk_features.values())))

    t0 = time.perf_counter()
    ok = [e for e in calib if e.success]
    try:
        cal = calibrate_cusum([list(e.chunk_scores.values()) for e in ok], alpha=args.alpha, k=args.k)
    except ValueError as e:
        raise SystemExit(
            f"{e}: {len(ok)}/{len(calib)} calibration episodes succeeded; run more (--calib-episodes, then "
            "--reuse keeps the base), a larger --alpha, or a stronger base (--sft-steps)"
        ) from None
    detectors: dict[str, list[int | None]] = {
        "accel CUSUM": [
            first_takeover(e, task, OperatorRules(stall_steps=0, drift_radius=0.0, **cal)) for e in evals
        ],
        "stall rule": [
            first_takeover(e, task, OperatorRules(stall_steps=args.stall_steps, drift_radius=0.0))
            for e in evals
        ],
    }
    peaks: dict[str, list[float]] = {
        "accel CUSUM": [
            float(
                cusum_path(
                    e.chunk_scores.values(), cal["uncertainty_mean"], cal["uncertainty_std"], args.k
                ).max()
            )
            for e in evals
        ]
    }
    thresholds = {}
    for label, use_time in (("learned (features + accel)", False), ("learned + time in episode", True)):
        head, h, _ = fit_predictor(args, train, calib, hz, use_time, dim)
        thresholds[label] = h
        detectors[label] = [predictor_first_alarm(head, e, h, hz, use_time) for e in evals]
        peaks[label] = [float(predictor_scores(head, e, hz, use_time)[1].max()) for e in evals]
    learned = detectors["learned (features + accel)"]
    detectors["learned or stall"] = [
        min((s for s in (a, b) if s is not None), default=None)
        for a, b in zip(learned, detectors["stall rule"], strict=True)
    ]
    timings["fit_and_score_s"] = time.perf_counter() - t0

    fails = [e for e in evals if not e.success]
    return {
        "task": task,
        "settings": {
            "demos": preset_value(args, task, "demos"),
            "noise": preset_value(args, task, "noise"),
            "sft_steps": preset_value(args, task, "sft_steps"),
            "sft": args.sft,
            "obs": args.obs,
            "image_size": args.image_size if args.obs == "rgb" else None,
            "episodes": n,
            "seeds": {"train": TRAIN_SEED, "calib": CALIB_SEED, "eval": EVAL_SEED},
            "alpha": args.alpha,
            "lead_s": args.lead_s,
            "lead_steps": lead_steps,
            "control_hz": hz,
            "horizon_s": args.horizon_s,
            "hidden": list(args.hidden),
            "fit_steps": args.steps,
            "stall_steps": args.stall_steps,
            "cusum_k": args.k,
            "feature_dim": dim,
            "n_exec": version.n_exec,
        },
        "autonomous_success": {name: sum(e.success for e in eps) / len(eps) for name, eps in sets.items()},
        "calibration": {"successful": len(ok), "cusum": cal, "thresholds": thresholds},
        "detectors": {k: early_stats(evals, v, lead_steps, hz) for k, v in detectors.items()},
        "episode_auroc_of_peak": {
            k: auroc(
                [p for p, e in zip(v, evals, strict=True) if not e.success],
                [p for p, e in zip(v, evals, strict=True) if e.success],
            )
            for k, v in peaks.items()
        },
        "failing_episode_lengths": sorted({e.length for e in fails}),
        "seconds": timings,
    }


def report(r: dict[str, Any]) -> str:
    def pct(x: float) -> str:
        return f"{x:.0%}"

    rows = []
    for name, d in r["detectors"].items():
        lo, hi = d["flag_early_ci95"]
        flo, fhi = d["false_alarm_ci95"]
        rows.append(
            [
                name,
                f"{d['flagged_early']}/{d['failures']} ({pct(d['flag_early_rate'])}, {pct(lo)}-{pct(hi)})",
                "-" if d["lead_s_median"] is None else f"{d['lead_s_median']:.2f}",
                f"{d['false_alarms']}/{d['successes']} ({pct(d['false_alarm_rate'])}, {pct(flo)}-{pct(fhi)})",
            ]
        )
    s = r["settings"]
    head = [
        "detector",
        f"failures flagged >= {s['lead_s']:g} s early (95% CI)",
        "lead median (s)",
        "false alarms on successes (95% CI)",
    ]
    auc = ", ".join(f"{k} {v:.2f}" for k, v in r["episode_auroc_of_peak"].items())
    succ = r["autonomous_success"]
    return "\n".join(
        [
            f"{r['task']}: autonomous success train {succ['train']:.0%} / calib {succ['calib']:.0%} / eval "
            f"{succ['eval']:.0%}; every detector calibrated on {r['calibration']['successful']} successful "
            f"held-out episodes at alpha = {s['alpha']}",
            "",
            table(rows, head),
            "",
            f"episode AUROC of the peak score: {auc}",
        ]
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="kinematic/Reach-v0", help="kinematic/Reach-v0 or PickCube (ManiSkill)")
    p.add_argument("--demos", type=int, default=None)
    p.add_argument("--noise", type=float, default=None)
    p.add_argument("--sft-steps", type=int, default=None)
    p.add_argument(
        "--sft",
        dest="sft_override",
        type=json.loads,
        default={},
        help='SFT fields over the preset\'s, as JSON (e.g. \'{"d_model": 64, "batch_size": 64}\')',
    )
    p.add_argument("--train-episodes", type=int, default=None, help="fit episodes (seeds from 100000)")
    p.add_argument(
        "--calib-episodes", type=int, default=None, help="calibration episodes (seeds from 200000)"
    )
    p.add_argument("--episodes", type=int, default=None, help="evaluated episodes (seeds from 300000)")
    p.add_argument("--group", type=int, default=None, help="episodes run in lock-step")
    add_obs_args(p)
    p.add_argument("--alpha", type=float, default=0.05, help="conformal level of every detector")
    p.add_argument("--lead-s", type=float, default=1.0, help="a failure counts as flagged this early")
    p.add_argument("--horizon-s", type=float, default=2.0, help="the predictor's positive window")
    p.add_argument("--hidden", type=int, nargs="+", default=[64, 64])
    p.add_argument("--steps", type=int, default=2000, help="head updates")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--k", type=float, default=0.25, help="CUSUM allowance in reference stds")
    p.add_argument("--stall-steps", type=int, default=OperatorRules().stall_steps)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", type=Path, default=Path("runs/bench_failure"))
    p.add_argument(
        "--reuse",
        action="store_true",
        help="reuse the SFT checkpoint and the rollout sets (each set's own cache) in --work if present",
    )
    p.add_argument("--out", type=Path, default=None, help="results file (default bench/results/failure.json)")
    args = p.parse_args()
    check_obs_args(p, args)
    t0 = time.perf_counter()
    r = run(args)
    r["seconds"]["total_s"] = time.perf_counter() - t0
    print(report(r))
    print(f"\nwrote {write_results('failure', r, args.out)}")


if __name__ == "__main__":
    main()
