"""Scripted-expert success rate per task and noise level (seeded episodes, obs="state").

python bench/expert_success.py [--episodes 20] [--noise 0 0.3 1.0] [--out PATH]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import sim
from bench.common import table, write_results


def success(task: str, episodes: int, noise: float) -> tuple[int, float]:
    wins, steps = 0, 0
    with sim.make_env(task) as env:
        for ep in range(episodes):
            _, info = env.reset(seed=1000 + ep)
            expert = sim.make_expert(task, noise=noise, seed=1000 + ep)
            done = False
            while not done:
                _, _, terminated, truncated, info = env.step(expert.act(info["privileged"]))
                done = terminated or truncated
            wins += info["success"]
            steps += env.elapsed_steps
    return wins, steps / episodes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, default=20)
    p.add_argument("--noise", type=float, nargs="+", default=[0.0, 0.3, 1.0])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    results = []
    for task in sim.TASKS:
        for noise in args.noise:
            wins, mean_steps = success(task, args.episodes, noise)
            results.append(
                {
                    "task": task,
                    "noise": noise,
                    "episodes": args.episodes,
                    "successes": wins,
                    "mean_steps": round(mean_steps, 1),
                }
            )
            print(results[-1], flush=True)
    rows = [[r["task"], r["noise"], f"{r['successes']}/{r['episodes']}", r["mean_steps"]] for r in results]
    print()
    print(table(rows, ["task", "noise", "success", "mean steps"]))
    print(f"\nwrote {write_results('expert_success', results, args.out)}")


if __name__ == "__main__":
    main()
