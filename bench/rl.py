"""Offline-to-online post-training on a task where SFT from noisy, limited demos is mediocre.

Protocol per seed (everything seeded; stages are cached under --work so reruns skip finished work, and a
cached training is reused only with the knobs it ran with):

1. record ``--demos`` scripted demonstrations at ``--noise`` (PickCube state by default; ``--task``,
   ``--obs rgb --image-size 64`` for pixels + proprioception);
2. SFT base for ``--sft-steps``: our FlowVLA from scratch, or with ``--policy smolvla|pi0|pi05`` (camera
   tasks) the small configuration of that LeRobot architecture ``vla-rl up --policy`` builds, every part
   training (its VLM is random); every later stage runs on it through the flow-policy contract. With
   ``--base-band LO HI`` the base is the most-trained SFT checkpoint whose success on
   ``--base-probe-episodes`` selection seeds (400000+, never evaluated) lies in the band (the issue's
   "base at 30-60%" as a rule, not a reroll); evaluate on ``--eval-episodes`` held-out seeds;
3. the fleet's experience: ``--rollouts`` autonomous episodes of the SFT base (controller policy,
   revision = the base), stored next to the demos;
4. each algorithm starts from the SFT base on that data (and, for online ones, the same env-step
   budget ``--env-steps`` in the vectorised sim) and is evaluated on the SAME seeds.

Prints a markdown table (success per seed, mean, delta vs SFT, wall time), writes
bench/results/rl.json and a plot bench/results/rl.png (per-algorithm success; learning curves of
online algorithms).

    python bench/rl.py                                  # all algorithms, 3 seeds (hours on 2 cores)
    python bench/rl.py --seeds 0 --algos awr recap      # one seed, offline algorithms only
    python -m bench.rl --merge A.json B.json --out AB.json   # seeds run apart, one table
    python -m bench.rl --policy smolvla --task maniskill/PushCube-v1 --obs rgb --image-size 64 ...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import RESULTS, table, write_results
from bench.common import cached as _cached
from fleet.store import EpisodeStore
from policies.loading import load_chunk_policy
from sim.demos import record_demos, record_rollouts
from vla_rl.core.seeds import BASE_SELECTION, EVAL, SeedOverlapError, check_disjoint
from vla_rl.evaluation import evaluate
from vla_rl.train.algorithms import make_config, train
from vla_rl.train.base import TrainerConfig
from vla_rl.train.common import config_dict
from vla_rl.train.sft import SFTConfig, train_sft
from vla_rl.up.config import IMAGE_MULTIPLE
from vla_rl.up.lerobot import UP_CHUNK, parameter_count, save_init_folder, tiny_sizes

OFFLINE = ("awr", "recap", "qam", "fql")
ONLINE = ("qam-o2o", "flow-noise", "flow-sde", "flow-sde-all", "awr-pi")
ALL = OFFLINE + ONLINE
POLICIES = ("flowvla", "smolvla", "pi0", "pi05")
"""``--policy``: our FlowVLA (from scratch), or the small LeRobot flow VLA of ``vla-rl up --policy``."""
INIT_DIR = "init"
"""<work>/seedN/init: the random LeRobot folder a ``--policy`` other than flowvla starts its SFT from."""
LEROBOT_SFT_TRAINABLE = "full"
"""What SFT trains of a LeRobot base: everything, its VLM being random (as ``vla-rl up`` trains its base)."""


def evaluate_checkpoint(ckpt: Path, task: str, episodes: int, seed: int = EVAL) -> dict[str, Any]:
    """Success of a checkpoint on the held-out episode seeds ``seed .. seed + episodes - 1``."""
    ev = evaluate(load_chunk_policy(ckpt), task, episodes=episodes, num_envs=2, seed=seed, progress=False)
    return {"success": ev.success_rate, "ci95": list(ev.ci95), "mean_length": ev.mean_length}


def _eval_name(tag: str, seeds: range) -> str:
    """The cache file of ``tag``'s evaluation on the episode seeds ``seeds`` (held-out or selection)."""
    return f"{tag}.eval-{seeds.start}-{len(seeds)}.json"


