"""A vector of simulated robots, one process each (CPU physics allows one ManiSkill env per process).

Batched observations: ``{"cameras": {name: uint8[N, H, W, 3]}, "state": float32[N, S], "instruction": [str]*N}``.

Episodes reset automatically in the same ``step`` call that ends them (gymnasium's "same-step"
autoreset). For each step, ``info`` holds

* ``success``, ``sparse_reward``, ``dense_reward``, ``elapsed_steps``: about the step just taken
  (for an env that finished, its terminal step),
* ``final_obs``: ``{env_index: terminal observation}`` for the envs that finished,
* ``privileged`` and ``episode_seed``: about the returned ``obs`` (after the reset, for envs that
  finished), because that is what the next action is computed from.

Seeding: env ``i``'s ``j``-th episode uses seed ``seed + i + j * num_envs``, so a run is reproducible
and no two episodes share a seed. ``replayable=True`` clears each simulator's history at every reset
(:class:`sim.base.EnvOptions`), so every episode replays exactly from its seed (:mod:`sim.replay`).

Workers: ``num_envs > 1`` runs one worker process per env on this machine (except for the physics-free
``kinematic`` task, whose envs step in this process: a process each would only add IPC to a numpy step;
``processes=True`` forces workers); ``ray="auto"`` or a Ray
cluster address runs them as Ray actors instead (:mod:`sim.ray_workers`: same calls, same seeds, so the
same rollouts, and a dead actor is replaced and its episode re-run).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import traceback
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from vla_rl_client.spec import RobotSpec

from sim.base import Observation, ObsMode, RewardMode, SimEnv
from sim.ray_workers import RayWorkerOptions, RayWorkers, check_ray_address
from vla_rl.core.lifeline import exit_with_parent
from vla_rl.core.scheduling import leave_realtime


def _worker(conn: Connection, make_kwargs: dict[str, Any], parent_pid: int) -> None:
    leave_realtime("sim env worker")
    # the env's resources go with the process; nobody is left to report to
    exit_with_parent(parent_pid, where="sim env worker")
    import torch

    # One simulator per process already fills the cores; torch's own thread pool would only fight them.
    torch.set_num_threads(1)
    from sim.registry import make_env

    env: SimEnv | None = None
    try:
        env = make_env(**make_kwargs)
        conn.send(("ok", (env.spec.to_dict(), env.max_episode_steps)))
        while True:
            cmd, arg = conn.recv()
            if cmd == "reset":
                conn.send(("ok", env.reset(seed=arg)))
            elif cmd == "step":
                conn.send(("ok", env.step(arg)))
            elif cmd == "render":
                conn.send(("ok", env.render()))
            elif cmd == "close":
                conn.send(("ok", None))
                return
    except (EOFError, KeyboardInterrupt):
        return
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        if env is not None:
            env.close()


class _Remote:
    """A SimEnv living in a worker process."""

    def __init__(self, ctx: Any, index: int, make_kwargs: dict[str, Any]) -> None:
        self.index = index
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_worker, args=(child, make_kwargs, os.getpid()), daemon=True, name=f"sim-env-{index}"
        )
        self.proc.start()
        child.close()

    def call(self, cmd: str, arg: Any = None) -> Any:
        self.send(cmd, arg)
        return self.recv()

    def send(self, cmd: str, arg: Any = None) -> None:
        self.conn.send((cmd, arg))

    def recv(self) -> Any:
        try:
            status, payload = self.conn.recv()
        except EOFError:
            raise RuntimeError(
                f"sim env {self.index}: worker process died (exit code {self.proc.exitcode})"
            ) from None
        if status == "error":
            raise RuntimeError(f"sim env {self.index} failed:\n{payload}")
        return payload


class VectorSimEnv:
    """``num_envs`` robots of one task stepped together, in worker processes (or in-process)."""

    def __init__(
        self,
        task: str,
        num_envs: int = 1,
        seed: int = 0,
        obs: ObsMode = "state",
        image_size: int = 128,
        max_episode_steps: int | None = None,
        reward: RewardMode = "dense",
        processes: bool | None = None,
        render_size: int | None = None,
        ray: str | None = None,
        ray_options: RayWorkerOptions | None = None,
        replayable: bool = False,
    ) -> None:
        if num_envs < 1:
            raise ValueError(f"num_envs: expected >= 1, got {num_envs}")
        self.num_envs = num_envs
        self.seed = seed
        make_kwargs = dict(
            task=task,
            obs=obs,
            image_size=image_size,
            max_episode_steps=max_episode_steps,
            reward=reward,
            render_size=render_size,
            replayable=replayable,
        )
        self._episode_count = np.zeros(num_envs, dtype=np.int64)
        self._local: list[SimEnv] = []
        self._remotes: list[_Remote] = []
        self._ray: RayWorkers | None = None
        if processes is None:  # physics wants a process per env; the kinematic task is numpy microseconds
            from sim.registry import resolve_task

            processes = num_envs > 1 and resolve_task(task).backend != "kinematic"
        use_processes = processes
        ray = check_ray_address(ray)
        if ray is not None:
            self._ray = RayWorkers(make_kwargs, num_envs, ray, ray_options)
            self.max_episode_steps = self._ray.max_episode_steps
            self.spec = RobotSpec.from_dict(self._ray.spec_dict)
        elif use_processes:
            ctx = mp.get_context("spawn")  # fork would copy the parent's simulator and torch state
            self._remotes = [_Remote(ctx, i, make_kwargs) for i in range(num_envs)]
            hellos = [r.recv() for r in self._remotes]  # every worker reports once it has built its env
            spec_dict, self.max_episode_steps = hellos[0]
            self.spec = RobotSpec.from_dict(spec_dict)
        else:
            from sim.registry import make_env

            self._local = [make_env(**make_kwargs) for _ in range(num_envs)]  # type: ignore[arg-type]
            self.spec = self._local[0].spec
            self.max_episode_steps = self._local[0].max_episode_steps
        self.task = self.spec.name

    # ---------------------------------------------------------------- helpers
    def _episode_seed(self, i: int) -> int:
        return int(self.seed + i + self._episode_count[i] * self.num_envs)

    @property
    def backend(self) -> str:
        """Where the envs run: ``ray``, ``processes`` or ``local`` (this process)."""
        return "ray" if self._ray else "processes" if self._remotes else "local"

    @property
    def replaced(self) -> list[int]:
        """Per env, how many times its worker died and was replaced (Ray workers; zeros otherwise)."""
        return list(self._ray.replaced) if self._ray else [0] * self.num_envs

    def _map(self, cmd: str, args: list[Any]) -> list[Any]:
        if self._ray:
            return self._ray.call(cmd, list(range(self.num_envs)), args)
        if self._local:
            env_call = {
                "reset": lambda e, a: e.reset(seed=a),
                "step": lambda e, a: e.step(a),
                "render": lambda e, a: e.render(),
            }[cmd]
            return [env_call(e, a) for e, a in zip(self._local, args, strict=True)]
        for r, a in zip(self._remotes, args, strict=True):
            r.send(cmd, a)
        return [r.recv() for r in self._remotes]

    def _stack_obs(self, obs_list: list[Observation]) -> Observation:
        return {
            "cameras": {
                name: np.stack([o["cameras"][name] for o in obs_list]) for name in self.spec.camera_names
            },
            "state": np.stack([o["state"] for o in obs_list]),
            "instruction": [o["instruction"] for o in obs_list],
        }

    @staticmethod
    def _stack_privileged(infos: list[dict[str, Any]]) -> dict[str, np.ndarray]:
        return {k: np.stack([i["privileged"][k] for i in infos]) for k in infos[0]["privileged"]}

    # ---------------------------------------------------------------- gym-style API
    def reset(self, seed: int | None = None) -> tuple[Observation, dict[str, Any]]:
        """Reset every env. A ``seed`` restarts the seed sequence described in the module docstring."""
        if seed is not None:
            self.seed = seed
            self._episode_count[:] = 0
        seeds = [self._episode_seed(i) for i in range(self.num_envs)]
        results = self._map("reset", seeds)
        obs = self._stack_obs([o for o, _ in results])
        infos = [i for _, i in results]
        return obs, {"privileged": self._stack_privileged(infos), "episode_seed": np.array(seeds)}

    def step(
        self, actions: np.ndarray
    ) -> tuple[Observation, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        actions = np.asarray(actions, dtype=np.float32)
        want = (self.num_envs, self.spec.action_dim)
        if actions.shape != want:
            raise ValueError(f"actions: expected shape {list(want)}, got {list(actions.shape)}")
        results = self._map("step", list(actions))
        obs_list = [r[0] for r in results]
        infos = [r[4] for r in results]
        reward = np.array([r[1] for r in results], dtype=np.float32)
        terminated = np.array([r[2] for r in results], dtype=bool)
        truncated = np.array([r[3] for r in results], dtype=bool)
        step_info: dict[str, Any] = {
            k: np.array([i[k] for i in infos])
            for k in ("success", "sparse_reward", "dense_reward", "elapsed_steps")
        }
        done = np.flatnonzero(terminated | truncated)
        step_info["final_obs"] = {int(i): obs_list[i] for i in done}
        if len(done):
            self._episode_count[done] += 1
            if self._ray:
                resets = self._ray.call(
                    "reset", [int(i) for i in done], [self._episode_seed(i) for i in done]
                )
            elif self._local:
                resets = [self._local[i].reset(seed=self._episode_seed(i)) for i in done]
            else:
                for i in done:
                    self._remotes[i].send("reset", self._episode_seed(i))
                resets = [self._remotes[i].recv() for i in done]
            for i, (o, inf) in zip(done, resets, strict=True):
                obs_list[i], infos[i] = o, inf
        step_info["privileged"] = self._stack_privileged(infos)
        step_info["episode_seed"] = np.array([self._episode_seed(i) for i in range(self.num_envs)])
        return self._stack_obs(obs_list), reward, terminated, truncated, step_info

    def render(self) -> np.ndarray:
        """uint8 [N, H, W, 3] third-person views (build with ``render_size``)."""
        return np.stack(self._map("render", [None] * self.num_envs))

    def close(self) -> None:
        if self._ray:
            self._ray.close()
            self._ray = None
        for e in self._local:
            e.close()
        for r in self._remotes:
            with contextlib.suppress(RuntimeError, OSError, BrokenPipeError):
                r.call("close")
            r.proc.join(timeout=10)
            if r.proc.is_alive():
                r.proc.kill()
        self._local, self._remotes = [], []

    def __enter__(self) -> VectorSimEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
