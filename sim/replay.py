"""Replay a recorded simulated episode: its reset seed and its actions determine it.

A simulated episode in the store keeps its reset seed (``EpisodeMeta.episode_seed``, written by the
recorders of :mod:`sim.demos`). Resetting a simulator of the same task to that seed and stepping the
recorded actions reproduces the episode exactly, in *any* observation mode: a camera episode replayed in
a ``state`` simulator yields the simulator's full state vector (object poses, goal, ...) for every
frame, which a camera policy's own state (proprioception and the task extras) is a prefix of. That is
what a trainer needs for privileged information during training only (an asymmetric value, hindsight
goals for camera policies), without storing it.

Each replay starts from a cleared simulator (:meth:`sim.base.SimEnv.clear_history`: ManiSkill rebuilds
its scene), since PhysX keeps state across resets that made some replays drift when one simulator
replayed episodes back to back (docs/experiment-log.md, replaying simulated episodes). The recordings can carry such state from their
own simulator's earlier episodes too, which no replay reproduces, unless they were recorded
``replayable`` (:class:`sim.base.EnvOptions`: the recording simulator clears it at every reset as well).
So replays are checked: the recorded state must equal the replayed one's leading columns
at every frame (within ``atol``), else the replay has diverged (that history, another simulator
version, a machine whose physics rounds differently, frames the store dropped) and
:func:`replay_episode` says so rather than return another episode's states. Frame 0 is not compared: at a reset ManiSkill reports the contact-derived
extras (PickCube's ``is_grasped``) of the previous episode's last physics step, so they depend on what
the simulator did before; the returned states keep the recorded columns, frame 0 included.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from fleet.store import Episode
    from sim.base import SimEnv

__all__ = ["replay_episode", "replay_states"]


def replay_states(env: SimEnv, episode_seed: int, actions: np.ndarray) -> np.ndarray:
    """float32 [T, S]: ``env``'s state observation before each of the ``T`` actions, from a reset to
    ``episode_seed`` (the last action is not stepped: nothing is observed after it)."""
    actions = np.asarray(actions, dtype=np.float32)
    if actions.ndim != 2 or actions.shape[1] != env.spec.action_dim:
        raise ValueError(f"actions: expected [T, {env.spec.action_dim}], got {list(actions.shape)}")
    # what earlier episodes left in the simulator must not steer this one
    if not env.options.replayable:  # (a replayable env clears it at every reset)
        env.clear_history(int(episode_seed))
    obs, _ = env.reset(seed=int(episode_seed))
    states = [np.asarray(obs["state"], dtype=np.float32)]
    for a in actions[:-1]:
        obs, _, terminated, truncated, _ = env.step(a)
        states.append(np.asarray(obs["state"], dtype=np.float32))
        if (terminated or truncated) and len(states) < len(actions):
            raise ValueError(
                f"replay: the episode ended after {len(states) - 1} of {len(actions)} actions (seed "
                f"{episode_seed}); the recorded actions are not this seed's episode"
            )
    return np.stack(states)[: len(actions)]


def replay_episode(env: SimEnv, episode: Episode, atol: float = 1e-3) -> np.ndarray:
    """float32 [T, S]: the full ``state`` of ``env`` (a ``state``-mode simulator of the episode's task)
    before each of ``episode``'s frames, checked against the recorded state (its leading columns)."""
    meta = episode.meta
    if env.options.obs != "state":
        raise ValueError(f"replay: expected a state-mode simulator, got obs={env.options.obs!r}")
    if meta.task != env.task:
        raise ValueError(
            f"replay: episode {meta.episode_id} is of task {meta.task!r}, the simulator {env.task!r}"
        )
    if meta.episode_seed is None:
        raise ValueError(
            f"replay: episode {meta.episode_id} has no episode_seed (a real robot's, or recorded before the "
            "store kept seeds); only simulated episodes recorded by sim.demos can be replayed"
        )
    if not episode.length:
        return np.zeros((0, env.spec.state_dim), np.float32)
    states = replay_states(env, meta.episode_seed, episode.action)
    recorded = np.asarray(episode.state, dtype=np.float32)
    k = recorded.shape[1]
    if k > states.shape[1]:
        raise ValueError(
            f"replay: episode {meta.episode_id}'s state has {k} values, the simulator's {states.shape[1]}: "
            "not a prefix of it"
        )
    err = np.abs(states[:, :k] - recorded).max(axis=1)
    err[0] = 0.0  # see the module docstring: a reset's contact-derived extras depend on the history
    bad = np.flatnonzero(~(err <= atol))
    if len(bad):
        t = int(bad[0])
        raise ValueError(
            f"replay: episode {meta.episode_id} diverged at frame {t} of {episode.length} (max |state "
            f"difference| {err[t]:.3g} > atol {atol:g}); it was recorded by another simulator build or machine"
        )
    states[:, :k] = recorded  # what the policy saw, frame 0 included
    return states
