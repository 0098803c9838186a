"""The per-episode rules of a LeRobot import (fleet/lerobot/plan.py) on hand-made columns, without LeRobot:
episode ends, the reader's outcome rule, task runs, controller codes, derived segments."""

from __future__ import annotations

import numpy as np
import pytest
from vla_rl_client.meta import Controller, SegmentKind
from vla_rl_client.spec import SpecError

from fleet.lerobot.plan import (
    _controllers,
    _derive_segments,
    _episode_ends,
    _episode_outcome,
    _task_runs,
)
from fleet.lerobot.schema import CONTROLLER_KEY, INTERVENTION_KEY

F, T = False, True


def flags(*values: bool) -> np.ndarray:
    return np.array(values, bool)


def test_episode_ends() -> None:
    # Another's dataset: a last frame that is not done ended without a terminal state -> truncated.
    terminated, truncated = _episode_ends(flags(F, F, F), flags(F, F, F), None)
    assert terminated.tolist() == [F, F, F] and truncated.tolist() == [F, F, T]
    # done without truncated is terminated; truncated counts as done but not terminated.
    terminated, truncated = _episode_ends(flags(F, F, T), flags(F, F, F), None)
    assert terminated.tolist() == [F, F, T] and truncated.tolist() == [F, F, F]
    terminated, truncated = _episode_ends(flags(F, F, F), flags(F, F, T), None)
    assert terminated.tolist() == [F, F, F] and truncated.tolist() == [F, F, T]
    # Our export added the end flag (the store had neither): it is dropped again.
    terminated, truncated = _episode_ends(flags(F, T), flags(F, T), {"end_flag_added": True})
    assert terminated.tolist() == [F, F] and truncated.tolist() == [F, F]
    # Our export without an added flag keeps the store's flags, and never adds one.
    terminated, truncated = _episode_ends(flags(F, T), flags(F, T), {"end_flag_added": False})
    assert terminated.tolist() == [F, F] and truncated.tolist() == [F, T]
    terminated, truncated = _episode_ends(flags(F, F), flags(F, F), {"end_flag_added": False})
    assert terminated.tolist() == [F, F] and truncated.tolist() == [F, F]


def test_the_readers_outcome_rule() -> None:
    assert _episode_outcome(None, None, None) == ("unknown", False)  # no next.success column
    assert _episode_outcome(None, flags(F, T), None) == ("success", True)
    assert _episode_outcome(None, flags(F, F), None) == ("failure", False)
    assert _episode_outcome(None, flags(F, F), flags(T, T)) == ("failure", False)
    assert _episode_outcome(None, flags(F, F), flags(F, F)) == ("unknown", False)
    assert _episode_outcome(None, flags(F, T), flags(F, F)) == ("success", True)
    # Our own export: the sidecar's outcome wins; one without a known success is unknown.
    entry = {"outcome": "failure", "success": False}
    assert _episode_outcome(entry, flags(F, T), None) == ("failure", False)
    assert _episode_outcome({"outcome": "unknown", "success": None}, flags(F, T), None) == ("unknown", False)


def test_task_runs() -> None:
    names = {0: "pick", 1: "place"}
    assert _task_runs(np.array([0, 0, 0]), names) == ((0, 3, "pick"),)
    assert _task_runs(np.array([0, 0, 1, 1, 0]), names) == ((0, 2, "pick"), (2, 4, "place"), (4, 5, "pick"))
    assert _task_runs(np.array([7]), names) == ((0, 1, ""),)  # a task index without a name


def test_controllers() -> None:
    episode, frame = np.zeros(3, np.int64), np.arange(3)
    codes = _controllers(
        {CONTROLLER_KEY: np.array([0, 1, 2])}, CONTROLLER_KEY, Controller.HUMAN, episode, frame
    )
    assert codes.dtype == np.uint8 and codes.tolist() == [0, 1, 2]
    flag = {INTERVENTION_KEY: np.array([False, True, False])}
    codes = _controllers(flag, INTERVENTION_KEY, Controller.HUMAN, episode, frame)
    assert codes.tolist() == [int(Controller.POLICY), int(Controller.HUMAN), int(Controller.POLICY)]
    codes = _controllers({}, None, Controller.POLICY, episode, frame)
    assert codes.tolist() == [int(Controller.POLICY)] * 3
    with pytest.raises(SpecError, match="5 at episode 0 frame 2"):
        _controllers({CONTROLLER_KEY: np.array([0, 1, 5])}, CONTROLLER_KEY, Controller.HUMAN, episode, frame)


def test_derive_segments() -> None:
    controller = np.array([0, 0, 1, 1, 0], np.uint8)
    segs = _derive_segments(controller, controller == 1, None)
    assert [(s.start, s.end, s.kind, s.controller) for s in segs] == [
        (0, 2, SegmentKind.AUTONOMOUS, Controller.POLICY),
        (2, 4, SegmentKind.INTERVENTION, Controller.HUMAN),
        (4, 5, SegmentKind.AUTONOMOUS, Controller.POLICY),
    ]
    # An exported segment column decides the cuts.
    segs = _derive_segments(controller, controller == 1, np.array([0, 0, 0, 1, 1]))
    assert [(s.start, s.end) for s in segs] == [(0, 3), (3, 5)]
