"""Success and the action jump at chunk boundaries vs latency, per chunk-merge method (issue 43 item 2).

For each setting (PushCube and PickCube on state, PushCube on 64 px camera frames) an SFT checkpoint is
trained quickly from noisy scripted demonstrations (bench/sft.py's settings; cached under ``--work``),
then evaluated on held-out seeds (200000 on) in the latency world of :mod:`sim.latency`: the robot keeps
executing its queued actions while a request is in flight, and the method decides how a late chunk joins
what is left. The latency of a column is the network delay (request sent -> chunk available, constant);
the observation is fresh. Every cell: success with its 95% Wilson interval, the mean action jump at chunk
boundaries, the mean of each episode's largest jump, and starved steps per episode. Cells are cached
under ``--work``, so an interrupted run resumes.

Methods: the queue's merges ``latest_only``, ``weighted_average`` (LeRobot's default, 0.3 old + 0.7 new),
``temporal_ensemble`` (ACT's, asking for a chunk as often as one can be in flight: threshold 1), all
asking at half a chunk otherwise; ``rtc-guided`` and ``rtc-trained``, real-time chunking
(:mod:`policies.rtc`): each request carries the robot's delay in control steps and the actions it will
execute meanwhile into ``predict_chunks(obs, seed, rtc)``, and the chunk replaces the rest of the queue.
``rtc-guided`` runs on the SFT checkpoint (guided sampling); ``rtc-trained`` on the same recipe trained
with ``rtc_max_delay`` = the largest latency in steps (a second cached stage, ``--no-rtc-train`` skips
it; ``--rtc-zero-delay-prob P`` trains it with d = 0 drawn with probability P, ``rtc_zero_delay_prob``, as
a stage and cells of their own, its rows labelled ``rtc-trained (p0 P)``); a row that cannot run says why.

    python -m bench.latency                                     # every setting, 50 episodes a cell
    python -m bench.latency --settings push-state --episodes 10 --latencies 0 100   # a quick look
    python -m bench.latency --train-only                        # train (or find) the checkpoints only
    python -m bench.latency --methods rtc-trained --rtc-zero-delay-prob 0.5   # trained RTC, d = 0 half the time
    python -m bench.latency --merge a.json b.json               # one result file and plot from several runs
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import RESULTS, cached, table, write_results
from bench.sft import SETTINGS
from fleet.store import EpisodeStore
from policies.loading import load_policy
from sim.demos import record_demos
from sim.latency import LatencyOptions, LatencySpec, RequestContext, to_steps
from vla_rl.evaluation import evaluate
from vla_rl.train.sft import SFTConfig, train_sft

DEMO_SEED = 0
"""Demonstrations start at seed 0 (as bench/sft.py's seed 0)."""
EVAL_SEED = 200_000
"""Held-out benchmark finals (:mod:`vla_rl.core.seeds`): no setting is chosen on these."""
LATENCIES_MS = (0, 50, 100, 200, 300)
MERGES: dict[str, LatencyOptions] = {
    "latest_only": LatencyOptions(merge="latest_only"),
    "weighted_average": LatencyOptions(merge="weighted_average"),
    "temporal_ensemble": LatencyOptions(merge="temporal_ensemble", chunk_size_threshold=1.0),
}
RTC = ("rtc-guided", "rtc-trained")
METHODS = (*MERGES, *RTC)


def rtc_variant(zero_delay_prob: float | None) -> str:
    """What names a trained-RTC checkpoint's delay distribution in its stage, cell files and rows: "" for
    the uniform one (``rtc_zero_delay_prob`` None, the names runs had before the option), else
    ``-zero<p>``, so a cached uniform stage or cell is never taken for a mixed one."""
    return "" if zero_delay_prob is None else f"-zero{zero_delay_prob:g}"


def train_checkpoint(
    name: str,
    work: Path,
    demos: int,
    noise: float,
    rtc_max_delay: int = 0,
    rtc_zero_delay_prob: float | None = None,
) -> dict[str, Any]:
    """Record ``demos`` noisy expert demonstrations for setting ``name`` and train SFT on them; cached in
    ``work/name/sft.json`` (the checkpoint path, loss and minutes), so reruns evaluate the same policy.
    ``rtc_max_delay`` > 0: the same recipe on the same demonstrations (the plain stage's store, recorded
    first) with training-time real-time chunking, ``rtc-trained``'s checkpoint; cached in
    ``work/name/sft-rtc.json`` (``sft-rtc-zero<p>.json`` with ``rtc_zero_delay_prob`` p, :func:`rtc_variant`)."""
    s = SETTINGS[name]
    root = work / name
    demo_report = train_checkpoint(name, work, demos, noise) if rtc_max_delay else None
    stem = f"sft-rtc{rtc_variant(rtc_zero_delay_prob)}" if rtc_max_delay else "sft"

    def train() -> dict[str, Any]:
        if demo_report is None:
            report = record_demos(
                EpisodeStore(root / "store", create=True),
                s["task"],
                episodes=demos,
                noise=noise,
                seed=DEMO_SEED,
                obs=s["obs"],
                image_size=s.get("image_size", 128),
                num_envs=2,
                progress=False,
            )
            frames, expert = report.frames, report.success_rate
        else:
            frames, expert = demo_report["demo_frames"], demo_report["expert_success"]
        cfg = SFTConfig(
            task=s["task"],
            store=root / "store",
            out=root / stem,
            steps=s["steps"],
            batch_size=s["batch_size"],
            seed=0,
            checkpoint_every=s["steps"],
            progress=False,
            resume=False,
            rtc_max_delay=rtc_max_delay,
            rtc_zero_delay_prob=rtc_zero_delay_prob,
        )
        t0 = time.perf_counter()
        result = train_sft(cfg)
        return {
            "checkpoint": str(result.checkpoint),
            "demos": demos,
            "noise": noise,
            "demo_frames": frames,
            "expert_success": expert,
            "steps": s["steps"],
            "rtc_max_delay": rtc_max_delay,
            "rtc_zero_delay_prob": rtc_zero_delay_prob,
            "final_loss": result.final_loss,
            "train_minutes": round((time.perf_counter() - t0) / 60, 2),
        }

    return cached(root / f"{stem}.json", train)


def trained_rtc_delay(policy: Any) -> int:
    """The checkpoint's training-time RTC delay (``rtc_max_delay``; 0: trained without RTC)."""
    if hasattr(policy, "rtc_max_delay"):
        return int(policy.rtc_max_delay)
    config = getattr(getattr(policy, "policy", None), "config", None)
    return int(getattr(config, "rtc_max_delay", 0))


def rtc_unavailable(method: str, policy: Any) -> str | None:
    """Why ``method`` (an RTC row) cannot run with ``policy``; None when it can. The policy's
    ``predict_chunks`` must take ``rtc`` (:func:`policies.flow_policy.seeded_rtc_chunks`), and its
    checkpoint picks the RTC path (:func:`policies.rtc.sample_rtc`): guided for one trained without RTC,
    the given prefix for one trained with ``rtc_max_delay``, so each row needs its own checkpoint."""
    if "rtc" not in inspect.signature(policy.predict_chunks).parameters:
        return "not available in this build: the policy's predict_chunks takes no rtc"
    delay = trained_rtc_delay(policy)
    if method == "rtc-trained" and not delay:
        return "no checkpoint trained with RTC (rtc_max_delay) in this run"
    if method == "rtc-guided" and delay:
        return f"the checkpoint was trained with RTC (rtc_max_delay {delay}): its RTC is not guided"
    return None


class RTCProposer:
    """The latency world's proposer for an RTC policy: each robot's request carries its delay in control
    steps and the actions it will execute meanwhile, env units (:class:`sim.latency.RequestContext`),
    into ``predict_chunks(obs, seed, rtc)``; a robot with nothing queued (an episode's first request) is
    sampled plainly. Seeded per call as :class:`sim.rollout.SeededChunkProposer`."""

    wants_context = True

    def __init__(self, policy: Any, seed: int) -> None:
        self.policy, self.seed, self.calls = policy, seed, 0

    def __call__(self, robots: list[int], obs: dict[str, Any], context: list[RequestContext]) -> np.ndarray:
        rtc = [(c.delay_steps, c.queued) if len(c.queued) else None for c in context]
        chunks = self.policy.predict_chunks(obs, self.seed * 1000 + self.calls, rtc)
        self.calls += 1
        return np.asarray(chunks)


def run_cell(
    name: str, policy: Any, method: str, latency_ms: float, episodes: int, num_envs: int
) -> dict[str, Any]:
    """One (setting, method, latency) cell on the held-out seeds: success, CI, jumps, starved steps."""
    s = SETTINGS[name]
    spec = LatencySpec.parse(f"const:{latency_ms:g}ms")
    row: dict[str, Any] = {"setting": name, "task": s["task"], "method": method, "latency_ms": latency_ms}
    if method in RTC:
        reason = rtc_unavailable(method, policy)
        if reason is not None:
            return row | {"available": False, "reason": reason}
    # RTC's chunk already continues what executes meanwhile: it replaces the rest of the queue
    method_options = MERGES.get(method, MERGES["latest_only"])
    options = LatencyOptions(
        spec, merge=method_options.merge, chunk_size_threshold=method_options.chunk_size_threshold
    )
    ev = evaluate(
        policy,
        s["task"],
        episodes=episodes,
        num_envs=num_envs,
        seed=EVAL_SEED,
        progress=False,
        latency=options,
        propose=RTCProposer(policy, EVAL_SEED) if method in RTC else None,
    )
    assert ev.latency is not None
    return row | {
        "available": True,
        "episodes": ev.episodes,
        "successes": ev.successes,
        "success_rate": ev.success_rate,
        "ci95": list(ev.ci95),
        "mean_length": ev.mean_length,
        "seconds": round(ev.seconds, 1),
        **{
            k: ev.latency[k]
            for k in ("mean_jump", "mean_max_jump", "starved_per_episode", "requests_per_episode")
        },
    }


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    """Success vs latency, one panel per setting, one line per method (bars: 95% intervals)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(dict.fromkeys(r["setting"] for r in rows))
    fig, axes = plt.subplots(1, len(settings), figsize=(5 * len(settings), 4), squeeze=False)
    for ax, name in zip(axes[0], settings, strict=True):
        for label in dict.fromkeys(method_label(r) for r in rows):
            pts = sorted(
                (r["latency_ms"], r["success_rate"], *r["ci95"])
                for r in rows
                if r["setting"] == name and method_label(r) == label and r.get("available")
            )
            if not pts:
                continue
            x, y, lo, hi = (np.array(v, dtype=float) for v in zip(*pts, strict=True))
            ax.errorbar(x, 100 * y, yerr=[100 * (y - lo), 100 * (hi - y)], marker="o", capsize=3, label=label)
        ax.set_title(f"{name} ({SETTINGS[name]['task']})")
        ax.set_xlabel("network latency (ms)")
        ax.set_ylabel("success (%)")
        ax.set_ylim(-5, 105)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fmt(x: float, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def summary(rows: list[dict[str, Any]]) -> str:
    """One markdown row per cell: success (CI), jumps, starved steps; unavailable rows say why."""
    out = []
    for r in rows:
        if not r.get("available"):
            out.append([r["setting"], method_label(r), r["latency_ms"], r["reason"], "", "", ""])
            continue
        lo, hi = r["ci95"]
        out.append(
            [
                r["setting"],
                method_label(r),
                r["latency_ms"],
                f"{r['success_rate']:.0%} ({lo:.0%}-{hi:.0%}, n={r['episodes']})",
                _fmt(r["mean_jump"], ".3f"),
                _fmt(r["mean_max_jump"], ".3f"),
                _fmt(r["starved_per_episode"], ".1f"),
            ]
        )
    header = ["setting", "method", "latency ms", "success (95% CI)", "mean jump", "max jump", "starved/ep"]
    return table(out, header)


def method_label(row: dict[str, Any]) -> str:
    """A row's method as tables and plots name it: ``rtc-trained (p0 0.5)`` for a trained-RTC row of a
    checkpoint trained with ``rtc_zero_delay_prob`` 0.5, else its method."""
    p = row.get("rtc_zero_delay_prob")
    return row["method"] if p is None else f"{row['method']} (p0 {p:g})"


def cell_key(row: dict[str, Any]) -> tuple[str, str, float]:
    """A row's cell: (setting, method label, latency in ms)."""
    return row["setting"], method_label(row), float(row["latency_ms"])


def merge(paths: list[Path], out: Path) -> Path:
    """One result file (and plot) from runs of separate settings, e.g. sized differently or run in turn:
    their rows in order, a later file's cell replacing an earlier one's in place (so a rerun of a few
    cells, e.g. RTC rows, merges into an earlier merged file), each source's arguments, checkpoints and
    machine under ``merged_from`` (a merged file's own sources kept as they were)."""
    docs = [json.loads(p.read_text()) for p in paths]
    cells: dict[tuple[str, str, float], dict[str, Any]] = {}
    for d in docs:
        cells.update({cell_key(r): r for r in d["results"]["rows"]})
    rows = list(cells.values())
    sources = [
        source
        for p, d in zip(paths, docs, strict=True)
        for source in d["results"].get("merged_from")
        or [
            {
                "file": p.name,
                "machine": d["machine"],
                "args": d["results"]["args"],
                "checkpoints": d["results"]["checkpoints"],
            }
        ]
    ]
    print(summary(rows))
    written = write_results("latency", {"rows": rows, "merged_from": sources, "complete": True}, out)
    print(f"\nwrote {written}\nplot {plot(rows, out.with_suffix('.png'))}")
    return written


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument(
        "--latencies", nargs="+", type=float, default=list(LATENCIES_MS), help="network latency, ms"
    )
    p.add_argument("--episodes", type=int, default=50, help="held-out episodes a cell")
    p.add_argument(
        "--rgb-episodes", type=int, default=None, help="episodes a camera cell (default --episodes)"
    )
    p.add_argument("--num-envs", type=int, default=2)
    p.add_argument("--demos", type=int, default=50)
    p.add_argument("--noise", type=float, default=0.5)
    p.add_argument("--work", type=Path, default=Path("runs/bench_latency"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--train-only", action="store_true")
    p.add_argument(
        "--no-rtc-train",
        action="store_true",
        help="no rtc_max_delay checkpoint (its rtc-trained rows then say why not)",
    )
    p.add_argument(
        "--rtc-zero-delay-prob",
        type=float,
        default=None,
        help="train the rtc-trained checkpoint with d = 0 at this probability, else U{1..max} "
        "(rtc_zero_delay_prob; default: d ~ U{0..max})",
    )
    p.add_argument("--out", type=Path, default=RESULTS / "latency.json")
    p.add_argument("--merge", type=Path, nargs="+", default=None, help="merge these result files into --out")
    args = p.parse_args()
    if args.merge:
        merge(args.merge, args.out)
        return
    torch.set_num_threads(args.threads)
    meta: dict[str, Any] = {"args": vars(args) | {"work": str(args.work), "out": str(args.out)}}
    checkpoints = {name: train_checkpoint(name, args.work, args.demos, args.noise) for name in args.settings}
    meta["checkpoints"] = checkpoints
    plain = {name: load_policy(Path(checkpoints[name]["checkpoint"])) for name in args.settings}
    if "rtc-trained" in args.methods and not args.no_rtc_train:
        for name in args.settings:
            delay = min(to_steps(max(args.latencies), plain[name].spec.control_hz), plain[name].chunk_len - 1)
            checkpoints[f"{name}/rtc"] = train_checkpoint(
                name, args.work, args.demos, args.noise, delay, args.rtc_zero_delay_prob
            )
    if args.train_only:
        print(checkpoints)
        return
    rows: list[dict[str, Any]] = []
    for name in args.settings:
        episodes = (
            args.rgb_episodes if SETTINGS[name]["obs"] == "rgb" and args.rgb_episodes else args.episodes
        )
        for method in args.methods:
            trained = checkpoints.get(f"{name}/rtc") if method == "rtc-trained" else None
            policy = load_policy(Path(trained["checkpoint"])) if trained else plain[name]
            variant = rtc_variant(args.rtc_zero_delay_prob) if method == "rtc-trained" else ""
            extra = {"rtc_zero_delay_prob": args.rtc_zero_delay_prob} if variant else {}
            for ms in args.latencies:
                cell = args.work / name / "cells" / f"{method}{variant}_{ms:g}ms_{episodes}ep.json"
                if cell.exists() and not json.loads(cell.read_text()).get("available"):
                    cell.unlink()  # why a row could not run is this build's and this run's: ask again
                row = cached(
                    cell,
                    lambda: run_cell(name, policy, method, ms, episodes, args.num_envs) | extra,  # noqa: B023
                )
                print(row, flush=True)
                rows.append(row)
                write_results("latency", meta | {"rows": rows, "complete": False}, args.out)
    print()
    print(summary(rows))
    print(f"\nwrote {write_results('latency', meta | {'rows': rows, 'complete': True}, args.out)}")
    print(f"plot {plot(rows, args.out.with_suffix('.png'))}")


if __name__ == "__main__":
    main()
