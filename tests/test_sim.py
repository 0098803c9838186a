"""Simulated robots: spec conformance, determinism under a seed, experts, vector env (real simulators)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import sim
from sim.registry import TASKS

TASK_NAMES = sorted(TASKS)


def _rollout(env: sim.SimEnv, seed: int, actions: np.ndarray) -> list[np.ndarray]:
    obs, info = env.reset(seed=seed)
    out = [obs["state"], *obs["cameras"].values(), info["privileged"]["goal_pos"]]
    for a in actions:
        obs, reward, terminated, truncated, info = env.step(a)
        out += [obs["state"], *obs["cameras"].values(), np.array([reward, terminated, truncated])]
    return out


@pytest.mark.parametrize("obs_mode", ["state", "rgb"])
@pytest.mark.parametrize("task", TASK_NAMES)
def test_task_follows_spec_and_is_deterministic(task: str, obs_mode: str) -> None:
    info = TASKS[task]
    rng = np.random.default_rng(0)
    actions = rng.uniform(-1, 1, size=(6, 4)).astype(np.float32)
    with sim.make_env(task, obs=obs_mode, image_size=48) as env:
        spec = env.spec
        assert spec.name == task
        assert spec.action_dim == 4 and spec.control_hz == info.control_hz
        assert spec.state_dim == info.state_dim[obs_mode]
        assert spec.camera_names == (info.cameras if obs_mode == "rgb" else ())
        assert all(c.height == c.width == 48 for c in spec.cameras)

        obs, first_info = env.reset(seed=7)
        spec.check_observation(obs)  # raises SpecError naming the field on any mismatch
        assert obs["instruction"] == info.instruction
        assert set(first_info) >= {"success", "sparse_reward", "dense_reward", "privileged"}
        if obs_mode == "rgb":
            img = next(iter(obs["cameras"].values()))
            assert img.std() > 5, "camera image is blank"

        a = _rollout(env, 7, actions)
        b = _rollout(env, 7, actions)
        c = _rollout(env, 8, actions)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True)), "same seed, same actions: must match"
    assert not np.array_equal(a[2 if obs_mode == "rgb" else 1], c[2 if obs_mode == "rgb" else 1]), (
        "different seeds should place the object differently"
    )


def test_step_rejects_bad_actions_and_clips() -> None:
    with sim.make_env("maniskill/PushCube-v1") as env:
        env.reset(seed=0)
        with pytest.raises(ValueError, match=r"action: expected shape \[4\]"):
            env.step(np.zeros(3, dtype=np.float32))
        with pytest.raises(ValueError, match="action: expected finite"):
            env.step(np.array([0, np.nan, 0, 1], dtype=np.float32))
        obs, *_ = env.step(np.array([5, 0, 0, 1], dtype=np.float32))  # clipped to [-1, 1], no error
        assert obs["state"].dtype == np.float32


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="obs: expected one of"):
        sim.make_env("maniskill/PushCube-v1", obs="depth")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="task: expected one of"):
        sim.make_env("maniskill/NoSuchTask-v9")
    assert sim.resolve_task("Lift").name == "robosuite/Lift"


@functools.cache
def _expert_wins(task: str, episodes: int, noise: float) -> tuple[bool, ...]:
    """Whether the expert succeeded in each of ``episodes`` episodes (seeds 1000, 1001, ..., one simulator,
    in order). Cached: the first n of a run are the n-episode run, so tests share one."""
    wins = []
    with sim.make_env(task) as env:
        for ep in range(episodes):
            _, info = env.reset(seed=1000 + ep)
            expert = sim.make_expert(task, noise=noise, seed=1000 + ep)
            done = False
            while not done:
                _, _, terminated, truncated, info = env.step(expert.act(info["privileged"]))
                done = terminated or truncated
            wins.append(bool(info["success"]))
    return tuple(wins)


def _expert_success(task: str, episodes: int, noise: float) -> float:
    return sum(_expert_wins(task, episodes, noise)) / episodes


EXPERT_EPISODES = 20


@pytest.mark.parametrize("task", TASK_NAMES)
def test_expert_succeeds_at_noise_zero(task: str) -> None:
    assert _expert_success(task, EXPERT_EPISODES, noise=0.0) >= 0.9


def test_noise_knob_makes_demos_worse() -> None:
    # the first 10 of the noise-zero test's episodes (the same run, cached)
    clean = sum(_expert_wins("maniskill/PickCube-v1", EXPERT_EPISODES, 0.0)[:10]) / 10
    sloppy = _expert_success("maniskill/PickCube-v1", 10, noise=1.5)
    assert clean == 1.0
    assert sloppy <= 0.6, f"noise=1.5 should make the expert clearly worse, got {sloppy:.0%}"


def test_expert_is_reproducible_and_validates_noise() -> None:
    priv = {
        "tcp_pos": np.array([0.0, 0.0, 0.2]),
        "obj_pos": np.array([0.05, 0.02, 0.02]),
        "goal_pos": np.array([0.0, 0.1, 0.2]),
        "gripper_width": np.float64(0.08),
        "is_grasped": np.bool_(False),
        "obj_half_size": np.float64(0.02),
    }
    a = [sim.make_expert("PickCube", noise=0.5, seed=3).act(priv) for _ in range(2)]
    assert np.array_equal(a[0], a[1])
    assert a[0].dtype == np.float32 and np.all(np.abs(a[0]) <= 1)
    with pytest.raises(ValueError, match="noise"):
        sim.make_expert("PickCube", noise=-1)


def test_vector_env_in_processes_matches_single_envs() -> None:
    """Two worker processes, autoreset, seed sequence seed + i + j * num_envs, same as in-process."""
    task, steps = "maniskill/PushCube-v1", 60
    actions = np.random.default_rng(1).uniform(-1, 1, size=(steps, 2, 4)).astype(np.float32)

    def run(processes: bool) -> tuple[list[np.ndarray], list[int]]:
        states, seeds = [], []
        with sim.make(task, num_envs=2, seed=10, max_episode_steps=25, processes=processes) as env:
            obs, info = env.reset()
            seeds += list(info["episode_seed"])
            for a in actions:
                obs, _r, terminated, truncated, info = env.step(a)
                states.append(obs["state"])
                for i in np.flatnonzero(terminated | truncated):
                    assert i in info["final_obs"]
                    seeds.append(int(info["episode_seed"][i]))
        return states, seeds

    proc_states, proc_seeds = run(processes=True)
    local_states, local_seeds = run(processes=False)
    assert proc_seeds == local_seeds
    assert proc_seeds[:2] == [10, 11] and {12, 13} <= set(proc_seeds[2:])
    assert all(np.array_equal(x, y) for x, y in zip(proc_states, local_states, strict=True))


def test_vector_env_workers_die_with_a_sigtermed_parent() -> None:
    """SIGTERM on a process driving a VectorSimEnv must not leave its workers behind, even when a process it
    forked keeps the workers' pipes open (so they never see EOF)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    code = (
        "import os, time, sim\n"
        "env = sim.make('maniskill/PushCube-v1', num_envs=2, seed=0, obs='state', processes=True)\n"
        "env.reset()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    time.sleep(120)\n"
        "    os._exit(0)\n"
        "print(pid, *(r.proc.pid for r in env._remotes), flush=True)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    fork_pid, *workers = (int(x) for x in proc.stdout.readline().split())

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    try:
        assert len(workers) == 2 and all(alive(w) for w in workers)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM  # the parent's own exit is unchanged
        deadline = time.monotonic() + 5
        while any(alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [w for w in workers if alive(w)], "workers outlived their parent"
    finally:
        for pid in (fork_pid, *workers):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()


def test_kinematic_reach_noise_knob_and_top_camera() -> None:
    """The physics-free test bed: noisy demos are mediocre, and its camera shows where things are."""
    assert _expert_success("kinematic/Reach-v0", 40, noise=0.0) == 1.0
    assert _expert_success("kinematic/Reach-v0", 40, noise=1.0) <= 0.5
    with sim.make_env("kinematic/Reach-v0", obs="rgb", image_size=32) as env:
        obs, _info = env.reset(seed=0)
        before = obs["cameras"]["top_camera"].copy()
        obs, *_ = env.step(np.array([1.0, 0.0, 0.0, 1.0], dtype=np.float32))  # 10 cm along +x
        after = obs["cameras"]["top_camera"]
    assert not np.array_equal(before, after), "moving the gripper must change the top-down image"
    assert obs["state"].shape == (4,)
