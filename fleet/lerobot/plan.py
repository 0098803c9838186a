"""Import, first pass: every non-image column of every LeRobot episode read and checked, and each
episode's segments, outcome, ends and task runs decided, before anything is written.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from vla_rl_client.meta import Controller, Segment, SegmentKind
from vla_rl_client.spec import SpecError

from fleet.lerobot.schema import (
    ACTION_KEY,
    CONTROLLER_KEY,
    DONE_KEY,
    OUTCOME_KNOWN_KEY,
    REWARD_KEY,
    SEGMENT_KEY,
    STATE_KEY,
    SUCCESS_KEY,
    TRUNCATED_KEY,
)
from fleet.lerobot.source import OptionalColumns, dataset_tasks

if TYPE_CHECKING:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

log = logging.getLogger("fleet.lerobot_io")  # one logger for the whole package, as before the split


@dataclasses.dataclass(frozen=True)
class EpisodePlan:
    """One LeRobot episode, fully read and checked except for its images."""

    episode_index: int
    rows: np.ndarray  # rows of the HF dataset, in frame order
    instruction: str
    task_runs: tuple[tuple[int, int, str], ...]  # (start, end, LeRobot task) per run of frames
    task: str
    segments: tuple[Segment, ...]  # end always set
    outcome: str
    success: bool
    start_time: float
    state: np.ndarray
    action: np.ndarray
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    controller: np.ndarray
    frame_time: np.ndarray  # seconds since the episode start (frame_index / fps)
    video_time: np.ndarray  # LeRobot's stored ``timestamp`` column, what its video decoder seeks by


def _column(cols: Mapping[str, np.ndarray], key: str, n: int) -> np.ndarray:
    """A column as [n, k]: HF gives shape-[1] features as [n] and vectors as [n, k]."""
    return np.asarray(cols[key]).reshape(n, -1)


def plan_episodes(
    ds: LeRobotDataset,
    opt: OptionalColumns,
    sidecar: Mapping[str, Any] | None,
    default_controller: Controller,
    fps: float,
    task: str,
    task_given: bool,
) -> list[EpisodePlan]:
    """Read and check every non-image column of every episode, before anything is written."""
    cols = ds.hf_dataset.select_columns(_column_keys(opt)).with_format("numpy")[:]
    n = len(cols["episode_index"])
    state = _column(cols, STATE_KEY, n).astype(np.float32)
    action = _column(cols, ACTION_KEY, n).astype(np.float32)
    episode = _column(cols, "episode_index", n)[:, 0].astype(np.int64)
    frame = _column(cols, "frame_index", n)[:, 0].astype(np.int64)
    for key, arr in ((STATE_KEY, state), (ACTION_KEY, action)):
        _check_finite(key, arr, episode, frame)
    reward = np.zeros(n, np.float32)
    if opt.reward:
        reward = _column(cols, REWARD_KEY, n)[:, 0].astype(np.float32)
        _check_finite(REWARD_KEY, reward, episode, frame)
    done = _column(cols, DONE_KEY, n)[:, 0].astype(bool) if opt.done else np.zeros(n, bool)
    truncated = _column(cols, TRUNCATED_KEY, n)[:, 0].astype(bool) if opt.truncated else np.zeros(n, bool)
    success = _column(cols, SUCCESS_KEY, n)[:, 0].astype(bool) if opt.success else None
    known = _column(cols, OUTCOME_KNOWN_KEY, n)[:, 0].astype(bool) if opt.outcome_known else None
    segment = _column(cols, SEGMENT_KEY, n)[:, 0].astype(np.int64) if opt.segment else None
    controller = _controllers(cols, opt.controller, default_controller, episode, frame)
    if opt.intervention is not None:
        intervention = _column(cols, opt.intervention, n)[:, 0].astype(bool)
    else:
        intervention = controller == int(Controller.HUMAN)
    task_names = dict(enumerate(dataset_tasks(ds)))
    task_index = _column(cols, "task_index", n)[:, 0].astype(np.int64)
    video_time = _column(cols, "timestamp", n)[:, 0].astype(np.float64)

    exported: dict[int, Mapping[str, Any]] = dict(sidecar["by_index"]) if sidecar is not None else {}
    now = time.time()
    plans = []
    for e in np.unique(episode):
        rows = np.flatnonzero(episode == e)
        rows = rows[np.argsort(frame[rows], kind="stable")]
        m = len(rows)
        seg_col = None if segment is None else segment[rows]
        ctrl = controller[rows]
        entry = exported.get(int(e))
        segments = _exported_segments(entry, m, seg_col) if entry is not None else None
        if segments is None:
            if entry is not None:
                log.warning("episode %d: exported segments no longer match its frames; re-derived", e)
            segments = _derive_segments(ctrl, intervention[rows], seg_col)
        terminated, ep_truncated = _episode_ends(done[rows], truncated[rows], entry)
        outcome, ok = _episode_outcome(
            entry, None if success is None else success[rows], None if known is None else known[rows]
        )
        runs = _task_runs(task_index[rows], task_names)
        instruction = runs[0][2]
        if len(runs) > 1:
            log.info("episode %d has %d task runs; instruction = the first, %r", e, len(runs), instruction)
        start = entry.get("start_time") if entry is not None else None
        ep_task = task if task_given or entry is None else str(entry.get("task") or task)
        plans.append(
            EpisodePlan(
                episode_index=int(e),
                rows=rows,
                instruction=instruction,
                task_runs=runs,
                task=ep_task,
                segments=segments,
                outcome=outcome,
                success=ok,
                start_time=float(start) if isinstance(start, int | float) else now,
                state=state[rows],
                action=action[rows],
                reward=reward[rows],
                terminated=terminated,
                truncated=ep_truncated,
                controller=ctrl,
                frame_time=frame[rows] / float(fps),
                video_time=video_time[rows],
            )
        )
    return plans


def _column_keys(opt: OptionalColumns) -> list[str]:
    """The columns to read: the required ones and every optional one the dataset has."""
    keys = [STATE_KEY, ACTION_KEY, "episode_index", "frame_index", "timestamp", "task_index"]
    keys += [k for k, on in ((REWARD_KEY, opt.reward), (DONE_KEY, opt.done)) if on]
    keys += [k for k, on in ((TRUNCATED_KEY, opt.truncated), (SUCCESS_KEY, opt.success)) if on]
    keys += [OUTCOME_KNOWN_KEY] if opt.outcome_known else []
    keys += sorted({k for k in (opt.controller, opt.intervention) if k})
    keys += [SEGMENT_KEY] if opt.segment else []
    return keys


def _controllers(
    cols: Mapping[str, np.ndarray],
    key: str | None,
    default_controller: Controller,
    episode: np.ndarray,
    frame: np.ndarray,
) -> np.ndarray:
    """uint8 controller codes per row: from the ``controller`` column (codes checked), from an
    intervention flag (True = human, False = policy), or ``default_controller`` without either."""
    n = len(episode)
    if key == CONTROLLER_KEY:
        controller = _column(cols, CONTROLLER_KEY, n)[:, 0].astype(np.int64)
        bad = ~np.isin(controller, [int(c) for c in Controller])
        if bad.any():
            i = int(np.argmax(bad))
            raise SpecError(
                CONTROLLER_KEY,
                "codes policy=0, human=1, scripted=2",
                f"{controller[i]} at episode {episode[i]} frame {frame[i]}",
            )
    elif key is not None:
        flag = _column(cols, key, n)[:, 0].astype(bool)
        controller = np.where(flag, int(Controller.HUMAN), int(Controller.POLICY))
    else:
        controller = np.full(n, int(default_controller), np.int64)
    return controller.astype(np.uint8)


def _episode_ends(
    done: np.ndarray, truncated: np.ndarray, entry: Mapping[str, Any] | None
) -> tuple[np.ndarray, np.ndarray]:
    """(terminated, truncated) of one episode from LeRobot's done / truncated flags. Our export marks a
    last frame with neither flag truncated (the sidecar entry says so): that flag is dropped again; an
    episode from elsewhere whose last frame is not done ended without a terminal state: truncated."""
    ep_truncated = truncated.copy()
    ep_done = done | ep_truncated
    if entry is not None and entry.get("end_flag_added") is True and ep_truncated[-1]:
        ep_truncated[-1] = ep_done[-1] = False  # the export added it; the store had neither flag
    elif entry is None and not ep_done[-1]:
        ep_truncated[-1] = True  # the episode ended here without a terminal state
    return ep_done & ~ep_truncated, ep_truncated


def _episode_outcome(
    entry: Mapping[str, Any] | None, success: np.ndarray | None, known: np.ndarray | None
) -> tuple[str, bool]:
    """(outcome, success) of one episode: the sidecar's for our own exports, else the reader's rule:
    success iff any frame has ``next.success``, failure iff not and every frame has ``outcome_known``
    (or there is no such column), else unknown."""
    if entry is not None and entry.get("outcome") and entry.get("success") is not None:
        return str(entry["outcome"]), bool(entry["success"])
    if entry is not None:  # exported while still open, or with an unknown outcome
        return "unknown", False
    if success is not None and bool(success.any()):
        return "success", True
    if success is not None and (known is None or bool(known.all())):
        return "failure", False
    return "unknown", False


def _task_runs(task_index: np.ndarray, task_names: Mapping[int, str]) -> tuple[tuple[int, int, str], ...]:
    """(start, end, LeRobot task) per run of frames with one task, in frame order."""
    cuts = [0, *(np.flatnonzero(np.diff(task_index) != 0) + 1).tolist(), len(task_index)]
    return tuple((a, b, task_names.get(int(task_index[a]), "")) for a, b in itertools.pairwise(cuts))


def _check_finite(key: str, arr: np.ndarray, episode: np.ndarray, frame: np.ndarray) -> None:
    bad = ~np.isfinite(arr.reshape(len(arr), -1)).all(axis=1)
    if bad.any():
        i = int(np.argmax(bad))
        raise SpecError(key, "finite values", f"NaN or inf at episode {episode[i]} frame {frame[i]}")


def _exported_segments(
    entry: Mapping[str, Any], n: int, seg_col: np.ndarray | None
) -> tuple[Segment, ...] | None:
    """The sidecar's segments for this episode, or None when they do not fit its frames."""
    try:
        segs = tuple(Segment.from_dict(s) for s in entry.get("segments", ()))
    except (KeyError, TypeError, ValueError):
        return None
    if int(entry.get("length", -1)) != n or not segs or segs[0].start != 0:
        return None
    for i, s in enumerate(segs):
        end = s.end if s.end is not None else n
        if s.index != i or not s.start <= end <= n or (i and segs[i - 1].end != s.start):
            return None
        if seg_col is not None and (seg_col[s.start : end] != i).any():
            return None
    if (segs[-1].end if segs[-1].end is not None else n) != n:
        return None
    return tuple(dataclasses.replace(s, end=n if s.end is None else s.end) for s in segs)


def _derive_segments(
    controller: np.ndarray, intervention: np.ndarray, seg_col: np.ndarray | None
) -> tuple[Segment, ...]:
    """Split where the segment column (if any) or else the controller or intervention flag changes;
    a segment whose first frame is under intervention is an ``intervention`` segment."""
    if seg_col is not None:
        cut = np.diff(seg_col) != 0
    else:
        cut = (np.diff(controller.astype(np.int64)) != 0) | (np.diff(intervention.astype(np.int8)) != 0)
    starts = [0, *(np.flatnonzero(cut) + 1).tolist()]
    ends = [*starts[1:], len(controller)]
    segs = []
    for i, (a, b) in enumerate(zip(starts, ends, strict=True)):
        ctrl = Controller(int(controller[a]))
        kind = SegmentKind.INTERVENTION if intervention[a] else SegmentKind.AUTONOMOUS
        segs.append(Segment(i, kind, ctrl, a, b, None))
    return tuple(segs)
