"""TACO vs best-of-N by a critic vs the base, on held-out episodes (ManiSkill PickCube from state).

1. record ``--demos`` noisy scripted demonstrations and train an SFT on them (the base; the default
   model, ``--sft-steps`` updates, half of bench/sft.py's);
2. fit TACO's coin-flipping network on the demos' (state, executed chunk) features, and, for the
   best-of-N comparison, a critic on the same features regressed on the demos' Monte-Carlo return
   ``γ^(T−1−t)·success`` (the cheap critic of docs/experiment-log.md's best-of-N probe);
3. evaluate the base, best-of-N by the critic and TACO (both N = ``--num-samples``) on the same
   ``--episodes`` seeds from 100000 (no setting was chosen on them), 95% Wilson intervals.

Demos and the SFT are cached in ``--work``. Prints a table and writes bench/results/taco.json.

    nice -n 19 timeout 1800 python bench/taco.py --episodes 30
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import table, write_results
from fleet.store import EpisodeStore
from policies.critics import mlp
from policies.loading import load_policy
from sim.demos import record_demos
from sim.registry import resolve_task
from vla_rl.evaluation import evaluate
from vla_rl.train import taco
from vla_rl.train.sft import SFTConfig, train_sft


def fit_critic(features: torch.Tensor, returns: torch.Tensor, steps: int, seed: int) -> torch.nn.Module:
    """Q(s, a_exec) regressed (MSE) on Monte-Carlo returns, on the CFN's standardised features."""
    torch.manual_seed(seed)
    mean, std = features.mean(0), features.std(0).clamp_min(1e-6)
    net = mlp(features.shape[1], (256, 256), 1)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = torch.from_numpy(rng.integers(0, len(features), 256))
        loss = torch.nn.functional.mse_loss(net((features[idx] - mean) / std).squeeze(-1), returns[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    net.eval()
    return lambda h: net((h - mean) / std).squeeze(-1)  # type: ignore[return-value]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="PickCube")
    ap.add_argument("--demos", type=int, default=50)
    ap.add_argument("--noise", type=float, default=0.5)
    ap.add_argument("--sft-steps", type=int, default=1000)
    ap.add_argument("--cfn-steps", type=int, default=2000)
    ap.add_argument("--num-samples", type=int, default=8)
    ap.add_argument("--episodes", type=int, default=30)
    ap.add_argument("--num-envs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=Path("runs/bench_taco"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    task = resolve_task(a.task).name
    work = a.work / task.replace("/", "_")
    t0 = time.perf_counter()
    store_root = work / "store"
    if not (work / "demos.done").exists():
        store = EpisodeStore(store_root, create=True)
        rep = record_demos(
            store, task, episodes=a.demos, noise=a.noise, seed=0, num_envs=a.num_envs, progress=False
        )
        (work / "demos.done").write_text(f"{rep.successes}/{rep.episodes}")
    store = EpisodeStore(store_root)
    ckpt = work / "sft" / "checkpoints" / "last"
    if not ckpt.exists():
        train_sft(
            SFTConfig(
                task=task,
                store=store_root,
                out=work / "sft",
                steps=a.sft_steps,
                batch_size=128,
                checkpoint_every=a.sft_steps,
                instruction_encoder="none",
                seed=a.seed,
                threads=1,
                progress=False,
            )
        )
    prep_s = time.perf_counter() - t0
    loaded = load_policy(ckpt, device="cpu")
    n_exec = loaded.policy.config.n_exec
    ids = store.episode_ids()
    t1 = time.perf_counter()
    feats = taco.data_features(loaded, store, ids, n_exec)
    cfn, losses = taco.train_cfn(
        feats, code_dim=64, hidden=(256, 256), steps=a.cfn_steps, batch_size=256, lr=1e-3, seed=a.seed
    )
    returns = []
    for eid in ids:
        ep = store.read_episode(eid, cameras=False)
        t = ep.length - n_exec + 1
        if t >= 1:
            returns.append(0.99 ** (ep.length - 1 - np.arange(t)) * float(ep.meta.success))
    q = fit_critic(feats, torch.as_tensor(np.concatenate(returns), dtype=torch.float32), a.cfn_steps, a.seed)
    fit_s = time.perf_counter() - t1

    def critic_score(obs: dict, chunks: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return q(taco.chunk_features(taco.observation_features(loaded.policy, obs), chunks, n_exec))

    settings = {
        "base (SFT)": loaded,
        f"best-of-{a.num_samples} by critic": taco.BestOfNPolicy(loaded, critic_score, a.num_samples),
        f"TACO (N={a.num_samples})": taco.BestOfNPolicy(
            loaded, taco.TACOScore(cfn, loaded.policy, n_exec), a.num_samples
        ),
    }
    rows, out = [], []
    for name, pol in settings.items():
        r = evaluate(pol, task, episodes=a.episodes, num_envs=a.num_envs, seed=100_000, progress=False)
        out.append({"setting": name, **{k: v for k, v in r.to_dict().items() if k != "per_episode"}})
        rows.append(
            [
                name,
                f"{r.success_rate:.0%}",
                f"[{r.ci95[0]:.0%}, {r.ci95[1]:.0%}]",
                f"{r.mean_length:.1f}",
                f"{r.seconds:.0f}",
            ]
        )
        print(rows[-1], flush=True)
    print(table(rows, ["setting", "success", "95% CI", "mean length", "eval s"]))
    path = write_results(
        "taco",
        {
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
            "task": task,
            "demo_success": (work / "demos.done").read_text(),
            "cfn_rows": len(feats),
            "cfn_final_loss": float(np.mean(losses[-50:])),
            "prep_seconds": round(prep_s, 1),
            "fit_seconds": round(fit_s, 1),
            "rows": out,
            "seconds": round(time.perf_counter() - t0, 1),
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
