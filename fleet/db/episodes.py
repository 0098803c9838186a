"""Episodes: recording them as writers open and close them (or in bulk), reading them back, and the
episode list (:class:`EpisodeSummary` pages of a :class:`~fleet.selection.EpisodeQuery`), and the
closed episodes a :class:`~fleet.selection.Selection` selects, all in SQL."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, insert, select
from sqlalchemy.orm import Session, selectinload
from vla_rl_client.meta import Controller, EpisodeMeta, EpisodeRecord, Segment

from fleet.db.engine import DBPart
from fleet.db.flags import Flag, _read_flags
from fleet.db.labels import _read_current_events, effective_outcome
from fleet.db.query import check_rounds, selection_where
from fleet.db.schema import EpisodeRevisionRow, EpisodeRow, SegmentRow
from fleet.selection import EpisodeQuery, Selection


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


class EpisodesPart(DBPart):
    """Recording and reading episodes (``MetadataDB``'s episode methods)."""

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

    def query_episodes(self, q: EpisodeQuery) -> tuple[list[EpisodeSummary], int]:
        """One page of the episode list and the total number of matches, filtered, sorted and paged in
        SQL (the same on SQLite and PostgreSQL). ValueError for a round that does not exist."""
        with Session(self._reader) as s:
            check_rounds(s, q)
            where = selection_where(q)
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
            check_rounds(s, q)
            col = getattr(EpisodeRow, q.sort.lstrip("-"))
            desc = q.sort.startswith("-")
            order = [col.desc(), EpisodeRow.id.desc()] if desc else [col.asc(), EpisodeRow.id.asc()]
            sel = select(EpisodeRow.id).where(*selection_where(q)).order_by(*order).limit(limit)
            return list(s.scalars(sel))

    def select_ids(self, q: Selection) -> list[str]:
        """The closed episodes ``q`` selects (what a round trains on), oldest first (created_at, then id):
        one query. ValueError naming ``round`` for a round the DB does not hold."""
        with Session(self._reader) as s:
            check_rounds(s, q)
            sel = select(EpisodeRow.id).where(*selection_where(q, EpisodeRow.status == "closed"))
            return list(s.scalars(sel.order_by(EpisodeRow.created_at, EpisodeRow.id)))

    def select_records(self, q: Selection) -> list[EpisodeRecord]:
        """:meth:`select_ids` as records, with their segments (lengths, outcomes, takeovers)."""
        with Session(self._reader) as s:
            check_rounds(s, q)
            sel = (
                select(EpisodeRow)
                .options(selectinload(EpisodeRow.segments))
                .where(*selection_where(q, EpisodeRow.status == "closed"))
                .order_by(EpisodeRow.created_at, EpisodeRow.id)
            )
            return [_record(r) for r in s.scalars(sel)]

    def closed_episode_index(self) -> list[tuple[str, str, int]]:
        """``(id, task, length)`` of every closed episode (auto-flags' length distributions)."""
        with Session(self._reader) as s:
            q = select(EpisodeRow.id, EpisodeRow.task, EpisodeRow.length).where(EpisodeRow.status == "closed")
            return [(r.id, r.task, int(r.length)) for r in s.execute(q)]

    def episode_ids(self) -> list[str]:
        """Every recorded episode's id (open and closed), sorted: one column, cheap at 10k+ rows."""
        with Session(self._reader) as s:
            return list(s.scalars(select(EpisodeRow.id).order_by(EpisodeRow.id)))


def _sync_revisions(s: Session, episode_id: str, revisions: Iterable[str]) -> None:
    """Make the episode's ``episode_revisions`` rows match its revision list."""
    s.execute(delete(EpisodeRevisionRow).where(EpisodeRevisionRow.episode_id == episode_id))
    rows = [{"episode_id": episode_id, "revision": str(r)} for r in dict.fromkeys(revisions)]
    if rows:
        s.execute(insert(EpisodeRevisionRow.__table__), rows)


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
