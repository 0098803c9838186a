"""Does PPO (Flow-Noise / Flow-SDE) improve a mediocre SFT policy? Success before and after, same seeds.

Without ``--base`` it first makes the weak base: ``--demos`` noisy scripted demonstrations of PickCube
(state) and a short SFT run (what it measured: docs/benchmarks.md and docs/experiment-log.md). Then, for each
method, ``train_ppo`` with a fixed env-step budget, and ``evaluate`` on the same ``--episodes`` held-out
seeds (from 100000) for the base (at its own K and at the RL K) and for each fine-tuned policy.
Prints a markdown table and writes bench/results/ppo_check.json.

    python bench/ppo_check.py                                   # demos + SFT + both methods (~1 h on 2 cores)
    python bench/ppo_check.py --base runs/ppo_check/sft/checkpoints/last --methods sde --env-steps 24000

:func:`run_ppo_check` is the reusable part (bench/rl.py can call it with a base it already has).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import table, write_results
from fleet.store import EpisodeStore
from policies.loading import load_policy
from sim.demos import record_demos
from vla_rl.evaluation import evaluate
from vla_rl.train.ppo import PPOConfig, train_ppo
from vla_rl.train.sft import SFTConfig, train_sft

TASK = "maniskill/PickCube-v1"
ACTOR_LR = {
    "sde": 3e-6,
    "noise": 1e-6,
}  # the learning rates measured best per method (docs/experiment-log.md)


def make_weak_base(work: Path, demos: int, noise: float, steps: int, seed: int) -> Path:
    """Noisy demos + a short SFT run: a weak PickCube policy, room to improve."""
    store = EpisodeStore(work / "store", create=True)
    record_demos(store, TASK, episodes=demos, noise=noise, seed=seed * 10_000, num_envs=2, progress=False)
    cfg = SFTConfig(
        task=TASK, store=work / "store", out=work / "sft", steps=steps, seed=seed, threads=1,
        checkpoint_every=steps, progress=False, resume=False,
    )  # fmt: skip
    return train_sft(cfg).checkpoint


def success(ref: str | Path, k: int | None, episodes: int, num_envs: int) -> float:
    lp = load_policy(ref, device="cpu")
    lp.num_steps = k
    return evaluate(lp, TASK, episodes=episodes, num_envs=num_envs, progress=False).success_rate


def run_ppo_check(
    base: str | Path,
    work: Path,
    methods: list[str],
    episodes: int = 50,
    num_envs: int = 4,
    base_eval: bool = True,
    **ppo_kw: Any,
) -> dict[str, Any]:
    """Evaluate ``base``, fine-tune it with each method, evaluate each result on the same seeds."""
    k = int(ppo_kw.get("num_steps", 4))
    out: dict[str, Any] = {"base": str(base), "episodes": episodes, "num_steps": k, "runs": []}
    if base_eval:
        out["base_success"] = success(base, None, episodes, num_envs)
        out["base_success_at_k"] = success(base, k, episodes, num_envs)
    for method in methods:
        kw = dict(ppo_kw)
        if kw.get("actor_lr") is None:  # Flow-Noise's exact 80-term chain log-prob needs a smaller step
            kw["actor_lr"] = ACTOR_LR[method]
        cfg = PPOConfig(
            base=str(base), out=work / f"ppo-{method}", method=method, num_envs=num_envs, progress=False, **kw
        )
        t0 = time.perf_counter()
        res = train_ppo(cfg)
        minutes = (time.perf_counter() - t0) / 60
        after = success(res.checkpoint, None, episodes, num_envs)  # the checkpoint's own K = the RL K
        curve = res.curve
        out["runs"].append(
            {
                "method": method,
                "env_steps": res.env_steps,
                "episodes_trained": res.episodes,
                "train_minutes": round(minutes, 1),
                "success_after": after,
                "rollout_success_first3": _mean([r["rollout_success"] for r in curve[:3]]),
                "rollout_success_last3": _mean([r["rollout_success"] for r in curve[-3:]]),
                "checkpoint": str(res.checkpoint),
                "config": {k2: str(v) for k2, v in vars(cfg).items()},
            }
        )
    return out


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return sum(xs) / len(xs) if xs else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default=None, help="checkpoint to fine-tune (default: make a weak PickCube one)")
    p.add_argument("--work", type=Path, default=Path("runs/ppo_check"))
    p.add_argument("--methods", nargs="+", default=["noise", "sde"], choices=["noise", "sde"])
    p.add_argument("--env-steps", type=int, default=30_000)
    p.add_argument("--num-envs", type=int, default=4)
    p.add_argument("--rollout-steps", type=int, default=400)
    p.add_argument("--k", type=int, default=4, help="denoising steps during RL")
    p.add_argument("--reward", default="dense", choices=["sparse", "dense"])
    p.add_argument("--actor-lr", type=float, default=None, help="default: 3e-6 for sde, 1e-6 for noise")
    p.add_argument("--critic-lr", type=float, default=3e-4)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--minibatch-size", type=int, default=160)
    p.add_argument("--critic-warmup", type=int, default=2, help="critic-only iterations first")
    p.add_argument("--target-kl", type=float, default=None)
    p.add_argument("--noise-std", type=float, nargs=2, default=None, metavar=("MIN", "MAX"))
    p.add_argument("--logprob-reduction", default="sum", choices=["sum", "mean"])
    p.add_argument("--episodes", type=int, default=50, help="evaluation episodes (seeds 100000..)")
    p.add_argument("--no-base-eval", action="store_true")
    p.add_argument("--demos", type=int, default=30)
    p.add_argument("--demo-noise", type=float, default=0.5)
    p.add_argument("--sft-steps", type=int, default=1500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="", help="suffix of the result file (ppo_check[_LABEL].json)")
    args = p.parse_args()
    torch.set_num_threads(1)
    from vla_rl.core.logs import setup_logging

    setup_logging()
    t0 = time.perf_counter()
    base = args.base or make_weak_base(args.work, args.demos, args.demo_noise, args.sft_steps, args.seed)
    res = run_ppo_check(
        base,
        args.work / (args.label or "run"),
        args.methods,
        episodes=args.episodes,
        num_envs=args.num_envs,
        base_eval=not args.no_base_eval,
        env_steps=args.env_steps,
        rollout_steps=args.rollout_steps,
        num_steps=args.k,
        reward=args.reward,
        actor_lr=args.actor_lr,
        critic_lr=args.critic_lr,
        update_epochs=args.epochs,
        minibatch_size=args.minibatch_size,
        critic_warmup_iterations=args.critic_warmup,
        target_kl=args.target_kl,
        noise_std_range=tuple(args.noise_std) if args.noise_std else None,
        logprob_reduction=args.logprob_reduction,
        seed=args.seed,
    )
    res["args"] = {k: str(v) for k, v in vars(args).items()}
    res["total_minutes"] = round((time.perf_counter() - t0) / 60, 1)
    rows = [
        [r["method"], f"{res.get('base_success', float('nan')):.0%}", f"{res.get('base_success_at_k', float('nan')):.0%}",
         f"{r['success_after']:.0%}", r["env_steps"], r["train_minutes"],
         f"{r['rollout_success_first3']:.0%} -> {r['rollout_success_last3']:.0%}"]
        for r in res["runs"]
    ]  # fmt: skip
    header = [
        "method",
        "SFT (K=10)",
        f"SFT (K={args.k})",
        "after PPO",
        "env steps",
        "train min",
        "rollout succ",
    ]
    print(table(rows, header))
    name = "ppo_check" + (f"_{args.label}" if args.label else "")
    print(f"wrote {write_results(name, res)}")


if __name__ == "__main__":
    main()
