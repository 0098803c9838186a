"""Metadata DB: episodes, their segments, labels, and post-training rounds (SQLAlchemy 2.0).

The episode store holds frames; this DB holds what we query and what we change after the fact.
Labels live only here, so relabelling never rewrites frames. SQLite is the default
(``sqlite:///<store root>/metadata.db``, WAL journal + busy timeout + ``BEGIN IMMEDIATE`` so several
writer processes take turns instead of failing); PostgreSQL (``postgresql://user:password@host/db``,
psycopg 3) is tested too, and is the one to use for workers on several machines.

The schema is Alembic's (``fleet/migrations``): opening a DB upgrades it to the newest revision, under a
lock (SQLite: ``BEGIN IMMEDIATE``; PostgreSQL: an advisory lock), so several processes may open it at
once; a DB already at head costs one query.

Timestamps are unix seconds (float), like the store's.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, get_args

from sqlalchemy import (
    JSON,
    ColumnElement,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    and_,
    case,
    cast,
    create_engine,
    delete,
    event,
    false,
    func,
    insert,
    inspect,
    make_url,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, OperationalError, ProgrammingError
from sqlalchemy.orm import (
    DeclarativeBase,
    Mapped,
    Session,
    aliased,
    mapped_column,
    relationship,
    selectinload,
)
from vla_rl_client.meta import Controller, EpisodeMeta, EpisodeRecord, Segment

log = logging.getLogger(__name__)

_BUSY_TIMEOUT_S = 30  # how long a SQLite writer waits for another process's transaction
_MIGRATIONS = Path(__file__).with_name("migrations")
_PG_MIGRATION_LOCK = 0x766C615F726C  # pg_advisory_xact_lock key of schema upgrades ("vla_rl")
_BASELINE_TABLES = frozenset({"episodes", "segments", "labels", "rounds"})
_URL_SETTING = (
    "the metadata DB URL (--db-url of `vla-rl round worker`, --db of `vla-rl collect` / `data` / `round`, "
    "db_url of a training config; unset = the SQLite file next to the episode store)"
)


class Base(DeclarativeBase):
    pass


class EpisodeRow(Base):
    __tablename__ = "episodes"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    robot_id: Mapped[str] = mapped_column(String(128), index=True)
    task: Mapped[str] = mapped_column(String(256), index=True)
    instruction: Mapped[str] = mapped_column(Text)
    store_path: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16), index=True)  # open | closed
    outcome: Mapped[str | None] = mapped_column(String(64))
    success: Mapped[bool | None]
    length: Mapped[int] = mapped_column(default=0)
    num_segments: Mapped[int] = mapped_column(default=0)
    created_at: Mapped[float] = mapped_column(index=True)
    closed_at: Mapped[float | None]
    revisions: Mapped[list[str]] = mapped_column(JSON, default=list)  # checkpoint revisions used
    segments: Mapped[list[SegmentRow]] = relationship(
        cascade="all, delete-orphan", order_by="SegmentRow.index", back_populates="episode"
    )


class SegmentRow(Base):
    __tablename__ = "segments"

    episode_id: Mapped[str] = mapped_column(ForeignKey("episodes.id", ondelete="CASCADE"), primary_key=True)
    index: Mapped[int] = mapped_column(primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))
    controller: Mapped[str] = mapped_column(String(32))
    start: Mapped[int]
    end: Mapped[int | None]
    reason: Mapped[str | None] = mapped_column(Text)
    episode: Mapped[EpisodeRow] = relationship(back_populates="segments")


class LabelRow(Base):
    """One label event (append-only): a value for a key, about a whole episode or a frame span of it, or
    an undo event (``undoes`` = the id of the label it retracts)."""

    __tablename__ = "labels"
    __table_args__ = (
        Index("ix_labels_episode_key", "episode_id", "key"),
        Index("ix_labels_key_current", "key", "current"),
    )

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    episode_id: Mapped[str] = mapped_column(ForeignKey("episodes.id", ondelete="CASCADE"), index=True)
    segment_index: Mapped[int | None]  # the segment a span label was put on (its frames are start/end)
    key: Mapped[str] = mapped_column(String(128), index=True)
    value: Mapped[Any] = mapped_column(JSON)
    author: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[float]
    start: Mapped[int | None]  # frame span [start, end); None = the whole episode
    end: Mapped[int | None]
    note: Mapped[str | None] = mapped_column(Text)
    source: Mapped[str] = mapped_column(String(16), default="human", server_default="human")
    undoes: Mapped[int | None] = mapped_column(index=True)
    current: Mapped[bool] = mapped_column(default=False, server_default=false())
    """In force now (kept by every write, so filters are an indexed lookup): for an episode-level key,
    its latest event not undone; for a span, not undone; never for an undo event."""


class EpisodeRevisionRow(Base):
    """Which checkpoint revisions acted in an episode (the JSON list ``episodes.revisions``, as rows, so
    revision and round filters are an indexed join on every backend)."""

    __tablename__ = "episode_revisions"

    episode_id: Mapped[str] = mapped_column(ForeignKey("episodes.id", ondelete="CASCADE"), primary_key=True)
    revision: Mapped[str] = mapped_column(String(128), primary_key=True, index=True)


class EpisodeFlagRow(Base):
    """One auto-flag check's result for an episode (``fleet.flags``); ``raised`` = it fired."""

    __tablename__ = "episode_flags"

    episode_id: Mapped[str] = mapped_column(ForeignKey("episodes.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), primary_key=True, index=True)
    score: Mapped[float]
    raised: Mapped[bool]
    detail: Mapped[str] = mapped_column(Text)
    computed_at: Mapped[float]
    # what a high_uncertainty result was judged on (Flag's fields of the same names; NULL for the other
    # checks and for results stored before migration 0004)
    calibration_revision: Mapped[str | None] = mapped_column(String(128))
    calibration_n: Mapped[int | None]
    calibrated: Mapped[bool | None]


class RoundRow(Base):
    """One post-training round: what it trained on, how, what it produced, and whether it shipped."""

    __tablename__ = "rounds"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)  # the round number
    algo: Mapped[str] = mapped_column(String(32), index=True)
    task: Mapped[str] = mapped_column(String(256), index=True)
    base_ref: Mapped[str] = mapped_column(Text)
    base_revision: Mapped[str | None] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(16), index=True)  # see ROUND_STATUSES
    config: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    data: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)  # selection + snapshot
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    checkpoint_ref: Mapped[str | None] = mapped_column(Text)  # e.g. hub://org/name@round-3
    checkpoint_revision: Mapped[str | None] = mapped_column(String(128))
    promoted: Mapped[bool] = mapped_column(default=False)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[float]
    finished_at: Mapped[float | None]
    job: Mapped[RoundJobRow] = relationship(lazy="selectin", cascade="all, delete-orphan", uselist=False)


class RoundJobRow(Base):
    """The job side of a round: which worker runs it, when it last said so, how often it was tried.

    Its own table (not columns of ``rounds``), so DBs written before rounds were jobs gain it on open."""

    __tablename__ = "round_jobs"

    round_id: Mapped[int] = mapped_column(ForeignKey("rounds.id", ondelete="CASCADE"), primary_key=True)
    worker: Mapped[str | None] = mapped_column(String(128))
    claimed_at: Mapped[float | None]
    heartbeat_at: Mapped[float | None] = mapped_column(index=True)
    attempts: Mapped[int] = mapped_column(default=0)
    cancel_requested: Mapped[bool] = mapped_column(default=False)
    progress: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


RoundStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
ROUND_STATUSES = get_args(RoundStatus)
FINISHED_STATUSES = ("succeeded", "failed", "cancelled")
_ROUND_FIELDS = (
    "task",
    "status",
    "base_revision",
    "config",
    "data",
    "metrics",
    "checkpoint_ref",
    "checkpoint_revision",
    "promoted",
    "error",
    "finished_at",
)


@dataclass(frozen=True)
class RoundRecord:
    """A round as the DB knows it (detached copy)."""

    id: int
    algo: str
    task: str
    base_ref: str
    base_revision: str | None
    status: str
    config: dict[str, Any]
    data: dict[str, Any]
    metrics: dict[str, Any]
    checkpoint_ref: str | None
    checkpoint_revision: str | None
    promoted: bool
    error: str | None
    created_at: float
    finished_at: float | None
    worker: str | None = None
    """The worker that claimed it last (its id: host:pid)."""
    heartbeat_at: float | None = None
    attempts: int = 0
    """How many times a worker claimed it (a dead worker's round is re-queued)."""
    cancel_requested: bool = False
    progress: dict[str, Any] | None = None
    """What the running round last reported (phase, ...)."""


class RoundLost(RuntimeError):
    """A worker's round is no longer its own (re-queued after its heartbeat expired, or cancelled)."""


LabelSource = Literal["human", "auto"]
LABEL_SOURCES: tuple[str, ...] = get_args(LabelSource)
OUTCOME_KEY = "outcome"
"""The episode label whose current value overrides the recorded outcome: for ``DataSelection``'s
``success=``, training credit, the episode list, the fleet statistics and LeRobot export. Its value is
the outcome (``success`` -> success True, any other value -> False)."""
_ID_CHUNK = 500  # ids per IN (...) list


