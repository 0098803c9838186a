"""Plot online learning curves (rollout success vs env steps) from trainers' ``curve.json`` files.

    python bench/plot_curves.py bench/results/curves/*.json --out bench/results/rl_online.png

Each curve is smoothed over 3 points; the label is the file name. With ``--group``, files in folders of
the same name (``<work>/seed*/<run>/curve.json``) are one run: its seeds are interpolated onto a common
env-step grid and drawn as their mean, with the range across seeds shaded:

    python bench/plot_curves.py runs/reach/seed*/{qam-o2o-pi,flow-noise-40k}/curve.json --group \
        --title "kinematic/Reach-v0, 3 seeds" --out bench/results/rl_kinematic_online_40k.png
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np


def _bin_means(x: np.ndarray, y: np.ndarray, edges: np.ndarray) -> list[float]:
    """Mean of ``y`` per ``x`` bin; an empty bin takes the curve's value at its centre."""
    out = []
    for lo, hi in itertools.pairwise(edges):
        inside = (x >= lo) & (x <= hi)
        out.append(float(y[inside].mean()) if inside.any() else float(np.interp((lo + hi) / 2, x, y)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("curves", type=Path, nargs="+", help="curve.json files (lists of rows with env_steps)")
    p.add_argument("--out", type=Path, default=Path("bench/results/rl_online.png"))
    p.add_argument("--baseline", type=float, default=None, help="draw the base policy's success (0-1)")
    p.add_argument("--group", action="store_true", help="one line per run folder: the mean over its seeds")
    p.add_argument("--title", default="online post-training on PickCube (state), 2 shared CPU cores")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    runs: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
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
        if args.group:
            runs.setdefault(path.parent.name, []).append((x, y))
            continue
        ys = np.convolve(y, np.ones(3) / 3, mode="valid") if len(y) >= 3 else y
        ax.plot(x[len(x) - len(ys) :], ys, label=path.stem)
    for name, seeds in runs.items():
        # common grid over the env steps every seed covers; 40 bins (logging rates differ between trainers)
        lo, hi = max(x[0] for x, _ in seeds), min(x[-1] for x, _ in seeds)
        edges = np.linspace(lo, hi, 41)
        mid = (edges[:-1] + edges[1:]) / 2
        binned = np.array([_bin_means(x, y, edges) for x, y in seeds])
        line = ax.plot(mid, binned.mean(0), label=f"{name} (mean of {len(seeds)})")[0]
        ax.fill_between(mid, binned.min(0), binned.max(0), color=line.get_color(), alpha=0.15)
    if args.baseline is not None:
        ax.axhline(100 * args.baseline, color="k", ls="--", lw=1, label="SFT base (eval)")
    ax.set_xlabel("env steps")
    ax.set_ylabel("rollout success (%, " + ("binned mean over seeds" if args.group else "3-point mean") + ")")
    ax.set_title(args.title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
