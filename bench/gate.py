"""How often does the promotion gate promote noise, and how often does it promote a real improvement?

A round's gate compares a candidate with its base on the same ``--gate-episodes`` seeds. This bench runs
that comparison many times on the kinematic test bed (``kinematic/Reach-v0``, no physics engine: cheap):

* **null**: the candidate *is* the base checkpoint, sampled with other flow noise (its ``predict_chunks``
  seeds shifted), so it is exactly as good, and every promotion is a false one;
* **modest** / **better**: the candidate is an SFT checkpoint trained on more (and, for ``better``, cleaner)
  demonstrations, known to be better: the gate's power (each checkpoint's success on
  ``--power-check-episodes`` other held-out seeds is in the results).

Each trial is a fresh block of ``--gate-episodes`` seeds (one evaluation of each policy over all
``--seeds``, split into blocks: the same episodes as one evaluation a block; one row a block size, 50 as
``vla-rl up``'s gate and 200 for the power a larger gate buys). Per trial the old rule
(promote iff candidate success - base success > 0, up's margin 0) and the paired test
(:func:`vla_rl.gate_stats.paired_outcomes`, exact one-sided McNemar at ``--alpha``) decide; reported per
scenario are the promotion rates with 95% Wilson intervals. For the old rule's promoted null trials it also
reports how far the gate's success of the promoted candidate lies above the candidate's true success
(the selection bias a round's reported success removes by scoring the promoted checkpoint again on
seeds the gate never saw).

Seeds: the gate blocks start at 200,000 (held-out benchmark finals: nothing is chosen on them), the
better checkpoint's check at 300,000 (:mod:`vla_rl.core.seeds`). Demonstrations and SFT are cached in
``--work``. Results: ``bench/results/gate.json`` and docs/benchmarks.md ("The promotion gate").
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import table, write_results
from fleet.store import EpisodeStore
from policies.loading import load_policy
from sim.demos import record_demos
from vla_rl.evaluation import evaluate, wilson_interval
from vla_rl.gate_stats import paired_outcomes
from vla_rl.train.sft import SFTConfig, train_sft

TASK = "kinematic/Reach-v0"
NULL = "null (candidate = base, other noise)"
GATE_SEED, CHECK_SEED = 200_000, 300_000
SFT_KNOBS = {"chunk_len": 4, "n_exec": 2, "d_model": 64, "instruction_encoder": "none", "batch_size": 64}
"""The kinematic benchmark's SFT recipe (``kinematic-sft``)."""
CHECKPOINTS = {
    "base": {"demos": 20, "noise": 0.5, "seed": 0},
    "modest": {"demos": 40, "noise": 0.5, "seed": 2},
    "better": {"demos": 100, "noise": 0.2, "seed": 1},
}
"""The weak base of the kinematic benchmark, and two candidates: twice its demonstrations (a modest gain)
and five times as many, cleaner (a large one)."""


class Reseeded:
    """The same policy with other flow noise: ``predict_chunks(obs, seed)`` asks for ``seed + offset``."""

    def __init__(self, policy: Any, offset: int) -> None:
        self.policy, self.offset = policy, offset
        self.spec, self.chunk_len = policy.spec, policy.chunk_len

    def predict_chunks(self, obs: dict[str, Any], seed: int) -> np.ndarray:
        return self.policy.predict_chunks(obs, seed + self.offset)


def checkpoint(name: str, work: Path, steps: int) -> Path:
    """SFT on ``CHECKPOINTS[name]``'s demonstrations (cached in ``work/name``)."""
    spec, out = CHECKPOINTS[name], work / name
    done = out / "checkpoint.txt"
    if done.exists():
        return Path(done.read_text().strip())
    store = EpisodeStore(out / "demos", create=True)
    demo_seed = spec["seed"] * 10_000
    record_demos(
        store, TASK, episodes=spec["demos"], noise=spec["noise"], seed=demo_seed, num_envs=1, progress=False
    )
    r = train_sft(
        SFTConfig(
            task=TASK,
            store=out / "demos",
            out=out / "sft",
            steps=steps,
            seed=spec["seed"],
            threads=1,
            checkpoint_every=steps,
            progress=False,
            resume=False,
            **SFT_KNOBS,
        )
    )
    done.write_text(str(r.checkpoint))
    return Path(r.checkpoint)


def outcomes(policy: Any, seed: int, episodes: int, envs: int) -> np.ndarray:
    """Successes (bool per seed, seed order) of ``policy`` on ``seed .. seed + episodes - 1``."""
    ev = evaluate(policy, TASK, episodes=episodes, num_envs=envs, seed=seed, progress=False)
    return np.array([r.success for r in ev.per_episode])