@dataclass(frozen=True)
class Label:
    """One label event (a detached copy). ``start``/``end`` (frames, end exclusive) make it a span label;
    without them it is about the whole episode. An undo event has ``undoes`` = the id it retracts.
    ``undone_by`` (filled by :meth:`MetadataDB.labels`) is the undo event that retracted this one."""

    id: int
    episode_id: str
    segment_index: int | None
    key: str
    value: Any
    author: str
    created_at: float
    start: int | None = None
    end: int | None = None
    note: str | None = None
    source: str = "human"
    undoes: int | None = None
    undone_by: int | None = None

    @property
    def is_span(self) -> bool:
        return self.start is not None

    @property
    def is_undo(self) -> bool:
        return self.undoes is not None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form of docs/dashboard.md (``{"id", "episode_id", "key", "value", "start", ...}``)."""
        return {
            "id": self.id,
            "episode_id": self.episode_id,
            "key": self.key,
            "value": self.value,
            "start": self.start,
            "end": self.end,
            "note": self.note,
            "author": self.author,
            "source": self.source,
            "created_at": self.created_at,
            "undoes": self.undoes,
            "undone_by": self.undone_by,
            "segment_index": self.segment_index,
        }


def effective_outcome(
    outcome: str | None, success: bool | None, labels: Mapping[str, Any]
) -> tuple[str | None, bool | None]:
    """The outcome and success an episode counts as, given its current episode labels: an ``outcome``
    label overrides the recorded pair (``success`` -> True, any other value -> False)."""
    override = labels.get(OUTCOME_KEY)
    if override is None:
        return outcome, success
    return str(override), str(override) == "success"


@dataclass(frozen=True)
class Flag:
    """One auto-flag check's result for an episode (see :mod:`fleet.flags`): ``score`` (bigger = more
    suspicious; the check's threshold decides ``raised``) and a short human ``detail``."""

    name: str
    score: float
    detail: str
    raised: bool = True
    computed_at: float = 0.0
    # The calibration basis of a ``high_uncertainty`` result (:func:`fleet.flags.needs_recalibration`
    # decides on these, never on ``detail``, which is for people):
    calibrated: bool | None = None
    """True: judged by ``calibration_revision``'s calibration on ``calibration_n`` successful episodes;
    False: not (with a revision: it had only ``calibration_n`` of them, too few, a provisional result; without
    one: judged by no revision's calibration, e.g. no scores); None: no basis recorded (another check, or a
    result stored before the metadata DB kept it)."""
    calibration_revision: str | None = None
    """The checkpoint revision whose calibration the result depends on (None: none)."""
    calibration_n: int | None = None
    """How many of that revision's successful episodes the calibration had (None: no revision)."""

    def __post_init__(self) -> None:
        if (self.calibration_revision is None) != (self.calibration_n is None):
            raise ValueError(
                "calibration_n: expected a count exactly when calibration_revision is given, got "
                f"{self.calibration_n!r} with revision {self.calibration_revision!r}"
            )
        if self.calibration_revision is not None and self.calibrated is None:
            raise ValueError("calibrated: expected true or false with a calibration_revision, got None")

    def to_dict(self) -> dict[str, Any]:
        return {"score": self.score, "detail": self.detail}


def parse_time(field_name: str, value: str | float) -> float:
    """Unix seconds from a number or an ISO date/time (``2026-11-01``, ``2026-11-01T12:00:00+00:00``; a
    date without a zone is local time, as everywhere in the CLI); ValueError naming ``field_name``."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    text_value = str(value).strip()
    try:
        return float(text_value)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text_value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise ValueError(
            f"{field_name}: expected unix seconds or an ISO date (2026-11-01), got {text_value!r}"
        ) from None


SORT_KEYS: tuple[str, ...] = ("created_at", "length", "robot_id", "task")
EPISODE_SORTS: tuple[str, ...] = tuple(s for k in SORT_KEYS for s in (k, f"-{k}"))
"""The episode list's sort orders (``-`` = descending); ties are broken by episode id."""
MAX_PER_PAGE = 500
_QUERY_PARAMS = (
    "task",
    "robot",
    "outcome",
    "revision",
    "round",
    "label",
    "intervention",
    "flag",
    "flagged",
    "status",
    "since",
    "until",
    "min_length",
    "max_length",
    "sort",
    "page",
    "per_page",
)


