"""QAM learning check: does QAM improve a mediocre SFT policy, offline and offline-to-online?

1. record ``--demos`` noisy scripted demonstrations (``--noise``) of ``--task`` (state observations);
2. train a deliberately short SFT (``--sft-steps``) on them: the weak base;
3. run QAM from that base: ``--offline-steps`` updates on the demos, then ``--env-steps`` online env
   steps with the fine policy acting (replay seeded with the demos);
4. evaluate the base, the offline checkpoint and the final checkpoint on the SAME ``--episodes`` seeds
   (100000 + i), each with the base's and QAM's number of denoising steps.

Demos, the SFT run and the base's evaluation are cached in ``--work`` and reused by later invocations
(so a λ sweep pays for them once). Prints a table and merges one row per ``--label`` into
bench/results/qam_check.json.

    nice -n 19 python bench/qam_check.py --label lam300 --inv-temp 300 --offline-steps 300 --env-steps 3000
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import RESULTS, table, write_results
from fleet.store import EpisodeStore
from policies.loading import load_policy
from sim.demos import record_demos
from vla_rl.evaluation import evaluate
from vla_rl.train.qam import QAMConfig, train_qam
from vla_rl.train.sft import SFTConfig, train_sft


def _eval(ref: Path, task: str, episodes: int, num_steps: int | None) -> dict[str, Any]:
    lp = load_policy(ref, device="cpu")
    lp.num_steps = num_steps
    r = evaluate(lp, task, episodes=episodes, num_envs=2, progress=False)
    return {
        "success": r.success_rate,
        "ci95": r.ci95,
        "mean_length": r.mean_length,
        "eval_s": round(r.seconds),
    }


def _cached_eval(cache: Path, ref: Path, task: str, episodes: int, num_steps: int | None) -> dict[str, Any]:
    key = f"{ref}|{episodes}|{num_steps}"
    data = json.loads(cache.read_text()) if cache.exists() else {}
    if key not in data:
        data[key] = _eval(ref, task, episodes, num_steps)
        cache.write_text(json.dumps(data, indent=1))
    return data[key]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", required=True, help="name of this QAM run (its folder and result row)")
    p.add_argument("--task", default="maniskill/PickCube-v1")
    p.add_argument("--work", type=Path, default=Path("runs/qam_check"))
    p.add_argument("--demos", type=int, default=25)
    p.add_argument("--noise", type=float, default=0.5)
    p.add_argument("--sft-steps", type=int, default=800)
    p.add_argument("--sft-d-model", type=int, default=128)
    p.add_argument("--sft-expert-layers", type=int, default=4)
    p.add_argument("--episodes", type=int, default=50, help="evaluation episodes (same seeds for all)")
    # QAM
    p.add_argument("--inv-temp", type=float, default=100.0)
    p.add_argument("--reward", default="steps_to_go", choices=["steps_to_go", "sparse", "dense"])
    p.add_argument("--offline-steps", type=int, default=300)
    p.add_argument("--env-steps", type=int, default=0)
    p.add_argument("--utd", type=float, default=0.1)
    p.add_argument("--start-online-after", type=int, default=0)
    p.add_argument("--flow-steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--members", type=int, default=10)
    p.add_argument("--critic-hidden", type=int, nargs="+", default=[256, 256, 256])
    p.add_argument("--actor-lr", type=float, default=3e-5)
    p.add_argument("--critic-lr", type=float, default=3e-4)
    p.add_argument("--critic-warmup", type=int, default=0)
    p.add_argument("--critic-mc-steps", type=int, default=0, help="Monte-Carlo critic warm start updates")
    p.add_argument("--train-base", action="store_true")
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "evals.json"

    store_root = work / "store"
    if not (store_root / "episodes").exists():
        rep = record_demos(
            EpisodeStore(store_root, create=True), args.task, args.demos, args.noise, seed=0, progress=False
        )
        print(f"demos: {rep.episodes} episodes, expert success {rep.success_rate:.0%}", flush=True)
    base = work / "sft" / "checkpoints" / "last"
    if not base.exists():
        t0 = time.perf_counter()
        train_sft(
            SFTConfig(
                task=args.task,
                store=store_root,
                out=work / "sft",
                steps=args.sft_steps,
                checkpoint_every=args.sft_steps,
                d_model=args.sft_d_model,
                expert_n_layers=args.sft_expert_layers,
                threads=args.threads,
                progress=False,
                resume=False,
            )
        )
        print(f"sft: {args.sft_steps} steps in {(time.perf_counter() - t0) / 60:.1f} min", flush=True)

    out = work / "qam" / args.label
    cfg = QAMConfig(
        base=str(base),
        store=store_root,
        out=out,
        reward=args.reward,
        gamma=args.gamma,
        inv_temp=args.inv_temp,
        members=args.members,
        critic_hidden=tuple(args.critic_hidden),
        flow_steps=args.flow_steps,
        batch_size=args.batch_size,
        actor_lr=args.actor_lr,
        critic_lr=args.critic_lr,
        critic_warmup=args.critic_warmup,
        critic_mc_steps=args.critic_mc_steps,
        train_base=args.train_base,
        offline_steps=args.offline_steps,
        env_steps=args.env_steps,
        utd=args.utd,
        start_online_after=args.start_online_after,
        num_envs=2,
        seed=args.seed,
        threads=args.threads,
        log_every=25,
        checkpoint_every=10**9,
        progress=True,
        device="cpu",
    )
    t0 = time.perf_counter()
    res = train_qam(cfg)
    train_min = (time.perf_counter() - t0) / 60
    print(f"qam: {res.steps} updates, {res.env_steps} env steps in {train_min:.1f} min", flush=True)

    evals: dict[str, Any] = {}
    for k in (None, args.flow_steps):
        evals[f"base_K{k or 'default'}"] = _cached_eval(cache, base, args.task, args.episodes, k)
    offline_ckpt = out / "checkpoints" / f"step_{args.offline_steps:06d}"
    if args.env_steps and offline_ckpt.exists():
        evals["qam_offline"] = _eval(offline_ckpt, args.task, args.episodes, args.flow_steps)
    evals["qam_final"] = _eval(res.checkpoint, args.task, args.episodes, args.flow_steps)

    row = {
        "label": args.label,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "updates": res.steps,
        "env_steps": res.env_steps,
        "train_minutes": round(train_min, 1),
        "online_episodes": res.metrics.get("online_episodes"),
        "online_success": res.metrics.get("online_success"),
        "final_losses": {k: round(v, 4) for k, v in res.metrics.items() if k.startswith(("loss", "q_"))},
        "evals": evals,
    }
    path = RESULTS / "qam_check.json"
    rows = json.loads(path.read_text())["results"]["rows"] if path.exists() else []
    rows = [r for r in rows if r["label"] != args.label] + [row]
    write_results("qam_check", {"rows": rows})
    print()
    print(
        table(
            [
                [
                    r["label"],
                    r["args"]["inv_temp"],
                    r["args"]["reward"],
                    r["updates"],
                    r["env_steps"],
                    r["train_minutes"],
                    *(
                        f"{r['evals'][k]['success']:.0%}" if k in r["evals"] else "-"
                        for k in (
                            "base_Kdefault",
                            f"base_K{r['args']['flow_steps']}",
                            "qam_offline",
                            "qam_final",
                        )
                    ),
                ]
                for r in rows
            ],
            [
                "label",
                "λ",
                "reward",
                "updates",
                "env steps",
                "train min",
                "SFT K10",
                "SFT K",
                "QAM offline",
                "QAM final",
            ],
        )
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
