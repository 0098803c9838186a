"""The metadata DB's tables as SQLAlchemy ORM rows (Alembic's ``fleet/migrations`` creates and upgrades
them; ``fleet/migrations/env.py`` compares against ``Base.metadata``)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, ForeignKey, Index, String, Text, false
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


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
    # the threshold a fleet-calibrated check (stillness, jerk, length_outlier) was judged by and how many
    # other episodes of the task it rested on (NULL for other checks and results before migration 0007)
    threshold: Mapped[float | None]
    reference_n: Mapped[int | None]


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
    committing_at: Mapped[float | None] = mapped_column(default=None)
    """When the round started pushing / promoting: past it, a cancel no longer applies (migration 0005)."""


class HelpRequestRow(Base):
    """A robot's request for an operator (``fleet.db.help``): opened by the robot through the collector,
    claimed by one person, then resolved (or expired while nobody took it)."""

    __tablename__ = "help_requests"
    __table_args__ = (Index("ix_help_requests_status_urgency", "status", "urgency"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    robot_id: Mapped[str] = mapped_column(String(128), index=True)
    episode_id: Mapped[str] = mapped_column(String(128), index=True)
    reason: Mapped[str] = mapped_column(String(256))
    urgency: Mapped[float]
    status: Mapped[str] = mapped_column(String(16), index=True)  # open | claimed | resolved | expired
    created_at: Mapped[float] = mapped_column(index=True)
    claimed_by: Mapped[str | None] = mapped_column(String(64))
    claimed_at: Mapped[float | None]
    closed_at: Mapped[float | None]
    note: Mapped[str | None] = mapped_column(String(256))  # how it was resolved / why it expired
