"""PPO's rollouts: the critic, and the noise-injected policy acting in a vector simulator.

:class:`Sampler` draws noise-injected chunks and records each one's chain, log-prob and value
(:class:`Chunk`); :class:`Rollout` drives a :class:`sim.rollout.ChunkRollout` with it, shaping rewards
and finding what each chunk bootstraps from; :func:`collect_groups` replays the same initial states for
GRPO. :class:`ValueFn` binds the :class:`Critic` to its input.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from policies.flow_policy import Prefix
from policies.flow_rl import FlowVLAStochastic, StochasticFlowPolicy
from policies.flow_vla import SDESchedule
from sim.rollout import ChunkRecord, ChunkRollout
from vla_rl.train.ppo_config import PPOConfig
from vla_rl.train.ppo_math import chunk_discounts, group_advantages

Tensor = torch.Tensor

__all__ = ["Chunk", "Critic", "Rollout", "Sampler", "ValueFn", "collect_groups", "critic_input", "stack_obs"]


# ============================================================================ critic
class Critic(nn.Module):
    """V(o): an MLP on the normalised state or on the pooled prefix tokens; the last layer starts at 0."""

    def __init__(self, d_in: int, hidden: tuple[int, ...]) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for h in hidden:
            layers += [nn.Linear(d_in, h), nn.LayerNorm(h), nn.SiLU()]
            d_in = h
        out = nn.Linear(d_in, 1)
        nn.init.zeros_(out.weight)
        nn.init.zeros_(out.bias)
        self.net = nn.Sequential(*layers, out)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x).squeeze(-1)


def critic_input(cfg: PPOConfig, policy: StochasticFlowPolicy) -> str:
    """``cfg.critic`` with ``"auto"`` resolved: the state for our FlowVLA, the prefix features for a VLA
    whose state has no normaliser here (LeRobot's: RLinf's π0.5 value head after the VLM prefix)."""
    if cfg.critic != "auto":
        return cfg.critic
    return "state" if isinstance(policy, FlowVLAStochastic) else "prefix"


class ValueFn:
    """Binds the critic to its input: the normalised state, or the policy's (detached) prefix features
    (:meth:`~policies.flow_policy.FlowPolicy.features`: FlowVLA's mean trunk token, a LeRobot VLA's mean
    VLM output over the valid prefix tokens)."""

    def __init__(self, cfg: PPOConfig, policy: StochasticFlowPolicy) -> None:
        self.kind, self.detach, self.policy = critic_input(cfg, policy), cfg.critic_detach, policy
        if self.kind == "state" and not isinstance(policy, FlowVLAStochastic):
            raise ValueError(
                f"critic: 'state' reads FlowVLA's state normaliser; a {type(policy.policy).__name__}'s value "
                "head reads its VLM prefix: use 'prefix' (or 'auto')"
            )
        if self.kind == "state" and policy.state_dim == 0:
            raise ValueError("critic: 'state' needs a policy with a state input; use 'prefix'")
        d_in = policy.state_dim if self.kind == "state" else policy.feature_dim
        self.net = Critic(d_in, cfg.critic_hidden).to(policy.device)

    def __call__(self, obs: Mapping[str, Any], prefix: Prefix | None) -> Tensor:
        if self.kind == "state":
            state = torch.as_tensor(obs["state"], device=self.policy.device).float()
            return self.net(self.policy.normalize_state(state))
        if prefix is None:
            prefix = self.policy.encode_prefix(obs)
        features = self.policy.features(prefix)
        return self.net(features.detach() if self.detach else features)


# ============================================================================ rollout storage
@dataclass
class Chunk:
    """One MDP step of one robot: the observation, the stored chain, and what executing it earned."""

    obs: dict[str, Any]  # {"state": [S], "cameras": {name: [h, w, 3]}}
    iterates: np.ndarray  # [K + 1, H, D] in the model's normalised (padded) space
    stochastic: np.ndarray  # [K] bool
    logp: float
    value: float
    reward: float = 0.0
    steps: int = 0
    terminated: bool = False
    truncated: bool = False
    success: bool = False
    next_value: float | None = None
    potential: float = 0.0  # Φ(s) at the chunk's first observation ('dense' reward)


def _obs_row(obs: Mapping[str, Any], i: int) -> dict[str, Any]:
    return {
        "state": np.array(obs["state"][i]),
        "cameras": {k: np.array(v[i]) for k, v in obs["cameras"].items()},
    }


def stack_obs(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Stored rows as one observation batch (the policy wrapper adds the instruction)."""
    return {
        "state": np.stack([r["state"] for r in rows]),
        "cameras": {k: np.stack([r["cameras"][k] for r in rows]) for k in rows[0]["cameras"]},
    }


