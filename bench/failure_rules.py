"""Which alarm rule over the learned failure predictor's score meets issue 44's target (flag >= 80% of
failing episodes >= 1 s early at <= 5% false alarms on successful ones)? Every variant on the same cached
rollouts and the same fit / calibration / evaluation split as bench/failure.py (``--work`` holds its
``rollouts.json``; nothing is rolled out here).

**Inputs** of the head (each fit on the fit set's decisions, labelled as bench/failure.py labels them):

* ``features + accel``: what the policy server serves (the policy's ``features(prefix)`` and the chunk's
  ``accel`` score);
* ``+ deltas``: also the change of the features since the previous decision and the mean accel of the last
  three decisions (a window of recent motion and uncertainty);
* ``+ time``: also seconds since the episode started;
* ``simulator state + time``: the simulator's privileged state (gripper, cube and goal positions, their
  differences, grasp) instead of the policy's features: no deployable detector sees it, so it bounds what
  a better encoder could reach on these episodes (the *ceiling* row).

**Rules** over the per-decision score ``p_t``, each calibrated split conformally on the calibration set's
successful episodes (the peak of the rule's statistic over an episode,
:func:`fleet.uncertainty.conformal_threshold` at ``--alpha``), so every row's false-alarm rate targets the
same level:

* ``peak``: ``p_t > h`` (today's rule);
* ``k of m``: the k-th largest of the last m scores ``> h`` (persistence);
* ``CUSUM k``: a one-sided CUSUM over ``logit(p_t)``, standardised with the calibration successes' mean and
  std of the logit (as the accel CUSUM standardises accel), allowance k;
* ``phase``: ``(p_t - mu(t)) / sd(t)`` with ``mu, sd`` the fit set's successful episodes' score at the same
  decision step (a hazard relative to the time in the episode).

Baselines in the same table: the accel CUSUM and the stall rule (replayed as bench/failure.py does), and
``time only``: an alarm at the last decision that is still ``--lead-s`` before the time limit, whatever the
score (every failure here is a time-out, so it flags all of them; its false alarms are the successes still
running then; not calibrated: it has no threshold to move).

    python -m bench.failure_rules --work runs/failpred/pick53 --out bench/results/failure_rules_pickcube.json
    python -m bench.failure_rules --task PushCube --obs rgb --image-size 64 --work runs/failcam  # a camera run
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
from bench.failure import early_stats, episode_from_json, training_rows
from bench.uncertainty import Episode, add_obs_args, auroc, check_obs_args, first_takeover, work_dir
from fleet.uncertainty import calibrate_cusum, conformal_threshold, cusum_path
from policies.failure import FailureHead, FailureHeadConfig
from sim.operator import OperatorRules
from sim.registry import resolve_task
from vla_rl.train.failure import fit_head

Path_ = tuple[np.ndarray, np.ndarray]
"""An episode's decision steps and the rule's statistic at each."""
Rule = Callable[[Episode], Path_]

PRIVILEGED = ("tcp_pos", "obj_pos", "goal_pos")


# ============================================================================ inputs
def decision_inputs(ep: Episode, kind: str, hz: float) -> tuple[np.ndarray, torch.Tensor]:
    """``(steps, x [n, d])`` of one episode's decisions for an input ``kind`` (module docstring):
    ``features``, ``deltas``, ``time``, ``state``, ``state_time``."""
    steps = np.array(sorted(ep.chunk_scores), np.int64)
    accel = np.array([ep.chunk_scores[t] for t in steps], np.float32)[:, None]
    if kind.startswith("state"):
        cols = [np.stack([_state_row(ep.privileged[min(t, len(ep.privileged) - 1)]) for t in steps]), accel]
    else:
        feats = np.stack([ep.chunk_features[t] for t in steps]).astype(np.float32)
        cols = [feats, accel]
        if kind == "deltas":
            delta = np.vstack([np.zeros((1, feats.shape[1]), np.float32), np.diff(feats, axis=0)])
            window = np.array([accel[max(0, i - 2) : i + 1].mean() for i in range(len(accel))], np.float32)
            cols += [delta, window[:, None]]
    if kind.endswith("time"):
        cols.append((steps / hz).astype(np.float32)[:, None])
    return steps, torch.from_numpy(np.hstack(cols))


def _state_row(p: dict[str, Any]) -> np.ndarray:
    tcp, obj, goal = (np.asarray(p[k], np.float32) for k in PRIVILEGED)
    return np.r_[tcp, obj, goal, tcp - obj, obj - goal, float(p["gripper_width"]), float(p["is_grasped"])]


def fit_scorer(
    train: list[Episode],
    kind: str,
    hidden: tuple[int, ...],
    steps: int,
    horizon_s: float,
    hz: float,
    seed: int = 0,
) -> Callable[[Episode], Path_]:
    """Fit a head on ``train``'s decisions (labels as bench/failure.py) and return ``ep -> (steps, p)``."""
    horizon = max(1, round(horizon_s * hz))
    x, y = training_rows(train, horizon, hz, False, inputs=lambda ep: decision_inputs(ep, kind, hz))
    cfg = FailureHeadConfig(x.shape[1] - 1, hidden, horizon_s, False)
    head, _ = fit_head(x, y, cfg, steps=steps, batch_size=256, lr=1e-3, seed=seed)
    return lambda ep: _scores(head, ep, kind, hz)