def _eval(ckpt: Path, args: argparse.Namespace) -> dict[str, Any]:
    return evaluate_checkpoint(ckpt, args.task, args.eval_episodes, seed=args.eval_seed)


class BaseOutOfBand(ValueError):
    """No SFT checkpoint of a seed scored inside ``--base-band`` on the selection seeds."""


def select_base(
    checkpoints: list[Path], band: tuple[float, float], score: Callable[[Path], float]
) -> dict[str, Any]:
    """The base a run starts from when it must score inside ``band`` (fractions, inclusive): the
    most-trained of ``checkpoints`` (SFT's ``step_NNNNNN`` folders) whose ``score`` lies in it. Scored
    from the last back, stopping at the first inside, so a base that came out too strong gives way to an
    earlier checkpoint of the same run; returns the choice and every score taken. Raises
    :class:`BaseOutOfBand` naming every score when none is inside."""
    lo, hi = band
    probed: list[dict[str, Any]] = []
    for ckpt in sorted(checkpoints, key=lambda c: c.name, reverse=True):
        success = float(score(ckpt))
        probed.append({"checkpoint": str(ckpt), "success": success})
        if lo <= success <= hi:
            return {"checkpoint": str(ckpt), "success": success, "band": [lo, hi], "probed": probed}
    shown = ", ".join(f"{Path(p['checkpoint']).name} {p['success']:.0%}" for p in probed) or "no checkpoints"
    raise BaseOutOfBand(
        f"--base-band {lo:g} {hi:g}: no SFT checkpoint scored inside the band ({shown}); all below it: train "
        "longer (--sft-steps) or record more demos (--demos); all above it: fewer demos, or checkpoints "
        "earlier in training (--sft '{\"checkpoint_every\": N}')"
    )


# bench names -> the algorithm table's names (vla_rl.train.algorithms) and the knobs a variant implies
ALGORITHM = {
    "awr": ("awr", {}),
    "recap": ("recap", {}),
    "qam": ("qam", {"env_steps": 0}),
    "fql": ("fql", {}),
    "qam-o2o": ("qam", {}),
    "flow-noise": ("flow-noise", {}),
    "flow-sde": ("flow-sde", {}),
    "flow-sde-all": ("flow-sde", {"sde_steps": "all"}),
    "awr-pi": ("awr-pi", {}),
}


def _config(
    algo: str, base: Path, store: Path, out: Path, seed: int, args: argparse.Namespace
) -> TrainerConfig:
    """One algorithm's trainer config from the SFT base: the same config rounds and the CLI build."""
    name, implied = ALGORITHM[algo]
    values: dict[str, Any] = {"base": str(base), "out": out, "seed": seed, "progress": not args.no_progress}
    if name == "qam":
        init = {"init_from": out.parent / args.qam_init_from} if args.qam_init_from else {}
        values |= {"store": store, "env_steps": args.env_steps, **init, **args.qam}
    elif name in ("awr", "recap"):
        values |= {"store": store, **args.awr}
    elif name == "fql":
        values |= {"store": store, **args.fql}
    elif name == "awr-pi":
        values |= {"store": store, "env_steps": args.env_steps, **args.awr_pi}
    else:
        values |= {"task": args.task, "env_steps": args.env_steps, **args.ppo}
    return make_config(name, **(values | implied))


def knobs(cfg: TrainerConfig) -> dict[str, Any]:
    """What a cached training result must match to be reused: the config, less the progress display."""
    return {k: v for k, v in config_dict(cfg).items() if k != "progress"}


