"""Record scripted-expert demonstrations (and autonomous policy rollouts) into an episode store.

Frame ``t`` of an episode holds the observation the expert saw, the action it executed, and the
reward / terminated / truncated that action produced. Demonstrations are one autonomous segment
driven by the ``scripted`` controller, with no checkpoint revision and no policy proposal.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from sim.experts import make_expert
from sim.latency import LatencyOptions, LatencyRollout
from sim.rollout import ChunkRollout, SeededChunkProposer, StepRecord
from sim.vector import VectorSimEnv

if TYPE_CHECKING:
    from fleet.codecs import CameraCodecs
    from fleet.store import EpisodeStore, EpisodeWriter

log = logging.getLogger(__name__)


@dataclass
class DemoReport:
    task: str
    episodes: int = 0
    successes: int = 0
    frames: int = 0
    seconds: float = 0.0
    env_steps: int = 0
    """Simulator steps taken (every robot's, recorded or not); counted by policy rollouts."""
    episode_ids: list[str] = field(default_factory=list)

    @property
    def success_rate(self) -> float:
        return self.successes / max(self.episodes, 1)

    def close_episode(self, writer: EpisodeWriter, success: bool, episode_seed: int | None = None) -> None:
        """Close ``writer``'s episode with its outcome (and its reset seed, for replay) and count it."""
        meta = writer.close(
            outcome="success" if success else "failure", success=success, episode_seed=episode_seed
        )
        self.episodes += 1
        self.successes += success
        self.frames += meta.length
        self.episode_ids.append(meta.episode_id)

    def write_step(
        self, writers: list[EpisodeWriter | None], step: StepRecord, bar: tqdm, **fields: Any
    ) -> list[int]:
        """Append one vector step to every open writer (``fields`` = extra frame fields, numpy arrays
        indexed per env, e.g. the controller); close and count the episodes that ended. Returns the env
        indices whose episode ended (the caller opens the next or stops)."""
        now = time.time()
        ended = []
        for i, w in enumerate(writers):
            if w is None:
                continue
            w.add_frame(
                cameras={k: v[i] for k, v in step.obs["cameras"].items()},
                state=step.obs["state"][i],
                action=step.actions[i],
                reward=float(step.reward[i]),
                terminated=bool(step.terminated[i]),
                truncated=bool(step.truncated[i]),
                timestamp=now,
                **{k: v[i] if isinstance(v, np.ndarray) else v for k, v in fields.items()},
            )
            if step.terminated[i] or step.truncated[i]:
                seed = step.seeds[i] if step.seeds else None
                self.close_episode(w, bool(step.info["success"][i]), seed)
                bar.update(1)
                bar.set_postfix(success=f"{self.success_rate:.0%}")
                ended.append(i)
        return ended


def record_demos(
    store: EpisodeStore,
    task: str,
    episodes: int,
    noise: float = 0.0,
    seed: int = 0,
    obs: str = "state",
    image_size: int = 128,
    num_envs: int = 1,
    max_episode_steps: int | None = None,
    robot_prefix: str = "sim",
    progress: bool = True,
    camera_codec: str | CameraCodecs | None = None,
    ray: str | None = None,
    replayable: bool = False,
) -> DemoReport:
    """Run the scripted expert for ``episodes`` episodes and write every frame to ``store``.

    ``camera_codec``: the cameras' codec in the store (``lossless``, ``jpeg:90``, ...; see
    :mod:`fleet.codecs`), checked against the task's cameras before the first episode.

    Episodes use the vector env's seed sequence (``seed + i + j * num_envs``), so the same call writes
    the same frames. The expert of each episode is seeded with the episode's seed. ``ray`` (``auto`` or a
    cluster address) runs the simulators as Ray actors (:mod:`sim.ray_workers`): the seeds, the expert
    and the writes stay in this process, so the same call writes the same frames there too.
    ``replayable``: every episode replays exactly from its seed (:class:`sim.base.EnvOptions`).
    """
    if episodes < 1:
        raise ValueError(f"episodes: expected >= 1, got {episodes}")
    num_envs = min(num_envs, episodes)
    from fleet.codecs import CameraCodecs

    codecs = CameraCodecs.parse(camera_codec)
    t0 = time.perf_counter()
    env = VectorSimEnv(
        task,
        num_envs=num_envs,
        seed=seed,
        obs=obs,
        image_size=image_size,  # type: ignore[arg-type]
        max_episode_steps=max_episode_steps,
        ray=ray,
        replayable=replayable,
    )
    codecs.check(env.spec.camera_names)
    report = DemoReport(task=env.task)
    bar = tqdm(total=episodes, desc=f"demos {env.task}", unit="ep", disable=not progress)
    started = num_envs

    def open_writer(i: int) -> EpisodeWriter:
        w = store.create_episode(env.spec, robot_id=f"{robot_prefix}-{i}", task=env.task, camera_codec=codecs)
        w.begin_segment("autonomous", controller="scripted", reason=f"scripted expert, noise={noise}")
        return w

    def act(robots: list[int], _obs: dict[str, Any]) -> np.ndarray:
        """The experts act every step: chunks of one action, from the privileged state."""
        priv = rollout.info["privileged"]
        return np.stack([experts[i].act({k: v[i] for k, v in priv.items()}) for i in robots])[:, None]

    def write(step: StepRecord) -> None:
        nonlocal started
        for i in report.write_step(writers, step, bar, controller="scripted"):
            # Start the next episode in this env only while more are needed.
            if started < episodes:
                writers[i] = open_writer(i)
                experts[i].reset(int(step.info["episode_seed"][i]))
                started += 1
            else:
                writers[i] = None

    try:
        rollout = ChunkRollout(env, act, n_exec=1, on_step=write)
        experts = [make_expert(env.task, noise=noise, seed=int(s)) for s in rollout.info["episode_seed"]]
        writers: list[EpisodeWriter | None] = [open_writer(i) for i in range(num_envs)]
        while report.episodes < episodes:
            rollout.step()
    finally:
        bar.close()
        env.close()
    report.seconds = time.perf_counter() - t0
    log.info(
        "recorded demos",
        extra={
            "task": report.task,
            "episodes": report.episodes,
            "success_rate": report.success_rate,
            "frames": report.frames,
            "seconds": round(report.seconds, 2),
        },
    )
    return report


def record_rollouts(
    store: EpisodeStore,
    policy: Any,
    task: str,
    episodes: int,
    seed: int = 0,
    num_envs: int = 1,
    n_exec: int | None = None,
    revision: str = "",
    max_episode_steps: int | None = None,
    robot_prefix: str = "sim",
    progress: bool = True,
    replayable: bool = False,
    latency: LatencyOptions | None = None,
) -> DemoReport:
    """Run ``policy`` (a :class:`vla_rl.evaluation.ChunkPolicy`: ``predict_chunks(obs, seed)``,
    ``spec``, ``chunk_len``) autonomously and write every frame to ``store``: controller ``policy``,
    the executed action also as the proposal, and ``revision`` (the checkpoint that acted).

    Receding horizon: each robot executes the first ``n_exec`` actions of a chunk (default H/2), then
    asks again. Episode seeds follow the vector env's sequence, so the same call writes the same frames.
    ``replayable``: every episode replays exactly from its seed (:class:`sim.base.EnvOptions`).
    ``latency``: act in the latency world instead (:mod:`sim.latency`; the frames hold what executed).
    """
    if episodes < 1:
        raise ValueError(f"episodes: expected >= 1, got {episodes}")
    spec = policy.spec
    env = VectorSimEnv(
        task,
        num_envs=min(num_envs, episodes),
        seed=seed,
        obs="rgb" if spec.cameras else "state",
        image_size=spec.cameras[0].height if spec.cameras else 128,
        max_episode_steps=max_episode_steps,
        replayable=replayable,
    )
    try:
        report = record_policy_episodes(
            store,
            env,
            policy,
            episodes,
            seed=seed,
            n_exec=n_exec,
            revision=revision,
            robot_prefix=robot_prefix,
            progress=progress,
            latency=latency,
        )
    finally:
        env.close()
    log.info(
        "recorded rollouts",
        extra={"task": report.task, "episodes": report.episodes, "success_rate": report.success_rate},
    )
    return report


def record_policy_episodes(
    store: EpisodeStore,
    env: VectorSimEnv,
    policy: Any,
    episodes: int,
    *,
    seed: int,
    n_exec: int | None = None,
    revision: str = "",
    robot_prefix: str = "sim",
    progress: bool = True,
    max_env_steps: int | None = None,
    latency: LatencyOptions | None = None,
) -> DemoReport:
    """:func:`record_rollouts` in an open ``env`` (kept open for the next call, e.g. by an online trainer):
    reset it to the seed sequence ``seed`` and record ``episodes`` autonomous episodes of ``policy``.

    ``max_env_steps``: stop once the simulators took this many steps (``num_envs`` per vector step); the
    episodes still running then are closed with outcome ``aborted`` and not counted. ``report.env_steps``
    counts every simulated step, also those of robots idling while the last episodes finish.
    ``latency``: the robots act in the latency world (:mod:`sim.latency`; ``n_exec`` unused), and each
    frame's action (and proposal) is the action the robot executed.
    """
    if episodes < 1:
        raise ValueError(f"episodes: expected >= 1, got {episodes}")
    if max_env_steps is not None and max_env_steps < 1:
        raise ValueError(f"max_env_steps: expected >= 1, got {max_env_steps}")
    n_exec = n_exec or max(1, policy.chunk_len // 2)
    t0 = time.perf_counter()
    report = DemoReport(task=env.task)
    bar = tqdm(total=episodes, desc=f"rollouts {env.task}", unit="ep", disable=not progress)
    started = min(env.num_envs, episodes)

    def open_writer(i: int) -> EpisodeWriter:
        w = store.create_episode(env.spec, robot_id=f"{robot_prefix}-{i}", task=env.task)
        w.begin_segment("autonomous", controller="policy", reason=f"policy rollout {revision}".strip())
        return w

    def write(step: StepRecord) -> None:
        nonlocal started
        fields = {"proposed_action": step.actions, "controller": "policy", "revision": revision}
        for i in report.write_step(writers, step, bar, **fields):
            if started < episodes:
                writers[i] = open_writer(i)
                started += 1
            else:
                writers[i] = None

    writers: list[EpisodeWriter | None] = [
        open_writer(i) if i < started else None for i in range(env.num_envs)
    ]
    try:
        proposer = SeededChunkProposer(policy.predict_chunks, seed)
        rollout = (
            ChunkRollout(env, proposer, n_exec, seed=seed, on_step=write)
            if latency is None
            else LatencyRollout(env, proposer, latency, seed=seed, on_step=write)
        )
        while report.episodes < episodes and (max_env_steps is None or report.env_steps < max_env_steps):
            rollout.step()
            report.env_steps += env.num_envs
    finally:
        for w in writers:
            if w is not None:
                w.close(outcome="aborted", success=False)
        bar.close()
    report.seconds = time.perf_counter() - t0
    return report
