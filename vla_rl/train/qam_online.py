"""QAM's online phase: the fine policy acting in simulators, and the replay it feeds.

:class:`OnlineRollouts` drives a :class:`sim.vector.VectorSimEnv` with :class:`sim.rollout.ChunkRollout`
(each chunk's first ``n_exec`` actions, as deployed) and appends finished episodes to the replay;
:class:`NextActionCache` holds the TD target's next chunks for every replay frame (``next_action_cache``);
:func:`replay_indices` samples a batch from the offline and online parts; :class:`FineEvalView` evaluates
the fine policy while it trains.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from vla_rl_client.meta import Controller
from vla_rl_client.spec import RobotSpec

from policies.loading import LoadedPolicy
from sim.rollout import EpisodeRecord, StepRecord
from vla_rl.train.common import batch_to_policy_inputs, sample_indices
from vla_rl.train.qam_config import QAMConfig
from vla_rl.train.qam_math import QAMLearner
from vla_rl.train.transitions import TransitionBuffer

Tensor = torch.Tensor

__all__ = ["FineEvalView", "NextActionCache", "OnlineRollouts", "add_episode", "replay_indices"]


# ============================================================================ online rollouts
class OnlineRollouts:
    """Fine-policy episodes in a VectorSimEnv (:class:`sim.rollout.ChunkRollout`, ``n_exec`` actions per
    chunk), appended to the replay buffer and to ``episodes`` as they finish."""

    def __init__(
        self,
        learner: QAMLearner,
        spec: RobotSpec,
        cfg: QAMConfig,
        instruction_emb: Tensor | None,
        buffer: TransitionBuffer,
        episodes: list[dict[str, np.ndarray]],
    ) -> None:
        from sim.rollout import ChunkRollout
        from sim.vector import VectorSimEnv

        self.learner, self.cfg, self.spec = learner, cfg, spec
        self.buffer, self.episodes = buffer, episodes
        self.env = VectorSimEnv(
            spec.name,
            num_envs=cfg.num_envs,
            seed=cfg.online_seed,
            obs="rgb" if spec.cameras else "state",  # type: ignore[arg-type]
            image_size=spec.cameras[0].height if spec.cameras else 128,
            max_episode_steps=cfg.max_episode_steps,
            ray=cfg.ray,
        )
        self.instruction_emb = instruction_emb
        self.frames: list[dict[str, list[Any]]] = [self._empty() for _ in range(cfg.num_envs)]
        self.gen = torch.Generator().manual_seed(cfg.seed * 7919 + 17)
        self.successes: deque[bool] = deque(maxlen=20)
        self.rollout = ChunkRollout(
            self.env,
            self._propose,
            learner.n_exec,
            reward_key="dense_reward",
            on_step=self._record_step,
            on_episode=self._episode_ended,
        )

    @staticmethod
    def _empty() -> dict[str, list[Any]]:
        return {"state": [], "action": [], "reward": [], "terminated": [], "cameras": []}

    @torch.no_grad()
    def _propose(self, robots: list[int], obs: Mapping[str, Any]) -> np.ndarray:
        """Env-unit chunks ``[len(robots), H, A]`` from the fine policy (ODE, noise from ``self.gen``)."""
        lr, device = self.learner, self.learner.base.device
        inputs: dict[str, Any] = {
            "state": torch.as_tensor(obs["state"], device=device),
            "cameras": {k: torch.as_tensor(v, device=device) for k, v in obs["cameras"].items()},
        }
        if self.instruction_emb is not None:
            inputs["instruction_embedding"] = self.instruction_emb.expand(len(robots), -1)
        if lr.reads_instruction_text:
            inputs["instruction"] = [self.spec.instruction] * len(robots)
        noise = torch.randn(len(robots), *lr.event, generator=self.gen).to(device)
        lr.fine.eval()
        chunks = lr.env_actions(lr.sample_fine(inputs, noise)).cpu().numpy()
        lr.fine.train()
        return chunks

    def _record_step(self, step: StepRecord) -> None:
        for i, f in enumerate(self.frames):
            f["state"].append(step.obs["state"][i])
            f["action"].append(step.actions[i])
            if self.spec.cameras:
                f["cameras"].append({k: v[i] for k, v in step.obs["cameras"].items()})
            f["reward"].append(float(step.info["dense_reward"][i]))
            f["terminated"].append(bool(step.terminated[i]))

    def _episode_ended(self, end: EpisodeRecord) -> None:
        f = self.frames[end.robot]
        ep = {
            "state": np.stack(f["state"]).astype(np.float32),
            "action": np.stack(f["action"]).astype(np.float32),
            "reward": np.asarray(f["reward"], np.float32),
            "terminated": np.asarray(f["terminated"], bool),
            "controller": np.full(len(f["state"]), int(Controller.POLICY), np.int64),
            "success": np.asarray(end.success),
        }
        for name in self.spec.camera_names if f["cameras"] else ():
            ep[f"camera.{name}"] = np.stack([c[name] for c in f["cameras"]])
        add_episode(self.buffer, ep)
        self.episodes.append(ep)
        self.successes.append(end.success)
        self.frames[end.robot] = self._empty()

    def step(self) -> None:
        """One vector step of every robot."""
        self.rollout.step()

    def close(self) -> None:
        self.env.close()


class NextActionCache:
    """The fine policy's chunk at every replay frame, for the TD target (``next_action_cache``).

    The table is re-sampled on a fixed grid of updates (``step // refresh``); frames appended since are
    sampled when they are first looked up. A resumed run re-samples at its resume step (not saved).
    """

    def __init__(
        self,
        learner: QAMLearner,
        buffer: TransitionBuffer,
        cfg: QAMConfig,
        instructions: Tensor | None,
        device: torch.device,
    ) -> None:
        self.learner, self.buffer, self.device = learner, buffer, device
        self.refresh, self.seed = cfg.next_action_cache, cfg.seed
        self.instructions = instructions  # embeddings of buffer.instructions (each row its own)
        self.table: Tensor | None = None
        self.epoch = -1

    def lookup(self, rows: Tensor, step: int) -> Tensor:
        """Normalised, clipped chunks ``[B, H, A]`` at buffer ``rows``."""
        n = len(self.buffer)
        if self.table is None or step // self.refresh != self.epoch:
            self.epoch = step // self.refresh
            self.table = self._sample(0, n)
        elif len(self.table) < n:
            self.table = torch.cat([self.table, self._sample(len(self.table), n)])
        return self.table[rows.to(self.table.device)]

    @torch.no_grad()
    def _sample(self, lo: int, hi: int, chunk: int = 1024) -> Tensor:
        lr = self.learner
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch * 7919 + lo)
        parts = []
        for start in range(lo, hi, chunk):
            rows = np.arange(start, min(start + chunk, hi))
            obs = batch_to_policy_inputs(
                self.buffer.batch(rows, lr.horizon, lr.n_exec), self.device, self.instructions
            )
            noise = torch.randn(len(rows), lr.horizon, lr.action_dim, generator=gen).to(self.device)
            parts.append(lr.sample_fine(obs, noise))
        return torch.cat(parts)  # lookup only samples non-empty ranges


def replay_indices(n: int, offline_frames: int, cfg: QAMConfig, step: int) -> np.ndarray:
    """Batch indices into a replay whose first ``offline_frames`` frames are the offline data: uniform,
    or ``cfg.offline_fraction`` of them from the offline part once online frames exist."""
    if cfg.offline_fraction is None or n <= offline_frames or offline_frames == 0:
        return sample_indices(n, cfg.batch_size, cfg.seed, step)
    rng = np.random.default_rng([cfg.seed, step])
    k = round(cfg.offline_fraction * cfg.batch_size)
    return np.concatenate(
        [rng.integers(0, offline_frames, size=k), rng.integers(offline_frames, n, size=cfg.batch_size - k)]
    )


def add_episode(buffer: TransitionBuffer, ep: Mapping[str, np.ndarray]) -> None:
    cams = {k[len("camera.") :]: v for k, v in ep.items() if k.startswith("camera.")}
    buffer.add_episode(
        state=ep["state"],
        action=ep["action"],
        reward=ep["reward"],
        terminated=ep["terminated"],
        controller=ep["controller"],
        success=bool(ep["success"]),
        cameras=cams or None,
    )


class FineEvalView:
    """The fine policy as a ChunkPolicy for :func:`vla_rl.evaluation.evaluate` (K = flow_steps)."""

    def __init__(self, learner: QAMLearner, loaded: LoadedPolicy) -> None:
        self._lp = LoadedPolicy(
            policy=learner.fine, info=loaded.info, path=loaded.path, commit="training", ref=loaded.ref
        )
        self._lp.num_steps = learner.cfg.flow_steps
        self.spec, self.chunk_len, self.n_exec = loaded.spec, learner.horizon, learner.n_exec

    def predict_chunks(self, obs: dict[str, Any], seed: int) -> np.ndarray:
        was = self._lp.policy.training
        self._lp.policy.eval()
        try:
            return self._lp.predict_chunks(obs, seed)
        finally:
            self._lp.policy.train(was)
