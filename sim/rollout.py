"""Receding-horizon chunk rollouts over a vector env: the one driver evaluation, RL and demos share.

A policy answers a robot's observation with a chunk of actions; the robot executes the first
``n_exec`` of them, then asks again (docs/architecture.md "Contracts"). :class:`ChunkRollout` keeps each robot's
queue and asks for all robots that ran dry in ONE batched ``propose(robots, obs)`` call. A chunk ends
when its queue is empty or when the robot's episode ends (terminated or truncated) inside it: the rest
of the chunk is dropped, and because the vector env resets a finished episode in the same ``step`` (see
:mod:`sim.vector`), the robot's next observation starts a new episode and asks for a new chunk at once.
So a chunk never straddles two episodes and starts at episode step ``0, n_exec, 2 n_exec, ...``.

Every step of robot ``i``'s chunk ``c`` adds to its :class:`ChunkRecord`: the executed action, the
reward ``r_k`` (the env's reward, or ``info[reward_key]``) and the discounted sum

    R_c = Σ_{k < steps} γ^k r_k          (γ = ``discount``; 1 = the plain sum)

and at the chunk's end what RL needs to bootstrap: ``terminated`` (no bootstrap), ``truncated``
(bootstrap from ``final_obs``, the observation the time limit cut off) or neither (``final_obs`` is
the next chunk's first observation). Episodes get an :class:`EpisodeRecord` with the same sum over the
whole episode. Seeds are the vector env's (``seed + i + j * num_envs`` for robot i's j-th episode), so
the same ``seed`` gives the same episodes.

Hooks, called at the end of each :meth:`ChunkRollout.step`, in this order, after the driver's own state
(``obs``, ``info``, ``seeds``) describes the observation the next step acts on:

1. ``on_step(StepRecord)``: the vector step (the observation it acted on, actions, rewards, flags, info);
2. ``on_chunks(list[ChunkRecord])``: the chunks that ended in this step, in robot order (if any);
3. ``on_episode(EpisodeRecord)``: once per episode that ended in this step, in robot order.

A chunk still running when the caller stops stepping stays in flight and completes in a later call.
The proposal itself (``propose``) is the "chunk ready" event: it is called with the robots that start a
chunk, before the step that executes its first action. Scripted experts that act every step are
``n_exec = 1`` with chunks of one action.

Imports numpy, the standard library and ``sim`` only: ``sim`` sits below ``vla_rl``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

__all__ = [
    "ChunkRecord",
    "ChunkRollout",
    "EpisodeRecord",
    "Proposer",
    "SeededChunkProposer",
    "StepRecord",
    "VectorEnv",
    "select_robots",
]

Obs = dict[str, Any]
"""A batched observation ``{"state": [N, S], "cameras": {name: [N, H, W, 3]}, "instruction": [str]*N}``
or one robot's row of it (the same keys, leading dim dropped)."""
Proposer = Callable[[list[int], Obs], np.ndarray]
"""``propose(robots, obs) -> chunks [len(robots), H, A]`` (env units), ``obs`` = those robots' rows."""


class VectorEnv(Protocol):
    """What the driver needs of :class:`sim.vector.VectorSimEnv` (tests use scripted fakes)."""

    num_envs: int

    def reset(self, seed: int | None = None) -> tuple[Obs, dict[str, Any]]: ...

    def step(self, actions: np.ndarray) -> tuple[Obs, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]: ...


def select_robots(batch: Any, robots: Sequence[int] | int) -> Any:
    """The rows ``robots`` (a list: a sub-batch) or row ``robots`` (an int) of a batched observation:
    arrays are indexed, lists picked from, dicts recursed into."""
    if isinstance(batch, Mapping):
        return {k: select_robots(v, robots) for k, v in batch.items()}
    if isinstance(batch, list):
        return batch[robots] if isinstance(robots, int) else [batch[i] for i in robots]
    return batch[robots]


def _info_row(info: Mapping[str, Any], i: int) -> dict[str, Any]:
    """Robot ``i``'s entries of a step's per-robot info arrays (success, sparse_reward, dense_reward,
    elapsed_steps, ...); ``episode_seed`` is left out (it describes the obs after the reset)."""
    return {k: v[i] for k, v in info.items() if isinstance(v, np.ndarray) and k != "episode_seed"}


