"""Re-evaluate the checkpoints of a finished ``bench/rl.py`` work folder on further held-out episodes.

``bench/rl.py`` evaluates every algorithm on the same 100 episodes (seeds 100000+). When settings were
chosen by those episodes, their numbers are optimistic (the winner's curse); this script scores the
cached checkpoints again on episodes no choice has seen (default seeds 100100-100399), per bench seed,
and prints the table with deltas against the SFT base on the same episodes.

    python bench/rl_reeval.py --work runs/reach --task kinematic/Reach-v0 \\
        --runs qam-lam20r qam-o2o-ra flow-noise-40k --out bench/results/rl_kinematic_reeval.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import RESULTS, table, write_results
from bench.rl import evaluate_checkpoint


def checkpoint_of(seed_dir: Path, run: str) -> Path:
    """``sft`` or a cached bench/rl run (``<run>.json`` holds its checkpoint path)."""
    record = seed_dir / f"{run}.json"
    if not record.is_file():
        raise FileNotFoundError(f"--runs {run}: no {record} (a run that bench/rl.py finished)")
    return Path(json.loads(record.read_text())["checkpoint"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True, help="bench/rl.py --work folder")
    p.add_argument("--task", required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument(
        "--runs", nargs="+", required=True, help="run folder names, e.g. qam-lam20r flow-noise-40k"
    )
    p.add_argument("--episodes", type=int, default=300)
    p.add_argument("--first-episode-seed", type=int, default=100_100, help="after bench/rl.py's 100")
    p.add_argument("--out", type=Path, default=RESULTS / "rl_reeval.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    names = ["sft", *args.runs]
    success: dict[str, list[float]] = {n: [] for n in names}
    per_seed: list[dict[str, Any]] = []
    for seed in args.seeds:
        seed_dir = args.work / f"seed{seed}"
        row: dict[str, Any] = {"seed": seed}
        for name in names:
            ckpt = checkpoint_of(seed_dir, name)
            ev = evaluate_checkpoint(ckpt, args.task, args.episodes, seed=args.first_episode_seed)
            row[name] = {**ev, "checkpoint": str(ckpt)}
            success[name].append(ev["success"])
            print(f"seed {seed} {name:<16} {ev['success']:.1%}", flush=True)
        per_seed.append(row)
    sft_mean = float(np.mean(success["sft"]))
    rows = [
        [
            n,
            *[f"{v:.1%}" for v in success[n]],
            f"{np.mean(success[n]):.1%}",
            "-" if n == "sft" else f"{100 * (np.mean(success[n]) - sft_mean):+.1f} pts",
        ]
        for n in names
    ]
    header = ["run", *[f"seed {s}" for s in args.seeds], "mean", "vs SFT"]
    print(table(rows, header))
    out = write_results(
        "rl_reeval",
        {
            "task": args.task,
            "episodes": f"{args.episodes} per seed, episode seeds {args.first_episode_seed}-"
            f"{args.first_episode_seed + args.episodes - 1}",
            "per_seed": per_seed,
            "table": {"header": header, "rows": rows},
        },
        out=args.out,
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
