"""Does the no-simulator gate rank candidates like true success does? The learned success estimate
(:mod:`vla_rl.gate_success`) against action MSE, on simulated data whose true outcome is known.

1. **Recorded data** (what a real fleet's store holds): ``--demos`` scripted demonstrations with action
   noise ``--demo-noise`` (some fail) and the rollouts of a weak SFT policy, with their outcomes, on the
   kinematic Reach task (``kinematic/Reach-v0``, no physics engine: cheap). The newest ``--held-out``
   rollouts are held out, as a round holds out the newest episodes; the estimator is fit on the rest
   (:func:`vla_rl.gate_success.fit_round_estimator`).
2. **Candidates**: SFT checkpoints of one run at several steps (``--sft-steps``), an SFT on more and
   cleaner demonstrations, and the best of them with Gaussian noise on its chunks (``--noised``).
3. For every candidate: its **true success** in the simulator on ``--episodes`` seeds from 300,000 (held
   out: nothing is chosen on them), and, on the held-out recorded episodes (one
   :func:`vla_rl.evaluation_offline.evaluate_offline` pass), its **estimated success** (the gate's score)
   and its **action MSE** (today's gate).
4. Spearman rank correlation over the candidates of true success with estimated success and with
   ``-action MSE`` (so +1 is a perfect ranking for both).

Results: ``bench/results/offline_gate.json`` and docs/benchmarks.md ("The no-simulator gate").

    nice -n 19 python -m bench.offline_gate
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.stats import spearmanr

from bench.common import table, write_results
from fleet.store import EpisodeStore
from policies.loading import load_policy
from sim.demos import record_demos, record_rollouts
from vla_rl.evaluation import evaluate
from vla_rl.evaluation_offline import evaluate_offline
from vla_rl.gate_success import fit_round_estimator
from vla_rl.train.sft import SFTConfig, train_sft

TASK = "kinematic/Reach-v0"
TRUE_SEED, DATA_SEED = 300_000, 400_000
SFT_KNOBS = {"chunk_len": 4, "n_exec": 2, "d_model": 64, "instruction_encoder": "none", "batch_size": 64}
"""The kinematic benchmark's SFT recipe (as bench/gate.py's)."""


class Noised:
    """A policy whose chunks get Gaussian noise of ``scale`` (seeded by the request's seed)."""

    def __init__(self, policy: Any, scale: float) -> None:
        self.policy, self.scale = policy, scale
        self.spec, self.chunk_len = policy.spec, policy.chunk_len

    def predict_chunks(self, obs: dict[str, Any], seed: int) -> np.ndarray:
        chunk = np.asarray(self.policy.predict_chunks(obs, seed))
        rng = np.random.default_rng(seed + 7)
        return (chunk + rng.normal(0, self.scale, chunk.shape)).astype(np.float32)


def sft(work: Path, name: str, demos: int, noise: float, steps: int, every: int, seed: int) -> Path:
    """An SFT run on ``demos`` scripted demonstrations (cached in ``work/name``); its checkpoints folder."""
    out = work / name
    if (out / "sft" / "checkpoints" / "last").exists():
        return out / "sft" / "checkpoints"
    store = EpisodeStore(out / "demos", create=True)
    record_demos(store, TASK, episodes=demos, noise=noise, seed=seed * 10_000, num_envs=1, progress=False)
    cfg = SFTConfig(
        task=TASK,
        store=out / "demos",
        out=out / "sft",
        steps=steps,
        seed=seed,
        threads=1,
        checkpoint_every=every,
        progress=False,
        resume=False,
        **SFT_KNOBS,
    )
    train_sft(cfg)
    return out / "sft" / "checkpoints"


def recorded_store(work: Path, args: argparse.Namespace, weak: Any) -> EpisodeStore:
    """The "real" data: noisy demonstrations and a weak policy's rollouts, with outcomes (cached)."""
    root = work / "recorded"
    if (root / "done").exists():
        return EpisodeStore(root)
    store = EpisodeStore(root, create=True)
    record_demos(store, TASK, episodes=args.demos, noise=args.demo_noise, seed=DATA_SEED, progress=False)
    record_rollouts(store, weak, TASK, episodes=args.rollouts, seed=DATA_SEED + 50_000, progress=False)
    (root / "done").write_text("ok")
    return store


def spearman(x: list[float], y: list[float]) -> float:
    rho = spearmanr(x, y).statistic
    return float(rho) if np.isfinite(rho) else float("nan")


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    work = Path(args.work)
    every = max(1, min(args.sft_steps))
    run_a = sft(work, "sft40", 40, 0.5, max(args.sft_steps), every, seed=2)
    run_b = sft(work, "sft100", 100, 0.2, max(args.sft_steps), max(args.sft_steps), seed=1)
    candidates: dict[str, Any] = {
        f"sft40 step {s}": load_policy(str(run_a / f"step_{s:06d}")) for s in sorted(args.sft_steps)
    }
    candidates["sft100 (cleaner, more demos)"] = load_policy(str(run_b / "last"))
    for scale in args.noised:
        candidates[f"sft100 + noise {scale}"] = Noised(candidates["sft100 (cleaner, more demos)"], scale)
    store = recorded_store(work, args, candidates[f"sft40 step {min(args.sft_steps)}"])
    ids = store.episode_ids()
    held, train = ids[-args.held_out :], ids[: -args.held_out]
    t_fit = time.perf_counter()
    base = candidates["sft100 (cleaner, more demos)"]
    est, summary = fit_round_estimator(base, store, train, None, seed=0)
    summary["seconds"] = round(time.perf_counter() - t_fit, 1)
    rows = []
    for name, policy in candidates.items():
        ev = evaluate(policy, TASK, episodes=args.episodes, num_envs=2, seed=TRUE_SEED, progress=False)
        off = evaluate_offline(
            policy, store, held, seed=0, max_frames=args.max_frames, chunk_score=est.chunk_scorer()
        )
        rows.append(
            {
                "candidate": name,
                "true_success": ev.success_rate,
                "true_ci95": list(ev.ci95),
                "estimated_success": off.score,
                "action_mse": off.action_mse,
            }
        )
        print(rows[-1], flush=True)
    true = [r["true_success"] for r in rows]
    return {
        "task": TASK,
        "args": vars(args),
        "estimator": summary,
        "recorded_episodes": len(ids),
        "held_out_episodes": len(held),
        "recorded_success_rate": float(np.mean([store.read_metadata(e).success for e in ids])),
        "candidates": rows,
        "spearman_estimated_success": spearman(true, [r["estimated_success"] for r in rows]),
        "spearman_neg_action_mse": spearman(true, [-r["action_mse"] for r in rows]),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def report(r: dict[str, Any]) -> str:
    rows = [
        [
            c["candidate"],
            f"{c['true_success']:.0%} [{c['true_ci95'][0]:.0%}, {c['true_ci95'][1]:.0%}]",
            f"{c['estimated_success']:.3f}",
            f"{c['action_mse']:.4f}",
        ]
        for c in r["candidates"]
    ]
    out = table(rows, ["candidate", "true success", "estimated success", "action MSE"])
    return (
        f"{out}\n\nSpearman with true success: estimated success {r['spearman_estimated_success']:+.2f}, "
        f"-action MSE {r['spearman_neg_action_mse']:+.2f} ({len(rows)} candidates)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="runs/bench_offline_gate")
    p.add_argument("--sft-steps", type=int, nargs="+", default=[25, 100, 300, 800])
    p.add_argument("--noised", type=float, nargs="*", default=[0.3, 1.0])
    p.add_argument("--demos", type=int, default=60)
    p.add_argument("--demo-noise", type=float, default=1.0)
    p.add_argument("--rollouts", type=int, default=60)
    p.add_argument("--held-out", type=int, default=20)
    p.add_argument("--episodes", type=int, default=100)
    p.add_argument("--max-frames", type=int, default=2000)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    r = run(args)
    print(report(r))
    print(write_results("offline_gate", r, args.out))


if __name__ == "__main__":
    main()
