"""Auto-flag results (:mod:`fleet.flags` computes them): stored per episode and check, read back, and
the episodes each check still lacks or that calibrate a revision's uncertainty."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from fleet.db.engine import DBPart, _chunks
from fleet.db.query import selection_where
from fleet.db.schema import EpisodeFlagRow, EpisodeRevisionRow, EpisodeRow
from fleet.selection import Selection


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
    """``high_uncertainty``: True: judged by ``calibration_revision``'s calibration on ``calibration_n`` successful episodes;
    False: not (with a revision: it had only ``calibration_n`` of them, too few, a provisional result; without
    one: judged by no revision's calibration, e.g. no scores); None: no basis recorded (another check, or a
    result stored before the metadata DB kept it). A check judged against the fleet
    (:mod:`fleet.flag_fleet`): True: by the task's quantile (``threshold``, ``reference_n``); False: by the
    fixed threshold (too few episodes of the task)."""
    calibration_revision: str | None = None
    """The checkpoint revision whose calibration the result depends on (None: none)."""
    calibration_n: int | None = None
    """How many of that revision's successful episodes the calibration had (None: no revision)."""
    threshold: float | None = None
    """A fleet-judged check's (:mod:`fleet.flag_fleet`): the value the score had to pass (None: other checks,
    or a result stored before the metadata DB kept it)."""
    reference_n: int | None = None
    """... and how many other episodes of the task that threshold rested on (``calibrated`` False: too few,
    the fixed threshold judged it)."""

    def __post_init__(self) -> None:
        if (self.calibration_revision is None) != (self.calibration_n is None):
            raise ValueError(
                "calibration_n: expected a count exactly when calibration_revision is given, got "
                f"{self.calibration_n!r} with revision {self.calibration_revision!r}"
            )
        if self.calibration_revision is not None and self.calibrated is None:
            raise ValueError("calibrated: expected true or false with a calibration_revision, got None")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"score": self.score, "detail": self.detail}
        if self.threshold is not None:
            out |= {
                "threshold": self.threshold,
                "reference_n": self.reference_n,
                "calibrated": self.calibrated,
            }
        return out


_CALIBRATION = Selection(status="closed", outcome="success", intervention=False)
"""Closed, successful (effective outcome), no takeover: the episodes that calibrate a revision's
uncertainty CUSUM (docs/algorithms.md §6a's held-out successful episodes)."""


class FlagsPart(DBPart):
    """Storing and reading auto-flag results (``MetadataDB``'s flag methods)."""

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
                        threshold=f.threshold,
                        reference_n=f.reference_n,
                    )
                    for f in fs
                )

    def flags(self, episode_ids: Iterable[str], *, raised_only: bool = True) -> dict[str, dict[str, Flag]]:
        """``{episode_id: {name: Flag}}`` for every id given: the raised flags (or every stored check's
        result with ``raised_only=False``)."""
        with Session(self._reader) as s:
            return _read_flags(s, episode_ids, raised_only)

    def calibration_counts(self) -> dict[str, tuple[int, float]]:
        """Per checkpoint revision: how many closed episodes it acted in are successful (effective
        outcome) without a takeover, and the newest one's ``closed_at`` (auto-flags' uncertainty
        calibration, :mod:`fleet.flags`; one grouped query). The empty revision is not one."""
        q = (
            select(EpisodeRevisionRow.revision, func.count(), func.max(EpisodeRow.closed_at))
            .join(EpisodeRow, EpisodeRow.id == EpisodeRevisionRow.episode_id)
            .where(EpisodeRevisionRow.revision != "", *selection_where(_CALIBRATION))
            .group_by(EpisodeRevisionRow.revision)
        )
        with Session(self._reader) as s:
            return {rev: (int(n), float(newest or 0.0)) for rev, n, newest in s.execute(q)}

    def calibration_episode_ids(self, revision: str) -> list[str]:
        """The episodes :meth:`calibration_counts` counts for ``revision``, oldest first."""
        q = (
            select(EpisodeRow.id)
            .join(EpisodeRevisionRow, EpisodeRow.id == EpisodeRevisionRow.episode_id)
            .where(EpisodeRevisionRow.revision == revision, *selection_where(_CALIBRATION))
            .order_by(EpisodeRow.created_at, EpisodeRow.id)
        )
        with Session(self._reader) as s:
            return list(s.scalars(q))

    def episode_tasks(self, episode_ids: Iterable[str]) -> dict[str, str]:
        """``{episode_id: task}`` of the closed episodes among ``episode_ids`` (a primary-key lookup)."""
        out: dict[str, str] = {}
        with Session(self._reader) as s:
            for chunk in _chunks(list(dict.fromkeys(episode_ids))):
                q = select(EpisodeRow.id, EpisodeRow.task).where(
                    EpisodeRow.id.in_(chunk), EpisodeRow.status == "closed"
                )
                out.update({eid: task for eid, task in s.execute(q)})
        return out

    def task_closed_counts(self, tasks: Iterable[str]) -> dict[str, tuple[int, float]]:
        """Per task: how many closed episodes it has and the newest one's ``closed_at`` (when a flag judged
        against the task's episodes is out of date, :func:`fleet.flag_fleet.needs_rejudging`)."""
        wanted = sorted(set(tasks))
        if not wanted:
            return {}
        q = (
            select(EpisodeRow.task, func.count(), func.max(EpisodeRow.closed_at))
            .where(EpisodeRow.status == "closed", EpisodeRow.task.in_(wanted))
            .group_by(EpisodeRow.task)
        )
        with Session(self._reader) as s:
            return {task: (int(n), float(newest or 0.0)) for task, n, newest in s.execute(q)}

    def flag_scores(self, name: str, task: str, limit: int) -> list[tuple[str, float]]:
        """``(episode_id, score)`` of the stored ``name`` results of the task's newest ``limit`` closed
        episodes that have one, newest first (the fleet's distribution of that check's metric)."""
        q = (
            select(EpisodeFlagRow.episode_id, EpisodeFlagRow.score)
            .join(EpisodeRow, EpisodeRow.id == EpisodeFlagRow.episode_id)
            .where(EpisodeFlagRow.name == name, EpisodeRow.task == task, EpisodeRow.status == "closed")
            .order_by(EpisodeRow.created_at.desc(), EpisodeRow.id)
            .limit(limit)
        )
        with Session(self._reader) as s:
            return [(eid, float(score)) for eid, score in s.execute(q)]

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
                threshold=r.threshold,
                reference_n=r.reference_n,
            )
    return out
