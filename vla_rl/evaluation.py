"""Evaluate a chunk policy in simulation: vectorised rollouts with receding-horizon execution.

The policy predicts an H-step action chunk; each robot executes the first ``n_exec`` actions and asks
again (docs/architecture.md "Contracts"). Episodes are exactly the seeds ``seed .. seed + episodes - 1``, so two
checkpoints evaluated with the same seed face the same initial states — the promotion gate compares
like with like.

With ``latency`` (:class:`sim.latency.LatencyOptions`) the robots run in the latency world instead: each
keeps executing its action queue while a request is in flight, chunks join the queue with the chosen
merge, and every episode also reports its action jump at chunk boundaries and its starved steps.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from vla_rl_client.spec import RobotSpec

from sim.latency import ContextProposer, LatencyOptions, LatencyRollout, LatencyStats
from sim.rollout import ChunkRollout, EpisodeRecord, Proposer, RTCChunkProposer, SeededChunkProposer
from sim.vector import VectorSimEnv
from vla_rl.core.seeds import EVAL
from vla_rl.train.base import StepProgress

log = logging.getLogger(__name__)


class ChunkPolicy(Protocol):
    """Anything that maps a batch of observations to action chunks (env units, float32 [N, H, A]). A
    checkpoint's policy also has ``n_exec``, the actions the fleet executes per chunk
    (:func:`default_n_exec`)."""

    spec: RobotSpec
    chunk_len: int

    def predict_chunks(self, obs: dict[str, Any], seed: int) -> np.ndarray: ...


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval for a binomial proportion (sane at 0% and 100%, unlike the normal one)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class EpisodeResult:
    seed: int
    success: bool
    length: int
    dense_return: float
    latency: dict[str, Any] | None = None
    """With latency: the episode's :class:`sim.latency.LatencyStats` (delays, starved steps, jumps)."""


def latency_summary(per: list[EpisodeResult], options: LatencyOptions) -> dict[str, Any]:
    """The latency world's settings and its per-episode numbers averaged: the mean action jump at chunk
    boundaries (over every boundary), the mean of each episode's largest jump, starved steps per episode."""
    stats = [e.latency for e in per if e.latency is not None]
    jumps = [j for s in stats for j in s["jumps"]]
    maxes = [s["max_jump"] for s in stats if s["jumps"]]
    return {
        "spec": str(options.latency),
        "merge": options.merge,
        "chunk_size_threshold": options.chunk_size_threshold,
        "when_starved": options.when_starved,
        "mean_jump": float(np.mean(jumps)) if jumps else float("nan"),
        "mean_max_jump": float(np.mean(maxes)) if maxes else float("nan"),
        "starved_per_episode": float(np.mean([s["starved"] for s in stats])),
        "requests_per_episode": float(np.mean([s["requests"] for s in stats])),
        "mean_network_ms": float(np.mean([s["network_ms"] for s in stats])),
        "mean_observation_ms": float(np.mean([s["observation_ms"] for s in stats])),
    }


