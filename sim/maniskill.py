"""ManiSkill3 tabletop tasks (Panda arm, CPU physics) behind :class:`sim.base.SimEnv`.

Control mode is ``pd_ee_delta_pos``: actions are [dx, dy, dz] in [-1, 1] (x 0.1 m per step) plus a
gripper command (+1 open, -1 closed), which matches our common action layout exactly.
CPU physics (``physx_cpu``) allows one environment per process; :mod:`sim.vector` runs several
processes for a vector of robots.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from vla_rl_client.spec import CameraSpec, RobotSpec

from sim.base import ACTION_NAMES, EnvOptions, Observation, Privileged, SimEnv, TaskInfo


def _np(t: Any, dtype: type = np.float64) -> np.ndarray:
    """A numpy copy of a (CPU) tensor: ``.numpy()`` alone would alias simulator buffers that change."""
    return np.array(t.detach().cpu().numpy(), dtype=dtype)


def _quiet_maniskill() -> None:
    # SAPIEN warns about the missing CUDA device on every start; we choose the CPU renderer explicitly.
    os.environ.setdefault("SAPIEN_NO_DISPLAY", "1")
    import logging

    logging.getLogger("mani_skill").setLevel(logging.ERROR)


class ManiSkillEnv(SimEnv):
    def __init__(self, info: TaskInfo, options: EnvOptions) -> None:
        super().__init__(options)
        _quiet_maniskill()
        import gymnasium as gym
        import mani_skill.envs  # noqa: F401  (registers the environments)

        self.task = info.name
        self.max_episode_steps = options.max_episode_steps or info.max_episode_steps
        kwargs: dict[str, Any] = dict(
            obs_mode="state" if options.obs == "state" else "rgb",
            control_mode="pd_ee_delta_pos",
            sim_backend="physx_cpu",
            # No renderer at all when nothing is drawn (state observations, no render_size): the physics
            # is the same, the env starts faster (docs/sim.md), and no Vulkan driver is needed (a headless node).
            render_backend="cpu" if options.obs == "rgb" or options.render_size else "none",
            num_envs=1,
            reward_mode="normalized_dense",
            max_episode_steps=10**9,  # our SimEnv owns truncation
        )
        if options.obs == "rgb":
            kwargs["sensor_configs"] = dict(width=options.image_size, height=options.image_size)
        if options.render_size:
            kwargs["render_mode"] = "rgb_array"
            kwargs["human_render_camera_configs"] = dict(
                width=options.render_size, height=options.render_size
            )
        self._env = gym.make(info.backend_id, **kwargs)
        self._u = self._env.unwrapped
        self._camera_names = info.cameras if options.obs == "rgb" else ()
        self._obs: Any = None
        self._success = False
        self._dense = 0.0
        obs, _ = self._env.reset(seed=0)
        state_dim = int(self._flat_state(obs).shape[0])
        self.spec = RobotSpec(
            name=info.name,
            state_dim=state_dim,
            action_dim=info.action_dim,
            control_hz=info.control_hz,
            instruction=info.instruction,
            cameras=tuple(CameraSpec(n, options.image_size, options.image_size) for n in self._camera_names),
            action_names=ACTION_NAMES,
            extras={"backend": "maniskill", "obs": options.obs, "control_mode": "pd_ee_delta_pos"},
        )

    # ---------------------------------------------------------------- backend hooks
    def _reset_backend(self, seed: int | None) -> None:
        self._obs, info = self._env.reset(seed=seed)
        self._success = bool(info["success"][0])
        self._dense = 0.0

    def _step_backend(self, action: np.ndarray) -> None:
        obs, reward, _terminated, _truncated, info = self._env.step(action[None])
        self._obs = obs
        self._success = bool(info["success"][0])
        self._dense = float(reward[0])

    def _evaluate(self) -> tuple[bool, float]:
        return self._success, self._dense

    def _flat_state(self, obs: Any) -> np.ndarray:
        if self.options.obs == "state":
            return _np(obs[0], np.float32)
        # rgb mode: proprioception and the task extras ManiSkill exposes alongside images
        # (tcp pose; the goal position where the goal is invisible to the camera).
        parts = [v for group in ("agent", "extra") for v in obs[group].values()]
        return np.concatenate([_np(p[0].float().reshape(-1), np.float32) for p in parts])

    def _observe(self) -> Observation:
        cameras = {
            name: _np(self._obs["sensor_data"][name]["rgb"][0], np.uint8) for name in self._camera_names
        }
        return {
            "cameras": cameras,
            "state": self._flat_state(self._obs),
            "instruction": self.spec.instruction,
        }

    def render(self) -> np.ndarray:
        if not self.options.render_size:
            raise RuntimeError("render: build the env with render_size=... to enable rendering")
        return _np(self._env.render()[0], np.uint8)

    def privileged(self) -> Privileged:
        u = self._u
        if self.task.endswith("StackCube-v1"):
            obj, other = u.cubeA, u.cubeB
            goal = _np(other.pose.p[0]) + np.array([0.0, 0.0, 2 * float(u.cube_half_size[0])])
            extra = {"other_pos": _np(other.pose.p[0])}
        elif self.task.endswith("PickCube-v1"):
            obj, goal, extra = u.cube, _np(u.goal_site.pose.p[0]), {}
        else:  # PushCube
            obj, goal, extra = u.obj, _np(u.goal_region.pose.p[0]), {}
        qpos = _np(u.agent.robot.get_qpos()[0])
        half = u.cube_half_size if np.ndim(u.cube_half_size) == 0 else u.cube_half_size[0]
        return {
            "tcp_pos": _np(u.agent.tcp.pose.p[0]),
            "obj_pos": _np(obj.pose.p[0]),
            "goal_pos": np.asarray(goal, dtype=np.float64),
            "gripper_width": np.float64(qpos[-2:].sum()),
            "is_grasped": np.bool_(bool(u.agent.is_grasping(obj)[0])),
            "obj_half_size": np.float64(float(half)),
            **{k: np.asarray(v, dtype=np.float64) for k, v in extra.items()},
        }

    def clear_history(self, seed: int | None = None) -> None:
        # PhysX keeps state across resets: an episode replayed after others sometimes drifted, never after
        # a rebuild of the scene (docs/experiment-log.md, replaying simulated episodes)
        self._env.reset(seed=seed, options={"reconfigure": True})

    def close(self) -> None:
        self._env.close()