def _scores(head: FailureHead, ep: Episode, kind: str, hz: float) -> Path_:
    st, x = decision_inputs(ep, kind, hz)
    with torch.no_grad():
        return st, torch.sigmoid(head(x)).numpy().astype(np.float64)


# ============================================================================ rules
def k_of_m(scorer: Rule, k: int, m: int) -> Rule:
    """Statistic: the k-th largest of the last m scores (0 before the k-th decision)."""

    def rule(ep: Episode) -> Path_:
        st, p = scorer(ep)
        q = [np.sort(p[max(0, i - m + 1) : i + 1])[-k] if i + 1 >= k else 0.0 for i in range(len(p))]
        return st, np.asarray(q)

    return rule


def logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return np.log(p / (1 - p))


def logit_cusum(scorer: Rule, calib_ok: list[Episode], k: float) -> Rule:
    """Statistic: the CUSUM over ``logit(p)`` standardised with the calibration successes' logits."""
    z = np.concatenate([logit(scorer(e)[1]) for e in calib_ok])
    mean, std = float(z.mean()), float(max(z.std(), 1e-6))

    def rule(ep: Episode) -> Path_:
        st, p = scorer(ep)
        return st, cusum_path(logit(p), mean, std, k)

    return rule


def by_phase(scorer: Rule, fit_ok: list[Episode]) -> Rule:
    """Statistic: the score standardised by the fit set's successful episodes' scores at the same step."""
    at: dict[int, list[float]] = {}
    for ep in fit_ok:
        for t, v in zip(*scorer(ep), strict=True):
            at.setdefault(int(t), []).append(float(v))
    ref = {t: (float(np.mean(v)), float(np.std(v)) + 1e-3) for t, v in at.items()}
    every = np.concatenate([np.asarray(v) for v in at.values()])
    pooled = (float(every.mean()), float(every.std()) + 1e-3)

    def rule(ep: Episode) -> Path_:
        st, p = scorer(ep)
        mu, sd = np.array([ref.get(int(t), pooled) for t in st]).T
        return st, (p - mu) / sd

    return rule


def time_only(lead_steps: int) -> Rule:
    """Statistic: 1 at the decision that falls in the last decision interval ending ``lead_steps`` before
    the time limit (an episode still running then), 0 elsewhere."""

    def rule(ep: Episode) -> Path_:
        st = np.array(sorted(ep.chunk_scores), np.int64)
        every = int(np.diff(st).min()) if len(st) > 1 else 1
        limit = ep.max_steps - lead_steps
        return st, ((st <= limit) & (st > limit - every)).astype(np.float64)

    return rule


def evaluate_rule(
    rule: Rule, calib_ok: list[Episode], evals: list[Episode], alpha: float, threshold: float | None = None
) -> dict[str, Any]:
    """Calibrate ``rule``'s threshold on ``calib_ok``'s peaks (or take ``threshold``: a rule whose false
    alarms are what they are); first alarms and peaks on ``evals``."""
    h = (
        threshold
        if threshold is not None
        else conformal_threshold([float(rule(e)[1].max()) for e in calib_ok], alpha)
    )
    alarms, peaks = [], []
    for ep in evals:
        st, s = rule(ep)
        hit = np.flatnonzero(s > h)
        alarms.append(int(st[hit[0]]) if len(hit) else None)
        peaks.append(float(s.max()))
    return {"threshold": h, "alarms": alarms, "peaks": peaks}


