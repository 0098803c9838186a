"""A :class:`~fleet.selection.Selection` in SQL (:func:`selection_where`: the WHERE clauses on
``episodes``, the same on SQLite and PostgreSQL), with the building blocks the statistics share (the
effective outcome, human segments)."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import ColumnElement, Text, and_, case, cast, func, or_, select
from sqlalchemy.orm import Session, aliased
from vla_rl_client.meta import Controller

from fleet.db.engine import _chunks
from fleet.db.labels import OUTCOME_KEY, _episode_level
from fleet.db.schema import EpisodeFlagRow, EpisodeRevisionRow, EpisodeRow, LabelRow, RoundRow, SegmentRow
from fleet.selection import WILDCARD, Selection


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


def _effective_success() -> ColumnElement[bool]:
    """The episode counts as a success, as :func:`fleet.db.labels.effective_outcome` says: its current
    ``outcome`` label is ``"success"``, or it has no such label (a JSON null is none) and its recorded
    success is true. Never NULL, so its negation is "not a success" (failures and unknown outcomes)."""
    value = cast(LabelRow.value, Text)
    said = select(LabelRow.episode_id).where(
        LabelRow.key == OUTCOME_KEY, LabelRow.current.is_(True), _episode_level(LabelRow)
    )
    return or_(
        EpisodeRow.id.in_(said.where(value == json.dumps("success"))),
        and_(EpisodeRow.id.not_in(said.where(value != "null")), EpisodeRow.success.is_(True)),
    )


def _robots(robots: tuple[str, ...]) -> ColumnElement[bool]:
    """Any of these robot ids; one ending in ``*`` is a prefix (compared as is: case-sensitive on both
    backends, where LIKE is not)."""
    exact = [r for r in robots if not r.endswith(WILDCARD)]
    prefixes = [r[:-1] for r in robots if r.endswith(WILDCARD)]
    return or_(
        *([EpisodeRow.robot_id.in_(exact)] if exact else []),
        *(func.substr(EpisodeRow.robot_id, 1, len(p)) == p for p in prefixes),
    )


def _acted(revisions: Any) -> ColumnElement[bool]:
    """One of ``revisions`` (a list or a subquery) acted in the episode."""
    return EpisodeRow.id.in_(
        select(EpisodeRevisionRow.episode_id).where(EpisodeRevisionRow.revision.in_(revisions))
    )


def _filters(q: Selection) -> list[ColumnElement[bool]]:
    """Every key of ``q`` but ``max`` as WHERE clauses (uncorrelated subqueries on ``episodes``)."""
    w: list[ColumnElement[bool]] = []
    if q.task is not None:
        w.append(EpisodeRow.task == q.task)
    if q.robots:
        w.append(_robots(q.robots))
    if q.status is not None:
        w.append(EpisodeRow.status == q.status)
    if q.success is not None:
        w.append(_effective_success() if q.success else ~_effective_success())
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
    if q.revisions:
        w.append(_acted(list(q.revisions)))
    if q.rounds:
        w.append(_acted(select(RoundRow.checkpoint_revision).where(RoundRow.id.in_(q.rounds))))
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
    if q.closed_since is not None:
        w.append(EpisodeRow.closed_at >= q.closed_since)
    if q.closed_until is not None:
        w.append(EpisodeRow.closed_at <= q.closed_until)
    if q.min_length is not None:
        w.append(EpisodeRow.length >= q.min_length)
    if q.max_length is not None:
        w.append(EpisodeRow.length <= q.max_length)
    w += [EpisodeRow.id.not_in(chunk) for chunk in _chunks(list(q.exclude))]
    return w


def selection_where(q: Selection, *also: ColumnElement[bool]) -> list[ColumnElement[bool]]:
    """The WHERE clauses of ``q`` and ``also`` (e.g. closed episodes only): ``max`` keeps the most
    recent (created_at, then id) of what the rest selects."""
    w = [*also, *_filters(q)]
    if q.max_episodes is None:
        return w
    recent = (
        select(EpisodeRow.id)
        .where(*w)
        .order_by(EpisodeRow.created_at.desc(), EpisodeRow.id.desc())
        .limit(q.max_episodes)
    )
    return [EpisodeRow.id.in_(recent)]


def check_rounds(s: Session, q: Selection) -> None:
    """ValueError naming ``round`` when ``q`` names a round the DB does not hold."""
    if not q.rounds:
        return
    known = set(s.scalars(select(RoundRow.id).where(RoundRow.id.in_(q.rounds))))
    missing = [r for r in q.rounds if r not in known]
    if missing:
        raise ValueError(f"round: no round {missing[0]} in the metadata DB")
