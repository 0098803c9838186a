"""Scripted experts that solve every task from privileged simulator state.

They are reactive: each call looks at the current ground truth (``info["privileged"]``) and decides,
keeping only a little memory (a release in progress, a failed grasp), so an expert can take over an
episode at any moment. That is what the simulated operator does when a policy stalls.

``noise`` makes demonstrations mediocre on purpose, for training data that leaves room for RL:

* Gaussian noise of std ``0.2 x noise`` (normalised action units; 1.0 = 10 cm for ManiSkill) on the
  position command at every step, and
* a per-episode bias of std ``noise`` x 1 cm on where the expert aims (grasp point, push line),
  which produces systematic near-misses like a sloppy operator's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sim.base import GRIPPER_CLOSED, GRIPPER_OPEN, Privileged

MAX_STEP = 0.5  # normalised units per step (~5 cm for ManiSkill): full 10 cm steps can stall the CPU IK
HOVER = 0.06  # metres above an object before descending
STEP_NOISE = 0.2  # per-step action noise std at noise=1 (normalised units; 2 cm for ManiSkill)


def _move(tcp: np.ndarray, target: np.ndarray, gain: float = 10.0) -> np.ndarray:
    """Proportional move towards ``target`` (metres) as a normalised, clipped delta command."""
    return np.clip((target - tcp) * gain, -MAX_STEP, MAX_STEP)


@dataclass
class ScriptedExpert:
    """Base class: seeding, noise, and the action format; subclasses implement :meth:`plan`."""

    noise: float = 0.0
    seed: int | None = None
    rng: np.random.Generator = field(init=False, repr=False)
    bias: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.noise <= 2.0:
            raise ValueError(f"noise: expected a value in [0, 2], got {self.noise}")
        self.reset(self.seed)

    def reset(self, seed: int | None = None) -> None:
        """Start a new episode (call after the env resets)."""
        self.rng = np.random.default_rng(seed)
        self.bias = np.zeros(3)
        self.bias[:2] = self.rng.normal(0.0, 0.01 * self.noise, size=2)
        self._reset_memory()

    def _reset_memory(self) -> None:
        pass

    def act(self, priv: Privileged) -> np.ndarray:
        """One action, float32[4] in [-1, 1]: [dx, dy, dz, gripper]."""
        delta, gripper = self.plan(priv)
        if self.noise > 0:
            delta = delta + self.rng.normal(0.0, STEP_NOISE * self.noise, size=3)
        return np.clip(np.append(delta, gripper), -1.0, 1.0).astype(np.float32)

    def plan(self, priv: Privileged) -> tuple[np.ndarray, float]:
        raise NotImplementedError


@dataclass
class PickPlaceExpert(ScriptedExpert):
    """Grasp the object from above, carry it to ``goal_pos``; with ``release`` open the gripper there."""

    release: bool = False
    place_tolerance: float = 0.006

    def _reset_memory(self) -> None:
        self._released = False
        self._regrasp = 0

    def plan(self, priv: Privileged) -> tuple[np.ndarray, float]:
        tcp, obj, goal = priv["tcp_pos"], priv["obj_pos"], priv["goal_pos"]
        half = float(priv["obj_half_size"])
        if self._released:  # placed: back off upwards with the gripper open
            return _move(tcp, tcp + np.array([0.0, 0.0, 0.05])), GRIPPER_OPEN
        if bool(priv["is_grasped"]):
            carry = goal + (tcp - obj)  # move the tcp so that the object lands on the goal
            if not self.release:
                return _move(tcp, carry), GRIPPER_CLOSED
            above = carry + np.array([0.0, 0.0, 0.03])
            xy_err = np.linalg.norm(obj[:2] - goal[:2])
            if xy_err > self.place_tolerance and obj[2] < goal[2] + 0.02:
                return _move(tcp, above), GRIPPER_CLOSED  # line up above the target first
            if abs(obj[2] - goal[2]) > 0.004:
                return _move(tcp, carry if xy_err <= self.place_tolerance else above), GRIPPER_CLOSED
            self._released = True
            return np.zeros(3), GRIPPER_OPEN
        # Not holding it: hover above, descend, close. A gripper closed on nothing means a missed grasp.
        aim = obj + self.bias
        if float(priv["gripper_width"]) < half * 0.5:
            self._regrasp = 4
        if self._regrasp > 0:
            self._regrasp -= 1
            return _move(tcp, aim + np.array([0.0, 0.0, HOVER])), GRIPPER_OPEN
        if np.linalg.norm(tcp[:2] - aim[:2]) > 0.01:
            hover = aim + np.array([0.0, 0.0, HOVER])
            # Rise before travelling sideways so the fingers never sweep the object away.
            target = hover if tcp[2] > obj[2] + 0.02 else np.append(tcp[:2], hover[2])
            return _move(tcp, target), GRIPPER_OPEN
        if tcp[2] - aim[2] > 0.008:
            return _move(tcp, aim), GRIPPER_OPEN
        return _move(tcp, aim), GRIPPER_CLOSED


@dataclass
class PushExpert(ScriptedExpert):
    """Get behind the object on the line to the goal, then push it along that line."""

    def plan(self, priv: Privileged) -> tuple[np.ndarray, float]:
        tcp, obj, goal = priv["tcp_pos"], priv["obj_pos"], priv["goal_pos"]
        half = float(priv["obj_half_size"])
        line = goal[:2] - obj[:2]
        dist = float(np.linalg.norm(line))
        d = line / max(dist, 1e-6)
        rel = tcp[:2] - obj[:2]
        behind = -float(rel @ d)  # how far behind the object the tcp is, along the push line
        lateral = abs(float(rel @ np.array([-d[1], d[0]])) - float(self.bias[1]))
        low_z = half
        start = obj[:2] - d * (half + 0.03) + np.array([-d[1], d[0]]) * self.bias[1]
        in_position = half <= behind <= half + 0.06 and lateral < 0.012
        if in_position and tcp[2] < low_z + 0.02:
            target = np.append(goal[:2] - d * (half + 0.005), low_z)
            return _move(tcp, target), GRIPPER_CLOSED
        if np.linalg.norm(tcp[:2] - start) > 0.01:
            # Travel high to the start point so we never knock the cube from the wrong side.
            if tcp[2] < low_z + 0.04 and behind < half:
                return _move(tcp, np.append(tcp[:2], low_z + 0.06)), GRIPPER_CLOSED
            return _move(tcp, np.append(start, low_z + 0.06)), GRIPPER_CLOSED
        return _move(tcp, np.append(start, low_z)), GRIPPER_CLOSED


@dataclass
class ReachExpert(ScriptedExpert):
    """Move to the (biased) goal, close the gripper once within a centimetre of where it aims."""

    def plan(self, priv: Privileged) -> tuple[np.ndarray, float]:
        tcp, aim = priv["tcp_pos"], priv["goal_pos"] + self.bias
        there = float(np.linalg.norm(aim - tcp)) < 0.01
        return _move(tcp, aim), GRIPPER_CLOSED if there else GRIPPER_OPEN


def make_expert(task: str, noise: float = 0.0, seed: int | None = None) -> ScriptedExpert:
    """The scripted expert for ``task`` (a task id from :func:`sim.list_tasks`)."""
    from sim.registry import resolve_task

    task = resolve_task(task).name
    if task.endswith("PushCube-v1"):
        return PushExpert(noise=noise, seed=seed)
    if task.endswith("StackCube-v1"):
        return PickPlaceExpert(noise=noise, seed=seed, release=True)
    if task.endswith("PickCube-v1") or task == "robosuite/Lift":
        return PickPlaceExpert(noise=noise, seed=seed)
    if task == "kinematic/Reach-v0":
        return ReachExpert(noise=noise, seed=seed)
    raise ValueError(f"task: no scripted expert for {task!r}")
