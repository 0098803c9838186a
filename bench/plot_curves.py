"""Plot online learning curves (rollout success vs env steps) from trainers' ``curve.json`` files.

    python bench/plot_curves.py bench/results/curves/*.json --out bench/results/rl_online.png

Each curve is smoothed over 3 points; the label is the file name.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("curves", type=Path, nargs="+", help="curve.json files (lists of rows with env_steps)")
    p.add_argument("--out", type=Path, default=Path("bench/results/rl_online.png"))
    p.add_argument("--baseline", type=float, default=None, help="draw the base policy's success (0-1)")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for path in args.curves:
        rows = [
            r
            for r in json.loads(path.read_text())
            if r.get("env_steps") and r.get("rollout_success") is not None
        ]
        if not rows:
            continue
        x = np.array([r["env_steps"] for r in rows], dtype=float)
        y = 100 * np.array([r["rollout_success"] for r in rows], dtype=float)
        ys = np.convolve(y, np.ones(3) / 3, mode="valid") if len(y) >= 3 else y
        ax.plot(x[len(x) - len(ys) :], ys, label=path.stem)
    if args.baseline is not None:
        ax.axhline(100 * args.baseline, color="k", ls="--", lw=1, label="SFT base (eval)")
    ax.set_xlabel("env steps")
    ax.set_ylabel("rollout success (%, 3-point mean)")
    ax.set_title("online post-training on PickCube (state), 2 shared CPU cores")
    ax.legend(fontsize=7)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