@dataclass(frozen=True)
class EpisodeQuery:
    """A filtered, sorted page of the episode list (docs/dashboard.md "Episode list"). Every filter is
    optional and they all narrow the set; :meth:`MetadataDB.query_episodes` runs it in SQL."""

    task: str | None = None
    robot: str | None = None
    outcome: str | None = None
    """The effective outcome (an ``outcome`` label overrides the recorded one); ``unknown`` = none."""
    revision: str | None = None
    """Episodes in which this checkpoint revision acted."""
    round: int | None = None
    """Episodes collected by the checkpoint this post-training round produced."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """Current episode-level label values that must all match (key -> value as text, case-insensitive)."""
    intervention: bool | None = None
    """True: at least one human segment; False: none."""
    flags: tuple[str, ...] = ()
    """Episodes with any of these auto-flags raised."""
    flagged: bool | None = None
    """True: any auto-flag raised; False: none raised."""
    status: str | None = None
    """``open`` or ``closed``."""
    since: float | None = None
    """Unix seconds; created at or after it."""
    until: float | None = None
    """Unix seconds; created at or before it."""
    min_length: int | None = None
    max_length: int | None = None
    sort: str = "-created_at"
    """One of :data:`EPISODE_SORTS`."""
    page: int = 1
    """1-based."""
    per_page: int = 50
    """1..500."""

    def __post_init__(self) -> None:
        for name in ("task", "robot", "outcome", "revision", "status"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise ValueError(f"{name}: expected a non-empty string, got {v!r}")
        if self.status is not None and self.status not in ("open", "closed"):
            raise ValueError(f"status: expected open or closed, got {self.status!r}")
        if self.round is not None and (not _is_int(self.round) or self.round < 1):
            raise ValueError(f"round: expected a round number >= 1, got {self.round!r}")
        for k, v in self.labels.items():
            if not isinstance(k, str) or not k.strip():
                raise ValueError(f"label: expected key:value with a non-empty key, got {k!r}")
            if not isinstance(v, str) or not v.strip():
                raise ValueError(f"label: expected key:value with a non-empty value, got {k}:{v!r}")
        object.__setattr__(self, "labels", dict(self.labels))
        object.__setattr__(self, "flags", tuple(self.flags))
        for f in self.flags:
            if not isinstance(f, str) or not f.strip():
                raise ValueError(f"flag: expected an auto-flag name, got {f!r}")
        for name in ("min_length", "max_length"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0):
                raise ValueError(f"{name}: expected an integer >= 0, got {v!r}")
        if self.min_length is not None and self.max_length is not None and self.max_length < self.min_length:
            raise ValueError(f"max_length: expected >= min_length ({self.min_length}), got {self.max_length}")
        if self.since is not None and self.until is not None and self.until < self.since:
            raise ValueError(f"until: expected >= since ({self.since}), got {self.until}")
        if self.sort not in EPISODE_SORTS:
            raise ValueError(f"sort: expected one of {', '.join(EPISODE_SORTS)}, got {self.sort!r}")
        if not _is_int(self.page) or self.page < 1:
            raise ValueError(f"page: expected an integer >= 1, got {self.page!r}")
        if not _is_int(self.per_page) or not 1 <= self.per_page <= MAX_PER_PAGE:
            raise ValueError(f"per_page: expected an integer in 1..{MAX_PER_PAGE}, got {self.per_page!r}")

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> EpisodeQuery:
        """From URL query parameters (a plain mapping of str or list-of-str values, or a multi-dict with
        ``getlist`` such as Starlette's ``QueryParams``). ``label=key:value`` and ``flag=NAME`` repeat;
        dates are unix seconds or ISO; booleans ``true|false``. Raises ValueError naming the parameter."""
        values: dict[str, list[str]] = {}
        getlist = getattr(params, "getlist", None)
        for key in params:
            if key not in _QUERY_PARAMS:
                raise ValueError(
                    f"{key}: unknown episode-list parameter; expected one of {', '.join(_QUERY_PARAMS)}"
                )
            raw = getlist(key) if getlist is not None else params[key]
            items = list(raw) if isinstance(raw, list | tuple) else [raw]
            values[key] = [str(v) for v in items if v is not None and str(v) != ""]
        kw: dict[str, Any] = {}

        def one(key: str) -> str | None:
            got = values.get(key) or []
            if len(got) > 1:
                raise ValueError(f"{key}: expected one value, got {len(got)} ({got})")
            return got[0] if got else None

        for key in ("task", "robot", "outcome", "revision", "status", "sort"):
            if (v := one(key)) is not None:
                kw[key] = v
        for key in ("round", "min_length", "max_length", "page", "per_page"):
            if (v := one(key)) is not None:
                try:
                    kw[key] = int(v)
                except ValueError:
                    raise ValueError(f"{key}: expected an integer, got {v!r}") from None
        for key in ("intervention", "flagged"):
            if (v := one(key)) is not None:
                kw[key] = _parse_bool(key, v)
        for key in ("since", "until"):
            if (v := one(key)) is not None:
                kw[key] = parse_time(key, v)
        labels: dict[str, str] = {}
        for item in values.get("label", []):
            k, sep, v = item.partition(":")
            if not sep or not k.strip() or not v.strip():
                raise ValueError(f"label: expected key:value (e.g. quality:good), got {item!r}")
            labels[k.strip()] = v.strip()
        kw["labels"] = labels
        kw["flags"] = tuple(values.get("flag", []))
        return cls(**kw)

    def to_params(self) -> list[tuple[str, str]]:
        """The URL query parameters (the inverse of :meth:`from_params`, defaults left out)."""
        out: list[tuple[str, str]] = []
        for key in ("task", "robot", "outcome", "revision", "round", "status", "since", "until"):
            v = getattr(self, key)
            if v is not None:
                out.append((key, str(v)))
        out += [("label", f"{k}:{v}") for k, v in self.labels.items()]
        for key in ("intervention", "flagged"):
            v = getattr(self, key)
            if v is not None:
                out.append((key, "true" if v else "false"))
        out += [("flag", f) for f in self.flags]
        for key in ("min_length", "max_length"):
            v = getattr(self, key)
            if v is not None:
                out.append((key, str(v)))
        defaults = EpisodeQuery()
        for key in ("sort", "page", "per_page"):
            if getattr(self, key) != getattr(defaults, key):
                out.append((key, str(getattr(self, key))))
        return out

    def to_data_selection(self) -> tuple[str | None, str, list[str]]:
        """The round data selection this filter means, for "start a round on these episodes": ``(task,
        text for DataSelection.parse, [filters a DataSelection cannot express])``. The outcome maps to
        ``success=`` (success / failure only); intervention, flags, status, lengths and paging do not
        map and are listed."""
        parts: list[str] = []
        dropped: list[str] = []
        if self.robot is not None:
            parts.append(f"robot={self.robot}")
        for key in ("since", "until"):
            v = getattr(self, key)
            if v is not None:
                parts.append(f"{key}={v}")
        if self.revision is not None:
            parts.append(f"revision={self.revision}")
        if self.round is not None:
            parts.append(f"round={self.round}")
        parts += [f"label.{k}={v}" for k, v in self.labels.items()]
        if self.outcome in ("success", "failure"):
            parts.append(f"success={'true' if self.outcome == 'success' else 'false'}")
        elif self.outcome is not None:
            dropped.append("outcome")
        for key in ("intervention", "flagged", "status", "min_length", "max_length"):
            if getattr(self, key) is not None:
                dropped.append(key)
        if self.flags:
            dropped.append("flag")
        return self.task, ",".join(parts), dropped


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_bool(key: str, v: str) -> bool:
    low = v.strip().lower()
    if low in ("true", "1", "yes"):
        return True
    if low in ("false", "0", "no"):
        return False
    raise ValueError(f"{key}: expected true or false, got {v!r}")


@dataclass(frozen=True)
class EpisodeSummary:
    """One row of the episode list. ``outcome``/``success`` are the effective ones (an ``outcome`` label
    overrides ``recorded_outcome``/``recorded_success``); ``intervention_frames`` = frames in human
    segments, ``takeovers`` = the number of human segments; ``labels`` = current episode-level labels;
    ``flags`` = the raised auto-flags."""

    id: str
    robot_id: str
    task: str
    instruction: str
    status: str
    outcome: str | None
    success: bool | None
    length: int
    created_at: float
    closed_at: float | None
    revisions: tuple[str, ...]
    intervention_frames: int
    takeovers: int
    labels: dict[str, Any]
    flags: dict[str, Flag]
    recorded_outcome: str | None
    recorded_success: bool | None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form of docs/dashboard.md (``flags`` as ``{name: {"score", "detail"}}``)."""
        return {
            "id": self.id,
            "robot_id": self.robot_id,
            "task": self.task,
            "instruction": self.instruction,
            "status": self.status,
            "outcome": self.outcome,
            "success": self.success,
            "recorded_outcome": self.recorded_outcome,
            "recorded_success": self.recorded_success,
            "length": self.length,
            "created_at": self.created_at,
            "closed_at": self.closed_at,
            "revisions": list(self.revisions),
            "intervention_frames": self.intervention_frames,
            "takeovers": self.takeovers,
            "labels": dict(self.labels),
            "flags": {n: f.to_dict() for n, f in self.flags.items()},
        }


@dataclass(frozen=True)
class RobotStats:
    """One robot's episodes (fleet page): counts, success rates over the last hour / day (closed episodes
    with a known effective outcome; None when there were none), the fraction of its closed episodes with
    a human takeover, and the last checkpoint revision its newest episode ran."""

    robot_id: str
    episodes: int
    episodes_hour: int
    success_hour: float | None
    episodes_day: int
    success_day: float | None
    intervention_rate: float | None
    revision: str | None
    last_episode_at: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RevisionStats:
    """One checkpoint revision: when it first acted, in how many episodes, the success rate and the
    fraction with a human takeover over its closed episodes."""

    revision: str
    first_seen: float
    episodes: int
    success_rate: float | None
    intervention_rate: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TimelinePoint:
    """Closed episodes of one revision created in ``[t, t + bucket_s)``."""

    t: float
    revision: str
    episodes: int
    success_rate: float | None
    intervention_rate: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def worker_id() -> str:
    """This process's name as a round worker (``claim_round``, ``heartbeat_round``): ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


def default_url(store_root: str | os.PathLike[str]) -> str:
    """The SQLite DB that sits next to an episode store."""
    if str(store_root).startswith("s3:/"):
        raise ValueError(
            f"db_url: the episode store {store_root} is on object storage and has no SQLite file beside "
            "it: give the metadata DB's URL (--db / --db-url / db_url)"
        )
    return f"sqlite:///{Path(store_root).absolute() / 'metadata.db'}"


def _sqlite_setup(engine: Engine) -> None:
    """WAL + busy timeout + foreign keys, and write-locking transactions.

    pysqlite's deferred BEGIN lets two processes both read and then both try to upgrade to a write
    lock; in WAL mode one of them then fails with SQLITE_BUSY without waiting. ``BEGIN IMMEDIATE``
    takes the write lock up front, so the busy timeout applies and writers queue.
    """

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_S * 1000}")
        cur.execute("PRAGMA journal_mode = WAL")
        cur.execute("PRAGMA synchronous = NORMAL")
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


_CALIBRATION_QUERY = EpisodeQuery(status="closed", outcome="success", intervention=False)
"""Closed, successful (effective outcome), no takeover: the episodes that calibrate a revision's
uncertainty CUSUM (docs/algorithms.md §6a's held-out successful episodes)."""


class MetadataDBError(RuntimeError):
    """The metadata DB cannot be opened (unreachable server, refused credentials, missing database, a
    schema newer than this code); the message names the URL (password hidden) and how to fix it."""


class MetadataDB:
    """Episodes, segments and labels. Safe to use from several processes (each opens its own)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = self.engine_for(url)
        # Reads that take several statements (a row, then its segments or job) see one snapshot: on
        # PostgreSQL that needs REPEATABLE READ (READ COMMITTED snapshots each statement); SQLite reads
        # run in one transaction (BEGIN IMMEDIATE) anyway.
        self._reader = (
            self.engine.execution_options(isolation_level="REPEATABLE READ")
            if self.engine.dialect.name == "postgresql"
            else self.engine
        )
        try:
            upgrade_schema(self.engine)
        except BaseException:
            self.engine.dispose()
            raise

    @staticmethod
    def engine_for(url: str) -> Engine:
        """An engine with this module's connection setup (SQLite: WAL, busy timeout, BEGIN IMMEDIATE)."""
        try:
            parsed = make_url(url)
            sqlite = parsed.get_backend_name() == "sqlite"
            # The driver-level timeout also covers the dialect's first queries, which run before our hook.
            connect_args: dict[str, Any] = {"timeout": _BUSY_TIMEOUT_S} if sqlite else {}
            if parsed.get_backend_name() == "postgresql" and parsed.get_driver_name() == "psycopg":
                connect_args = {"connect_timeout": 10}  # an unreachable host fails at start-up, soon
            engine = create_engine(parsed, connect_args=connect_args)
        except (ArgumentError, NoSuchModuleError, ImportError) as e:  # malformed URL, unknown backend
            shown = re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)
            raise MetadataDBError(
                f"{shown!r} is not a usable database URL ({e}); fix {_URL_SETTING}, e.g. "
                "postgresql://USER:PASSWORD@HOST:5432/DBNAME or sqlite:///PATH/metadata.db"
            ) from e
        if sqlite:
            _sqlite_setup(engine)
        return engine

    @classmethod
    def for_store(cls, store_root: str | os.PathLike[str]) -> MetadataDB:
        """The SQLite DB in the store's directory (created if missing, so the DB can be opened first and
        handed to ``EpisodeStore(store_root, create=True, db=...)``)."""
        url = default_url(store_root)  # refuses an object store before any folder is made
        Path(store_root).mkdir(parents=True, exist_ok=True)
        return cls(url)

    def __repr__(self) -> str:
        return f"MetadataDB({self.engine.url.render_as_string(hide_password=True)!r})"

    def close(self) -> None:
        self.engine.dispose()

    # ------------------------------------------------------------------ episodes
    def record_episode_open(self, meta: EpisodeMeta, store_path: str) -> None:
        """Insert (or reset) the episode's row when its writer starts."""
        with Session(self.engine) as s, s.begin():
            row = s.get(EpisodeRow, meta.episode_id) or EpisodeRow(id=meta.episode_id)
            row.robot_id = meta.robot_id
            row.task = meta.task
            row.instruction = meta.instruction
            row.store_path = store_path
            row.status = meta.status
            row.length = meta.length
            row.created_at = meta.created
            row.revisions = list(meta.revisions)
            s.add(row)
            s.flush()  # the row exists before its revision rows reference it
            _sync_revisions(s, meta.episode_id, meta.revisions)

    def record_episode_closed(self, meta: EpisodeMeta) -> None:
        """Record the final length, outcome, revisions and segments of a closed episode."""
        if not meta.is_closed:
            raise ValueError(f"episode {meta.episode_id} is not closed")
        with Session(self.engine) as s, s.begin():
            row = s.get(EpisodeRow, meta.episode_id, options=[selectinload(EpisodeRow.segments)])
            if row is None:
                raise KeyError(f"episode {meta.episode_id!r} was never recorded as open")
            row.status = meta.status
            row.outcome = meta.outcome
            row.success = meta.success
            row.length = meta.length
            row.closed_at = meta.closed
            row.revisions = list(meta.revisions)
            _sync_revisions(s, meta.episode_id, meta.revisions)
            row.num_segments = len(meta.segments)
            row.segments.clear()
            s.flush()  # delete the old segment rows before inserting rows with the same keys
            row.segments.extend(
                SegmentRow(
                    index=seg.index,
                    kind=seg.kind.value,
                    controller=seg.controller.label,
                    start=seg.start,
                    end=seg.end,
                    reason=seg.reason,
                )
                for seg in meta.segments
            )

    def episode(self, episode_id: str) -> EpisodeRecord | None:
        with Session(self._reader) as s:
            row = s.get(EpisodeRow, episode_id, options=[selectinload(EpisodeRow.segments)])
            return None if row is None else _record(row)

    def episodes(
        self, task: str | None = None, status: str | None = None, success: bool | None = None
    ) -> list[EpisodeRecord]:
        """Episodes ordered by creation time, filtered by task / status / success when given."""
        q = (
            select(EpisodeRow)
            .options(selectinload(EpisodeRow.segments))
            .order_by(EpisodeRow.created_at, EpisodeRow.id)
        )
        if task is not None:
            q = q.where(EpisodeRow.task == task)
        if status is not None:
            q = q.where(EpisodeRow.status == status)
        if success is not None:
            q = q.where(EpisodeRow.success == success)
        with Session(self._reader) as s:
            return [_record(r) for r in s.scalars(q)]

    def record_episodes(self, metas: Iterable[EpisodeMeta], store_path: str) -> int:
        """Insert many new episodes (open or closed, with their segments and revisions) in one
        transaction, in bulk (imports, tests that need 10k rows). Returns how many; an id already in
        the DB fails the whole batch."""
        episodes: list[dict[str, Any]] = []
        segments: list[dict[str, Any]] = []
        revisions: list[dict[str, Any]] = []
        for m in metas:
            episodes.append(
                {
                    "id": m.episode_id,
                    "robot_id": m.robot_id,
                    "task": m.task,
                    "instruction": m.instruction,
                    "store_path": store_path,
                    "status": m.status,
                    "outcome": m.outcome,
                    "success": m.success,
                    "length": m.length,
                    "num_segments": len(m.segments),
                    "created_at": m.created,
                    "closed_at": m.closed,
                    "revisions": list(m.revisions),
                }
            )
            segments += [
                {
                    "episode_id": m.episode_id,
                    "index": g.index,
                    "kind": g.kind.value,
                    "controller": g.controller.label,
                    "start": g.start,
                    "end": g.end,
                    "reason": g.reason,
                }
                for g in m.segments
            ]
            revisions += [{"episode_id": m.episode_id, "revision": r} for r in dict.fromkeys(m.revisions)]
        with Session(self.engine) as s, s.begin():
            for table, rows in (
                (EpisodeRow.__table__, episodes),
                (SegmentRow.__table__, segments),
                (EpisodeRevisionRow.__table__, revisions),
            ):
                for i in range(0, len(rows), 2000):
                    s.execute(insert(table), rows[i : i + 2000])
        return len(episodes)

    # ------------------------------------------------------------------ labels
    def add_label(
        self,
        episode_id: str,
        key: str,
        value: Any,
        *,
        author: str,
        segment_index: int | None = None,
        start: int | None = None,
        end: int | None = None,
        note: str | None = None,
        source: str = "human",
    ) -> int:
        """Append a label event (any JSON value) about an episode, a frame span ``[start, end)`` of it, or
        one of its segments (``segment_index``: the span is the segment's frames unless given); returns
        its id. Labels are never overwritten: a relabel is a newer event with the same key, and the
        current value is the latest one not undone (:meth:`undo_label`).

        Raises KeyError for an unknown episode, ValueError (naming the field) for an empty key or author,
        a source other than human|auto, or a span outside the episode (spans need a closed episode)."""
        return self.add_labels(
            [episode_id],
            key,
            value,
            author=author,
            segment_index=segment_index,
            start=start,
            end=end,
            note=note,
            source=source,
        )[0]

    def add_labels(
        self,
        episode_ids: Iterable[str],
        key: str,
        value: Any,
        *,
        author: str,
        segment_index: int | None = None,
        start: int | None = None,
        end: int | None = None,
        note: str | None = None,
        source: str = "human",
    ) -> list[int]:
        """:meth:`add_label` on many episodes in ONE transaction: all are written or none (an unknown
        episode raises KeyError naming it; a span outside any of them raises ValueError). Returns the new
        label ids in the order of ``episode_ids`` (duplicates labelled once)."""
        _check_label(key, author, source, start, end, note, segment_index)
        ids = list(dict.fromkeys(episode_ids))
        if not ids:
            raise ValueError("episode_ids: expected at least one episode id")
        now = time.time()
        with Session(self.engine) as s, s.begin():
            found: dict[str, tuple[str, int]] = {}
            for chunk in _chunks(sorted(ids)):
                q = (
                    select(EpisodeRow.id, EpisodeRow.status, EpisodeRow.length)
                    .where(EpisodeRow.id.in_(chunk))
                    .order_by(EpisodeRow.id)
                )
                # FOR UPDATE (PostgreSQL): two labellers of one episode take turns keeping ``current``
                # right; rows locked in id order, so two bulk labellers never deadlock
                found.update({r.id: (r.status, r.length) for r in s.execute(q.with_for_update())})
            missing = [e for e in ids if e not in found]
            if missing:
                more = f" (and {len(missing) - 1} more: {missing[1:4]})" if len(missing) > 1 else ""
                raise KeyError(f"no episode {missing[0]!r} in the metadata DB{more}")
            segs: dict[str, SegmentRow] = {}
            if segment_index is not None:
                for chunk in _chunks(ids):
                    q2 = select(SegmentRow).where(
                        SegmentRow.episode_id.in_(chunk), SegmentRow.index == segment_index
                    )
                    segs.update({g.episode_id: g for g in s.scalars(q2)})
            rows = []
            for eid in ids:
                status, length = found[eid]
                a, b = start, end
                if segment_index is not None:
                    seg = segs.get(eid)
                    if seg is None:
                        raise ValueError(f"segment_index: episode {eid!r} has no segment {segment_index}")
                    if a is None and (seg.end is not None or status == "closed"):
                        a, b = seg.start, seg.end if seg.end is not None else length
                if a is not None and b is not None:
                    if status != "closed":
                        raise ValueError(
                            f"start/end: episode {eid!r} is still recording (its length is not final); "
                            "label its spans once it has closed"
                        )
                    if b > length:
                        raise ValueError(
                            f"end: expected <= {length} (the length of episode {eid!r}; frames "
                            f"0..{length - 1}, end exclusive), got {b}"
                        )
                rows.append(
                    LabelRow(
                        episode_id=eid,
                        segment_index=segment_index,
                        key=key,
                        value=value,
                        author=author,
                        created_at=now,
                        start=a,
                        end=b,
                        note=note,
                        source=source,
                        current=True,
                    )
                )
            if start is None and segment_index is None:  # episode-level: the new event replaces the old
                for chunk in _chunks(ids):
                    s.execute(
                        update(LabelRow)
                        .where(LabelRow.episode_id.in_(chunk), LabelRow.key == key, _episode_level(LabelRow))
                        .where(LabelRow.current.is_(True))
                        .values(current=False)
                    )
            s.add_all(rows)
            s.flush()
            return [int(r.id) for r in rows]

    def undo_label(
        self, label_id: int, *, author: str, note: str | None = None, source: str = "human"
    ) -> int:
        """Retract label ``label_id`` by appending an undo event (same episode, key, value and span;
        ``undoes`` = its id); returns the undo event's id. The key's current value falls back to the
        latest earlier event not undone. KeyError: no such label; ValueError: it is already undone, or
        is itself an undo event (label the value again instead)."""
        _check_label("undo", author, source, None, None, note, None)
        with Session(self.engine) as s, s.begin():
            row = s.get(LabelRow, label_id)
            if row is None:
                raise KeyError(f"no label {label_id} in the metadata DB")
            s.execute(select(EpisodeRow.id).where(EpisodeRow.id == row.episode_id).with_for_update())
            s.refresh(row)
            if row.undoes is not None:
                raise ValueError(
                    f"label_id: label {label_id} is an undo event (of label {row.undoes}); to restore the "
                    "value, label it again"
                )
            prior = s.scalars(select(LabelRow.id).where(LabelRow.undoes == label_id)).first()
            if prior is not None:
                raise ValueError(f"label_id: label {label_id} was already undone (by label {prior})")
            undo = LabelRow(
                episode_id=row.episode_id,
                segment_index=row.segment_index,
                key=row.key,
                value=row.value,
                author=author,
                created_at=time.time(),
                start=row.start,
                end=row.end,
                note=note,
                source=source,
                undoes=label_id,
                current=False,
            )
            s.add(undo)
            s.flush()
            if row.current:
                row.current = False
                if row.start is None and row.segment_index is None:  # the latest earlier event takes over
                    prev = s.scalars(
                        select(LabelRow)
                        .where(
                            LabelRow.episode_id == row.episode_id,
                            LabelRow.key == row.key,
                            _episode_level(LabelRow),
                            _live(LabelRow),
                        )
                        .order_by(LabelRow.id.desc())
                        .limit(1)
                    ).first()
                    if prev is not None:
                        prev.current = True
            return int(undo.id)

    def label(self, label_id: int) -> Label | None:
        """One label event (with ``undone_by``), or None."""
        with Session(self._reader) as s:
            row = s.get(LabelRow, label_id)
            if row is None:
                return None
            by = s.scalars(select(LabelRow.id).where(LabelRow.undoes == label_id)).first()
            return _label(row, by)

    def labels(
        self,
        episode_id: str | None = None,
        key: str | None = None,
        *,
        episode_ids: Iterable[str] | None = None,
    ) -> list[Label]:
        """The label history (every event, undo events too, ``undone_by`` filled) in the order added,
        filtered by episode (or ``episode_ids``) / key when given."""
        q = select(LabelRow).order_by(LabelRow.id)
        if episode_id is not None:
            q = q.where(LabelRow.episode_id == episode_id)
        if key is not None:
            q = q.where(LabelRow.key == key)
        with Session(self._reader) as s:
            if episode_ids is None:
                rows = list(s.scalars(q))
            else:
                rows = [
                    r
                    for chunk in _chunks(list(episode_ids))
                    for r in s.scalars(q.where(LabelRow.episode_id.in_(chunk)))
                ]
                rows.sort(key=lambda r: r.id)
        undone_by = {r.undoes: r.id for r in rows if r.undoes is not None}  # an undo shares episode and key
        return [_label(r, undone_by.get(r.id)) for r in rows]

    def current_label_events(self, episode_ids: Iterable[str]) -> dict[str, list[Label]]:
        """Per episode (every id given appears): the label events in force, i.e. not undone and not undo
        events: the latest episode-level event of each key, then every span label (by start, then id)."""
        with Session(self._reader) as s:
            return _read_current_events(s, episode_ids)

    def current_labels(self, episode_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """``{episode_id: {key: value}}``: each episode-level key's latest value not undone (every id
        given appears, ``{}`` when it has none)."""
        return {
            eid: {lb.key: lb.value for lb in events if not lb.is_span}
            for eid, events in self.current_label_events(episode_ids).items()
        }

    def current_spans(self, episode_ids: Iterable[str]) -> dict[str, list[Label]]:
        """``{episode_id: [Label]}``: the span labels in force (not undone), ordered by start then id."""
        return {
            eid: [lb for lb in events if lb.is_span]
            for eid, events in self.current_label_events(episode_ids).items()
        }

    # ------------------------------------------------------------------ episode list (dashboard)
    def query_episodes(self, q: EpisodeQuery) -> tuple[list[EpisodeSummary], int]:
        """One page of the episode list and the total number of matches, filtered, sorted and paged in
        SQL (the same on SQLite and PostgreSQL). ValueError for a round that does not exist."""
        with Session(self._reader) as s:
            if q.round is not None and s.get(RoundRow, q.round) is None:
                raise ValueError(f"round: no round {q.round} in the metadata DB")
            where = _episode_filters(q)
            total = int(s.scalar(select(func.count()).select_from(EpisodeRow).where(*where)) or 0)
            key = q.sort.lstrip("-")
            col = getattr(EpisodeRow, key)
            desc = q.sort.startswith("-")
            order = [col.desc(), EpisodeRow.id.desc()] if desc else [col.asc(), EpisodeRow.id.asc()]
            page = select(EpisodeRow).where(*where).order_by(*order)
            page = page.offset((q.page - 1) * q.per_page).limit(q.per_page)
            rows = list(s.scalars(page))
            ids = [r.id for r in rows]
            human: dict[str, tuple[int, int]] = {}
            if ids:
                seg_end = func.coalesce(SegmentRow.end, EpisodeRow.length)
                hq = (
                    select(SegmentRow.episode_id, func.count(), func.sum(seg_end - SegmentRow.start))
                    .join(EpisodeRow, EpisodeRow.id == SegmentRow.episode_id)
                    .where(SegmentRow.episode_id.in_(ids), SegmentRow.controller == Controller.HUMAN.label)
                    .group_by(SegmentRow.episode_id)
                )
                human = {eid: (int(n), int(frames or 0)) for eid, n, frames in s.execute(hq)}
            events = _read_current_events(s, ids)
            flags = _read_flags(s, ids, raised_only=True)
        labels = {eid: {lb.key: lb.value for lb in evs if not lb.is_span} for eid, evs in events.items()}
        out = []
        for r in rows:
            outcome, success = effective_outcome(r.outcome, r.success, labels[r.id])
            takeovers, frames = human.get(r.id, (0, 0))
            out.append(
                EpisodeSummary(
                    id=r.id,
                    robot_id=r.robot_id,
                    task=r.task,
                    instruction=r.instruction,
                    status=r.status,
                    outcome=outcome,
                    success=success,
                    length=r.length,
                    created_at=r.created_at,
                    closed_at=r.closed_at,
                    revisions=tuple(r.revisions or ()),
                    intervention_frames=frames,
                    takeovers=takeovers,
                    labels=labels[r.id],
                    flags=flags[r.id],
                    recorded_outcome=r.outcome,
                    recorded_success=r.success,
                )
            )
        return out, total

    def query_episode_ids(self, q: EpisodeQuery, limit: int = 100_000) -> list[str]:
        """Every id matching ``q``'s filters (ignoring its paging), in its sort order, at most ``limit``
        (bulk labelling "every match of this filter")."""
        with Session(self._reader) as s:
            if q.round is not None and s.get(RoundRow, q.round) is None:
                raise ValueError(f"round: no round {q.round} in the metadata DB")
            col = getattr(EpisodeRow, q.sort.lstrip("-"))
            desc = q.sort.startswith("-")
            order = [col.desc(), EpisodeRow.id.desc()] if desc else [col.asc(), EpisodeRow.id.asc()]
            sel = select(EpisodeRow.id).where(*_episode_filters(q)).order_by(*order).limit(limit)
            return list(s.scalars(sel))

    def closed_episode_index(self) -> list[tuple[str, str, int]]:
        """``(id, task, length)`` of every closed episode (auto-flags' length distributions)."""
        with Session(self._reader) as s:
            q = select(EpisodeRow.id, EpisodeRow.task, EpisodeRow.length).where(EpisodeRow.status == "closed")
            return [(r.id, r.task, int(r.length)) for r in s.execute(q)]

    def calibration_counts(self) -> dict[str, tuple[int, float]]:
        """Per checkpoint revision: how many closed episodes it acted in are successful (effective
        outcome) without a takeover, and the newest one's ``closed_at`` (auto-flags' uncertainty
        calibration, :mod:`fleet.flags`; one grouped query). The empty revision is not one."""
        q = (
            select(EpisodeRevisionRow.revision, func.count(), func.max(EpisodeRow.closed_at))
            .join(EpisodeRow, EpisodeRow.id == EpisodeRevisionRow.episode_id)
            .where(EpisodeRevisionRow.revision != "", *_episode_filters(_CALIBRATION_QUERY))
            .group_by(EpisodeRevisionRow.revision)
        )
        with Session(self._reader) as s:
            return {rev: (int(n), float(newest or 0.0)) for rev, n, newest in s.execute(q)}

    def calibration_episode_ids(self, revision: str) -> list[str]:
        """The episodes :meth:`calibration_counts` counts for ``revision``, oldest first."""
        q = (
            select(EpisodeRow.id)
            .join(EpisodeRevisionRow, EpisodeRow.id == EpisodeRevisionRow.episode_id)
            .where(EpisodeRevisionRow.revision == revision, *_episode_filters(_CALIBRATION_QUERY))
            .order_by(EpisodeRow.created_at, EpisodeRow.id)
        )
        with Session(self._reader) as s:
            return list(s.scalars(q))

    def episode_ids(self) -> list[str]:
        """Every recorded episode's id (open and closed), sorted: one column, cheap at 10k+ rows."""
        with Session(self._reader) as s:
            return list(s.scalars(select(EpisodeRow.id).order_by(EpisodeRow.id)))

    def closed_lacking_flags(self, names: Sequence[str]) -> list[str]:
        """Ids of closed episodes without a stored result for at least one check in ``names``, newest
        first: what :func:`fleet.flags.refresh_flags` would compute (one query, no flag rows loaded)."""
        wanted = sorted(set(names))
        if not wanted:
            return []
        have = (
            select(func.count())
            .where(EpisodeFlagRow.episode_id == EpisodeRow.id, EpisodeFlagRow.name.in_(wanted))
            .scalar_subquery()
        )
        q = (
            select(EpisodeRow.id)
            .where(EpisodeRow.status == "closed", have < len(wanted))
            .order_by(EpisodeRow.created_at.desc(), EpisodeRow.id)
        )
        with Session(self._reader) as s:
            return list(s.scalars(q))

    # ------------------------------------------------------------------ fleet statistics (dashboard)
    def robot_stats(self, now: float | None = None) -> list[RobotStats]:
        """Per robot (by id): episodes in all / the last hour / the last day (by creation time), success
        rates over those windows, intervention rate (closed episodes with a takeover) and the revision
        its newest episode ran last."""
        now = time.time() if now is None else now
        hour, day = now - 3600.0, now - 86400.0
        ov, on = _outcome_join()
        succ = _success_value(ov)
        closed = EpisodeRow.status == "closed"
        q = (
            select(
                EpisodeRow.robot_id,
                func.count(),
                func.sum(case((EpisodeRow.created_at >= hour, 1), else_=0)),
                func.avg(case((and_(closed, EpisodeRow.created_at >= hour), succ), else_=None)),
                func.sum(case((EpisodeRow.created_at >= day, 1), else_=0)),
                func.avg(case((and_(closed, EpisodeRow.created_at >= day), succ), else_=None)),
                func.avg(case((closed, case((_has_human(), 1.0), else_=0.0)), else_=None)),
                func.max(EpisodeRow.created_at),
            )
            .outerjoin(ov, on)
            .group_by(EpisodeRow.robot_id)
            .order_by(EpisodeRow.robot_id)
        )
        newest = aliased(EpisodeRow)
        latest_q = select(EpisodeRow.robot_id, EpisodeRow.revisions).where(
            EpisodeRow.created_at
            == select(func.max(newest.created_at))
            .where(newest.robot_id == EpisodeRow.robot_id)
            .scalar_subquery()
        )
        with Session(self._reader) as s:
            rows = list(s.execute(q))
            # the last checkpoint revision of the newest episode ("" is the entry of its human frames)
            latest = {rid: ([r for r in revs or [] if r] or [None])[-1] for rid, revs in s.execute(latest_q)}
        return [
            RobotStats(
                robot_id=rid,
                episodes=int(n),
                episodes_hour=int(nh or 0),
                success_hour=_rate(sh),
                episodes_day=int(nd or 0),
                success_day=_rate(sd),
                intervention_rate=_rate(ir),
                revision=latest.get(rid),
                last_episode_at=last,
            )
            for rid, n, nh, sh, nd, sd, ir, last in rows
        ]

    def revision_stats(self) -> list[RevisionStats]:
        """Per checkpoint revision, oldest first: first seen, episodes it acted in, success and
        intervention rates over those that closed. The empty revision (frames no checkpoint produced:
        demonstrations, human driving) is not one."""
        closed = EpisodeRow.status == "closed"
        ov, on = _outcome_join()
        q = (
            select(
                EpisodeRevisionRow.revision,
                func.min(EpisodeRow.created_at),
                func.count(),
                func.avg(case((closed, _success_value(ov)), else_=None)),
                func.avg(case((closed, case((_has_human(), 1.0), else_=0.0)), else_=None)),
            )
            .join(EpisodeRow, EpisodeRow.id == EpisodeRevisionRow.episode_id)
            .outerjoin(ov, on)
            .where(EpisodeRevisionRow.revision != "")  # demos / human frames: no checkpoint ran
            .group_by(EpisodeRevisionRow.revision)
            .order_by(func.min(EpisodeRow.created_at), EpisodeRevisionRow.revision)
        )
        with Session(self._reader) as s:
            return [
                RevisionStats(rev, float(first), int(n), _rate(sr), _rate(ir))
                for rev, first, n, sr, ir in s.execute(q)
            ]

    def revision_timeline(
        self, bucket_s: float = 3600.0, since: float | None = None, until: float | None = None
    ) -> list[TimelinePoint]:
        """Success and intervention rate per revision over time: closed episodes grouped by revision and
        creation time in buckets of ``bucket_s`` seconds (``t`` = bucket start), oldest first; without the
        empty revision (see :meth:`revision_stats`)."""
        if not bucket_s > 0:
            raise ValueError(f"bucket_s: expected seconds > 0, got {bucket_s}")
        if self.engine.dialect.name == "sqlite":  # no FLOOR; CAST truncates, = floor for t >= 0
            bucket = cast(EpisodeRow.created_at / bucket_s, Integer)
        else:
            bucket = func.floor(EpisodeRow.created_at / bucket_s)
        ov, on = _outcome_join()
        q = (
            select(
                bucket.label("b"),
                EpisodeRevisionRow.revision,
                func.count(),
                func.avg(_success_value(ov)),
                func.avg(case((_has_human(), 1.0), else_=0.0)),
            )
            .join(EpisodeRow, EpisodeRow.id == EpisodeRevisionRow.episode_id)
            .outerjoin(ov, on)
            .where(EpisodeRow.status == "closed", EpisodeRevisionRow.revision != "")
            .group_by(bucket, EpisodeRevisionRow.revision)
            .order_by(bucket, EpisodeRevisionRow.revision)
        )
        if since is not None:
            q = q.where(EpisodeRow.created_at >= since)
        if until is not None:
            q = q.where(EpisodeRow.created_at <= until)
        with Session(self._reader) as s:
            return [
                TimelinePoint(float(b) * bucket_s, rev, int(n), _rate(sr), _rate(ir))
                for b, rev, n, sr, ir in s.execute(q)
            ]

    # ------------------------------------------------------------------ auto-flags
    def set_flags(self, flags: Mapping[str, Iterable[Flag]]) -> None:
        """Store auto-flag results ``{episode_id: [Flag]}`` in one transaction, replacing earlier results
        of the same names. KeyError for an unknown episode (nothing written)."""
        now = time.time()
        by_ep = {eid: list(fs) for eid, fs in flags.items()}
        with Session(self.engine) as s, s.begin():
            ids = sorted(by_ep)
            known: set[str] = set()
            # lock the episodes' rows (in id order: no deadlock) so two writers of the same flags (the
            # dashboard's start-up refresh and a page's lazy one) take turns instead of both inserting
            for chunk in _chunks(ids):
                q = select(EpisodeRow.id).where(EpisodeRow.id.in_(chunk)).order_by(EpisodeRow.id)
                known.update(s.scalars(q.with_for_update()))
            missing = [e for e in ids if e not in known]
            if missing:
                raise KeyError(f"no episode {missing[0]!r} in the metadata DB")
            for eid, fs in by_ep.items():
                if not fs:
                    continue
                names = [f.name for f in fs]
                s.execute(
                    delete(EpisodeFlagRow).where(
                        EpisodeFlagRow.episode_id == eid, EpisodeFlagRow.name.in_(names)
                    )
                )
                s.add_all(
                    EpisodeFlagRow(
                        episode_id=eid,
                        name=f.name,
                        score=float(f.score),
                        raised=bool(f.raised),
                        detail=f.detail,
                        computed_at=f.computed_at or now,
                        calibration_revision=f.calibration_revision,
                        calibration_n=f.calibration_n,
                        calibrated=f.calibrated,
                    )
                    for f in fs
                )

    def flags(self, episode_ids: Iterable[str], *, raised_only: bool = True) -> dict[str, dict[str, Flag]]:
        """``{episode_id: {name: Flag}}`` for every id given: the raised flags (or every stored check's
        result with ``raised_only=False``)."""
        with Session(self._reader) as s:
            return _read_flags(s, episode_ids, raised_only)

    # ------------------------------------------------------------------ rounds
    def create_round(
        self, *, algo: str, task: str, base_ref: str, config: dict[str, Any], status: RoundStatus = "queued"
    ) -> int:
        """Record a new round (``queued`` for a worker to claim); returns its number (1, 2, ...)."""
        with Session(self.engine) as s, s.begin():
            row = RoundRow(
                algo=algo,
                task=task,
                base_ref=base_ref,
                status=status,
                config=config,
                data={},
                metrics={},
                created_at=time.time(),
                job=RoundJobRow(attempts=0, progress={}),
            )
            s.add(row)
            s.flush()
            return int(row.id)

    # The job queue. Every transition is one transaction: on SQLite under BEGIN IMMEDIATE (writers take
    # turns), on PostgreSQL with SELECT ... FOR UPDATE SKIP LOCKED (workers never claim the same row).
    def claim_round(self, worker: str, round_id: int | None = None) -> RoundRecord | None:
        """Take the oldest queued round (or ``round_id`` if it is queued) for ``worker``: it becomes
        ``running`` with a fresh heartbeat. None when there is nothing to claim."""
        now = time.time()
        with Session(self.engine) as s, s.begin():
            q = select(RoundRow).where(RoundRow.status == "queued").order_by(RoundRow.id).limit(1)
            if round_id is not None:
                q = q.where(RoundRow.id == round_id)
            row = s.scalars(q.with_for_update(skip_locked=True)).first()
            if row is None:
                return None
            job = row.job or RoundJobRow(round_id=row.id, attempts=0, progress={})
            row.job = job
            row.status = "running"
            job.worker, job.claimed_at, job.heartbeat_at = worker, now, now
            job.attempts = (job.attempts or 0) + 1
            s.flush()
            return _round_record(row)

    def heartbeat_round(self, round_id: int, worker: str, progress: dict[str, Any] | None = None) -> bool:
        """The worker still runs ``round_id``; returns True when someone asked to cancel it. Raises
        :class:`RoundLost` when the round is no longer this worker's (re-queued or finished)."""
        with Session(self.engine) as s, s.begin():
            row = s.get(RoundRow, round_id)
            if row is None or row.status != "running" or row.job is None or row.job.worker != worker:
                state = "missing" if row is None else row.status
                raise RoundLost(f"round {round_id} is no longer run by {worker} (it is {state})")
            row.job.heartbeat_at = time.time()
            if progress is not None:
                row.job.progress = {**(row.job.progress or {}), **progress}
            return bool(row.job.cancel_requested)

    def requeue_stale_rounds(self, stale_after_s: float, max_attempts: int) -> list[RoundRecord]:
        """Rounds whose worker stopped heartbeating ``stale_after_s`` ago: queued again, or failed with
        the reason once they were tried ``max_attempts`` times. Returns the rounds it changed."""
        cutoff, changed = time.time() - stale_after_s, []
        with Session(self.engine) as s, s.begin():
            q = (
                select(RoundRow)
                .join(RoundJobRow)
                .where(RoundRow.status == "running", RoundJobRow.heartbeat_at < cutoff)
                .with_for_update(skip_locked=True)
            )
            for row in s.scalars(q):
                job = row.job
                why = f"worker {job.worker} stopped heartbeating (last at {job.heartbeat_at:.0f}, attempt {job.attempts})"
                if job.attempts >= max_attempts:
                    row.status, row.finished_at = "failed", time.time()
                    row.error = f"{why}; gave up after {job.attempts} attempt(s)"
                else:
                    row.status, row.error = "queued", why
                job.worker = None
                s.flush()
                changed.append(_round_record(row))
        return changed

    def cancel_round(self, round_id: int) -> RoundRecord:
        """Cancel a queued round at once; ask a running one's worker to stop (it sees the flag at its next
        heartbeat). A finished round raises ValueError."""
        with Session(self.engine) as s, s.begin():
            row = s.get(RoundRow, round_id)
            if row is None:
                raise KeyError(f"no round {round_id}")
            if row.status in FINISHED_STATUSES:
                raise ValueError(f"round {round_id} already {row.status}; nothing to cancel")
            if row.status == "queued":
                row.status, row.finished_at, row.error = "cancelled", time.time(), "cancelled before it ran"
            row.job = row.job or RoundJobRow(round_id=row.id, attempts=0, progress={})
            row.job.cancel_requested = True
            s.flush()
            return _round_record(row)

    def update_round(self, round_id: int, **fields: Any) -> RoundRecord:
        """Set some of a round's fields (status, metrics, checkpoint_ref, promoted, error, ...)."""
        unknown = set(fields) - set(_ROUND_FIELDS)
        if unknown:
            raise ValueError(
                f"update_round: unknown fields {sorted(unknown)}; expected some of {_ROUND_FIELDS}"
            )
        if "status" in fields and fields["status"] not in ROUND_STATUSES:
            raise ValueError(f"status: expected one of {ROUND_STATUSES}, got {fields['status']!r}")
        with Session(self.engine) as s, s.begin():
            row = s.get(RoundRow, round_id)
            if row is None:
                raise KeyError(f"no round {round_id}")
            for k, v in fields.items():
                setattr(row, k, v)
            s.flush()
            return _round_record(row)

    def round(self, round_id: int) -> RoundRecord | None:
        with Session(self._reader) as s:
            row = s.get(RoundRow, round_id)
            return _round_record(row) if row is not None else None

    def rounds(self, task: str | None = None) -> list[RoundRecord]:
        """Rounds in order, optionally for one task."""
        q = select(RoundRow).order_by(RoundRow.id)
        if task is not None:
            q = q.where(RoundRow.task == task)
        with Session(self._reader) as s:
            return [_round_record(r) for r in s.scalars(q)]

    def round_revisions(self) -> dict[int, list[str]]:
        """Round number -> the checkpoint revisions it produced (for selecting data by round)."""
        return {r.id: [r.checkpoint_revision] for r in self.rounds() if r.checkpoint_revision}


# ---------------------------------------------------------------------- schema (Alembic)
def _alembic_config(connection: Connection | None = None) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    cfg.attributes["connection"] = connection
    return cfg


SCHEMA_HEAD = "0004"
"""The newest migration in fleet/migrations/versions (tests/test_metadata_db.py checks it): opening a DB
at this revision needs no Alembic import, only one query."""


def _legacy_revision(tables: set[str]) -> str | None:
    """The revision a DB without ``alembic_version`` (written by ``create_all`` before migrations) matches:
    the baseline's tables and round_jobs = 0002; the baseline's = 0001 (the release before rounds were
    jobs); else None (the baseline then creates only the tables that are missing)."""
    if tables >= _BASELINE_TABLES | {"round_jobs"}:
        # also when today's tables are all there: 0003 and 0004 add only what is missing (0003 re-derives
        # the labels' ``current`` and the revision rows from the rows themselves)
        return "0002"
    if tables >= _BASELINE_TABLES:
        return "0001"
    return None


def _current_revisions(conn: Connection) -> set[str] | None:
    """The DB's alembic revisions (one query); None when it has no ``alembic_version`` table (the
    transaction is then rolled back: PostgreSQL aborts it on the error)."""
    try:
        return set(conn.execute(text("SELECT version_num FROM alembic_version")).scalars())
    except (OperationalError, ProgrammingError) as e:
        if "alembic_version" not in str(e):
            raise
        conn.rollback()
        return None


def _explain(url: Any, e: BaseException) -> MetadataDBError:
    shown = url.render_as_string(hide_password=True)
    why = str(getattr(e, "orig", None) or e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    hint = (
        "check the file path and that its directory exists and is writable"
        if url.get_backend_name() == "sqlite"
        else "check host and port (is the server running and reachable?), user and password, and that the "
        "database exists (createdb NAME) and the user may create tables in it"
    )
    return MetadataDBError(f"cannot open the metadata DB {shown}: {why}. Fix {_URL_SETTING}: {hint}")


def upgrade_schema(engine: Engine) -> str:
    """Bring the DB to the newest migration (creating it when empty, stamping a pre-Alembic one by the
    tables it holds). One query when already there; otherwise under a lock, so concurrent first opens
    cannot race: SQLite's BEGIN IMMEDIATE, PostgreSQL's transaction-scoped advisory lock. Returns the
    revision it is at."""
    head = SCHEMA_HEAD
    try:
        with engine.connect() as conn:
            if _current_revisions(conn) == {head}:
                conn.rollback()
                return head
            conn.rollback()
            with conn.begin():  # SQLite: BEGIN IMMEDIATE (see _sqlite_setup), so writers wait here
                if conn.dialect.name == "postgresql":
                    conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_MIGRATION_LOCK})
                _upgrade_locked(conn, head)
    except MetadataDBError:
        raise
    except DBAPIError as e:
        raise _explain(engine.url, e) from e
    return head


@contextmanager
def _quiet_alembic() -> Iterator[None]:
    """Alembic logs each step at INFO; a CLI that opens a new DB must not start its output with that."""
    logger = logging.getLogger("alembic")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def _upgrade_locked(conn: Connection, head: str) -> None:
    with _quiet_alembic():
        from alembic import command
        from alembic.runtime.migration import MigrationContext
        from alembic.script import ScriptDirectory

        cfg = _alembic_config(conn)
        current = set(MigrationContext.configure(conn).get_current_heads())
        if current == {head}:
            return  # another process upgraded it while we waited for the lock
        known = {s.revision for s in ScriptDirectory.from_config(cfg).walk_revisions()}
        if current - known:
            raise MetadataDBError(
                f"the metadata DB {conn.engine.url.render_as_string(hide_password=True)} is at schema "
                f"revision {sorted(current - known)}, newer than this vla-rl knows (head {head}): upgrade vla-rl"
            )
        if not current:
            tables = set(inspect(conn).get_table_names()) - {"alembic_version"}
            legacy = _legacy_revision(tables) if tables else None
            if legacy is not None:
                command.stamp(cfg, legacy)
        command.upgrade(cfg, "head")
    log.debug("metadata DB schema upgraded", extra={"from": sorted(current), "to": head})


# ---------------------------------------------------------------------- SQL building blocks
def _chunks(ids: list[str]) -> Iterator[list[str]]:
    for i in range(0, len(ids), _ID_CHUNK):
        yield ids[i : i + _ID_CHUNK]


def _sync_revisions(s: Session, episode_id: str, revisions: Iterable[str]) -> None:
    """Make the episode's ``episode_revisions`` rows match its revision list."""
    s.execute(delete(EpisodeRevisionRow).where(EpisodeRevisionRow.episode_id == episode_id))
    rows = [{"episode_id": episode_id, "revision": str(r)} for r in dict.fromkeys(revisions)]
    if rows:
        s.execute(insert(EpisodeRevisionRow.__table__), rows)


def _read_current_events(s: Session, episode_ids: Iterable[str]) -> dict[str, list[Label]]:
    ids = list(dict.fromkeys(episode_ids))
    out: dict[str, list[Label]] = {e: [] for e in ids}
    for chunk in _chunks(ids):
        q = (
            select(LabelRow)
            .where(LabelRow.episode_id.in_(chunk), LabelRow.current.is_(True))
            .order_by(LabelRow.id)
        )
        spans: list[Label] = []
        for r in s.scalars(q):
            if r.start is None and r.segment_index is None:
                out[r.episode_id].append(_label(r, None))
            elif r.start is not None:
                spans.append(_label(r, None))
        for lb in sorted(spans, key=lambda x: (x.start, x.id)):
            out[lb.episode_id].append(lb)
    return out


def _read_flags(s: Session, episode_ids: Iterable[str], raised_only: bool) -> dict[str, dict[str, Flag]]:
    ids = list(dict.fromkeys(episode_ids))
    out: dict[str, dict[str, Flag]] = {e: {} for e in ids}
    for chunk in _chunks(ids):
        q = select(EpisodeFlagRow).where(EpisodeFlagRow.episode_id.in_(chunk))
        if raised_only:
            q = q.where(EpisodeFlagRow.raised.is_(True))
        for r in s.scalars(q.order_by(EpisodeFlagRow.name)):
            out[r.episode_id][r.name] = Flag(
                r.name,
                r.score,
                r.detail,
                bool(r.raised),
                r.computed_at,
                calibrated=None if r.calibrated is None else bool(r.calibrated),
                calibration_revision=r.calibration_revision,
                calibration_n=r.calibration_n,
            )
    return out


def _check_label(
    key: str,
    author: str,
    source: str,
    start: int | None,
    end: int | None,
    note: str | None,
    segment_index: int | None,
) -> None:
    if not isinstance(key, str) or not key.strip():
        raise ValueError(f"key: expected a non-empty label key, got {key!r}")
    if not isinstance(author, str) or not author.strip():
        raise ValueError(f"author: expected a non-empty name (who labels), got {author!r}")
    if source not in LABEL_SOURCES:
        raise ValueError(f"source: expected one of {'|'.join(LABEL_SOURCES)}, got {source!r}")
    if note is not None and not isinstance(note, str):
        raise ValueError(f"note: expected text, got {type(note).__name__}")
    if segment_index is not None and (not _is_int(segment_index) or segment_index < 0):
        raise ValueError(f"segment_index: expected a segment index >= 0, got {segment_index!r}")
    if (start is None) != (end is None):
        raise ValueError(
            f"start/end: expected both (the span [start, end), end exclusive) or neither (the whole "
            f"episode), got start={start!r}, end={end!r}"
        )
    if start is not None:
        if not _is_int(start) or start < 0:
            raise ValueError(f"start: expected a frame index >= 0, got {start!r}")
        if not _is_int(end) or end <= start:  # type: ignore[operator]
            raise ValueError(f"end: expected a frame index > start ({start}), end exclusive, got {end!r}")


def _label(r: LabelRow, undone_by: int | None) -> Label:
    return Label(
        id=r.id,
        episode_id=r.episode_id,
        segment_index=r.segment_index,
        key=r.key,
        value=r.value,
        author=r.author,
        created_at=r.created_at,
        start=r.start,
        end=r.end,
        note=r.note,
        source=r.source or "human",
        undoes=r.undoes,
        undone_by=undone_by,
    )


def _live(lb: Any) -> ColumnElement[bool]:
    """Label events in force: not undo events and not undone (``lb``: LabelRow or an alias of it)."""
    undo = aliased(LabelRow, name="undo_event")
    return and_(lb.undoes.is_(None), lb.id.not_in(select(undo.undoes).where(undo.undoes.is_not(None))))


def _episode_level(lb: Any) -> ColumnElement[bool]:
    return and_(lb.start.is_(None), lb.segment_index.is_(None))


def _current_ids(key: str, texts: list[str] | None = None) -> Any:
    """``SELECT episode_id`` of the episodes whose current episode-level ``key`` is one of ``texts``
    (lower-cased JSON texts; None = has any value)."""
    sel = select(LabelRow.episode_id).where(
        LabelRow.key == key, LabelRow.current.is_(True), _episode_level(LabelRow)
    )
    if texts is not None:
        sel = sel.where(func.lower(cast(LabelRow.value, Text)).in_(texts))
    return sel


def _outcome_join() -> tuple[Any, ColumnElement[bool]]:
    """An alias of ``labels`` and the ON clause that outer-joins each episode's current outcome label."""
    ov = aliased(LabelRow, name="outcome_label")
    on = and_(ov.episode_id == EpisodeRow.id, ov.key == OUTCOME_KEY, ov.current.is_(True), _episode_level(ov))
    return ov, on


def _json_texts(value: str) -> list[str]:
    """The JSON texts (lower-cased) a label value given as text matches: the string itself, and the
    number / boolean / null it spells (``true`` matches true and "true")."""
    out = [json.dumps(value).lower()]
    try:
        parsed = json.loads(value)
    except ValueError:
        return out
    if not isinstance(parsed, dict | list | str):
        out.append(json.dumps(parsed).lower())
    return out


def _has_human() -> Any:
    """The episode has a human segment (an uncorrelated IN: one hashed scan of ``segments``)."""
    return EpisodeRow.id.in_(
        select(SegmentRow.episode_id).where(SegmentRow.controller == Controller.HUMAN.label)
    )


def _success_value(ov: Any) -> Any:
    """1.0 / 0.0 for the effective success (``ov``: the outer-joined outcome label, which overrides),
    NULL when unknown."""
    return case(
        (cast(ov.value, Text) == json.dumps("success"), 1.0),
        (ov.id.is_not(None), 0.0),
        (EpisodeRow.success.is_(True), 1.0),
        (EpisodeRow.success.is_(False), 0.0),
        else_=None,
    )


def _rate(v: Any) -> float | None:
    return None if v is None else float(v)


def _episode_filters(q: EpisodeQuery) -> list[ColumnElement[bool]]:
    """The WHERE clauses of an episode query (correlated subqueries on ``episodes``)."""
    w: list[ColumnElement[bool]] = []
    if q.task is not None:
        w.append(EpisodeRow.task == q.task)
    if q.robot is not None:
        w.append(EpisodeRow.robot_id == q.robot)
    if q.status is not None:
        w.append(EpisodeRow.status == q.status)
    if q.outcome is not None:
        overridden = EpisodeRow.id.in_(_current_ids(OUTCOME_KEY))
        if q.outcome == "unknown":
            w.append(and_(~overridden, or_(EpisodeRow.outcome.is_(None), EpisodeRow.outcome == "unknown")))
        else:
            w.append(
                or_(
                    EpisodeRow.id.in_(_current_ids(OUTCOME_KEY, [json.dumps(q.outcome).lower()])),
                    and_(~overridden, EpisodeRow.outcome == q.outcome),
                )
            )
    if q.revision is not None:
        w.append(
            EpisodeRow.id.in_(
                select(EpisodeRevisionRow.episode_id).where(EpisodeRevisionRow.revision == q.revision)
            )
        )
    if q.round is not None:
        rev = select(RoundRow.checkpoint_revision).where(RoundRow.id == q.round).scalar_subquery()
        w.append(
            EpisodeRow.id.in_(select(EpisodeRevisionRow.episode_id).where(EpisodeRevisionRow.revision == rev))
        )
    for key, value in q.labels.items():
        w.append(EpisodeRow.id.in_(_current_ids(key, _json_texts(value))))
    if q.intervention is not None:
        w.append(_has_human() if q.intervention else ~_has_human())
    if q.flags:
        w.append(
            EpisodeRow.id.in_(
                select(EpisodeFlagRow.episode_id).where(
                    EpisodeFlagRow.raised.is_(True), EpisodeFlagRow.name.in_(q.flags)
                )
            )
        )
    if q.flagged is not None:
        any_flag = EpisodeRow.id.in_(select(EpisodeFlagRow.episode_id).where(EpisodeFlagRow.raised.is_(True)))
        w.append(any_flag if q.flagged else ~any_flag)
    if q.since is not None:
        w.append(EpisodeRow.created_at >= q.since)
    if q.until is not None:
        w.append(EpisodeRow.created_at <= q.until)
    if q.min_length is not None:
        w.append(EpisodeRow.length >= q.min_length)
    if q.max_length is not None:
        w.append(EpisodeRow.length <= q.max_length)
    return w


def _round_record(row: RoundRow) -> RoundRecord:
    job = row.job
    return RoundRecord(
        worker=job.worker if job else None,
        heartbeat_at=job.heartbeat_at if job else None,
        attempts=job.attempts if job else 0,
        cancel_requested=bool(job.cancel_requested) if job else False,
        progress=dict(job.progress or {}) if job else {},
        id=row.id,
        algo=row.algo,
        task=row.task,
        base_ref=row.base_ref,
        base_revision=row.base_revision,
        status=row.status,
        config=dict(row.config or {}),
        data=dict(row.data or {}),
        metrics=dict(row.metrics or {}),
        checkpoint_ref=row.checkpoint_ref,
        checkpoint_revision=row.checkpoint_revision,
        promoted=bool(row.promoted),
        error=row.error,
        created_at=row.created_at,
        finished_at=row.finished_at,
    )


def _record(row: EpisodeRow) -> EpisodeRecord:
    return EpisodeRecord(
        id=row.id,
        robot_id=row.robot_id,
        task=row.task,
        instruction=row.instruction,
        store_path=row.store_path,
        status=row.status,
        outcome=row.outcome,
        success=row.success,
        length=row.length,
        created_at=row.created_at,
        closed_at=row.closed_at,
        revisions=tuple(row.revisions),
        segments=tuple(
            Segment.from_dict(
                {
                    "index": g.index,
                    "kind": g.kind,
                    "controller": g.controller,
                    "start": g.start,
                    "end": g.end,
                    "reason": g.reason,
                }
            )
            for g in row.segments
        ),
    )
