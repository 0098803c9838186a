"""HELP segment critic vs the simulator's ground truth (dense-reward progress) on held-out episodes.

1. record scripted-expert episodes at several ``--noise`` levels (each level its own seeds) and the
   rollouts of a weak policy (a deliberately short, small SFT on those demos) into one store;
2. split the episodes (seeded) into a half the critic is fitted on and a held-out half;
3. classify every held-out frame with the critic (it sees states, controllers and outcomes only) and
   with the same rule applied to the simulator's dense reward (the truth: what the store's ``reward``
   column holds for simulated episodes);
4. report per-class precision / recall / F1, the confusion matrix, accuracy and macro F1, next to two
   baselines a broken critic would look like: every frame ``idle`` (the majority class) and the
   critic's own value shuffled across frames.

Episodes and the SFT are cached in ``--work``. Prints a table and writes
bench/results/segment_critic[_<label>].json.

    nice -n 19 timeout 1200 python bench/segment_critic.py --task PickCube
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import table, write_results
from fleet.store import EpisodeStore
from sim.demos import record_demos, record_rollouts
from sim.registry import resolve_task
from vla_rl.train import segment_critic as sc


def record(work: Path, task: str, args: argparse.Namespace) -> tuple[EpisodeStore, dict[str, str]]:
    """The store with every episode, and each episode's source (``expert-<noise>`` / ``weak-policy``)."""
    from policies.loading import load_policy
    from vla_rl.train.sft import SFTConfig, train_sft

    root = work / "store"
    if (work / "done").exists():
        store = EpisodeStore(root)
        sources = dict(line.split("\t") for line in (work / "done").read_text().splitlines())
        return store, sources
    store = EpisodeStore(root, create=True)
    sources: dict[str, str] = {}
    for i, noise in enumerate(args.noise):
        rep = record_demos(
            store, task, episodes=args.episodes_per_noise, noise=noise, seed=10_000 * (i + 1), progress=False
        )
        sources.update({e: f"expert-{noise:g}" for e in rep.episode_ids})
        print(
            f"expert noise {noise:g}: {rep.successes}/{rep.episodes} success, {rep.seconds:.0f} s", flush=True
        )
    if args.policy_episodes:
        res = train_sft(
            SFTConfig(
                task=task,
                store=root,
                out=work / "sft",
                steps=args.sft_steps,
                batch_size=64,
                checkpoint_every=args.sft_steps,
                d_model=64,
                n_layers=2,
                expert_n_layers=2,
                n_heads=2,
                instruction_encoder="none",
                threads=1,
                progress=False,
            )
        )
        rep = record_rollouts(
            store,
            load_policy(res.checkpoint, device="cpu"),
            task,
            episodes=args.policy_episodes,
            seed=90_000,
            progress=False,
        )
        sources.update({e: "weak-policy" for e in rep.episode_ids})
        print(f"weak policy: {rep.successes}/{rep.episodes} success, {rep.seconds:.0f} s", flush=True)
    (work / "done").write_text("\n".join(f"{e}\t{s}" for e, s in sources.items()))
    return store, sources


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="PickCube")
    ap.add_argument("--noise", type=float, nargs="+", default=[0.3, 0.6, 1.0])
    ap.add_argument("--episodes-per-noise", type=int, default=12)
    ap.add_argument("--policy-episodes", type=int, default=12)
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0, help="split and value-fit seed")
    ap.add_argument(
        "--delta", type=float, default=sc.SegmentCriticConfig.delta, help="slope threshold (both signals)"
    )
    ap.add_argument("--window", type=int, default=sc.SegmentCriticConfig.window, help="slope half-width")
    ap.add_argument("--work", type=Path, default=Path("runs/bench_segment_critic"))
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    torch.set_num_threads(1)
    task = resolve_task(a.task).name
    work = a.work / task.replace("/", "_")
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    store, sources = record(work, task, a)
    ids = list(sources)  # recording order (store ids sort by time and a random part)
    rng = np.random.default_rng(a.seed)
    perm = rng.permutation(len(ids))
    fit_ids = sorted(ids[i] for i in perm[: len(ids) // 2])
    held = sorted(ids[i] for i in perm[len(ids) // 2 :])
    cfg = sc.SegmentCriticConfig(store=store.root, seed=a.seed, delta=a.delta, window=a.window)
    t1 = time.perf_counter()
    value = sc.fit_progress_value(
        sc.load_buffer(store, fit_ids), hidden=cfg.value_hidden, steps=cfg.value_steps, seed=a.seed
    )
    fit_s = time.perf_counter() - t1
    test = sc.load_buffer(store, held)
    pred = sc.classify_buffer(test, value, cfg)
    truth = sc.reward_truth(test, cfg)
    idle = {e: np.full(len(t), sc.IDLE) for e, t in truth.items()}
    # a broken critic: its own values shuffled across the held-out frames
    shuffled = sc.classify_signal(test, rng.permutation(value(test.states)), cfg)
    results = {
        "critic": sc.agreement(truth, pred),
        "all-idle": sc.agreement(truth, idle),
        "shuffled-value": sc.agreement(truth, shuffled),
    }
    by_source = {
        src: sc.agreement({e: truth[e] for e in held if sources[e] == src}, pred)
        for src in sorted(set(sources.values()))
        if any(sources[e] == src for e in held)
    }
    rows = [
        [name]
        + [f"{r['per_class'][c]['f1']:.2f}" for c in sc.CLASSES]
        + [f"{r['accuracy']:.3f}", f"{r['macro_f1']:.3f}"]
        for name, r in results.items()
    ]
    print(table(rows, ["held-out", *(f"F1 {c}" for c in sc.CLASSES), "accuracy", "macro F1"]))
    crit = results["critic"]
    print(
        table(
            [
                [c, f"{s['precision']:.2f}", f"{s['recall']:.2f}", f"{s['f1']:.2f}", str(s["support"])]
                for c, s in crit["per_class"].items()
            ],
            ["class", "precision", "recall", "F1", "frames (truth)"],
        )
    )
    print("confusion (rows truth, columns critic):", sc.CLASSES)
    for c, row in zip(sc.CLASSES, crit["confusion"], strict=True):
        print(f"  {c:>16} {row}")
    out = write_results(
        "segment_critic" + (f"_{a.label}" if a.label else ""),
        {
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
            "task": task,
            "config": {
                k: getattr(cfg, k) for k in ("window", "delta", "min_span", "value_hidden", "value_steps")
            },
            "episodes": {"fit": len(fit_ids), "held_out": len(held), "held_out_frames": len(test)},
            "sources": {s: sum(1 for e in ids if sources[e] == s) for s in sorted(set(sources.values()))},
            "success_by_source": {
                s: float(np.mean([store.read_metadata(e).success for e in ids if sources[e] == s]))
                for s in sorted(set(sources.values()))
            },
            "value_fit_seconds": round(fit_s, 2),
            "value_final_loss": value.final_loss,
            "results": results,
            "critic_by_source": by_source,
            "seconds": round(time.perf_counter() - t0, 1),
        },
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