class Sampler:
    """Draws noise-injected chunks for a batch of observations and records what PPO needs."""

    def __init__(self, cfg: PPOConfig, policy: StochasticFlowPolicy, value_fn: ValueFn) -> None:
        self.cfg, self.policy, self.value_fn = cfg, policy, value_fn
        self.gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
        self.rng = np.random.default_rng([cfg.seed, 1])
        self.schedule = SDESchedule("flow_sde", cfg.noise_level) if cfg.method == "sde" else None

    @torch.no_grad()
    def act(self, rows: list[dict[str, Any]]) -> tuple[list[Chunk], np.ndarray]:
        """Chunks for ``rows`` and the executed actions in env units ``[B, n_exec, A]``."""
        p, k = self.policy, self.cfg.num_steps
        obs = stack_obs(rows)
        prefix = p.encode_prefix(obs)
        steps = None
        if self.cfg.method == "sde" and self.cfg.sde_steps == "one":
            # one SDE step per call, same index for the batch, never the last (RLinf's ignore_last)
            steps = [int(self.rng.integers(0, k - 1))]
        s = p.sample(
            prefix,
            method=self.cfg.method,
            num_steps=k,
            generator=self.gen,
            schedule=self.schedule,
            stochastic_steps=steps,
        )
        assert s.chain is not None and s.log_prob is not None
        values = self.value_fn(obs, prefix).cpu().numpy()
        # as the policy deploys (FlowVLA clips under min-max); the stored chain stays unclipped
        env_actions = p.to_env(s.actions[:, 0])[:, : p.n_exec].cpu().numpy()
        stoch = s.chain.stochastic
        stoch = stoch.expand(len(rows), 1, k) if stoch.ndim == 1 else stoch
        chunks = [
            Chunk(
                obs=row,
                iterates=s.chain.iterates[j, 0].cpu().numpy(),
                stochastic=stoch[j, 0].cpu().numpy().astype(bool),
                logp=float(s.log_prob[j, 0]),
                value=float(values[j]),
            )
            for j, row in enumerate(rows)
        ]
        return chunks, env_actions.astype(np.float32)

    @torch.no_grad()
    def values(self, rows: list[dict[str, Any]]) -> np.ndarray:
        return self.value_fn(stack_obs(rows), None).cpu().numpy()


