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

import logging
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from sqlalchemy import JSON, ForeignKey, String, Text, create_engine, event, inspect, make_url, select, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, OperationalError, ProgrammingError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, relationship, selectinload

from fleet.meta import EpisodeMeta, EpisodeRecord, Segment

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
    created_at: Mapped[float]
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
    __tablename__ = "labels"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    episode_id: Mapped[str] = mapped_column(ForeignKey("episodes.id", ondelete="CASCADE"), index=True)
    segment_index: Mapped[int | None]  # None: the label is about the whole episode
    key: Mapped[str] = mapped_column(String(128), index=True)
    value: Mapped[Any] = mapped_column(JSON)
    author: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[float]


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


@dataclass(frozen=True)
class Label:
    id: int
    episode_id: str
    segment_index: int | None
    key: str
    value: Any
    author: str
    created_at: float


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

    # ------------------------------------------------------------------ labels
    def add_label(
        self, episode_id: str, key: str, value: Any, *, author: str, segment_index: int | None = None
    ) -> int:
        """Attach a label (any JSON value) to an episode or one of its segments; returns the label id.

        Labels are never overwritten: a relabel is a newer label with the same key.
        """
        if not key:
            raise ValueError("label key must be non-empty")
        with Session(self.engine) as s, s.begin():
            if s.get(EpisodeRow, episode_id) is None:
                raise KeyError(f"no episode {episode_id!r} in the metadata DB")
            row = LabelRow(
                episode_id=episode_id,
                segment_index=segment_index,
                key=key,
                value=value,
                author=author,
                created_at=time.time(),
            )
            s.add(row)
            s.flush()
            return row.id

    def labels(self, episode_id: str | None = None, key: str | None = None) -> list[Label]:
        """Labels in the order they were added, filtered by episode / key when given."""
        q = select(LabelRow).order_by(LabelRow.id)
        if episode_id is not None:
            q = q.where(LabelRow.episode_id == episode_id)
        if key is not None:
            q = q.where(LabelRow.key == key)
        with Session(self._reader) as s:
            return [
                Label(r.id, r.episode_id, r.segment_index, r.key, r.value, r.author, r.created_at)
                for r in s.scalars(q)
            ]

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


SCHEMA_HEAD = "0002"
"""The newest migration in fleet/migrations/versions (tests/test_metadata_db.py checks it): opening a DB
at this revision needs no Alembic import, only one query."""


def _legacy_revision(tables: set[str]) -> str | None:
    """The revision a DB without ``alembic_version`` (written by ``create_all`` before migrations) matches:
    all of today's tables = head; the baseline's = 0001 (the release before rounds were jobs); else None
    (the baseline then creates only the tables that are missing)."""
    if set(Base.metadata.tables) <= tables:
        return SCHEMA_HEAD
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
