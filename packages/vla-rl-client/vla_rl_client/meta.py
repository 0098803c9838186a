"""Episode metadata: the types the episode store, the metadata DB, the collector and robots share.

A bottom-layer module: it imports nothing of ours but the robot spec, and no storage library, so the
robot-side client (``packages/vla-rl-client/vla_rl_client/robot_client.py``) uses it without zarr or SQLAlchemy, and ``fleet/store.py``
and ``fleet/db/`` both build on it without importing each other (the store is handed its DB as an
:class:`EpisodeDB`).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Any, Protocol

import numpy as np

from vla_rl_client.spec import RobotSpec, SpecError

STORE_VERSION = 1  # the store's format version; also the ``format`` of every commit record


class Controller(IntEnum):
    """Who produced a frame's executed action. Stored as uint8."""

    POLICY = 0
    HUMAN = 1
    SCRIPTED = 2

    @classmethod
    def parse(cls, value: Controller | str | int) -> Controller:
        """Accept the enum, its lower-case name ("policy", ...) or its integer code."""
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                pass
        elif isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_):
            try:
                return cls(int(value))
            except ValueError:
                pass
        names = "|".join(c.name.lower() for c in cls)
        raise SpecError("controller", f"one of {names} (or codes 0-{len(cls) - 1})", repr(value))

    @property
    def label(self) -> str:
        return self.name.lower()


class SegmentKind(StrEnum):
    """What a stretch of an episode was: the policy acting, a human intervening, or a reset."""

    AUTONOMOUS = "autonomous"
    INTERVENTION = "intervention"
    RESET = "reset"


@dataclass(frozen=True)
class Segment:
    """Frames ``[start, end)`` of an episode. ``end`` is None while the segment is still running."""

    index: int
    kind: SegmentKind
    controller: Controller
    start: int
    end: int | None = None
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "kind": self.kind.value,
            "controller": self.controller.label,
            "start": self.start,
            "end": self.end,
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Segment:
        end = d.get("end")
        return cls(
            index=int(d["index"]),
            kind=SegmentKind(d["kind"]),
            controller=Controller.parse(d["controller"]),
            start=int(d["start"]),
            end=None if end is None else int(end),
            reason=d.get("reason"),
        )


@dataclass(frozen=True)
class EpisodeMeta:
    """Everything about an episode except its frames; the content of ``commit.json``."""

    episode_id: str
    robot_id: str
    task: str
    instruction: str
    spec: RobotSpec
    chunk_len: int
    created: float
    length: int = 0
    status: str = "open"
    revisions: tuple[str, ...] = ()
    segments: tuple[Segment, ...] = ()
    outcome: str | None = None
    success: bool | None = None
    closed: float | None = None
    episode_seed: int | None = None
    """A simulated episode's reset seed: with its actions it replays the episode (checked, drift refused:
    :mod:`sim.replay`); None for real robots and for episodes recorded before the store kept it."""

    @property
    def is_closed(self) -> bool:
        return self.status == "closed"

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": STORE_VERSION,
            "episode_id": self.episode_id,
            "robot_id": self.robot_id,
            "task": self.task,
            "instruction": self.instruction,
            "spec": self.spec.to_dict(),
            "chunk_len": self.chunk_len,
            "created": self.created,
            "length": self.length,
            "status": self.status,
            "revisions": list(self.revisions),
            "segments": [s.to_dict() for s in self.segments],
            "outcome": self.outcome,
            "success": self.success,
            "closed": self.closed,
            "episode_seed": self.episode_seed,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EpisodeMeta:
        success = d.get("success")
        closed = d.get("closed")
        return cls(
            episode_id=str(d["episode_id"]),
            robot_id=str(d["robot_id"]),
            task=str(d["task"]),
            instruction=str(d["instruction"]),
            spec=RobotSpec.from_dict(d["spec"]),
            chunk_len=int(d["chunk_len"]),
            created=float(d["created"]),
            length=int(d["length"]),
            status=str(d["status"]),
            revisions=tuple(str(r) for r in d.get("revisions", ())),
            segments=tuple(Segment.from_dict(s) for s in d.get("segments", ())),
            outcome=d.get("outcome"),
            success=None if success is None else bool(success),
            closed=None if closed is None else float(closed),
            episode_seed=None if d.get("episode_seed") is None else int(d["episode_seed"]),
        )


@dataclass(frozen=True)
class EpisodeRecord:
    """An episode as the DB knows it (a detached copy; editing it changes nothing)."""

    id: str
    robot_id: str
    task: str
    instruction: str
    store_path: str
    status: str
    outcome: str | None
    success: bool | None
    length: int
    created_at: float
    closed_at: float | None
    revisions: tuple[str, ...]
    segments: tuple[Segment, ...]


def new_episode_id(robot_id: str) -> str:
    """A fresh episode id, ``<UTC time>-<robot>-<random>``: unique, and sortable by creation time."""
    safe_robot = re.sub(r"[^A-Za-z0-9_.-]", "_", robot_id)[:64]
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{safe_robot}-{uuid.uuid4().hex[:8]}"


class EpisodeDB(Protocol):
    """The metadata DB as the episode store sees it (:class:`fleet.db.MetadataDB` is the one we have):
    writers record the episodes they open and close, ``verify`` reads them back, importers label them."""

    def record_episode_open(self, meta: EpisodeMeta, store_path: str) -> None: ...

    def record_episode_closed(self, meta: EpisodeMeta) -> None: ...

    def episode(self, episode_id: str) -> EpisodeRecord | None: ...

    def add_label(
        self, episode_id: str, key: str, value: Any, *, author: str, segment_index: int | None = None
    ) -> int: ...


TASK_RUNS_LABEL = "lerobot_tasks"
"""The DB label a LeRobot import writes on an episode whose frames carry several tasks: its runs of
frames as ``[[start, end, task], ...]`` (end exclusive). The episode's ``instruction`` is its first task."""


def frame_instructions(length: int, instruction: str, runs: Any = None) -> list[str]:
    """Each of an episode's ``length`` frames' instruction: ``instruction`` everywhere, replaced over each
    ``[start, end, text]`` of ``runs`` (a :data:`TASK_RUNS_LABEL` value; None: no runs). ValueError naming
    the label for runs that are not integer ranges inside the episode with a string each."""
    out = [instruction] * length
    for run in runs or ():
        ok = isinstance(run, Sequence) and not isinstance(run, str) and len(run) == 3
        start, end, text = run if ok else (None, None, None)
        if not (
            isinstance(start, int)
            and isinstance(end, int)
            and isinstance(text, str)
            and 0 <= start < end <= length
        ):
            raise ValueError(
                f"{TASK_RUNS_LABEL}: expected runs [start, end, task] with 0 <= start < end <= {length} "
                f"(the episode's length), got {run!r}"
            )
        out[start:end] = [text] * (end - start)
    return out
