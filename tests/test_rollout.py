"""The chunk rollout driver (sim/rollout.py), once and thoroughly, on a scripted vector env: chunk cuts at
termination / truncation, new episodes start new chunks, n_exec, discounting, chunks in flight across
calls, hook order and records, batched proposals, and deterministic reseeding (also on the real env)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from sim.rollout import ChunkRecord, ChunkRollout, EpisodeRecord, SeededChunkProposer, StepRecord
from sim.vector import VectorSimEnv


class ScriptedVectorEnv:
    """Robot i's episodes end at episode step ``ends[i]``: terminated (success) or truncated (time limit).

    Same-step auto-reset and seeds ``seed + i + j * num_envs`` as :class:`sim.vector.VectorSimEnv`.
    State = [robot, episode step, episode index]; the env reward of a step is ``robot + t / 10`` (t =
    episode step after it), ``info["dense_reward"]`` is ten times that.
    """

    def __init__(self, ends: list[tuple[int, str]], seed: int = 0) -> None:
        self.ends, self.num_envs, self.seed = ends, len(ends), seed
        self.t = np.zeros(self.num_envs, dtype=int)
        self.ep = np.zeros(self.num_envs, dtype=int)
        self.actions: list[np.ndarray] = []
        self.resets: list[int | None] = []

    def _row(self, i: int) -> dict[str, Any]:
        return {
            "state": np.array([i, self.t[i], self.ep[i]], np.float32),
            "cameras": {},
            "instruction": f"r{i}",
        }

    def _obs(self) -> dict[str, Any]:
        rows = [self._row(i) for i in range(self.num_envs)]
        return {
            "state": np.stack([r["state"] for r in rows]),
            "cameras": {},
            "instruction": [r["instruction"] for r in rows],
        }

    def _seeds(self) -> np.ndarray:
        return self.seed + np.arange(self.num_envs) + self.ep * self.num_envs

    def reset(self, seed: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        self.resets.append(seed)
        if seed is not None:
            self.seed = seed
        self.t[:], self.ep[:] = 0, 0
        return self._obs(), {"episode_seed": self._seeds()}

    def step(self, actions: np.ndarray) -> tuple[Any, ...]:
        assert actions.shape == (self.num_envs, 1) and actions.dtype == np.float32
        self.actions.append(actions.copy())
        self.t += 1
        at_end = np.array([self.t[i] == end for i, (end, _) in enumerate(self.ends)])
        terminated = at_end & np.array([kind == "terminated" for _, kind in self.ends])
        truncated = at_end & ~terminated
        reward = (np.arange(self.num_envs) + self.t / 10).astype(np.float32)
        info: dict[str, Any] = {
            "success": terminated.copy(),
            "dense_reward": 10 * reward,
            "elapsed_steps": self.t.copy(),
            "final_obs": {int(i): self._row(int(i)) for i in np.flatnonzero(at_end)},
        }
        for i in np.flatnonzero(at_end):
            self.t[i], self.ep[i] = 0, self.ep[i] + 1
        info["episode_seed"] = self._seeds()
        return self._obs(), reward, terminated, truncated, info


class Planner:
    """Chunk of robot i at observation [i, t, ep]: action k = 100 i + 10 t + k (shows whose, when, which)."""

    def __init__(self, horizon: int = 4) -> None:
        self.horizon = horizon
        self.calls: list[tuple[list[int], list[list[float]]]] = []

    def __call__(self, robots: list[int], obs: dict[str, Any]) -> np.ndarray:
        self.calls.append((robots, obs["state"].tolist()))
        assert obs["instruction"] == [f"r{i}" for i in robots]
        base = 100 * obs["state"][:, 0] + 10 * obs["state"][:, 1]
        return (base[:, None] + np.arange(self.horizon))[:, :, None]


def _rollout(env: ScriptedVectorEnv, n_exec: int, events: list[Any] | None = None, **kw: Any) -> ChunkRollout:
    log = events if events is not None else []
    return ChunkRollout(
        env,
        Planner(),
        n_exec,
        on_step=lambda s: log.append(("step", s)),
        on_chunks=lambda cs: log.append(("chunks", cs)),
        on_episode=lambda e: log.append(("episode", e)),
        **kw,
    )


def _chunks(events: list[Any]) -> dict[int, list[ChunkRecord]]:
    out: dict[int, list[ChunkRecord]] = {}
    for kind, payload in events:
        if kind == "chunks":
            for c in payload:
                out.setdefault(c.robot, []).append(c)
    return out


def test_chunks_are_cut_at_episode_ends_and_new_episodes_start_new_chunks() -> None:
    # robot 0 succeeds at episode step 4 (inside its 2nd 3-action chunk), robot 1 hits the limit at 5
    env = ScriptedVectorEnv([(4, "terminated"), (5, "truncated")], seed=10)
    events: list[Any] = []
    rollout = _rollout(env, n_exec=3, events=events, seed=10)
    assert rollout.run(10) == 20
    c0, c1 = _chunks(events)[0], _chunks(events)[1]
    # robot 0: 3 + 1 | 3 + 1 | (2 in flight); robot 1: 3 + 2 | 3 + 2
    assert [c.steps for c in c0] == [3, 1, 3, 1] and [c.steps for c in c1] == [3, 2, 3, 2]
    assert [c.start_step for c in c0] == [0, 3, 0, 3] and [c.start_step for c in c1] == [0, 3, 0, 3]
    assert [(c.terminated, c.truncated) for c in c0] == [(False, False), (True, False)] * 2
    assert [(c.terminated, c.truncated) for c in c1] == [(False, False), (False, True)] * 2
    assert [c.seed for c in c0] == [10, 10, 12, 12] and [c.seed for c in c1] == [11, 11, 13, 13]
    # each chunk starts from its own observation; the episode's next chunk starts from step 0
    assert [c.obs["state"].tolist() for c in c0] == [[0, 0, 0], [0, 3, 0], [0, 0, 1], [0, 3, 1]]
    # executed = the first n_exec of the proposal, cut at the episode's end
    assert c0[1].planned[:, 0].tolist() == [30, 31, 32] and [a[0] for a in c0[1].actions] == [30]
    assert [a[0] for a in c1[0].actions] == [100, 101, 102]
    # final obs: the terminal observation after an episode end, else the next chunk's first observation
    assert c0[1].final_obs is not None and c0[1].final_obs["state"].tolist() == [0, 4, 0]
    assert c1[1].final_obs is not None and c1[1].final_obs["state"].tolist() == [1, 5, 0]
    assert c0[0].final_obs is not None and c0[0].final_obs["state"].tolist() == c0[1].obs["state"].tolist()
    # env rewards (reward_key None), plain sum (discount 1), the last step's info
    assert c1[1].rewards == pytest.approx([1.4, 1.5]) and c1[1].reward == pytest.approx(2.9)
    assert c0[1].info["success"] and c0[1].info["elapsed_steps"] == 4 and "episode_seed" not in c0[1].info
    # the env saw exactly the queued actions, robot by robot
    assert [float(a[1, 0]) for a in env.actions[:5]] == [100, 101, 102, 130, 131]
    assert env.resets == [10]


def test_episode_records_and_the_seed_sequence() -> None:
    env = ScriptedVectorEnv([(4, "terminated"), (5, "truncated")])
    events: list[Any] = []
    _rollout(env, n_exec=3, events=events, seed=7).run(10)
    eps = [e for kind, e in events if kind == "episode"]
    assert [(e.robot, e.seed, e.length, e.success) for e in eps] == [
        (0, 7, 4, True),
        (1, 8, 5, False),
        (0, 9, 4, True),
        (1, 10, 5, False),
    ]
    assert [(e.terminated, e.truncated) for e in eps] == [(True, False), (False, True)] * 2
    assert eps[1].reward == pytest.approx(1.1 + 1.2 + 1.3 + 1.4 + 1.5)  # the whole episode, not a chunk
    assert eps[1].final_obs["state"].tolist() == [1, 5, 0] and eps[1].info["elapsed_steps"] == 5


def test_hooks_run_in_order_after_the_state_moved_on() -> None:
    env = ScriptedVectorEnv([(2, "terminated"), (3, "truncated")])
    events: list[Any] = []
    seen: list[tuple[str, list[int | None]]] = []
    rollout = _rollout(env, n_exec=2, events=events)
    rollout.on_episode = lambda e: seen.append(("episode", list(rollout.seeds)))
    rollout.run(3)
    kinds = [(k, [c.robot for c in p] if k == "chunks" else None) for k, p in events if k != "episode"]
    # step 1: nothing ends; step 2: robot 0's chunk (success) and robot 1's full chunk; step 3: robot 1's
    assert kinds == [("step", None), ("step", None), ("chunks", [0, 1]), ("step", None), ("chunks", [1])]
    # episode hooks see the next episode's seed already (robot 0 at step 2, robot 1 at step 3)
    assert seen == [("episode", [2, 1]), ("episode", [2, 3])]
    step = events[0][1]
    assert isinstance(step, StepRecord) and step.obs["state"][:, 1].tolist() == [0, 0]
    assert step.next_obs["state"][:, 1].tolist() == [1, 1] and step.actions[:, 0].tolist() == [0, 100]


def test_dry_robots_ask_together_and_a_chunk_in_flight_completes_next_call() -> None:
    env = ScriptedVectorEnv([(4, "terminated"), (9, "truncated")])
    events: list[Any] = []
    rollout = _rollout(env, n_exec=3, events=events)
    planner = rollout.propose
    assert isinstance(planner, Planner)
    rollout.run(2)
    assert planner.calls == [([0, 1], [[0, 0, 0], [1, 0, 0]])]  # one batched call, rows of those robots
    in_flight = rollout.chunks[1]
    assert in_flight is not None and in_flight.steps == 2 and _chunks(events) == {}
    rollout.run(2)
    assert _chunks(events)[1] == [in_flight] and in_flight.steps == 3  # the same record, completed
    assert planner.calls[1] == ([0, 1], [[0, 3, 0], [1, 3, 0]])
    assert rollout.refill() == [0]  # robot 0's episode just ended: it asks for its new episode at once
    assert planner.calls[2] == ([0], [[0, 0, 1]]) and rollout.refill() == []


def test_discount_applies_per_step_within_chunks_and_episodes() -> None:
    env = ScriptedVectorEnv([(3, "terminated")])
    events: list[Any] = []
    _rollout(env, n_exec=2, events=events, reward_key="dense_reward", discount=0.5).run(3)
    first, second = _chunks(events)[0]
    assert first.rewards == pytest.approx([1.0, 2.0]) and first.reward == pytest.approx(1.0 + 0.5 * 2.0)
    assert second.reward == pytest.approx(3.0)  # a chunk's sum starts at its own first step
    (ep,) = [e for k, e in events if k == "episode"]
    assert isinstance(ep, EpisodeRecord) and ep.reward == pytest.approx(1.0 + 0.5 * 2.0 + 0.25 * 3.0)


def test_one_action_chunks_ask_every_step() -> None:
    """Scripted experts: n_exec = 1 and chunks of one action; every robot asks every step."""
    env = ScriptedVectorEnv([(2, "terminated"), (3, "truncated")])
    calls: list[list[int]] = []

    def expert(robots: list[int], obs: dict[str, Any]) -> np.ndarray:
        calls.append(robots)
        return obs["state"][:, 1:2, None] + 0.5

    events: list[Any] = []
    rollout = ChunkRollout(env, expert, 1, on_chunks=lambda cs: events.extend(cs))
    rollout.run(3)
    assert calls == [[0, 1]] * 3 and [a[:, 0].tolist() for a in env.actions] == [
        [0.5, 0.5],
        [1.5, 1.5],
        [0.5, 2.5],
    ]
    assert all(c.steps == 1 for c in events) and len(events) == 6


def test_same_seed_same_episodes() -> None:
    def run(seed: int) -> list[tuple[Any, ...]]:
        env = ScriptedVectorEnv([(4, "terminated"), (5, "truncated")])
        events: list[Any] = []
        _rollout(env, n_exec=3, events=events, seed=seed).run(8)
        return [
            (c.robot, c.seed, c.steps, c.reward, tuple(c.planned[:, 0]))
            for cs in _chunks(events).values()
            for c in cs
        ]

    assert run(3) == run(3) and run(3) != run(4)


def test_real_vector_env_reseeds_deterministically() -> None:
    """The kinematic task's envs step in this process by default (no physics to isolate)."""

    def episodes(seed: int) -> list[tuple[int, int | None, int, float]]:
        out: list[EpisodeRecord] = []
        with VectorSimEnv("kinematic/Reach-v0", num_envs=2, seed=0, max_episode_steps=5) as env:
            assert env.backend == "local"
            rng = np.random.default_rng(0)
            rollout = ChunkRollout(
                env,
                lambda robots, obs: rng.uniform(-1, 1, (len(robots), 4, env.spec.action_dim)),
                3,
                seed=seed,
                reward_key="dense_reward",
                on_episode=out.append,
            )
            rollout.run(11)
        return [(e.robot, e.seed, e.length, e.reward) for e in out]

    first = episodes(50)
    assert [(r, s, n) for r, s, n, _ in first] == [(0, 50, 5), (1, 51, 5), (0, 52, 5), (1, 53, 5)]
    assert episodes(50) == first


def test_seeded_proposer_seeds_each_call() -> None:
    seen: list[tuple[list[float], int]] = []

    def predict_chunks(obs: dict[str, Any], seed: int) -> np.ndarray:
        seen.append((obs["state"][:, 0].tolist(), seed))
        return np.asarray([[[s[0] * 100 + k] for k in range(4)] for s in obs["state"]], np.float32)

    env = ScriptedVectorEnv([(3, "terminated"), (9, "truncated"), (9, "truncated")])
    rollout = ChunkRollout(env, SeededChunkProposer(predict_chunks, seed=7), n_exec=2)
    rollout.run(5)
    # all start; all ran dry at step 3; robot 0's new episode at step 4; robots 1 and 2 at step 5
    assert [s for _, s in seen] == [7000, 7001, 7002, 7003]
    assert [rows for rows, _ in seen] == [[0, 1, 2], [0, 1, 2], [0], [1, 2]]


def test_bad_proposals_and_n_exec_are_refused() -> None:
    env = ScriptedVectorEnv([(3, "terminated")])
    with pytest.raises(ValueError, match="n_exec"):
        ChunkRollout(env, Planner(), 0)
    with pytest.raises(ValueError, match="propose"):
        ChunkRollout(env, Planner(horizon=2), 3).step()