def check_cached_knobs(path: Path, trained: dict[str, Any], cfg: TrainerConfig) -> None:
    """Refuse a cached result trained with other knobs (results cached before the knobs were recorded
    pass): reusing it would report the old run under the new settings. A knob the cached config lacks
    and this run leaves at its default was added to the config since, and the cached run had its
    behaviour: it matches."""
    if "config" not in trained:
        return
    want = knobs(cfg)
    defaults = {
        f.name: config_dict({f.name: f.default})[f.name]
        for f in dataclasses.fields(cfg)
        if f.default is not dataclasses.MISSING
    }
    have = {**{k: v for k, v in defaults.items() if k in want}, **trained["config"]}
    diff = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
    if diff:
        shown = ", ".join(f"{k} {have.get(k)!r} -> {want.get(k)!r}" for k in diff)
        raise SystemExit(
            f"{path}: cached training used other knobs ({shown}); give another --tag, or delete the file "
            "to retrain (a run folder next to it resumes from its train state)"
        )


def _train(cfg: TrainerConfig, args: argparse.Namespace) -> dict[str, Any]:
    """Train one algorithm through the same entry point as rounds and the CLI; returns checkpoint path,
    seconds, curve, metrics and the knobs it ran with."""
    seeds: range | None = cfg.collection_seeds() if hasattr(cfg, "collection_seeds") else None
    if seeds is not None:
        check_disjoint(_eval_seeds(args), {cfg.algorithm: seeds})
    r = train(cfg)
    return {
        "checkpoint": str(r.checkpoint),
        "seconds": r.seconds,
        "curve": r.curve,
        "metrics": r.metrics,
        "config": knobs(cfg),
        **({"collection_seeds": [seeds.start, seeds.stop]} if seeds is not None else {}),
    }


