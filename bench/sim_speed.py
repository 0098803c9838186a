"""Simulator speed per task and observation mode: env steps per second on this machine.

Steps a single env (one process) with its scripted expert for a fixed number of steps, and, for the
ManiSkill tasks, a 2-process vector env. Prints a markdown table and writes bench/results/sim_speed.json.

    python bench/sim_speed.py [--steps 300] [--image-size 128] [--out PATH]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

import sim
from bench.common import table, write_results


def single(task: str, obs: str, steps: int, image_size: int) -> float:
    with sim.make_env(task, obs=obs, image_size=image_size) as env:  # type: ignore[arg-type]
        _, info = env.reset(seed=0)
        expert = sim.make_expert(task, noise=0.3, seed=0)
        t0 = time.perf_counter()
        for _ in range(steps):
            _, _, terminated, truncated, info = env.step(expert.act(info["privileged"]))
            if terminated or truncated:
                _, info = env.reset()
                expert.reset()
        return steps / (time.perf_counter() - t0)


def vector(task: str, obs: str, steps: int, image_size: int, num_envs: int) -> float:
    with sim.make(task, num_envs=num_envs, obs=obs, image_size=image_size) as env:
        _, info = env.reset()
        experts = [sim.make_expert(task, noise=0.3, seed=i) for i in range(num_envs)]
        t0 = time.perf_counter()
        for _ in range(steps // num_envs):
            priv = info["privileged"]
            actions = np.stack([e.act({k: v[i] for k, v in priv.items()}) for i, e in enumerate(experts)])
            _, _, _, _, info = env.step(actions)
        return (steps // num_envs) * num_envs / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="env steps per measurement")
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--num-envs", type=int, default=2, help="processes for the vector measurement")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    results = []
    for task in sim.TASKS:
        for obs in ("state", "rgb"):
            steps = args.steps if obs == "state" else max(args.steps // 4, 40)
            r = {"task": task, "obs": obs, "image_size": args.image_size if obs == "rgb" else None}
            r["steps_per_s_1env"] = round(single(task, obs, steps, args.image_size), 1)
            if task.startswith("maniskill/"):
                r[f"steps_per_s_{args.num_envs}proc"] = round(
                    vector(task, obs, steps, args.image_size, args.num_envs), 1
                )
            results.append(r)
            print(r, flush=True)
    key = f"steps_per_s_{args.num_envs}proc"
    rows = [[r["task"], r["obs"], r["steps_per_s_1env"], r.get(key, "-")] for r in results]
    print()
    print(table(rows, ["task", "obs", "steps/s, 1 env", f"steps/s, {args.num_envs} processes"]))
    print(f"\nwrote {write_results('sim_speed', results, args.out)}")


if __name__ == "__main__":
    main()
