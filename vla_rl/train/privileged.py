"""Privileged value inputs: the simulator's full state, for training only (asymmetric actor-critic).

A camera policy sees images and proprioception; its value, fitted on the frozen trunk's features of
the same inputs, must infer from pixels where the object is. In simulation the trainer may give the
value what the policy never sees (Pinto et al. 2018, "Asymmetric Actor Critic for Image-Based Robot
Learning"; standard in sim RL): with ``value_input = "privileged"`` the advantage trainers
(:class:`vla_rl.train.awr.AdvantageConfig`) regress V on the simulator's ``state``-mode observation of
every frame (object and goal poses included), replayed from the episode's reset seed and actions
(:mod:`sim.replay`, checked against the recorded state), standardised over the buffer. The policy, and
what ships, are unchanged: V only weighs the training frames.

Only simulated episodes recorded with their seed can be replayed (a real robot's cannot: the trainer
says which episode and why). A hindsight copy (:mod:`vla_rl.train.hindsight`) reads its source
episode's frames; its weight is fixed, so what V says of it is not used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from vla_rl.train.hindsight import HINDSIGHT_PREFIX

if TYPE_CHECKING:
    from fleet.store import Episode
    from sim.base import SimEnv
    from vla_rl.train.transitions import TransitionBuffer

__all__ = ["ReplayedStates"]


class ReplayedStates:
    """The full simulator state of each buffered frame, by replaying its episode once (cached by id)
    in a ``state``-mode simulator of ``task`` (built on first use; :meth:`close` frees it and keeps the
    cache). ``episode(id)``: the stored episode of a buffer's episode id; ``uses``: the knobs that asked
    for the replay (:meth:`vla_rl.train.awr.AdvantageConfig.replay_uses`), named when one fails."""

    def __init__(
        self,
        task: str,
        episode: Callable[[str], Episode],
        atol: float = 1e-3,
        uses: Sequence[str] = ("value_input 'privileged'",),
    ) -> None:
        self.task, self.episode, self.atol, self.uses = task, episode, atol, list(uses)
        self._env: SimEnv | None = None
        self._states: dict[str, np.ndarray] = {}

    def states(self, episode_id: str) -> np.ndarray:
        """float32 [T, S]: the episode's replayed full state before each frame (cached)."""
        if episode_id not in self._states:
            from sim.registry import make_env
            from sim.replay import replay_episode

            if self._env is None:
                self._env = make_env(self.task, obs="state", replayable=True)
            try:
                self._states[episode_id] = replay_episode(self._env, self.episode(episode_id), atol=self.atol)
            except ValueError as e:
                knobs = " and ".join(self.uses) or "replaying episodes"
                raise ValueError(
                    f"{knobs}: {e} (these need each episode's simulator state; or turn them off: "
                    "value_input 'policy', hindsight_weight 0)"
                ) from None
        return self._states[episode_id]

    def forget(self, keep: set[str]) -> None:
        """Drop the cached replays of episodes not in ``keep`` (an online trainer's buffer moved on)."""
        for eid in set(self._states) - keep:
            del self._states[eid]

    def features(self, buf: TransitionBuffer) -> np.ndarray:
        """float32 [N, S]: the replayed state of each of ``buf``'s rows, standardised over the rows
        (hindsight copies read their source episode's)."""
        ep_idx, frame = buf.array("episode"), buf.array("frame")
        out: np.ndarray | None = None
        for k, eid in enumerate(buf.episode_ids):
            rows = np.flatnonzero(ep_idx == k)
            if not len(rows):
                continue
            states = self.states(eid.removeprefix(HINDSIGHT_PREFIX))
            if out is None:
                out = np.zeros((len(buf), states.shape[1]), np.float32)
            out[rows] = states[frame[rows]]
        if out is None:
            raise ValueError("value_input 'privileged': the buffer holds no frames")
        mean, std = out.mean(axis=0), out.std(axis=0)
        return ((out - mean) / np.maximum(std, 1e-6)).astype(np.float32)

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None
