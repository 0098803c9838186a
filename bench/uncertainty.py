"""Does the `accel` uncertainty alarm flag the episodes that fail without help, and how early?

1. record ``--demos`` scripted demonstrations at ``--noise`` and SFT a small flow VLA on them (a base that
   fails often enough to have something to detect);
2. **calibrate** on ``--calib-episodes`` held-out episodes (seeds from 200000): roll the policy out alone,
   keep the successful ones, and set the CUSUM's reference mean/std and threshold h by split conformal on
   their peak CUSUM (:func:`fleet.uncertainty.calibrate_cusum`, alpha ``--alpha``, docs/algorithms.md §6a);
3. **evaluate** on ``--episodes`` other episodes (seeds from 300000, disjoint from the calibration seeds):
   roll the policy out autonomously (no operator) to find the episodes that fail without help, then
   replay each recorded episode through :class:`sim.operator.SimulatedOperator` twice, once with only the
   uncertainty alarm and once with only the stall rule (``--stall-steps``), and note the first step each
   would have taken over. Per failed episode: was it flagged, how many steps before the end (failure is the
   time limit on Reach), and which rule flagged it first. Per successful episode: a false alarm.

The chunks come from the policy server's own scored inference (:class:`server.slots.ServedVersion`,
``infer_scored``: the same code, batch and seeds ``seed * 1000 + t`` as ``vla-rl fleet sim``), run in
this process with the episodes of a group in lock-step. Prints a markdown table and writes
bench/results/uncertainty.json.

    python bench/uncertainty.py                      # kinematic/Reach-v0, a few minutes on 2 cores
    python bench/uncertainty.py --task PickCube      # maniskill/PickCube-v1 (slower: ~70 sim steps/s)
    python bench/uncertainty.py --task PickCube --obs rgb --image-size 64   # from the 64 px camera

``--obs rgb``: the demos, the policy and the rollouts see the task's camera(s) at ``--image-size`` pixels
plus the proprioception the camera mode keeps (:data:`CAMERA_PRESETS`); the work folder gets an
``_rgb<size>`` suffix so a camera run never reuses a state run's base or rollouts.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vla_rl_client.spec import RobotSpec

from bench.common import table, write_results
from fleet.store import EpisodeStore
from fleet.uncertainty import calibrate_cusum, cusum_path
from policies.loading import load_policy
from server.slots import ServedVersion, initial_noise
from sim.base import ObsMode
from sim.demos import record_demos
from sim.operator import OperatorRules, SimulatedOperator
from sim.registry import make_env, resolve_task
from vla_rl.train.ppo_rollout import stack_obs
from vla_rl.train.sft import SFTConfig, train_sft

CALIB_SEED, EVAL_SEED = 200_000, 300_000
PRESETS: dict[str, dict[str, Any]] = {
    "kinematic/Reach-v0": dict(
        demos=20,
        noise=0.5,
        sft_steps=1000,
        calib_episodes=150,
        episodes=300,
        group=50,
        sft=dict(chunk_len=4, n_exec=2, d_model=64, instruction_encoder="none", batch_size=64),
    ),
    "maniskill/PickCube-v1": dict(
        demos=30,
        noise=0.5,
        sft_steps=1500,
        calib_episodes=60,
        episodes=60,
        group=1,  # one ManiSkill env in this process
        sft=dict(instruction_encoder="none", batch_size=128),
    ),
}
PIXEL_SFT: dict[str, Any] = dict(instruction_encoder="none", batch_size=64)
"""A 64 px base's SFT fields, as bench/rl.py's pixel rows train them."""
CAMERA_PRESETS: dict[str, dict[str, Any]] = {
    # PickCube from pixels needs more demos and steps than from state (50 demos x 2,000 steps gave 2-5%:
    # docs/experiment-log.md); PushCube's 50-demo, 1,500-step pixel base lands at 50-60%
    "maniskill/PickCube-v1": {
        **PRESETS["maniskill/PickCube-v1"],
        "demos": 150,
        "sft_steps": 3000,
        "sft": PIXEL_SFT,
    },
    "maniskill/PushCube-v1": {
        **PRESETS["maniskill/PickCube-v1"],
        "demos": 50,
        "sft_steps": 1500,
        "sft": PIXEL_SFT,
    },
}
"""``--obs rgb`` presets (other tasks: the state preset's, seen through the camera)."""


@dataclass
class Episode:
    """One autonomous episode: what the operator rules look at, step by step, and each chunk's score."""

    seed: int
    max_steps: int
    privileged: list[dict[str, np.ndarray]] = field(default_factory=list)  # before step t
    dense: list[float] = field(default_factory=list)  # before step t
    chunk_scores: dict[int, float] = field(default_factory=dict)  # step a chunk was produced -> score
    success: bool = False
    length: int = 0
    chunk_features: dict[int, np.ndarray] = field(default_factory=dict)  # same steps -> features(prefix)


def rollout(
    version: ServedVersion, task: str, seeds: list[int], group: int, features: bool = False
) -> list[Episode]:
    """The policy alone on ``seeds``, ``group`` episodes in lock-step (one batched inference per step);
    ``features``: keep each decision's ``features(prefix)`` too (one more prefix pass per decision)."""
    out: list[Episode] = []
    for start in range(0, len(seeds), group):
        out += _rollout_group(version, task, seeds[start : start + group], features)
    return out


def policy_obs(spec: RobotSpec) -> tuple[ObsMode, int]:
    """The simulator observations a policy with ``spec`` acts from: ``("rgb", size)``, its cameras at their
    own size, or ``("state", 128)`` for a policy without cameras. The simulator renders every camera
    square at one size, so a policy whose cameras are not all ``size`` x ``size`` cannot be fed its own
    frames: refused, naming each camera's size (rendering at one camera's size would feed the others
    frames of the wrong size)."""
    if not spec.cameras:
        return "state", 128
    size = spec.cameras[0].height
    if any((c.height, c.width) != (size, size) for c in spec.cameras):
        sizes = ", ".join(f"{c.name} {c.height}x{c.width}" for c in spec.cameras)
        raise ValueError(
            f"cameras: the simulator renders every camera square at one size, but {spec.name}'s policy "
            f"takes {sizes}"
        )
    return "rgb", size


def _rollout_group(version: ServedVersion, task: str, seeds: list[int], features: bool) -> list[Episode]:
    spec = version.spec
    obs_mode, image_size = policy_obs(spec)  # what the policy was trained on
    envs = [make_env(task, obs=obs_mode, image_size=image_size) for _ in seeds]
    try:
        eps = [Episode(s, env.max_episode_steps) for s, env in zip(seeds, envs, strict=True)]
        obs, infos = zip(*(env.reset(seed=s) for env, s in zip(envs, seeds, strict=True)), strict=True)
        obs, infos = list(obs), list(infos)
        chunks: list[np.ndarray | None] = [None] * len(envs)
        k = [0] * len(envs)
        active = set(range(len(envs)))
        n_exec = max(1, version.n_exec)
        t = 0
        while active:
            for i in active:
                eps[i].privileged.append(infos[i]["privileged"])
                eps[i].dense.append(float(infos[i]["dense_reward"]))
            need = sorted(i for i in active if chunks[i] is None or k[i] >= n_exec)
            if need:
                batch = stack_obs([obs[i] for i in need])
                states, cams = batch["state"].astype(np.float32), batch["cameras"]
                instructions = [spec.instruction] * len(need)
                noise = np.stack([initial_noise(seeds[i] * 1000 + t, *version.noise_shape) for i in need])  # type: ignore[misc]
                acts, scores = version.infer_scored(states, cams, instructions, noise)
                feats = version.model.features(states, cams, instructions) if features else None  # type: ignore[attr-defined]
                for j, i in enumerate(need):
                    chunks[i], k[i] = acts[j], 0
                    eps[i].chunk_scores[t] = float(scores[j])
                    if feats is not None:
                        eps[i].chunk_features[t] = feats[j]
            for i in sorted(active):
                action = np.clip(chunks[i][k[i]], -1.0, 1.0).astype(np.float32)  # type: ignore[index]
                k[i] += 1
                obs[i], _, terminated, truncated, infos[i] = envs[i].step(action)
                if terminated or truncated:
                    eps[i].success, eps[i].length = bool(infos[i]["success"]), t + 1
                    active.discard(i)
            t += 1
        return eps
    finally:
        for env in envs:
            env.close()


def first_takeover(ep: Episode, task: str, rules: OperatorRules) -> int | None:
    """The step at which the simulated operator with ``rules`` would first take over this episode."""
    op = SimulatedOperator(task, rules)
    op.reset(ep.seed, ep.max_steps)
    for t in range(ep.length):
        if op.observe(t, ep.privileged[t], ep.dense[t]) is not None:
            return t
        if t in ep.chunk_scores and op.observe_chunk(t, ep.chunk_scores[t]) is not None:
            return t
    return None


def auroc(pos: list[float], neg: list[float]) -> float:
    """P(score of a failure > score of a success), ties half (Mann-Whitney)."""
    if not pos or not neg:
        return float("nan")
    p, n = np.asarray(pos)[:, None], np.asarray(neg)[None, :]
    return float(((p > n).sum() + 0.5 * (p == n).sum()) / (p.size * n.size))


def detector_stats(eps: list[Episode], steps: list[int | None]) -> dict[str, Any]:
    fails = [(e, s) for e, s in zip(eps, steps, strict=True) if not e.success]
    succ = [(e, s) for e, s in zip(eps, steps, strict=True) if e.success]
    leads = [e.length - s for e, s in fails if s is not None]
    return {
        "flagged_failures": len(leads),
        "failures": len(fails),
        "flag_rate": len(leads) / max(len(fails), 1),
        "lead_steps_median": float(np.median(leads)) if leads else None,
        "lead_steps_mean": float(np.mean(leads)) if leads else None,
        "lead_fraction_mean": float(np.mean([(e.length - s) / e.length for e, s in fails if s is not None]))
        if leads
        else None,
        "false_alarms": sum(s is not None for _, s in succ),
        "successes": len(succ),
        "false_alarm_rate": sum(s is not None for _, s in succ) / max(len(succ), 1),
    }


def for_task[T](task: str, obs: str, state: Mapping[str, T], camera: Mapping[str, T]) -> T:
    """``task``'s entry for ``obs`` (``state`` or ``rgb``) of a per-task table and its camera variant:
    ``camera``'s for ``rgb`` where it names the task, else ``state``'s (the kinematic Reach one for a task
    it does not name). The presets here and bench/failure.py's set sizes are looked up so."""
    entry = state.get(task, state["kinematic/Reach-v0"])
    return camera.get(task, entry) if obs == "rgb" else entry


def preset(task: str, obs: str = "state") -> dict[str, Any]:
    """The task's preset for ``obs`` (``state`` or ``rgb``); the kinematic one for tasks without one."""
    return for_task(task, obs, PRESETS, CAMERA_PRESETS)


def preset_value(args: argparse.Namespace, task: str, name: str) -> Any:
    """``--name`` when given, else the task's preset for ``--obs`` (:func:`preset`)."""
    value = getattr(args, name, None)
    return value if value is not None else preset(task, getattr(args, "obs", "state"))[name]


def work_dir(args: argparse.Namespace, task: str) -> Path:
    """The run's folder under ``--work``: the task's name, with ``_rgb<size>`` for a camera run."""
    name = task.replace("/", "_")
    if getattr(args, "obs", "state") == "rgb":
        name += f"_rgb{args.image_size}"
    return Path(args.work) / name


def base_checkpoint(args: argparse.Namespace, task: str, work: Path) -> Path:
    """The policy under test: ``--demos`` scripted demos at ``--noise`` and an SFT of the task's preset
    on them, in ``work`` (with ``--reuse``, the one a previous run left there, or its demos when it
    stopped before the SFT ended)."""
    saved = work / "checkpoint.txt"
    if args.reuse and saved.exists():
        return Path(saved.read_text().strip())
    pick = lambda name: preset_value(args, task, name)  # noqa: E731
    if not (args.reuse and _recorded(work / "demos", pick("demos"))):
        _record(args, task, work / "demos", pick("demos"), pick("noise"))
    result = train_sft(
        SFTConfig(
            task=task,
            store=work / "demos",
            out=work / "sft",
            steps=pick("sft_steps"),
            seed=0,
            threads=args.threads,
            checkpoint_every=pick("sft_steps"),
            progress=False,
            resume=False,
            **dict(pick("sft")),
        )
    )
    ckpt = Path(result.checkpoint)
    saved.write_text(str(ckpt))
    return ckpt


def _recorded(root: Path, episodes: int) -> bool:
    """Whether ``root`` holds a store of ``episodes`` demos (a previous run recorded them all)."""
    return (root / "zarr.json").exists() and len(EpisodeStore(root).episode_ids()) == episodes


def _record(args: argparse.Namespace, task: str, root: Path, episodes: int, noise: float) -> None:
    """``episodes`` scripted demos at ``noise`` (seeds from 0) into a new store at ``root``, from the
    camera at ``--image-size`` for ``--obs rgb``."""
    camera = getattr(args, "obs", "state") == "rgb"
    record_demos(
        EpisodeStore(root, create=True),
        task,
        episodes=episodes,
        noise=noise,
        seed=0,
        obs="rgb" if camera else "state",
        image_size=args.image_size if camera else 128,
        num_envs=1,
        progress=False,
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    task = resolve_task(args.task).name
    pick = lambda name: preset_value(args, task, name)  # noqa: E731
    work = work_dir(args, task)
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    ckpt = base_checkpoint(args, task, work)
    timings["demos_and_sft_s"] = time.perf_counter() - t0
    version = ServedVersion(load_policy(ckpt, device="cpu"))

    t0 = time.perf_counter()
    group = pick("group")
    calib = rollout(version, task, [CALIB_SEED + i for i in range(pick("calib_episodes"))], group)
    ok = [e for e in calib if e.success]
    try:
        cal = calibrate_cusum([list(e.chunk_scores.values()) for e in ok], alpha=args.alpha, k=args.k)
    except ValueError as e:
        raise SystemExit(
            f"{e}: {len(ok)}/{len(calib)} calibration episodes succeeded; "
            "run more of them (--calib-episodes) or train the base longer (--sft-steps)"
        ) from None
    timings["calibration_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    evals = rollout(version, task, [EVAL_SEED + i for i in range(pick("episodes"))], group)
    timings["evaluation_s"] = time.perf_counter() - t0

    alarm_rules = OperatorRules(stall_steps=0, drift_radius=0.0, **cal)
    stall_rules = OperatorRules(stall_steps=args.stall_steps, drift_radius=0.0)
    alarm = [first_takeover(e, task, alarm_rules) for e in evals]
    stall = [first_takeover(e, task, stall_rules) for e in evals]
    either = [
        min((s for s in (a, b) if s is not None), default=None) for a, b in zip(alarm, stall, strict=True)
    ]
    fails = [i for i, e in enumerate(evals) if not e.success]
    first = {
        "alarm_first": sum(
            alarm[i] is not None and (stall[i] is None or alarm[i] < stall[i])  # type: ignore[operator]
            for i in fails
        ),
        "stall_first": sum(
            stall[i] is not None and (alarm[i] is None or stall[i] < alarm[i])  # type: ignore[operator]
            for i in fails
        ),
        "same_step": sum(alarm[i] is not None and alarm[i] == stall[i] for i in fails),
        "neither": sum(alarm[i] is None and stall[i] is None for i in fails),
    }

    def peak(e: Episode) -> float:
        m, sd, k = cal["uncertainty_mean"], cal["uncertainty_std"], cal["uncertainty_k"]
        return float(cusum_path(e.chunk_scores.values(), m, sd, k).max())

    scores_f = [s for e in evals if not e.success for s in e.chunk_scores.values()]
    scores_s = [s for e in evals if e.success for s in e.chunk_scores.values()]
    return {
        "task": task,
        "settings": {
            "demos": pick("demos"),
            "noise": pick("noise"),
            "sft_steps": pick("sft_steps"),
            "sft": pick("sft"),
            "obs": args.obs,
            "image_size": args.image_size if args.obs == "rgb" else None,
            "calib_episodes": pick("calib_episodes"),
            "calib_seeds": [CALIB_SEED, CALIB_SEED + pick("calib_episodes") - 1],
            "episodes": pick("episodes"),
            "eval_seeds": [EVAL_SEED, EVAL_SEED + pick("episodes") - 1],
            "alpha": args.alpha,
            "stall_steps": args.stall_steps,
            "num_inference_steps": version.model.loaded.policy.config.num_inference_steps,  # type: ignore[attr-defined]
            "n_exec": version.n_exec,
        },
        "calibration": {
            "episodes": len(calib),
            "successful": len(ok),
            "rules": cal,
        },
        "autonomous_success": sum(e.success for e in evals) / len(evals),
        "alarm": detector_stats(evals, alarm),
        "stall": detector_stats(evals, stall),
        "alarm_or_stall": detector_stats(evals, either),
        "on_failures": first,
        "episode_auroc_peak_cusum": auroc(
            [peak(e) for e in evals if not e.success], [peak(e) for e in evals if e.success]
        ),
        "chunk_score_mean": {
            "failures": float(np.mean(scores_f)) if scores_f else None,
            "successes": float(np.mean(scores_s)) if scores_s else None,
        },
        "seconds": timings,
    }


def report(r: dict[str, Any]) -> str:
    def fmt(x: float | None, spec: str = ".1f") -> str:
        return "-" if x is None else format(x, spec)

    rows = []
    for name, label in (
        ("alarm", "accel CUSUM alarm"),
        ("stall", "stall rule"),
        ("alarm_or_stall", "either"),
    ):
        d = r[name]
        rows.append(
            [
                label,
                f"{d['flagged_failures']}/{d['failures']} ({d['flag_rate']:.0%})",
                fmt(d["lead_steps_median"]),
                fmt(d["lead_steps_mean"]),
                f"{d['false_alarms']}/{d['successes']} ({d['false_alarm_rate']:.0%})",
            ]
        )
    head = [
        "rule",
        "failures flagged",
        "lead median (steps)",
        "lead mean (steps)",
        "false alarms (successes)",
    ]
    f = r["on_failures"]
    cal = r["calibration"]
    return "\n".join(
        [
            f"{r['task']}: autonomous success {r['autonomous_success']:.0%} on {r['settings']['episodes']} episodes; "
            f"calibrated on {cal['successful']}/{cal['episodes']} successful held-out episodes "
            f"(h = {cal['rules']['uncertainty_h']:.2f}, alpha = {r['settings']['alpha']})",
            "",
            table(rows, head),
            "",
            f"on failures: alarm first {f['alarm_first']}, stall first {f['stall_first']}, same step "
            f"{f['same_step']}, neither {f['neither']}; episode AUROC of peak CUSUM "
            f"{r['episode_auroc_peak_cusum']:.2f}",
        ]
    )


def add_obs_args(p: argparse.ArgumentParser) -> None:
    """``--obs`` and ``--image-size``: what the demos record and so what the policy sees."""
    p.add_argument(
        "--obs",
        choices=["state", "rgb"],
        default="state",
        help="the simulator state, or the task's camera(s) + proprioception (a camera preset)",
    )
    p.add_argument("--image-size", type=int, default=64, help="camera height = width in pixels (--obs rgb)")


def check_obs_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.obs == "rgb" and args.image_size < 8:
        p.error(f"--image-size: expected at least 8 pixels, got {args.image_size}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="kinematic/Reach-v0", help="kinematic/Reach-v0 or PickCube (ManiSkill)")
    p.add_argument("--demos", type=int, default=None)
    p.add_argument("--noise", type=float, default=None)
    p.add_argument("--sft-steps", type=int, default=None)
    p.add_argument("--calib-episodes", type=int, default=None, help="held-out episodes (seeds from 200000)")
    p.add_argument("--episodes", type=int, default=None, help="evaluated episodes (seeds from 300000)")
    p.add_argument("--group", type=int, default=None, help="episodes run in lock-step")
    add_obs_args(p)
    p.add_argument("--alpha", type=float, default=0.1, help="conformal level: target false-alarm rate")
    p.add_argument("--k", type=float, default=0.25, help="CUSUM allowance in reference stds")
    p.add_argument("--stall-steps", type=int, default=OperatorRules().stall_steps)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", type=Path, default=Path("runs/bench_uncertainty"))
    p.add_argument("--reuse", action="store_true", help="reuse the SFT checkpoint in --work if present")
    p.add_argument(
        "--out", type=Path, default=None, help="results file (default bench/results/uncertainty.json)"
    )
    args = p.parse_args()
    check_obs_args(p, args)
    t0 = time.perf_counter()
    r = run(args)
    r["seconds"]["total_s"] = time.perf_counter() - t0
    print(report(r))
    path = write_results("uncertainty", r, args.out)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
