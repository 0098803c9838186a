"""Labels: append-only events (a value for a key, about a whole episode or a frame span of it, or an
undo), the current value of each key, and the outcome label that overrides the recorded outcome."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from sqlalchemy import ColumnElement, and_, select, update
from sqlalchemy.orm import Session, aliased

from fleet.db.engine import DBPart, _chunks
from fleet.db.schema import EpisodeRow, LabelRow, SegmentRow
from fleet.selection import is_int
from vla_rl.core.text import check_json_text, check_text

LabelSource = Literal["human", "auto"]
LABEL_SOURCES: tuple[str, ...] = get_args(LabelSource)
MAX_NAME_CHARS = 128
"""Longest label key and author (their columns' size)."""
MAX_NOTE_CHARS = 2000
"""Longest note of a label event."""
MAX_VALUE_TEXT_CHARS = 4096
"""Longest text inside a label's value (a free-text value, a path an import records)."""
OUTCOME_KEY = "outcome"
"""The episode label whose current value overrides the recorded outcome: for a selection's ``success=``
and ``outcome=`` (:mod:`fleet.selection`), training credit, the episode list, the fleet statistics and
LeRobot export. Its value is the outcome (``success`` -> success True, any other value -> False)."""


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


class LabelsPart(DBPart):
    """Writing and reading label events (``MetadataDB``'s label methods)."""

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
        a source other than human|auto, a span outside the episode (spans need a closed episode), or text
        (key, author, note, any string in the value) that is not valid Unicode, holds a control character or
        is too long (:data:`MAX_NAME_CHARS`, :data:`MAX_NOTE_CHARS`, :data:`MAX_VALUE_TEXT_CHARS`)."""
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
        check_json_text(value, "value", max_chars=MAX_VALUE_TEXT_CHARS, multiline=True)
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


def _check_label(
    key: str,
    author: str,
    source: str,
    start: int | None,
    end: int | None,
    note: str | None,
    segment_index: int | None,
) -> None:
    """What every label event is checked for before it is written (ValueError naming the field); its text
    goes through :func:`vla_rl.core.text.check_text` (valid Unicode, no control characters, bounded)."""
    if not isinstance(key, str) or not key.strip():
        raise ValueError(f"key: expected a non-empty label key, got {key!r}")
    check_text(key, "key", max_chars=MAX_NAME_CHARS)
    if not isinstance(author, str) or not author.strip():
        raise ValueError(f"author: expected a non-empty name (who labels), got {author!r}")
    check_text(author, "author", max_chars=MAX_NAME_CHARS)
    if source not in LABEL_SOURCES:
        raise ValueError(f"source: expected one of {'|'.join(LABEL_SOURCES)}, got {source!r}")
    if note is not None:
        check_text(note, "note", max_chars=MAX_NOTE_CHARS, multiline=True)
    if segment_index is not None and (not is_int(segment_index) or segment_index < 0):
        raise ValueError(f"segment_index: expected a segment index >= 0, got {segment_index!r}")
    if (start is None) != (end is None):
        raise ValueError(
            f"start/end: expected both (the span [start, end), end exclusive) or neither (the whole "
            f"episode), got start={start!r}, end={end!r}"
        )
    if start is not None:
        if not is_int(start) or start < 0:
            raise ValueError(f"start: expected a frame index >= 0, got {start!r}")
        if not is_int(end) or end <= start:  # type: ignore[operator]
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