@dataclass
class ChunkRecord:
    """One robot's chunk: where it started, what it executed and earned, and how it ended."""

    robot: int
    seed: int | None
    """The episode's seed (None when the env reports none)."""
    start_step: int
    """Episode step of the chunk's first action."""
    obs: Obs
    """The robot's observation the chunk was proposed for."""
    planned: np.ndarray
    """float32 [n_exec, A]: the actions queued (the proposal's first ``n_exec``)."""
    actions: list[np.ndarray] = field(default_factory=list)
    """The actions executed (a prefix of ``planned``)."""
    rewards: list[float] = field(default_factory=list)
    reward: float = 0.0
    """R = Σ_k γ^k r_k over the executed steps (γ = the rollout's ``discount``)."""
    terminated: bool = False
    truncated: bool = False
    final_obs: Obs | None = None
    """Set at the end: the terminal observation when the episode ended, else the next chunk's first."""
    info: dict[str, Any] = field(default_factory=dict)
    """The robot's info of the chunk's last step (success, dense_reward, ...)."""

    @property
    def steps(self) -> int:
        return len(self.rewards)

    @property
    def episode_ended(self) -> bool:
        return self.terminated or self.truncated


@dataclass(frozen=True)
class EpisodeRecord:
    """One robot's finished episode (its last chunk's end, summed over the whole episode)."""

    robot: int
    seed: int | None
    length: int
    """Steps the robot executed in the episode."""
    success: bool
    terminated: bool
    truncated: bool
    reward: float
    """Σ_t γ^t r_t over the episode (γ = the rollout's ``discount``)."""
    final_obs: Obs
    info: dict[str, Any]
    """The robot's info of the episode's last step."""
    latency: Any = None
    """What latency did to the episode: a :class:`sim.latency.LatencyStats` from
    :class:`sim.latency.LatencyRollout`, None without latency (not imported: sim.latency builds on this
    module)."""


@dataclass(frozen=True)
class StepRecord:
    """One vector step, batched: ``obs`` is what the actions were computed from, ``next_obs`` what the
    env returned (after the reset, for robots whose episode ended: the terminal ones are in
    ``info["final_obs"]``)."""

    obs: Obs
    actions: np.ndarray
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    info: dict[str, Any]
    next_obs: Obs
    seeds: tuple[int | None, ...] = ()
    """Each robot's episode seed for ``obs`` (the episode its action belongs to; None: unseeded env)."""


