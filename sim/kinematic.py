"""A kinematic point-gripper task with no physics engine, for fast learning checks.

``kinematic/Reach-v0``: move the gripper to a goal point in the air and close it there. The gripper
moves exactly by the commanded delta (x 0.1 m per step, like ManiSkill's ``pd_ee_delta_pos``); the
episode succeeds on the first step the gripper is closed within ``TOLERANCE`` of the goal. It keeps
the common action layout ([dx, dy, dz, gripper]) and the :class:`sim.base.SimEnv` contract, so every
trainer, the evaluator, demos and the sim fleet run on it unchanged, thousands of steps per second.

Why it exists: ManiSkill on a CPU does tens of steps a second (docs/benchmarks.md), so a test that an RL algorithm *learns*
(not just that it runs) would take hours there. Here SFT from a few noisy demonstrations is
imprecise (it closes the gripper a little off target), and an algorithm that works must fix that in a
few thousand steps. It is a test bed, not a benchmark of manipulation skill.

Observations: state = [gripper xyz (3), goal xyz (3), gripper closed (1)]; in ``rgb`` mode one
top-down ``top_camera`` image (goal in red, gripper in blue, darker when lower) and a state of
[gripper xyz, gripper closed].
"""

from __future__ import annotations

import numpy as np
from vla_rl_client.spec import CameraSpec, RobotSpec

from sim.base import ACTION_NAMES, EnvOptions, Observation, Privileged, SimEnv, TaskInfo

ACTION_SCALE = 0.1
"""Metres per unit of action (ManiSkill's pd_ee_delta_pos scale)."""
TOLERANCE = 0.015
"""Success: gripper closed within this distance of the goal (metres)."""
WORKSPACE_LOW = np.array([-0.2, -0.2, 0.0])
WORKSPACE_HIGH = np.array([0.2, 0.2, 0.3])
GOAL_LOW = np.array([-0.15, -0.15, 0.05])
GOAL_HIGH = np.array([0.15, 0.15, 0.25])
START = np.array([0.0, 0.0, 0.15])


class KinematicReachEnv(SimEnv):
    def __init__(self, info: TaskInfo, options: EnvOptions) -> None:
        super().__init__(options)
        self.task = info.name
        self.max_episode_steps = options.max_episode_steps or info.max_episode_steps
        self._rgb = options.obs == "rgb"
        size = options.image_size
        cameras = (CameraSpec(info.cameras[0], size, size),) if self._rgb else ()
        state_dim = info.state_dim[options.obs]
        self.spec = RobotSpec(
            name=info.name,
            state_dim=state_dim,
            action_dim=info.action_dim,
            cameras=cameras,
            control_hz=info.control_hz,
            instruction=info.instruction,
            action_names=ACTION_NAMES,
            extras={"backend": "kinematic", "obs": options.obs},
        )
        self._rng = np.random.default_rng()
        self._tcp = START.copy()
        self._goal = START.copy()
        self._closed = False

    def _reset_backend(self, seed: int | None) -> None:
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self._tcp = START + self._rng.uniform(-0.02, 0.02, size=3)
        self._goal = self._rng.uniform(GOAL_LOW, GOAL_HIGH)
        self._closed = False

    def _step_backend(self, action: np.ndarray) -> None:
        self._tcp = np.clip(
            self._tcp + ACTION_SCALE * action[:3].astype(np.float64), WORKSPACE_LOW, WORKSPACE_HIGH
        )
        self._closed = bool(action[3] < 0.0)

    def _distance(self) -> float:
        return float(np.linalg.norm(self._tcp - self._goal))

    def _evaluate(self) -> tuple[bool, float]:
        dist = self._distance()
        success = self._closed and dist < TOLERANCE
        # ManiSkill-style shaping in [0, 1]: reaching, plus a bonus for closing only when there.
        dense = 0.75 * (1.0 - np.tanh(10.0 * dist)) + (0.25 if success else 0.0)
        return success, float(dense)

    def _observe(self) -> Observation:
        closed = np.array([float(self._closed)])
        if not self._rgb:
            state = np.concatenate([self._tcp, self._goal, closed]).astype(np.float32)
            return {"cameras": {}, "state": state, "instruction": self.spec.instruction}
        return {
            "cameras": {self.spec.cameras[0].name: self._render_top(self.spec.cameras[0].height)},
            "state": np.concatenate([self._tcp, closed]).astype(np.float32),
            "instruction": self.spec.instruction,
        }

    def _render_top(self, size: int) -> np.ndarray:
        img = np.full((size, size, 3), 230, dtype=np.uint8)
        yy, xx = np.mgrid[0:size, 0:size]

        def disk(p: np.ndarray, radius: float, color: tuple[int, int, int]) -> None:
            u = (p[0] - WORKSPACE_LOW[0]) / (WORKSPACE_HIGH[0] - WORKSPACE_LOW[0]) * (size - 1)
            v = (p[1] - WORKSPACE_LOW[1]) / (WORKSPACE_HIGH[1] - WORKSPACE_LOW[1]) * (size - 1)
            shade = 0.4 + 0.6 * (p[2] - WORKSPACE_LOW[2]) / (WORKSPACE_HIGH[2] - WORKSPACE_LOW[2])
            mask = (xx - u) ** 2 + (yy - v) ** 2 <= (radius * size) ** 2
            img[mask] = (np.array(color) * shade).astype(np.uint8)

        disk(self._goal, 0.05, (220, 40, 40))
        disk(self._tcp, 0.035, (40, 40, 220) if not self._closed else (40, 180, 40))
        return img

    def privileged(self) -> Privileged:
        return {
            "tcp_pos": self._tcp.copy(),
            "goal_pos": self._goal.copy(),
            "gripper_closed": np.array(float(self._closed)),
        }

    def render(self) -> np.ndarray:
        if self.options.render_size is None:
            raise ValueError("render_size: build the env with render_size=... to render videos")
        return self._render_top(self.options.render_size)
