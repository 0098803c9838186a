"""Fleet statistics for the dashboard: per robot, per checkpoint revision, and per revision over time,
each one grouped query."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import Integer, and_, case, cast, func, select
from sqlalchemy.orm import Session, aliased

from fleet.db.engine import DBPart
from fleet.db.query import _has_human, _outcome_join, _success_value
from fleet.db.schema import EpisodeRevisionRow, EpisodeRow


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


class StatsPart(DBPart):
    """Grouped statistics over episodes (``MetadataDB``'s statistics methods)."""

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


def _rate(v: Any) -> float | None:
    return None if v is None else float(v)