class ChunkRollout:
    """Steps ``env`` with chunks from ``propose``, ``n_exec`` actions each; see the module docstring.

    Resets ``env`` (with ``seed``; None keeps the env's seed sequence) on construction. ``reward_key``:
    None sums the reward ``env.step`` returns, else ``info[reward_key]`` (e.g. ``"dense_reward"``).
    """

    def __init__(
        self,
        env: VectorEnv,
        propose: Proposer,
        n_exec: int,
        *,
        seed: int | None = None,
        reward_key: str | None = None,
        discount: float = 1.0,
        on_step: Callable[[StepRecord], None] | None = None,
        on_chunks: Callable[[list[ChunkRecord]], None] | None = None,
        on_episode: Callable[[EpisodeRecord], None] | None = None,
    ) -> None:
        if n_exec < 1:
            raise ValueError(f"n_exec: expected >= 1, got {n_exec}")
        self.env, self.propose, self.n_exec = env, propose, n_exec
        self.reward_key, self.discount = reward_key, discount
        self.on_step, self.on_chunks, self.on_episode = on_step, on_chunks, on_episode
        n = env.num_envs
        self.queues: list[deque[np.ndarray]] = [deque() for _ in range(n)]
        self.chunks: list[ChunkRecord | None] = [None] * n
        """Each robot's chunk in flight (None: it asks for one at the next step)."""
        self.episode_steps = np.zeros(n, dtype=np.int64)
        self.episode_reward = np.zeros(n)
        self.obs, self.info = env.reset(seed=seed)
        self.seeds = self._seeds()

    def _seeds(self) -> list[int | None]:
        seeds = self.info.get("episode_seed")
        return [None] * self.env.num_envs if seeds is None else [int(s) for s in seeds]

    def refill(self) -> list[int]:
        """Ask for chunks for the robots whose queue ran dry (one batched call); returns those robots."""
        robots = [i for i, q in enumerate(self.queues) if not q]
        if not robots:
            return robots
        chunks = np.asarray(self.propose(robots, select_robots(self.obs, robots)))
        if chunks.ndim != 3 or chunks.shape[0] != len(robots) or chunks.shape[1] < self.n_exec:
            raise ValueError(
                f"propose: expected chunks [{len(robots)}, >= {self.n_exec}, A], got {list(chunks.shape)}"
            )
        for j, i in enumerate(robots):
            planned = chunks[j, : self.n_exec].astype(np.float32)
            self.queues[i].extend(planned)
            self.chunks[i] = ChunkRecord(
                robot=i,
                seed=self.seeds[i],
                start_step=int(self.episode_steps[i]),
                obs=select_robots(self.obs, i),
                planned=planned,
            )
        return robots

    def step(self) -> StepRecord:
        """Refill, execute one action per robot, cut chunks and episodes, call the hooks."""
        self.refill()
        actions = np.stack([q.popleft() for q in self.queues]).astype(np.float32)
        obs, seeds = self.obs, tuple(self.seeds)
        next_obs, reward, terminated, truncated, info = self.env.step(actions)
        rewards = reward if self.reward_key is None else info[self.reward_key]
        finished: list[ChunkRecord] = []
        episodes: list[EpisodeRecord] = []
        for i, chunk in enumerate(self.chunks):
            assert chunk is not None
            r = float(rewards[i])
            chunk.reward += self.discount**chunk.steps * r
            chunk.actions.append(actions[i])
            chunk.rewards.append(r)
            self.episode_reward[i] += self.discount ** int(self.episode_steps[i]) * r
            self.episode_steps[i] += 1
            ended = bool(terminated[i] or truncated[i])
            if not ended and self.queues[i]:
                continue
            chunk.terminated, chunk.truncated = bool(terminated[i]), bool(truncated[i])
            chunk.final_obs = info["final_obs"][i] if ended else select_robots(next_obs, i)
            chunk.info = _info_row(info, i)
            finished.append(chunk)
            self.chunks[i] = None
            if ended:
                self.queues[i].clear()
                episodes.append(self._end_episode(chunk))
        self.obs, self.info = next_obs, info
        self.seeds = self._seeds()
        record = StepRecord(obs, actions, reward, terminated, truncated, info, next_obs, seeds)
        if self.on_step is not None:
            self.on_step(record)
        if finished and self.on_chunks is not None:
            self.on_chunks(finished)
        if self.on_episode is not None:
            for ep in episodes:
                self.on_episode(ep)
        return record

    def _end_episode(self, last: ChunkRecord) -> EpisodeRecord:
        i = last.robot
        assert last.final_obs is not None
        ep = EpisodeRecord(
            robot=i,
            seed=last.seed,
            length=int(self.episode_steps[i]),
            success=bool(last.info.get("success", False)),
            terminated=last.terminated,
            truncated=last.truncated,
            reward=float(self.episode_reward[i]),
            final_obs=last.final_obs,
            info=last.info,
        )
        self.episode_steps[i] = 0
        self.episode_reward[i] = 0.0
        return ep

    def run(self, steps: int) -> int:
        """``steps`` vector steps; returns the env steps taken (``steps * num_envs``)."""
        for _ in range(steps):
            self.step()
        return steps * self.env.num_envs


class SeededChunkProposer:
    """A :data:`Proposer` from ``predict_chunks(obs, seed)`` (a :class:`vla_rl.evaluation.ChunkPolicy`'s):
    call ``k`` is seeded ``seed * 1000 + k``, so a rollout is reproducible."""

    def __init__(self, predict_chunks: Callable[[Obs, int], np.ndarray], seed: int) -> None:
        self.predict_chunks, self.seed = predict_chunks, seed
        self.calls = 0

    def __call__(self, robots: list[int], obs: Obs) -> np.ndarray:
        chunks = self.predict_chunks(obs, self.seed * 1000 + self.calls)
        self.calls += 1
        return chunks


class RTCChunkProposer(SeededChunkProposer):
    """:class:`SeededChunkProposer` with real-time chunking: within an episode, each robot's chunk is made to
    continue the unexecuted rest of its previous one (delay 0: the rollout waits for its chunks), through
    ``predict_chunks(obs, seed, rtc)`` with ``rtc`` one ``(delay, queued actions [n, A])`` or None per robot.
    ``rollout`` (set once it exists) says which robots are at an episode's first step (nothing to continue)."""

    def __init__(self, predict_chunks: Callable[..., np.ndarray], seed: int, n_exec: int) -> None:
        super().__init__(predict_chunks, seed)
        self.n_exec = n_exec
        self.rollout: ChunkRollout | None = None
        self._rest: dict[int, np.ndarray] = {}

    def __call__(self, robots: list[int], obs: Obs) -> np.ndarray:
        steps = self.rollout.episode_steps if self.rollout is not None else np.zeros(max(robots) + 1)
        rest = [self._rest.get(i) if steps[i] > 0 else None for i in robots]
        rtc = [None if r is None or not len(r) else (0, r) for r in rest]
        chunks = np.asarray(self.predict_chunks(obs, self.seed * 1000 + self.calls, rtc))
        self.calls += 1
        for j, i in enumerate(robots):
            self._rest[i] = chunks[j, self.n_exec :].astype(np.float32)
        return chunks