def trials(cand: np.ndarray, base: np.ndarray, n: int, alpha: float) -> dict[str, Any]:
    """Split paired outcomes into blocks of ``n`` seeds and gate each: promotions under the old rule and
    the paired test, with 95% Wilson intervals, and the old rule's optimism on its promotions."""
    blocks = len(cand) // n
    old, new, gate_success = 0, 0, []
    for b in range(blocks):
        c, s = cand[b * n : (b + 1) * n], base[b * n : (b + 1) * n]
        test = paired_outcomes(dict(enumerate(c.tolist())), dict(enumerate(s.tolist())))
        if c.mean() - s.mean() > 0:
            old += 1
            gate_success.append(float(c.mean()))
        new += test.passes(alpha)
    true = float(cand.mean())

    def rate(k: int) -> dict[str, Any]:
        return {"promoted": k, "trials": blocks, "rate": k / blocks, "ci95": list(wilson_interval(k, blocks))}

    return {
        "old_rule": rate(old),
        "paired_test": rate(new),
        "candidate_success": true,
        "base_success": float(base.mean()),
        "old_rule_gate_success_when_promoted": float(np.mean(gate_success)) if gate_success else None,
        "old_rule_optimism": float(np.mean(gate_success)) - true if gate_success else None,
    }


def _rows(results: dict[int, dict[str, Any]]) -> list[list[str]]:
    cell = lambda x: f"{x['rate']:.1%} ({x['ci95'][0]:.1%}-{x['ci95'][1]:.1%})"  # noqa: E731
    return [
        [
            name,
            f"{size} x {r['old_rule']['trials']}",
            f"{r['candidate_success']:.1%} / {r['base_success']:.1%}",
            cell(r["old_rule"]),
            cell(r["paired_test"]),
        ]
        for size, by_name in results.items()
        for name, r in by_name.items()
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=10_000, help="gate seeds in all, split into trials")
    ap.add_argument(
        "--gate-episodes",
        type=int,
        nargs="+",
        default=[50, 200],
        help="seeds per gate (up's --eval-episodes): one row a size, trials = --seeds / size",
    )
    ap.add_argument("--alpha", type=float, default=0.05, help="the paired test's false-promotion rate")
    ap.add_argument("--sft-steps", type=int, default=1000)
    ap.add_argument(
        "--envs", type=int, default=100, help="simulators per evaluation (in-process: one policy batch)"
    )
    ap.add_argument("--power-check-episodes", type=int, default=400)
    ap.add_argument("--work", type=Path, default=Path("runs/bench_gate"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    ckpts = {name: checkpoint(name, args.work, args.sft_steps) for name in CHECKPOINTS}
    policies = {name: load_policy(str(c)) for name, c in ckpts.items()}
    base, n_seeds = policies["base"], args.seeds
    base_out = outcomes(base, GATE_SEED, n_seeds, args.envs)
    scenarios = {
        NULL: outcomes(Reseeded(base, 7_919), GATE_SEED, n_seeds, args.envs),
        "modest (2x the demos)": outcomes(policies["modest"], GATE_SEED, n_seeds, args.envs),
        "better (5x the demos, cleaner)": outcomes(policies["better"], GATE_SEED, n_seeds, args.envs),
    }
    results = {
        size: {name: trials(c, base_out, size, args.alpha) for name, c in scenarios.items()}
        for size in args.gate_episodes
    }
    check = {
        name: float(outcomes(p, CHECK_SEED, args.power_check_episodes, args.envs).mean())
        for name, p in policies.items()
    }
    header = ["candidate", "seeds x trials", "candidate / base success", "old rule (margin 0)", "paired test"]
    print(table(_rows(results), header))
    for size, by_name in results.items():
        null = by_name[NULL]
        if null["old_rule_optimism"] is not None:
            print(
                f"old rule, null, {size} seeds: a promoted candidate's gate success "
                f"{null['old_rule_gate_success_when_promoted']:.1%} vs its true {null['candidate_success']:.1%} "
                f"({null['old_rule_optimism']:+.1%})"
            )
    minutes = (time.perf_counter() - t0) / 60
    print(f"{n_seeds} gate seeds a policy at alpha {args.alpha}; {minutes:.1f} min")
    path = write_results(
        "gate",
        {
            "task": TASK,
            "seeds": n_seeds,
            "gate_episodes": args.gate_episodes,
            "alpha": args.alpha,
            "gate_seeds": [GATE_SEED, GATE_SEED + n_seeds - 1],
            "checkpoints": CHECKPOINTS,
            "sft_steps": args.sft_steps,
            "held_out_check": {"episodes": args.power_check_episodes, "seed": CHECK_SEED, **check},
            "scenarios": {str(size): by_name for size, by_name in results.items()},
            "minutes": minutes,
        },
        args.out,
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