# ============================================================================ the run
HEADS = {"1 x 16, 300 updates": ((16,), 300), "2 x 64, 2,000 updates": ((64, 64), 2000)}
INPUTS = {
    "features + accel": "features",
    "+ deltas": "deltas",
    "+ time": "time",
    "simulator state + time (ceiling)": "state_time",
}


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    task = resolve_task(args.task).name
    cache = work_dir(args, task) / "rollouts.json"
    saved = json.loads(cache.read_text())
    sets = {k: [episode_from_json(e) for e in v] for k, v in saved["sets"].items()}
    train, calib, evals = sets["train"], sets["calib"], sets["eval"]
    hz, lead_steps = args.control_hz, round(args.lead_s * args.control_hz)
    calib_ok, fit_ok = [e for e in calib if e.success], [e for e in train if e.success]
    rows: dict[str, dict[str, Any]] = {}

    def add(name: str, r: dict[str, Any]) -> None:
        rows[name] = {
            **early_stats(evals, r["alarms"], lead_steps, hz),
            "threshold": r.get("threshold"),
            "episode_auroc_of_peak": _auroc(r["peaks"], evals),
        }
        print(" | ".join(cells(name, rows[name])), flush=True)

    cal = calibrate_cusum([list(e.chunk_scores.values()) for e in calib_ok], alpha=args.alpha, k=args.k)
    accel = lambda e: (  # noqa: E731
        np.array(sorted(e.chunk_scores)),
        cusum_path([e.chunk_scores[t] for t in sorted(e.chunk_scores)], *_ref(cal), args.k),
    )
    add("accel CUSUM", evaluate_rule(accel, calib_ok, evals, args.alpha))
    stall = OperatorRules(stall_steps=args.stall_steps, drift_radius=0.0)
    add("stall rule", {"alarms": [first_takeover(e, task, stall) for e in evals], "peaks": None})
    add("time only", evaluate_rule(time_only(lead_steps), calib_ok, evals, args.alpha, threshold=0.5))
    for head_name, (hidden, steps) in HEADS.items():
        for input_name, kind in INPUTS.items():
            scorer = fit_scorer(train, kind, hidden, steps, args.horizon_s, hz)
            rules: dict[str, Rule] = {
                "peak": scorer,
                "2 of 2": k_of_m(scorer, 2, 2),
                "2 of 3": k_of_m(scorer, 2, 3),
                "CUSUM k=0.5": logit_cusum(scorer, calib_ok, 0.5),
                "CUSUM k=1": logit_cusum(scorer, calib_ok, 1.0),
                "phase": by_phase(scorer, fit_ok),
            }
            for rule_name, rule in rules.items():
                add(
                    f"{input_name}, {head_name}: {rule_name}",
                    evaluate_rule(rule, calib_ok, evals, args.alpha),
                )
    spread = seed_spread(args, train, calib_ok, evals, lead_steps)
    return {
        "task": task,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "episodes": {k: len(v) for k, v in sets.items()},
        "calibration_successes": len(calib_ok),
        "rows": rows,
        "seed_spread": spread,
    }


def seed_spread(
    args: argparse.Namespace, train: list[Episode], calib_ok: list[Episode], evals: list[Episode], lead: int
) -> dict[str, list[list[int]]]:
    """The served inputs' heads refit with ``--seeds`` initialisations and batch orders: for each head
    and rule (peak, 2 of 2, CUSUM k=1), ``[flagged early, false alarms]`` per seed (how much of a row is
    the seed)."""
    hz, out = args.control_hz, {}
    for head_name, (hidden, steps) in HEADS.items():
        for seed in range(args.seeds):
            scorer = fit_scorer(train, "features", hidden, steps, args.horizon_s, hz, seed=seed)
            rules = {
                "peak": scorer,
                "2 of 2": k_of_m(scorer, 2, 2),
                "CUSUM k=1": logit_cusum(scorer, calib_ok, 1.0),
            }
            for rule_name, rule in rules.items():
                d = early_stats(evals, evaluate_rule(rule, calib_ok, evals, args.alpha)["alarms"], lead, hz)
                out.setdefault(f"{head_name}: {rule_name}", []).append(
                    [d["flagged_early"], d["false_alarms"]]
                )
    return out


def _ref(cal: dict[str, float]) -> tuple[float, float]:
    return cal["uncertainty_mean"], cal["uncertainty_std"]


def _auroc(peaks: list[float] | None, evals: list[Episode]) -> float | None:
    if peaks is None:
        return None
    pairs = list(zip(peaks, evals, strict=True))
    return auroc([p for p, e in pairs if not e.success], [p for p, e in pairs if e.success])


def cells(name: str, d: dict[str, Any]) -> list[str]:
    """One table row: the detector, failures flagged early, false alarms, AUROC of the peak."""
    auc = d["episode_auroc_of_peak"]
    return [
        name,
        f"{d['flagged_early']}/{d['failures']} ({d['flag_early_rate']:.0%})",
        f"{d['false_alarms']}/{d['successes']} ({d['false_alarm_rate']:.0%})",
        "-" if auc is None or np.isnan(auc) else f"{auc:.2f}",
    ]


def report(r: dict[str, Any]) -> str:
    head = ["detector: rule", "failures flagged >= 1 s early", "false alarms on successes", "AUROC"]
    return table([cells(name, d) for name, d in r["rows"].items()], head)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--work", type=Path, default=Path("runs/failpred/pick53"), help="bench/failure.py's --work"
    )
    p.add_argument("--task", default="maniskill/PickCube-v1", help="bench/failure.py's --task")
    add_obs_args(p)
    p.add_argument("--alpha", type=float, default=0.05)
    p.add_argument("--lead-s", type=float, default=1.0)
    p.add_argument("--horizon-s", type=float, default=2.0)
    p.add_argument("--control-hz", type=float, default=20.0, help="the rollouts' control rate")
    p.add_argument("--k", type=float, default=0.25, help="accel CUSUM allowance")
    p.add_argument("--stall-steps", type=int, default=OperatorRules().stall_steps)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seeds", type=int, default=4, help="head seeds of the seed-spread rows")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    check_obs_args(p, args)
    t0 = time.perf_counter()
    r = run(args)
    r["seconds"] = time.perf_counter() - t0
    print(report(r))
    print(f"\nwrote {write_results('failure_rules', r, args.out)}")


if __name__ == "__main__":
    main()
