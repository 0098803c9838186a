"""SFT on noisy scripted demonstrations: success rate per task and seed, with data size and training time.

For each (task, obs mode) setting and seed: record ``--demos`` expert demonstrations at ``--noise``,
train SFT for ``--steps``, evaluate ``--episodes`` held-out episodes (seeds from 100000). Prints a
markdown table and writes bench/results/sft.json. The expert's own success on the demos is the
ceiling to compare against.

    python bench/sft.py                       # all settings, 3 seeds (about an hour on 2 cores)
    python bench/sft.py --settings push-state --seeds 0 --steps 500 --episodes 10   # a quick look
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import table, write_results
from fleet.store import EpisodeStore
from policies.loading import load_policy
from sim.demos import record_demos
from vla_rl.evaluation import evaluate
from vla_rl.train.sft import SFTConfig, train_sft

# Per-setting budgets sized so the whole bench fits in about an hour on 2 CPU cores.
SETTINGS: dict[str, dict[str, Any]] = {
    "push-state": dict(task="maniskill/PushCube-v1", obs="state", steps=2000, batch_size=128, episodes=50),
    "pick-state": dict(task="maniskill/PickCube-v1", obs="state", steps=2000, batch_size=128, episodes=50),
    "push-rgb": dict(
        task="maniskill/PushCube-v1", obs="rgb", image_size=64, steps=1500, batch_size=64, episodes=30
    ),
}


def run(name: str, seed: int, args: argparse.Namespace, work: Path) -> dict[str, object]:
    s = SETTINGS[name]
    root = work / f"{name}-seed{seed}"
    store = EpisodeStore(root / "store", create=True)
    demos = record_demos(
        store,
        s["task"],
        episodes=args.demos,
        noise=args.noise,
        seed=seed * 10_000,
        obs=s["obs"],
        image_size=s.get("image_size", 128),
        num_envs=2,
        progress=False,
    )
    steps = args.steps or s["steps"]
    episodes = args.episodes or s["episodes"]
    cfg = SFTConfig(
        task=s["task"],
        store=root / "store",
        out=root / "sft",
        steps=steps,
        batch_size=s["batch_size"],
        seed=seed,
        checkpoint_every=steps,
        progress=False,
        resume=False,
    )
    t0 = time.perf_counter()
    result = train_sft(cfg)
    train_min = (time.perf_counter() - t0) / 60
    ev = evaluate(load_policy(result.checkpoint), s["task"], episodes=episodes, num_envs=2, progress=False)
    row = {
        "setting": name,
        "task": s["task"],
        "obs": s["obs"],
        "seed": seed,
        "demos": args.demos,
        "demo_frames": demos.frames,
        "noise": args.noise,
        "expert_success": demos.success_rate,
        "steps": steps,
        "batch_size": s["batch_size"],
        "train_minutes": round(train_min, 2),
        "final_loss": round(result.final_loss, 4),
        "eval_episodes": ev.episodes,
        "success_rate": ev.success_rate,
        "ci95": ev.ci95,
        "mean_length": ev.mean_length,
    }
    print(row, flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--demos", type=int, default=50)
    p.add_argument("--noise", type=float, default=0.5)
    p.add_argument("--steps", type=int, default=None, help="override every setting's training steps")
    p.add_argument("--episodes", type=int, default=None, help="override every setting's eval episodes")
    p.add_argument("--work", type=Path, default=Path("runs/bench_sft"))
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads for training (1 is robust on 2 shared cores)"
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    meta = {"args": vars(args) | {"work": str(args.work)}}
    rows = []
    for name in args.settings:
        for seed in args.seeds:
            rows.append(run(name, seed, args, args.work))
            write_results(
                "sft", meta | {"rows": rows, "complete": False}, args.out
            )  # survive an interruption
    summary = []
    for name in args.settings:
        rs = [r for r in rows if r["setting"] == name]
        rates = [float(r["success_rate"]) for r in rs]
        summary.append(
            [
                name,
                len(rs),
                rs[0]["demos"],
                rs[0]["steps"],
                f"{np.mean([float(r['expert_success']) for r in rs]):.0%}",
                " / ".join(f"{x:.0%}" for x in rates),
                f"{np.mean(rates):.0%} ± {np.std(rates):.0%}",
                f"{np.mean([float(r['train_minutes']) for r in rs]):.1f}",
            ]
        )
    print()
    print(
        table(
            summary,
            [
                "setting",
                "seeds",
                "demos",
                "steps",
                "expert (demo) success",
                "SFT success per seed",
                "mean ± std",
                "train min",
            ],
        )
    )
    print(f"\nwrote {write_results('sft', meta | {'rows': rows, 'complete': True}, args.out)}")


if __name__ == "__main__":
    main()