@dataclass
class EvalResult:
    task: str
    episodes: int
    successes: int
    success_rate: float
    ci95: tuple[float, float]
    mean_length: float
    mean_dense_return: float
    n_exec: int
    seconds: float
    per_episode: list[EpisodeResult] = field(default_factory=list)
    videos: list[str] = field(default_factory=list)
    latency: dict[str, Any] | None = None
    """With latency: :func:`latency_summary` (None: the receding-horizon driver, no latency)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        lo, hi = self.ci95
        line = (
            f"{self.task}: success {self.successes}/{self.episodes} = {self.success_rate:.0%} "
            f"(95% CI {lo:.0%}-{hi:.0%}), mean length {self.mean_length:.1f}, {self.seconds:.0f} s"
        )
        if self.latency is None:
            return line
        lat = self.latency
        return (
            f"{line}\nlatency {lat['spec']}, merge {lat['merge']}: action jump at chunk boundaries "
            f"mean {lat['mean_jump']:.3f} (largest per episode {lat['mean_max_jump']:.3f}), "
            f"{lat['starved_per_episode']:.1f} starved steps per episode"
        )


def default_n_exec(policy: ChunkPolicy) -> int:
    """The actions each robot executes per chunk when evaluation is not told: the policy's own ``n_exec``
    where it records one (a checkpoint's: what the policy server replies with and the fleet executes, so
    gates and benchmarks measure the policy as it is deployed), else half the chunk (receding horizon)."""
    n = getattr(policy, "n_exec", None)
    return int(n) if n else max(1, policy.chunk_len // 2)


def _proposer(policy: ChunkPolicy, seed: int, n_exec: int, rtc: str) -> SeededChunkProposer:
    """The rollout's proposer for evaluate's ``rtc`` (checked here, before any simulator starts)."""
    if rtc not in ("auto", "on", "off"):
        raise ValueError(f"rtc: expected one of ['auto', 'on', 'off'], got {rtc!r}")
    if rtc != "on":
        return SeededChunkProposer(policy.predict_chunks, seed)
    if "rtc" not in inspect.signature(policy.predict_chunks).parameters:
        raise ValueError(
            f"rtc: 'on' but {type(policy).__name__} cannot run real-time chunking; use auto or off"
        )
    return RTCChunkProposer(policy.predict_chunks, seed, n_exec)


def _save_video(frames: list[np.ndarray], path: Path, fps: float) -> Path:
    import imageio.v3 as iio

    try:
        iio.imwrite(path.with_suffix(".mp4"), np.stack(frames), fps=fps, codec="libx264", plugin="pyav")
        return path.with_suffix(".mp4")
    except Exception:  # no codec available: a GIF always works
        iio.imwrite(path.with_suffix(".gif"), np.stack(frames), duration=1000 / fps, loop=0)
        return path.with_suffix(".gif")


def evaluate(
    policy: ChunkPolicy,
    task: str,
    episodes: int = 20,
    num_envs: int = 2,
    seed: int = EVAL,
    n_exec: int | None = None,
    video_dir: Path | None = None,
    num_videos: int = 0,
    render_size: int = 128,
    max_episode_steps: int | None = None,
    progress: bool = True,
    ray: str | None = None,
    rtc: str = "auto",
    latency: LatencyOptions | None = None,
    propose: Proposer | ContextProposer | None = None,
) -> EvalResult:
    """Roll ``policy`` out for the seeds ``seed .. seed + episodes - 1`` and report success and length.

    ``n_exec`` defaults to the policy's own (:func:`default_n_exec`: a checkpoint executes as the fleet
    runs it; half the chunk for a policy that records none). The default seed is far from the
    demonstration seeds (which start at 0) so training episodes are not re-used as tests. ``ray``
    (``auto`` or a cluster address) runs the simulators as Ray actors (:mod:`sim.ray_workers`) instead of
    local processes: the same seeds give the same episodes. ``rtc`` (``auto|on|off``): real-time
    chunking; the rollout waits for every chunk (no inference delay to hide), so ``auto`` is off and
    ``on`` makes each chunk continue the unexecuted rest of the robot's previous one
    (:class:`sim.rollout.RTCChunkProposer`; a policy whose ``predict_chunks`` takes no ``rtc`` is refused).
    ``latency``: run in the latency world
    (:mod:`sim.latency`; ``n_exec`` is then unused: the queue's threshold decides when a robot asks).
    ``propose``: ask this proposer for chunks instead of ``policy.predict_chunks`` (seeded per call); with
    ``latency`` it may be a :class:`sim.latency.ContextProposer` (real-time chunking's requests).
    """
    if episodes < 1:
        raise ValueError(f"episodes: expected >= 1, got {episodes}")
    n_exec = n_exec or default_n_exec(policy)
    proposer = _proposer(policy, seed, n_exec, rtc)
    if latency is not None and rtc == "on":
        raise ValueError(
            "rtc: 'on' is for the waiting rollout; in the latency world real-time chunking's requests come "
            "from a ContextProposer (propose=...), so pass rtc='off' or 'auto' with latency"
        )
    if not 1 <= n_exec <= policy.chunk_len:
        raise ValueError(f"n_exec: expected 1..{policy.chunk_len} (the chunk length), got {n_exec}")
    spec = policy.spec
    obs_mode = "rgb" if spec.cameras else "state"
    image_size = spec.cameras[0].height if spec.cameras else 128
    num_envs = max(1, min(num_envs, episodes))
    want_video = video_dir is not None and num_videos > 0
    t0 = time.perf_counter()
    env = VectorSimEnv(
        task,
        num_envs=num_envs,
        seed=seed,
        obs=obs_mode,
        image_size=image_size,  # type: ignore[arg-type]
        max_episode_steps=max_episode_steps,
        render_size=render_size if want_video else None,
        ray=ray,
    )
    if env.spec.state_dim != spec.state_dim or env.spec.camera_names != spec.camera_names:
        env.close()
        raise ValueError(
            f"policy spec {spec.name} (state {spec.state_dim}, cameras {list(spec.camera_names)}) does not match "
            f"task {env.task} (state {env.spec.state_dim}, cameras {list(env.spec.camera_names)})"
        )
    limit = seed + episodes
    results: dict[int, EpisodeResult] = {}
    frames: dict[int, list[np.ndarray]] = {}
    video_seeds = set(range(seed, seed + num_videos)) if want_video else set()
    bar = StepProgress(episodes, stage="eval", desc=f"eval {env.task}", unit="ep", show=progress)

    def episode_ended(ep: EpisodeRecord) -> None:
        assert ep.seed is not None
        if ep.seed < limit and ep.seed not in results:
            stats = ep.latency.to_dict() if isinstance(ep.latency, LatencyStats) else None
            length = int(ep.info["elapsed_steps"])
            results[ep.seed] = EpisodeResult(ep.seed, ep.success, length, ep.reward, stats)
            bar.update(1)
            bar.set_postfix(success=f"{np.mean([r.success for r in results.values()]):.0%}")

    try:
        if propose is not None:
            proposer = propose
        rollout = (
            ChunkRollout(env, proposer, n_exec, reward_key="dense_reward", on_episode=episode_ended)  # type: ignore[arg-type]
            if latency is None
            else LatencyRollout(env, proposer, latency, reward_key="dense_reward", on_episode=episode_ended)
        )
        if isinstance(proposer, RTCChunkProposer):
            proposer.rollout = rollout
        while len(results) < episodes:
            if video_seeds & set(rollout.seeds):
                views = env.render()
                for i, s in enumerate(rollout.seeds):
                    if s in video_seeds:
                        frames.setdefault(s, []).append(views[i])
            rollout.step()
    finally:
        bar.close()
        env.close()
    per = [results[s] for s in sorted(results)]
    videos: list[str] = []
    if want_video:
        assert video_dir is not None
        video_dir.mkdir(parents=True, exist_ok=True)
        for s in sorted(frames):
            tag = "success" if results.get(s) and results[s].success else "failure"
            videos.append(str(_save_video(frames[s], video_dir / f"seed{s}_{tag}", spec.control_hz)))
    wins = sum(r.success for r in per)
    result = EvalResult(
        task=env.task,
        episodes=len(per),
        successes=wins,
        success_rate=wins / len(per),
        ci95=wilson_interval(wins, len(per)),
        mean_length=float(np.mean([r.length for r in per])),
        mean_dense_return=float(np.mean([r.dense_return for r in per])),
        n_exec=n_exec,
        seconds=time.perf_counter() - t0,
        per_episode=per,
        videos=videos,
        latency=None if latency is None else latency_summary(per, latency),
    )
    log.info(
        "evaluated",
        extra={
            "task": result.task,
            "success_rate": result.success_rate,
            "episodes": result.episodes,
            "seconds": round(result.seconds, 1),
        },
    )
    return result
