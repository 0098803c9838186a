"""robosuite ``Lift`` (Panda) behind :class:`sim.base.SimEnv`.

robosuite's BASIC controller is OSC_POSE with a 7-d action (position x 0.05 m, rotation x 0.5 rad,
gripper -1 open / +1 close). We expose the common 4-d layout [dx, dy, dz, gripper(+1 open)]: rotation
is held at zero (Lift needs none) and the gripper sign is flipped, so the same policies and experts
work across simulators.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
from vla_rl_client.spec import CameraSpec, RobotSpec

from sim.base import ACTION_NAMES, EnvOptions, Observation, Privileged, SimEnv, TaskInfo

LIFT_HEIGHT = 0.04  # robosuite's own success threshold above the table


def _import_robosuite() -> Any:
    """``robosuite``, configured for a headless, quiet process.

    Rendering: EGL through Mesa works on CPU-only machines; a user's choice (e.g. osmesa) is respected.
    Logging: robosuite sets its logger to INFO when it is imported and then warns on every episode that
    the Panda has no "left"/"torso"/"head"/"base"/"legs" controller (and at import that no private macro
    file exists); only its errors reach our logs.
    """
    os.environ.setdefault("MUJOCO_GL", "egl")
    if os.environ["MUJOCO_GL"] == "osmesa":
        os.environ.setdefault("PYOPENGL_PLATFORM", "osmesa")
    logging.disable(logging.WARNING)  # the import-time warnings; restored right after
    try:
        import robosuite
    finally:
        logging.disable(logging.NOTSET)
    logging.getLogger("robosuite_logs").setLevel(logging.ERROR)
    return robosuite


class RobosuiteEnv(SimEnv):
    camera = "agentview"  # must match the TaskInfo cameras

    def __init__(self, info: TaskInfo, options: EnvOptions) -> None:
        super().__init__(options)
        suite = _import_robosuite()
        from robosuite.controllers import load_composite_controller_config

        self.task = info.name
        self.max_episode_steps = options.max_episode_steps or info.max_episode_steps
        rgb = options.obs == "rgb"
        self._env = suite.make(
            info.backend_id,
            robots="Panda",
            controller_configs=load_composite_controller_config(controller="BASIC", robot="Panda"),
            use_camera_obs=rgb,
            camera_names=[self.camera] if rgb else None,
            camera_heights=options.image_size,
            camera_widths=options.image_size,
            has_renderer=False,
            has_offscreen_renderer=rgb or bool(options.render_size),
            reward_shaping=True,
            control_freq=int(info.control_hz),
            horizon=10**9,  # our SimEnv owns truncation
            ignore_done=True,
            hard_reset=False,  # else the MuJoCo model is reloaded every episode
            seed=0,
        )
        self._raw: dict[str, Any] = self._env.reset()
        self._dense = 0.0
        state_dim = int(self._flat_state().shape[0])
        self.spec = RobotSpec(
            name=info.name,
            state_dim=state_dim,
            action_dim=info.action_dim,
            control_hz=info.control_hz,
            instruction=info.instruction,
            cameras=(CameraSpec(self.camera, options.image_size, options.image_size),) if rgb else (),
            action_names=ACTION_NAMES,
            extras={"backend": "robosuite", "obs": options.obs, "controller": "OSC_POSE"},
        )

    def _reset_backend(self, seed: int | None) -> None:
        if seed is not None:
            # robosuite draws placements from its own RandomState: reseed it for a reproducible episode.
            self._env.rng = np.random.default_rng(seed)
            for sampler in self._placement_samplers():
                sampler.rng = self._env.rng
        self._raw = self._env.reset()
        self._dense = 0.0

    def _placement_samplers(self) -> list[Any]:
        root = getattr(self._env, "placement_initializer", None)
        if root is None:
            return []
        return [root, *getattr(root, "samplers", {}).values()]

    def _step_backend(self, action: np.ndarray) -> None:
        full = np.zeros(7, dtype=np.float64)
        full[:3] = action[:3]
        full[6] = -action[3]  # ours: +1 open; robosuite: +1 close
        self._raw, reward, _done, _info = self._env.step(full)
        self._dense = float(np.clip(reward / 2.25, 0.0, 1.0))  # Lift's shaped reward peaks at 2.25

    def _evaluate(self) -> tuple[bool, float]:
        return bool(self._env._check_success()), self._dense

    def _flat_state(self) -> np.ndarray:
        keys = ["robot0_proprio-state"] + (["object-state"] if self.options.obs == "state" else [])
        return np.concatenate([np.asarray(self._raw[k]).reshape(-1) for k in keys]).astype(np.float32)

    def _observe(self) -> Observation:
        cameras = {}
        if self.options.obs == "rgb":
            # robosuite renders OpenGL-style, bottom row first.
            cameras[self.camera] = np.ascontiguousarray(self._raw[f"{self.camera}_image"][::-1])
        return {"cameras": cameras, "state": self._flat_state(), "instruction": self.spec.instruction}

    def render(self) -> np.ndarray:
        if not self.options.render_size:
            raise RuntimeError("render: build the env with render_size=... to enable rendering")
        size = self.options.render_size
        return np.ascontiguousarray(
            self._env.sim.render(camera_name="frontview", width=size, height=size)[::-1]
        )

    def privileged(self) -> Privileged:
        # np.array copies: body_xpos rows are views into live MuJoCo memory.
        cube = np.array(self._env.sim.data.body_xpos[self._env.cube_body_id], dtype=np.float64)
        table_z = float(self._env.model.mujoco_arena.table_offset[2])
        grasped = bool(
            self._env._check_grasp(gripper=self._env.robots[0].gripper, object_geoms=self._env.cube)
        )
        qpos = np.asarray(self._raw["robot0_gripper_qpos"], dtype=np.float64)
        return {
            "tcp_pos": np.array(self._raw["robot0_eef_pos"], dtype=np.float64),
            "obj_pos": cube,
            "goal_pos": np.array([cube[0], cube[1], table_z + LIFT_HEIGHT + 0.06]),
            "gripper_width": np.float64(abs(qpos[0]) + abs(qpos[1])),
            "is_grasped": np.bool_(grasped),
            "obj_half_size": np.float64(0.02),
        }

    def close(self) -> None:
        self._env.close()
