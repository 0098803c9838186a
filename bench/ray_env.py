"""Ray simulator workers vs subprocess workers: vector-env steps per second on this machine.

Steps the same vector env (``--num-envs`` robots, the task's seeded scripted experts, auto-reset) once
with one worker process per robot and once with one Ray actor per robot (``ray="auto"``: a local head on
127.0.0.1, started by this script), for PickCube (state) and the kinematic test bed, and reports env
steps/s of each and their ratio. Ray's cost is per call (a task submission and an object-store round
trip per robot per step), so the ratio is near 1 where a step takes milliseconds (ManiSkill) and far
below 1 for a simulator that steps in microseconds. Start-up (building the envs) is timed separately.
Prints a markdown table and writes bench/results/ray_env.json.

    python bench/ray_env.py [--steps 400] [--kinematic-steps 4000] [--num-envs 2] [--repeats 2] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # the local head: loopback only

import numpy as np

import sim
from bench.common import table, write_results
from sim.vector import VectorSimEnv


def measure(task: str, steps: int, num_envs: int, **backend: Any) -> dict[str, float]:
    """Build a vector env on ``backend``, take ``steps`` env steps (summed over robots) with experts."""
    t0 = time.perf_counter()
    env = VectorSimEnv(task, num_envs=num_envs, seed=0, **backend)
    try:
        built = time.perf_counter() - t0
        _, info = env.reset()
        experts = [sim.make_expert(task, noise=0.3, seed=i) for i in range(num_envs)]
        vector_steps = max(1, steps // num_envs)
        t0 = time.perf_counter()
        for _ in range(vector_steps):
            priv = info["privileged"]
            actions = np.stack([e.act({k: v[i] for k, v in priv.items()}) for i, e in enumerate(experts)])
            _, _, _, _, info = env.step(actions)
            for i in info["final_obs"]:
                experts[i].reset(int(info["episode_seed"][i]))
        seconds = time.perf_counter() - t0
    finally:
        env.close()
    return {"steps_per_s": vector_steps * num_envs / seconds, "start_s": built}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=400, help="env steps per ManiSkill measurement")
    p.add_argument("--kinematic-steps", type=int, default=4000, help="env steps per kinematic measurement")
    p.add_argument("--num-envs", type=int, default=2, help="robots (worker processes / Ray actors)")
    p.add_argument("--repeats", type=int, default=2, help="measurements per backend (the best is kept)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    import ray

    from sim.ray_workers import connect

    connect("auto")  # a local head on loopback unless this machine is part of a Ray cluster
    results = []
    try:
        for task, steps in (
            ("maniskill/PickCube-v1", args.steps),
            ("kinematic/Reach-v0", args.kinematic_steps),
        ):
            r: dict[str, Any] = {"task": task, "obs": "state", "num_envs": args.num_envs, "steps": steps}
            for name, backend in (("processes", {"processes": True}), ("ray", {"ray": "auto"})):
                runs = [measure(task, steps, args.num_envs, **backend) for _ in range(args.repeats)]
                r[f"{name}_steps_per_s"] = round(max(x["steps_per_s"] for x in runs), 1)
                r[f"{name}_start_s"] = round(min(x["start_s"] for x in runs), 2)
            r["ray_vs_processes"] = round(r["ray_steps_per_s"] / r["processes_steps_per_s"], 3)
            results.append(r)
            print(r, flush=True)
    finally:
        ray.shutdown()
    rows = [
        [
            r["task"],
            r["num_envs"],
            r["processes_steps_per_s"],
            r["ray_steps_per_s"],
            f"{r['ray_vs_processes']:.2f}",
            r["processes_start_s"],
            r["ray_start_s"],
        ]
        for r in results
    ]
    print()
    print(
        table(
            rows,
            [
                "task (state)",
                "envs",
                "processes steps/s",
                "Ray steps/s",
                "Ray / processes",
                "processes start s",
                "Ray start s",
            ],
        )
    )
    print(f"\nwrote {write_results('ray_env', results, args.out)}")


if __name__ == "__main__":
    main()