class Rollout:
    """PPO's view of a :class:`sim.rollout.ChunkRollout`: each chunk's stored chain, value and shaped
    reward, and its bootstrap value; completed chunks accumulate per robot, in time order."""

    def __init__(self, cfg: PPOConfig, env: Any, sampler: Sampler, seed: int | None = None) -> None:
        self.cfg, self.sampler = cfg, sampler
        n = env.num_envs
        self.pending: list[Chunk | None] = [None] * n
        self.waiting: list[Chunk | None] = [None] * n  # completed, needs V(next obs) from the next chunk
        self.done: list[list[Chunk]] = [[] for _ in range(n)]
        self.episodes: list[bool] = []  # success of each episode finished in this iteration
        self.potential = np.zeros(n)  # Φ of each robot's current observation (last dense reward)
        self.rollout = ChunkRollout(
            env,
            self._propose,
            sampler.policy.n_exec,
            seed=cfg.env_seed if seed is None else seed,
            reward_key="sparse_reward",
            on_chunks=self._finish,
        )

    def _propose(self, robots: list[int], obs: Mapping[str, Any]) -> np.ndarray:
        chunks, actions = self.sampler.act([_obs_row(obs, j) for j in range(len(robots))])
        for j, i in enumerate(robots):
            if self.waiting[i] is not None:
                self.waiting[i].next_value = chunks[j].value
                self.waiting[i] = None
            chunks[j].potential = float(self.potential[i])
            self.pending[i] = chunks[j]
        return actions

    def _finish(self, records: list[ChunkRecord]) -> None:
        """Chunks that ended in one vector step: rewards (shaped), ends, and what to bootstrap from."""
        truncated: list[ChunkRecord] = []
        for rec in records:
            i = rec.robot
            c = self.pending[i]
            assert c is not None
            c.reward, c.steps = rec.reward, rec.steps
            if self.cfg.reward == "dense":
                phi_next = 0.0 if rec.terminated else float(rec.info["dense_reward"])
                g = float(chunk_discounts(np.array([c.steps]), self.cfg.gamma, self.cfg.discount)[0])
                c.reward += g * phi_next - c.potential
            self.potential[i] = 0.0 if rec.episode_ended else float(rec.info["dense_reward"])
            if rec.episode_ended:
                c.terminated, c.truncated = rec.terminated, rec.truncated
                c.success = bool(rec.info["success"])
                self.episodes.append(c.success)
                if c.truncated and not c.terminated:
                    truncated.append(rec)
                else:
                    c.next_value = 0.0
            else:
                self.waiting[i] = c
            self.done[i].append(c)
            self.pending[i] = None
        if truncated:  # bootstrap from the observation the time limit cut off
            vals = self.sampler.values([_final_obs_row(rec.final_obs) for rec in truncated])
            for rec, v in zip(truncated, vals, strict=True):
                self.done[rec.robot][-1].next_value = float(v)

    def collect(self, steps: int) -> int:
        """Run ``steps`` vector steps; returns env steps taken. Chunks in flight carry over."""
        taken = self.rollout.run(steps)
        self.rollout.refill()  # every completed chunk now knows V(next obs)
        return taken

    def take(self) -> tuple[list[list[Chunk]], list[bool]]:
        done, episodes = self.done, self.episodes
        self.done, self.episodes = [[] for _ in range(len(done))], []
        return done, episodes


def _final_obs_row(o: Mapping[str, Any]) -> dict[str, Any]:
    return {"state": np.asarray(o["state"]), "cameras": {k: np.asarray(v) for k, v in o["cameras"].items()}}


def collect_groups(
    cfg: PPOConfig, env: Any, sampler: Sampler, seed: int
) -> tuple[list[Chunk], np.ndarray, list[bool], int]:
    """GRPO rollouts: ``group_size`` rounds from the same initial states (``env.reset(seed)`` gives robot
    i seed ``seed + i`` every time); each round keeps each robot's first episode. Returns the chunks,
    their group-normalised advantages, the episodes' successes and the env steps spent (robots that
    finish early keep stepping until the slowest is done; those steps count but are not trained on)."""
    n = env.num_envs
    chunks: list[Chunk] = []
    chunk_group: list[tuple[int, int]] = []  # (robot, round) of each kept chunk
    successes = np.zeros((cfg.group_size, n))
    steps = 0
    for rnd in range(cfg.group_size):
        rollout = Rollout(cfg, env, sampler, seed=seed)
        first: list[list[Chunk] | None] = [None] * n
        while any(f is None for f in first):
            steps += rollout.collect(1)
            for i in range(n):
                if first[i] is None:
                    ends = [j for j, c in enumerate(rollout.done[i]) if c.terminated or c.truncated]
                    if ends:
                        first[i] = rollout.done[i][: ends[0] + 1]
        for i, episode in enumerate(first):
            assert episode is not None
            successes[rnd, i] = float(episode[-1].success)
            chunks += episode
            chunk_group += [(i, rnd)] * len(episode)
    # group = robot (its initial state); one return per (round, robot) episode
    adv_ep = group_advantages(successes.reshape(-1), np.tile(np.arange(n), cfg.group_size)).reshape(
        cfg.group_size, n
    )
    adv = np.array([adv_ep[rnd, i] for i, rnd in chunk_group])
    return chunks, adv, [bool(x) for x in successes.reshape(-1)], steps