def _held_out_curve(
    work: Path, tag: str, trained: dict[str, Any], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Success on the held-out seeds of every intermediate checkpoint ``<run>/checkpoints/iter_NNNN``
    (``checkpoint_every``), each evaluation cached like the final one, with the env steps the run had
    spent when it was saved (from the run's curve)."""
    steps = {int(c["iteration"]): c.get("env_steps") for c in trained.get("curve", []) if "iteration" in c}
    rows = []
    for ckpt in sorted((work / tag / "checkpoints").glob("iter_*")):
        it = int(ckpt.name.removeprefix("iter_"))
        ev = _cached(
            work / _eval_name(f"{tag}.{ckpt.name}", _eval_seeds(args)), lambda ckpt=ckpt: _eval(ckpt, args)
        )
        rows.append({"iteration": it, "env_steps": steps.get(it), **ev})
    return rows


def _eval_seeds(args: argparse.Namespace) -> range:
    return range(args.eval_seed, args.eval_seed + args.eval_episodes)


def _selection_seeds(args: argparse.Namespace) -> range:
    return range(BASE_SELECTION, BASE_SELECTION + args.base_probe_episodes)


def _demo_seed(seed: int) -> int:
    return seed * 10_000


def _rollout_seed(seed: int) -> int:
    return 50_000 + seed * 10_000


def lerobot_start(work: Path, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """The SFT knobs that make the base a ``--policy`` LeRobot VLA: continue the random small folder
    ``vla-rl up --policy`` builds (<work>/init, seeded by the run's seed) with every part training, as
    ``vla-rl up`` trains its base. Nothing for flowvla (SFT builds a FlowVLA from scratch)."""
    if args.policy == "flowvla":
        return {}
    folder = save_init_folder(work / INIT_DIR, args.policy, args.task, args.image_size, seed)
    return {"base": str(folder), "init": "base", "trainable": LEROBOT_SFT_TRAINABLE}


def policy_info(args: argparse.Namespace) -> dict[str, Any]:
    """What the results JSON records of the policy: its name, and for a LeRobot VLA its parameter count
    (of the first seed's initial folder: every seed builds the same sizes) and the config it was built
    with (VLM sizes, action chunk, camera resolution)."""
    if args.policy == "flowvla":
        return {"name": "flowvla"}
    folder = args.work / f"seed{args.seeds[0]}" / INIT_DIR
    return {
        "name": args.policy,
        "parameters": parameter_count(folder),
        "config": {
            "sizes": dataclasses.asdict(tiny_sizes(args.policy, args.image_size)),
            **UP_CHUNK,
            "image_size": args.image_size,
            "trainable_in_sft": LEROBOT_SFT_TRAINABLE,
        },
    }


def run_seed(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    work = args.work / f"seed{seed}"
    store_path = work / "store"
    check_disjoint(
        _eval_seeds(args),
        {
            "demos": range(_demo_seed(seed), _demo_seed(seed) + args.demos),
            "base rollouts": range(_rollout_seed(seed), _rollout_seed(seed) + args.rollouts),
            **({"the base's selection": _selection_seeds(args)} if args.base_band else {}),
        },
    )

    def demos() -> dict[str, Any]:
        rep = record_demos(
            EpisodeStore(store_path, create=True),
            args.task,
            episodes=args.demos,
            noise=args.noise,
            seed=_demo_seed(seed),
            obs=args.obs,
            image_size=args.image_size,
            num_envs=2,
            progress=False,
            replayable=args.obs == "rgb",  # a camera policy's trainers may replay them (privileged inputs)
        )
        return {"success_rate": rep.success_rate, "frames": rep.frames, "seconds": rep.seconds}

    demo = _cached(work / "demos.json", demos)

    def sft() -> dict[str, Any]:
        t0 = time.perf_counter()
        r = train_sft(
            SFTConfig(
                task=args.task,
                store=store_path,
                out=work / "sft",
                steps=args.sft_steps,
                seed=seed,
                threads=1,
                progress=not args.no_progress,
                **lerobot_start(work, seed, args),
                **{"batch_size": 128, **args.sft},
            )
        )
        made = {} if args.policy == "flowvla" else {"policy": args.policy}
        return {"checkpoint": str(r.checkpoint), "seconds": time.perf_counter() - t0, **made}

    base = _cached(work / "sft.json", sft)
    if base.get("policy", "flowvla") != args.policy:
        raise SystemExit(
            f"{work / 'sft.json'}: the cached SFT base is a {base.get('policy', 'flowvla')}, not --policy "
            f"{args.policy}; give this policy its own --work"
        )
    base_ckpt, base_name, selection = Path(base["checkpoint"]), "sft", {}
    if args.base_band:
        sel = _selection_seeds(args)
        lo, hi = args.base_band
        # each checkpoint's score is cached as an evaluation is, so another band or a rerun after a seed
        # with none inside scores nothing twice; the choice itself is derived from them every time
        selection = select_base(
            list((work / "sft" / "checkpoints").glob("step_*")),
            (lo, hi),
            lambda c: _cached(
                work / _eval_name(f"sft.{c.name}", sel),
                lambda: evaluate_checkpoint(c, args.task, len(sel), seed=sel.start),
            )["success"],
        )
        base_ckpt = Path(selection["checkpoint"])
        base_name = f"sft.{base_ckpt.name}"
        print(
            f"seed {seed} base {base_ckpt.name}: {selection['success']:.0%} on the selection seeds",
            flush=True,
        )
    base_eval = (
        {}
        if args.train_only
        else _cached(work / _eval_name(base_name, _eval_seeds(args)), lambda: _eval(base_ckpt, args))
    )

    def rollouts() -> dict[str, Any]:
        lp = load_chunk_policy(base_ckpt)
        rep = record_rollouts(
            EpisodeStore(store_path),
            lp,
            args.task,
            episodes=args.rollouts,
            seed=_rollout_seed(seed),
            num_envs=2,
            revision=lp.commit,
            robot_prefix="fleet",
            progress=False,
            replayable=args.obs == "rgb",
        )
        return {
            "success_rate": rep.success_rate,
            "frames": rep.frames,
            "seconds": rep.seconds,
            "base": str(base_ckpt),
        }

    roll = _cached(work / "rollouts.json", rollouts) if args.rollouts else {}
    if roll.get("base", str(base_ckpt)) != str(base_ckpt):
        raise SystemExit(
            f"{work / 'rollouts.json'}: the store holds rollouts of {roll['base']}, not of this run's base "
            f"{base_ckpt}; give this setting its own --work"
        )
    results: dict[str, Any] = {
        "seed": seed,
        "demos": demo,
        "rollouts": roll,
        "sft": {**base_eval, "seconds": base["seconds"], **({"selection": selection} if selection else {})},
    }
    for algo in args.algos:
        tag = algo + (f"-{args.tag}" if args.tag else "")

        cache = work / f"{tag}.train.json"
        try:
            cfg = _config(algo, base_ckpt, store_path, work / tag, seed, args)
            trained = _cached(cache, lambda cfg=cfg: _train(cfg, args))
        except ModuleNotFoundError as e:  # an optional package is missing; a broken import is a bug: raise
            results[algo] = {"error": f"not available: {e}"}
            print(f"seed {seed} {algo:<10} {results[algo]['error']}", flush=True)
            continue
        check_cached_knobs(cache, trained, cfg)
        if args.train_only:
            print(
                f"seed {seed} {algo:<10} trained in {trained['seconds'] / 60:.1f} min (--train-only)",
                flush=True,
            )
            continue
        if "collection_seeds" in trained:  # a cached run: its episodes must still be outside the evaluation
            check_disjoint(_eval_seeds(args), {algo: range(*trained["collection_seeds"])})
        ckpt = Path(trained["checkpoint"])
        results[algo] = {
            **trained,
            **_cached(work / _eval_name(tag, _eval_seeds(args)), lambda ckpt=ckpt: _eval(ckpt, args)),
        }
        if args.eval_checkpoints:
            results[algo]["held_out_curve"] = _held_out_curve(work, tag, trained, args)
        r = results[algo]
        print(
            f"seed {seed} {algo:<10} "
            + (
                f"success {r['success']:.0%} (SFT {base_eval['success']:.0%}) in {r['seconds'] / 60:.1f} min"
                if "success" in r
                else r["error"]
            ),
            flush=True,
        )
    return results


def _plot(per_seed: list[dict[str, Any]], algos: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = ["sft", *algos]
    means = [
        np.mean([s[a]["success"] for s in per_seed if "success" in s.get(a, {})] or [np.nan]) for a in names
    ]
    ax1.bar(names, [100 * m for m in means], color=["#888"] + ["#3a7"] * len(algos))
    for i, a in enumerate(names):
        pts = [100 * s[a]["success"] for s in per_seed if "success" in s.get(a, {})]
        ax1.scatter([i] * len(pts), pts, color="k", s=12, zorder=3)
    ax1.set_ylabel("success (%)")
    ax1.set_title("success after post-training (dots: seeds)")
    ax1.tick_params(axis="x", rotation=30)
    for a in algos:
        for s in per_seed:
            curve = s.get(a, {}).get("curve") or []
            # online rows carry the rollout success of the (exploring) policy at that env step
            pts = [
                (c["env_steps"], 100 * c["rollout_success"])
                for c in curve
                if c.get("env_steps")
                and isinstance(c.get("rollout_success"), float)
                and np.isfinite(c["rollout_success"])
            ]
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            if xs:
                (line,) = ax2.plot(xs, ys, label=f"{a} seed {s['seed']}", alpha=0.6)
                held = [h for h in s[a].get("held_out_curve", []) if h.get("env_steps")]
                final = s[a].get("metrics", {}).get("env_steps")
                if held and "success" in s[a] and final:  # held-out points: the snapshots and the end
                    ax2.plot(
                        [h["env_steps"] for h in held] + [final],
                        [100 * h["success"] for h in held] + [100 * s[a]["success"]],
                        "o-",
                        color=line.get_color(),
                        label=f"{a} seed {s['seed']} held-out",
                    )
    if ax2.lines:
        ax2.set_xlabel("env steps")
        ax2.set_title("online learning curves (lines: rollouts; dots: held-out)")
    else:  # offline rows only: each seed's base and result with their 95% intervals
        for j, a in enumerate(names):
            rows = [(i, s[a]) for i, s in enumerate(per_seed) if "success" in s.get(a, {})]
            xs = [i + (j - (len(names) - 1) / 2) * 0.15 for i, _ in rows]
            ys = [100 * r["success"] for _, r in rows]
            yerr = None
            if all("ci95" in r for _, r in rows):
                lo, hi = (np.array([100 * r["ci95"][k] for _, r in rows]) for k in (0, 1))
                yerr = [np.array(ys) - lo, hi - np.array(ys)]
            ax2.errorbar(xs, ys, yerr=yerr, fmt="o", capsize=3, label=a)
        ax2.set_xticks(range(len(per_seed)), [f"seed {s['seed']}" for s in per_seed])
        ax2.set_title("per seed, with 95% intervals")
    ax2.set_ylabel("success (%)")
    if ax2.lines:
        ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def preset_knobs(name: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """A named preset's knobs with ``overrides`` (``--qam`` / ``--awr-pi``) on top. The preset's own
    ``env_steps`` (a round's budget) gives way to the bench's ``--env-steps``, the budget every online
    algorithm of a run shares and the JSON reports; set it in ``overrides`` to pin another."""
    from vla_rl.train.presets import get_preset

    return {**{k: v for k, v in get_preset(name).values.items() if k != "env_steps"}, **overrides}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="maniskill/PickCube-v1")
    p.add_argument(
        "--obs",
        default="state",
        choices=["state", "rgb"],
        help="what the demos record and so what the policy sees: the simulator state, or camera images "
        "plus proprioception (every later stage follows the policy's spec)",
    )
    p.add_argument("--image-size", type=int, default=64, help="camera height = width in pixels (--obs rgb)")
    p.add_argument(
        "--policy",
        default="flowvla",
        choices=POLICIES,
        help="the SFT base: our FlowVLA from scratch, or the small SmolVLA / pi0 / pi0.5 configuration "
        "`vla-rl up --policy` builds (camera tasks: --obs rgb, --image-size a multiple of 32), trained whole",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--algos", nargs="+", default=list(ALL), choices=ALL)
    p.add_argument("--demos", type=int, default=30)
    p.add_argument("--noise", type=float, default=0.5)
    p.add_argument("--sft-steps", type=int, default=1500)
    p.add_argument(
        "--base-band",
        type=float,
        nargs=2,
        default=None,
        metavar=("LO", "HI"),
        help="start from the most-trained SFT checkpoint whose success on the selection seeds (400000+) lies "
        "in [LO, HI] (fractions, e.g. 0.3 0.6); SFT then saves a checkpoint every sft-steps / 6 unless --sft "
        "sets checkpoint_every; a seed with none inside stops with every checkpoint's score",
    )
    p.add_argument(
        "--base-probe-episodes",
        type=int,
        default=50,
        help="episodes each checkpoint is scored on (--base-band)",
    )
    p.add_argument(
        "--rollouts", type=int, default=100, help="autonomous episodes of the SFT base (the fleet data)"
    )
    p.add_argument("--env-steps", type=int, default=20_000, help="online budget per online algorithm")
    p.add_argument("--eval-episodes", type=int, default=50)
    p.add_argument(
        "--eval-seed",
        type=int,
        default=EVAL,
        help="first held-out episode seed (episodes eval-seed .. eval-seed + eval-episodes - 1); pick a range "
        "no setting was chosen on",
    )
    p.add_argument(
        "--train-only",
        action="store_true",
        help="prepare and train, evaluate nothing (e.g. train on a GPU machine, evaluate here later: the "
        "cached <work>/seedN/<algo>.train.json and checkpoints are what a later run evaluates)",
    )
    p.add_argument(
        "--awr", type=json.loads, default={}, help="AWRConfig overrides as JSON, e.g. '{\"beta\": 0.5}'"
    )
    p.add_argument(
        "--sft",
        type=json.loads,
        default={},
        help='SFTConfig overrides as JSON, e.g. \'{"chunk_len": 4, "n_exec": 2, "d_model": 64}\'',
    )
    p.add_argument("--qam", type=json.loads, default={}, help="QAMConfig overrides as JSON")
    p.add_argument(
        "--qam-preset",
        default=None,
        help="start QAM's knobs from this named preset (vla_rl/train/presets.py, e.g. kinematic-qam-pi); "
        "--qam overrides single knobs on top; its env_steps gives way to --env-steps",
    )
    p.add_argument(
        "--qam-init-from",
        default=None,
        help="start each seed's QAM run from that seed's earlier run folder <work>/seed<N>/<NAME> "
        "(e.g. qam-lam10; QAMConfig.init_from; add '{\"init_reset_actor\": true}' to --qam to re-extract)",
    )
    p.add_argument("--fql", type=json.loads, default={}, help="FQLConfig overrides as JSON")
    p.add_argument("--awr-pi", type=json.loads, default={}, help="AWRPIConfig overrides as JSON")
    p.add_argument(
        "--awr-pi-preset",
        default=None,
        help="start awr-pi's knobs from this named preset (e.g. pickcube-awr-pi); --awr-pi overrides on top; "
        "its env_steps gives way to --env-steps",
    )
    p.add_argument("--ppo", type=json.loads, default={}, help="PPOConfig overrides as JSON")
    p.add_argument(
        "--eval-checkpoints",
        action="store_true",
        help="also score every intermediate checkpoint (checkpoints/iter_NNNN, saved by awr-pi's and PPO's "
        "checkpoint_every) on the same held-out seeds: a held-out learning curve over the budget",
    )
    p.add_argument("--tag", default="", help="suffix for cached algorithm results (to compare settings)")
    p.add_argument("--work", type=Path, default=Path("runs/bench_rl"))
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        metavar="JSON",
        help="only join these results files of one protocol on other seeds into --out (no training)",
    )
    p.add_argument("--out", type=Path, default=None, help="results JSON (default bench/results/rl.json)")
    args = p.parse_args()
    if args.merge:
        if args.out is None:
            p.error("--merge: give the merged file's path with --out")
        merge(args.merge, args.out)
        return
    if args.policy != "flowvla":
        if args.obs != "rgb":
            p.error(f"--policy {args.policy}: a LeRobot VLA acts from the camera; add --obs rgb")
        if args.image_size < 1 or args.image_size % IMAGE_MULTIPLE:
            p.error(
                f"--image-size: expected a positive multiple of {IMAGE_MULTIPLE} for --policy {args.policy} "
                f"(16 px patches, then a 2 x 2 pixel shuffle), got {args.image_size}"
            )
    if args.base_band:
        lo, hi = args.base_band
        if not 0 <= lo <= hi <= 1:
            p.error(f"--base-band: expected 0 <= LO <= HI <= 1 (success fractions), got {lo:g} {hi:g}")
        if args.base_probe_episodes < 1:
            p.error(f"--base-probe-episodes: expected a positive integer, got {args.base_probe_episodes}")
        args.sft = {"checkpoint_every": max(1, args.sft_steps // 6), **args.sft}
    if args.qam_preset:
        args.qam = preset_knobs(args.qam_preset, args.qam)
    if args.awr_pi_preset:
        args.awr_pi = preset_knobs(args.awr_pi_preset, args.awr_pi)
    t0 = time.perf_counter()
    try:
        per_seed = [run_seed(s, args) for s in args.seeds]
    except (SeedOverlapError, BaseOutOfBand) as e:
        p.error(str(e))
    if args.train_only:
        return
    header, rows = _table(per_seed, list(args.algos))
    print(table(rows, header))
    out = write_results(
        "rl",
        {
            "task": args.task,
            "obs": args.obs if args.obs == "state" else f"rgb {args.image_size} px + proprioception",
            "policy": policy_info(args),
            "budgets": {
                "demos": args.demos,
                "noise": args.noise,
                "sft_steps": args.sft_steps,
                "rollouts": args.rollouts,
                "env_steps": args.env_steps,
                "eval_episodes": args.eval_episodes,
                "eval_seed": args.eval_seed,
                **(
                    {"base_band": args.base_band, "base_probe_episodes": args.base_probe_episodes}
                    if args.base_band
                    else {}
                ),
            },
            "overrides": {
                "sft": args.sft,
                "awr": args.awr,
                "qam": args.qam,
                "fql": args.fql,
                "ppo": args.ppo,
                "awr_pi": args.awr_pi,
            },
            "per_seed": per_seed,
            "table": {"header": header, "rows": rows},
            "seconds": time.perf_counter() - t0,
        },
        out=args.out,
    )
    _plot(per_seed, list(args.algos), (args.out or RESULTS / "rl.json").with_suffix(".png"))
    print(f"wrote {out}")


def _table(per_seed: list[dict[str, Any]], algos: list[str]) -> tuple[list[str], list[list[str]]]:
    """The printed table: success per seed, mean, change over the SFT base, wall minutes per seed."""
    header = ["algorithm", *[f"seed {s['seed']}" for s in per_seed], "mean", "vs SFT", "wall min/seed"]
    rows = []
    sft_mean = float(np.mean([s["sft"]["success"] for s in per_seed]))
    for a in ["sft", *algos]:
        vals = [s[a].get("success") for s in per_seed]
        ok = [v for v in vals if v is not None]
        mean = float(np.mean(ok)) if ok else float("nan")
        secs = [s[a].get("seconds", 0) for s in per_seed]
        rows.append(
            [
                a,
                *[f"{v:.0%}" if v is not None else "n/a" for v in vals],
                f"{mean:.0%}" if ok else "n/a",
                "-" if a == "sft" or not ok else f"{100 * (mean - sft_mean):+.0f} pts",
                f"{np.mean(secs) / 60:.1f}",
            ]
        )
    return header, rows


def _protocol(results: dict[str, Any], key: str) -> Any:
    """``results[key]``, the policy of files written before it was recorded being FlowVLA."""
    return results.get(key, {"name": "flowvla"}) if key == "policy" else results[key]


def merge(paths: list[Path], out: Path) -> Path:
    """One results JSON (and plot) from runs of the same protocol on other seeds, e.g. seeds trained in
    parallel processes or sessions: their ``per_seed`` rows joined, the table recomputed, and each
    source's file and machine kept under ``merged_from`` (a merged source contributes its own sources, so
    seeds added in a later session merge into the earlier table). The task, observation, policy, budgets and overrides
    must agree; a seed may appear once."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    first = docs[0]["results"]
    for path, doc in zip(paths[1:], docs[1:], strict=True):
        for key in ("task", "obs", "policy", "budgets", "overrides"):
            if _protocol(doc["results"], key) != _protocol(first, key):
                raise SystemExit(
                    f"merge: {path}'s {key} differs from {paths[0]}'s; only runs of one protocol merge"
                )
    per_seed = sorted((s for d in docs for s in d["results"]["per_seed"]), key=lambda s: s["seed"])
    seeds = [s["seed"] for s in per_seed]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"merge: a seed appears twice ({seeds})")
    algos = [a for a in ALL if any(a in s for s in per_seed)]
    header, rows = _table(per_seed, algos)
    print(table(rows, header))
    written = write_results(
        "rl",
        {
            **{k: _protocol(first, k) for k in ("task", "obs", "policy", "budgets", "overrides")},
            "per_seed": per_seed,
            "table": {"header": header, "rows": rows},
            "seconds": sum(d["results"].get("seconds", 0.0) for d in docs),
            "merged_from": [
                src
                for p, d in zip(paths, docs, strict=True)
                for src in d["results"].get("merged_from", [{"file": Path(p).name, "machine": d["machine"]}])
            ],
        },
        out=out,
    )
    _plot(per_seed, algos, out.with_suffix(".png"))
    print(f"wrote {written}")
    return written


if __name__ == "__main__":
    main()
