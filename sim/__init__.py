"""Simulated robots behind one interface: ManiSkill3 cube tasks and robosuite Lift.

    import sim
    env = sim.make("maniskill/PickCube-v1", obs="rgb", image_size=128, num_envs=2, seed=0)
    obs, info = env.reset()
    expert = sim.make_expert("maniskill/PickCube-v1", noise=0.3, seed=0)

``sim.make`` returns a :class:`~sim.vector.VectorSimEnv` (batched, auto-resetting); use
:func:`sim.make_env` for a single unbatched :class:`~sim.base.SimEnv`.
"""

from __future__ import annotations

from sim.base import ACTION_NAMES, GRIPPER_CLOSED, GRIPPER_OPEN, OBS_MODES, EnvOptions, SimEnv, TaskInfo
from sim.experts import ScriptedExpert, make_expert
from sim.registry import TASKS, list_tasks, make_env, resolve_task
from sim.vector import VectorSimEnv


def make(task: str, num_envs: int = 1, seed: int = 0, **kwargs: object) -> VectorSimEnv:
    """A vector of ``num_envs`` robots for ``task``; kwargs: obs, image_size, max_episode_steps, reward."""
    return VectorSimEnv(task, num_envs=num_envs, seed=seed, **kwargs)  # type: ignore[arg-type]


__all__ = [
    "ACTION_NAMES",
    "GRIPPER_CLOSED",
    "GRIPPER_OPEN",
    "OBS_MODES",
    "TASKS",
    "EnvOptions",
    "ScriptedExpert",
    "SimEnv",
    "TaskInfo",
    "VectorSimEnv",
    "list_tasks",
    "make",
    "make_env",
    "make_expert",
    "resolve_task",
]
