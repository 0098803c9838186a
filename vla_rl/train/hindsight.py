"""Hindsight goal relabelling (Andrychowicz et al. 2017, "Hindsight Experience Replay"; Ghosh et al. 2019,
"Learning to Reach Goals via Iterated Supervised Learning"): a failed episode of a goal-conditioned task
is a successful demonstration of reaching the place it did reach.

For a task whose ``state`` observation holds its goal (a :class:`sim.base.GoalLayout`), an episode that
failed is copied, up to its *reached* frame, with the goal replaced:

1. **reached frames** ``t`` (:func:`reached_frames`): the state after the action, ``s[t + 1]``, has the
   object in hand (``s[held] > 0.5``) and, where the layout asks, the arm at rest
   (``max |s[a:b]| <= still_below``), i.e. everything the task's success asks except the goal;
2. **the end** ``e`` (:func:`hindsight_end`): of the reached frames, the one whose achieved position
   ``p(s[e + 1])`` came nearest the episode's own goal ``g`` (where the policy was aiming; ties: the
   earliest). No reached frame: no copy;
3. **the copy** (:func:`relabel_states`): frames ``0..e`` with ``g' = p(s[e + 1])`` written into the goal
   slot and every ``goal - achieved`` slot recomputed, ``s'[t, to_goal] = g' - p(s[t])``; it ends in
   success at ``e`` (the next state has the object at ``g'``, in hand, the arm at rest).

The trainers (:class:`vla_rl.train.awr.AdvantageConfig.hindsight_weight`) add one copy per failed
episode to the buffer (:func:`add_hindsight_copies`) as frames to clone with a fixed weight, kept out
of the value fit: their stored rewards were earned for the old goal. A camera policy's state is a
prefix of the state observation (proprioception and the goal, not the object's pose): its copies are
computed on the episode's full state replayed from its seed (:mod:`sim.replay`) and cut back to the
prefix, its images kept, which is sound where the cameras do not see the goal (PickCube hides its goal
marker from them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from sim.base import GoalLayout
    from vla_rl.train.transitions import TransitionBuffer

__all__ = [
    "HINDSIGHT_PREFIX",
    "add_hindsight_copies",
    "goal_layout",
    "hindsight_end",
    "reached_frames",
    "relabel_states",
]

HINDSIGHT_PREFIX = "hindsight:"
"""Episode-id prefix of a hindsight copy in a buffer (the rest is its source episode's id)."""


def goal_layout(task: str, cameras: bool) -> GoalLayout:
    """The simulated ``task``'s goal layout, or a ValueError saying why hindsight cannot apply."""
    from sim.registry import TASKS

    info = TASKS.get(task)
    if info is None or info.goal_layout is None:
        known = sorted(t.name for t in TASKS.values() if t.goal_layout is not None)
        raise ValueError(
            f"hindsight_weight: task {task!r} declares no goal in its state (tasks that do: {known}); "
            "set hindsight_weight 0"
        )
    layout = info.goal_layout
    if cameras:
        # a camera policy's state is a prefix of the state observation: it must hold what gets relabelled
        dim = info.state_dim["rgb"]
        used = [layout.goal + 2, *([layout.held] if layout.held is not None else [])]
        used += [layout.still[1] - 1] if layout.still is not None else []
        if max(used) >= dim:
            raise ValueError(
                f"hindsight_weight: {task!r}'s camera observation ({dim} state values) does not hold its goal "
                "(set hindsight_weight 0)"
            )
    return layout


def reached_frames(state: np.ndarray, layout: GoalLayout) -> np.ndarray:
    """Bool [T]: frame ``t`` ends in a reached state ``s[t + 1]`` (object in hand, arm at rest); the
    last frame has no next state in the episode and is never reached."""
    nxt = np.asarray(state)[1:]
    ok = np.ones(len(nxt), bool)
    if layout.held is not None:
        ok &= nxt[:, layout.held] > 0.5
    if layout.still is not None:
        a, b = layout.still
        ok &= np.abs(nxt[:, a:b]).max(axis=1) <= layout.still_below
    return np.concatenate([ok, [False]])


def hindsight_end(state: np.ndarray, layout: GoalLayout) -> int | None:
    """The frame a hindsight copy ends at: of the reached frames, the one whose next achieved position
    is nearest the episode's goal (the first frame's); None when no frame is reached."""
    state = np.asarray(state)
    reached = np.flatnonzero(reached_frames(state, layout))
    if not len(reached):
        return None
    goal = state[0, layout.goal : layout.goal + 3]
    achieved = state[reached + 1, layout.achieved : layout.achieved + 3]
    return int(reached[np.argmin(np.linalg.norm(achieved - goal, axis=1))])


def relabel_states(state: np.ndarray, layout: GoalLayout, goal: np.ndarray) -> np.ndarray:
    """A copy of ``state`` [T, S] as it would read had the goal been ``goal`` (3 values): the goal slot
    set, every ``goal - achieved`` slot recomputed from the frame's achieved position."""
    out = np.array(state, dtype=np.float32, copy=True)
    g = np.asarray(goal, dtype=np.float32)
    out[:, layout.goal : layout.goal + 3] = g
    achieved = out[:, layout.achieved : layout.achieved + 3]
    for i in layout.to_goal:
        out[:, i : i + 3] = g - achieved
    return out


def add_hindsight_copies(
    buf: TransitionBuffer, layout: GoalLayout, full_states: Callable[[str], np.ndarray] | None = None
) -> list[int]:
    """Append to ``buf`` one hindsight copy of each failed episode it holds (frames ``0..e``, the goal
    relabelled, ending in success; the copy's frames are to clone, ``bc``); returns the copies' episode
    indices in the buffer. Episodes with dropped (idle) frames and those with no reached frame get none.

    ``full_states(episode_id)``: the episode's full ``state``-mode observation on every frame (replayed:
    :class:`vla_rl.train.privileged.ReplayedStates`), for a camera policy's buffer, whose state is a
    prefix of it without the achieved position. The reached frames, the end and the new goal are read
    there; the copy's state is the relabelled full state cut to the buffer's width, and its images are
    the episode's (the goal must be invisible to the cameras, as PickCube's goal marker is)."""
    if buf.use_cameras and full_states is None:
        raise ValueError(
            "hindsight: a camera buffer needs full_states (the episodes' replayed simulator state)"
        )
    keys = ["state", "action", "controller", "episode", "frame", "instruction"]
    keys += [f"image.{c}" for c in buf.spec.camera_names] if buf.use_cameras else []
    a = {k: buf.array(k) for k in keys}
    width = buf.spec.state_dim
    order = np.argsort(a["episode"], kind="stable")
    bounds = np.searchsorted(a["episode"][order], np.arange(len(buf.episode_ids) + 1))
    copies: list[int] = []
    for k, success in enumerate(list(buf.episode_success)):
        rows = order[bounds[k] : bounds[k + 1]]
        if success or len(rows) < 2 or not np.array_equal(a["frame"][rows], np.arange(len(rows))):
            continue
        state = a["state"][rows] if full_states is None else full_states(buf.episode_ids[k])[: len(rows)]
        end = hindsight_end(state, layout)
        if end is None:
            continue
        keep = rows[: end + 1]
        goal = state[end + 1, layout.achieved : layout.achieved + 3]
        terminated = np.zeros(len(keep), bool)
        terminated[-1] = True
        buf.add_episode(
            state=relabel_states(state[: end + 1], layout, goal)[:, :width],
            cameras={c: a[f"image.{c}"][keep] for c in buf.spec.camera_names} if buf.use_cameras else None,
            action=a["action"][keep],
            reward=np.zeros(len(keep), np.float32),
            terminated=terminated,
            controller=a["controller"][keep],
            success=True,
            episode_id=f"{HINDSIGHT_PREFIX}{buf.episode_ids[k]}",
            instruction=[buf.instructions[i] for i in a["instruction"][keep]],
            clone=True,
        )
        copies.append(len(buf.episode_ids) - 1)
    return copies
