"""The one interface every simulated robot follows.

A :class:`SimEnv` is a single robot in a single simulator process. Its observations follow the robot
spec (``vla_rl_client.spec``): ``{"cameras": {name: uint8[H, W, 3]}, "state": float32[S], "instruction": str}``;
its actions are float32 in [-1, 1] (end-effector delta position x/y/z and a gripper command where
+1 opens and -1 closes, for every task, so policies and experts carry across simulators).

``step`` returns ``(obs, reward, terminated, truncated, info)`` with ``info`` holding

* ``success`` (bool), ``sparse_reward`` (1.0 on success, else 0.0), ``dense_reward`` (task shaping, in [0, 1]),
* ``privileged``: simulator ground truth (object and goal positions, ...) that scripted experts and
  the simulated operator use. Policies never see it unless they are given ``obs="state"``.

An episode terminates on success and is truncated at ``max_episode_steps``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np
from vla_rl_client.spec import RobotSpec

ObsMode = Literal["state", "rgb"]
RewardMode = Literal["sparse", "dense"]
Observation = dict[str, Any]
Privileged = dict[str, np.ndarray]

OBS_MODES: tuple[str, ...] = get_args(ObsMode)
REWARD_MODES: tuple[str, ...] = get_args(RewardMode)

# One action layout for every task: [dx, dy, dz, gripper], each in [-1, 1].
ACTION_NAMES = ("ee_dx", "ee_dy", "ee_dz", "gripper")
GRIPPER_OPEN = 1.0
GRIPPER_CLOSED = -1.0


@dataclass(frozen=True)
class GoalLayout:
    """Where a goal-conditioned task's ``state`` observation holds its goal, so a trainer can relabel a
    failed episode in hindsight (:mod:`vla_rl.train.hindsight`): the place the episode did bring the
    object (or gripper) to becomes the goal it reached. Indices are into the state vector; positions are
    3 values (metres, world frame).

    A frame ``t`` counts as "reached" when the state after it, ``s[t + 1]``, has ``s[held] > 0.5`` (the
    object is grasped, or the gripper is closed) and, with ``still``, ``max |s[still]| <= still_below``
    (the arm is at rest, as the simulator's own success test asks)."""

    goal: int
    """``s[goal:goal + 3]``: the goal position."""
    achieved: int
    """``s[achieved:achieved + 3]``: the position that must reach the goal (the object, or the gripper)."""
    to_goal: tuple[int, ...] = ()
    """Each ``s[i:i + 3] = goal - achieved`` the state also carries (recomputed on relabelling)."""
    held: int | None = None
    """``s[held] > 0.5`` where a reached frame must have the object in hand (None: no such test)."""
    still: tuple[int, int] | None = None
    """``(a, b)``: joint velocities ``s[a:b]`` a reached frame must have at rest (None: no such test)."""
    still_below: float = 0.2
    """At rest: every ``|s[a:b]|`` at most this (ManiSkill's ``is_static(0.2)``, rad/s)."""


@dataclass(frozen=True)
class TaskInfo:
    """One simulated task (the table is ``sim.registry.TASKS``); every backend's env is built from one."""

    name: str  # our id, "<backend>/<task>"
    backend: str  # "maniskill" | "robosuite" | "kinematic"
    backend_id: str  # the simulator's own env name
    instruction: str
    max_episode_steps: int  # default episode length at 20 Hz
    cameras: tuple[str, ...]  # cameras in rgb mode
    state_dim: dict[str, int]  # obs mode -> state vector size (a test checks these against the sims)
    action_dim: int = 4  # [dx, dy, dz, gripper] for every task
    control_hz: float = 20.0
    goal_layout: GoalLayout | None = None  # the goal in the obs="state" vector (hindsight relabelling)


@dataclass(frozen=True)
class EnvOptions:
    """Construction options shared by every backend (validated here, once)."""

    obs: ObsMode = "state"
    image_size: int = 128
    max_episode_steps: int | None = None
    reward: RewardMode = "dense"
    render_size: int | None = None  # enable SimEnv.render() at this square size (for videos)
    replayable: bool = False
    """Clear the simulator's history at every reset (:meth:`SimEnv.clear_history`), so each recorded
    episode replays exactly from its seed and actions (:mod:`sim.replay`: privileged training inputs for
    camera policies). ManiSkill rebuilds its scene, a slower reset. Off, PhysX carries state across
    resets and some episodes replay off (both measured: docs/experiment-log.md, replaying simulated
    episodes)."""

    def __post_init__(self) -> None:
        if self.obs not in OBS_MODES:
            raise ValueError(f"obs: expected one of {list(OBS_MODES)}, got {self.obs!r}")
        if self.reward not in REWARD_MODES:
            raise ValueError(f"reward: expected one of {list(REWARD_MODES)}, got {self.reward!r}")
        if not 16 <= self.image_size <= 512:
            raise ValueError(f"image_size: expected 16..512 pixels, got {self.image_size}")
        if self.render_size is not None and not 16 <= self.render_size <= 1024:
            raise ValueError(f"render_size: expected 16..1024 pixels, got {self.render_size}")
        if self.max_episode_steps is not None and self.max_episode_steps <= 0:
            raise ValueError(f"max_episode_steps: expected a positive integer, got {self.max_episode_steps}")


class SimEnv(abc.ABC):
    """One simulated robot. Subclasses implement the backend hooks; the episode logic lives here."""

    task: str
    spec: RobotSpec
    max_episode_steps: int

    def __init__(self, options: EnvOptions) -> None:
        self.options = options
        self._elapsed = 0

    # ---------------------------------------------------------------- backend hooks
    @abc.abstractmethod
    def _reset_backend(self, seed: int | None) -> None: ...

    @abc.abstractmethod
    def _step_backend(self, action: np.ndarray) -> None: ...

    @abc.abstractmethod
    def _observe(self) -> Observation: ...

    @abc.abstractmethod
    def _evaluate(self) -> tuple[bool, float]:
        """(success, dense reward in [0, 1]) for the current simulator state."""

    @abc.abstractmethod
    def privileged(self) -> Privileged:
        """Ground-truth state for scripted experts (positions in metres, world frame)."""

    def render(self) -> np.ndarray:
        """A third-person uint8 [H, W, 3] view for videos (needs ``render_size``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot render")

    def clear_history(self, seed: int | None = None) -> None:  # noqa: B027 - optional hook
        """Forget what earlier episodes left in the simulator, so the next reset behaves as a new
        simulator's would: what an exact replay needs (:mod:`sim.replay`). Default: nothing to forget."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass

    # ---------------------------------------------------------------- episode logic
    def reset(self, seed: int | None = None) -> tuple[Observation, dict[str, Any]]:
        if self.options.replayable:
            self.clear_history(seed)
        self._reset_backend(seed)
        self._elapsed = 0
        success, dense = self._evaluate()
        return self._observe(), self._info(success, dense)

    def step(self, action: np.ndarray) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        action = np.asarray(action, dtype=np.float32)
        if action.shape != (self.spec.action_dim,):
            raise ValueError(f"action: expected shape [{self.spec.action_dim}], got {list(action.shape)}")
        if not np.isfinite(action).all():
            raise ValueError("action: expected finite values, got NaN or inf")
        self._step_backend(np.clip(action, -1.0, 1.0))
        self._elapsed += 1
        success, dense = self._evaluate()
        info = self._info(success, dense)
        reward = info["dense_reward"] if self.options.reward == "dense" else info["sparse_reward"]
        truncated = (not success) and self._elapsed >= self.max_episode_steps
        return self._observe(), float(reward), bool(success), bool(truncated), info

    def _info(self, success: bool, dense: float) -> dict[str, Any]:
        return {
            "success": bool(success),
            "sparse_reward": 1.0 if success else 0.0,
            "dense_reward": float(dense),
            "elapsed_steps": self._elapsed,
            "privileged": self.privileged(),
        }

    @property
    def elapsed_steps(self) -> int:
        return self._elapsed

    def __enter__(self) -> SimEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
