"""Post-training rounds and their job queue: a round is a row from the moment it is queued; workers
claim, heartbeat and finish it, each transition one transaction (SQLite: under ``BEGIN IMMEDIATE``,
writers take turns; PostgreSQL: ``SELECT ... FOR UPDATE SKIP LOCKED``, workers never claim the same row)."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Literal, get_args

from sqlalchemy import select
from sqlalchemy.orm import Session

from fleet.db.engine import DBPart
from fleet.db.schema import RoundJobRow, RoundRow

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


def worker_id() -> str:
    """This process's name as a round worker (``claim_round``, ``heartbeat_round``): ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


class RoundsPart(DBPart):
    """Rounds and the round job queue (``MetadataDB``'s round methods)."""

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

    def begin_commit(self, round_id: int, worker: str) -> bool:
        """The round ``worker`` runs is about to push and promote: mark it committing, unless a cancel was
        asked first (then False: the round must stop without pushing). One transaction on the round's row,
        so a cancel either lands before (and wins) or after (and no longer applies). Raises
        :class:`RoundLost` when the round is not ``worker``'s running round."""
        with Session(self.engine) as s, s.begin():
            row = s.get(RoundRow, round_id, with_for_update=True)
            if row is None or row.status != "running" or row.job is None or row.job.worker != worker:
                state = "missing" if row is None else row.status
                raise RoundLost(f"round {round_id} is no longer run by {worker} (it is {state})")
            if row.job.cancel_requested:
                return False
            row.job.committing_at = time.time()
            return True

    def cancel_running(self, round_id: int, why: str = "cancelled while running") -> RoundRecord:
        """Record a running round as cancelled: only if it is still running and has not begun committing
        (:meth:`begin_commit`), in one transaction. Returns the round as it is now: ``cancelled``, or still
        ``running`` (it is pushing: it finishes) or already finished (its own record stands)."""
        with Session(self.engine) as s, s.begin():
            row = s.get(RoundRow, round_id, with_for_update=True)
            if row is None:
                raise KeyError(f"no round {round_id}")
            if row.status == "running" and (row.job is None or row.job.committing_at is None):
                row.status, row.finished_at, row.error = "cancelled", time.time(), why
                s.flush()
            return _round_record(row)

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
