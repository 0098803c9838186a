"""Robots' help requests: the queue a human operator works from.

A robot whose alarm fired (or that asks outright) opens a request through the collector
(:meth:`HelpPart.open_help`): its robot and episode, why, and an urgency score (the failure predictor's
score or the standardised uncertainty; bigger = sooner). The queue (:meth:`HelpPart.help_queue`) lists
open requests by urgency, then age. One person claims a request (:meth:`HelpPart.claim_help`; ``open`` ->
``claimed``): a conditional update of the row, so two people can never both claim it (the second gets
:class:`HelpConflict`). The robot polls its request (:meth:`HelpPart.help_request`) to learn it was
claimed and hands control over; resolving closes it (``resolved``). A request nobody claimed within its
time to live is ``expired`` (:meth:`HelpPart.expire_help`; the queue does it before it lists).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from fleet.db.engine import DBPart
from fleet.db.schema import HelpRequestRow

HelpStatus = Literal["open", "claimed", "resolved", "expired"]
HELP_STATUSES: tuple[str, ...] = get_args(HelpStatus)
ACTIVE_STATUSES = ("open", "claimed")

MAX_REASON_CHARS = 256
MAX_NOTE_CHARS = 256
MAX_OPERATOR_CHARS = 64
MAX_URGENCY = 1e6
MAX_ACTIVE_PER_ROBOT = 4
"""Open or claimed requests one robot may hold at once (for different episodes)."""
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # robot and episode ids (the collector's)


class HelpConflict(RuntimeError):
    """The request is not in a state that allows the change (claimed by someone else, already closed):
    the message says what it is now."""


@dataclass(frozen=True)
class HelpRequest:
    """One help request as the DB knows it (detached copy)."""

    id: int
    robot_id: str
    episode_id: str
    reason: str
    urgency: float
    status: str
    created_at: float
    claimed_by: str | None = None
    claimed_at: float | None = None
    closed_at: float | None = None
    note: str | None = None

    def waited_s(self, now: float) -> float:
        """How long the robot has waited for a person: until the claim, else until ``now`` (or the close)."""
        end = self.claimed_at or self.closed_at or now
        return max(0.0, end - self.created_at)

    def to_dict(self, now: float | None = None) -> dict[str, Any]:
        return {**asdict(self), "waited_s": self.waited_s(time.time() if now is None else now)}


def _text(field: str, value: object, limit: int, *, empty_ok: bool = False) -> str:
    if not isinstance(value, str) or (not value.strip() and not empty_ok):
        raise ValueError(f"{field}: expected a non-empty string, got {value!r}")
    if len(value) > limit:
        raise ValueError(f"{field}: expected at most {limit} characters, got {len(value)}")
    if any(ord(c) < 32 for c in value):
        raise ValueError(f"{field}: expected one line of printable text (no control characters)")
    return value


def check_help_fields(robot_id: object, episode_id: object, reason: object, urgency: object) -> None:
    """ValueError naming the first field out of bounds (what a collector and the DB accept)."""
    for name, v in (("robot_id", robot_id), ("episode_id", episode_id)):
        if not isinstance(v, str) or not _ID_RE.fullmatch(v):
            raise ValueError(f"{name}: expected an id {_ID_RE.pattern}, got {v!r}"[:300])
    _text("reason", reason, MAX_REASON_CHARS)
    if (
        not isinstance(urgency, int | float)
        or isinstance(urgency, bool)
        or not math.isfinite(urgency)
        or abs(urgency) > MAX_URGENCY
    ):
        raise ValueError(f"urgency: expected a finite number within ±{MAX_URGENCY:g}, got {urgency!r}")


def _record(r: HelpRequestRow) -> HelpRequest:
    return HelpRequest(
        r.id,
        r.robot_id,
        r.episode_id,
        r.reason,
        float(r.urgency),
        r.status,
        float(r.created_at),
        r.claimed_by,
        r.claimed_at,
        r.closed_at,
        r.note,
    )


class HelpPart(DBPart):
    """Help requests (``MetadataDB``'s help methods; see the module docstring)."""

    def open_help(
        self,
        robot_id: str,
        episode_id: str,
        reason: str,
        urgency: float,
        *,
        now: float | None = None,
        max_active: int = MAX_ACTIVE_PER_ROBOT,
    ) -> HelpRequest:
        """Open a request, or return the robot's request for this episode that is still open or claimed
        (a robot that asks again, or resends after a reconnect, does not queue twice; a higher urgency
        raises the one queued). ValueError naming the field out of bounds; HelpConflict when the robot
        already has ``max_active`` requests open or claimed (for other episodes)."""
        check_help_fields(robot_id, episode_id, reason, urgency)
        now = time.time() if now is None else now
        with Session(self.engine) as s, s.begin():
            q = select(HelpRequestRow).where(
                HelpRequestRow.robot_id == robot_id,
                HelpRequestRow.episode_id == episode_id,
                HelpRequestRow.status.in_(ACTIVE_STATUSES),
            )
            row = s.scalars(q.with_for_update()).first()
            if row is None:
                active = s.scalar(
                    select(func.count()).where(
                        HelpRequestRow.robot_id == robot_id, HelpRequestRow.status.in_(ACTIVE_STATUSES)
                    )
                )
                if (active or 0) >= max_active:
                    raise HelpConflict(
                        f"robot_id: {robot_id} already has {active} help requests open or claimed "
                        f"(at most {max_active}); withdraw one first"
                    )
                row = HelpRequestRow(
                    robot_id=robot_id,
                    episode_id=episode_id,
                    reason=reason,
                    urgency=float(urgency),
                    status="open",
                    created_at=now,
                )
                s.add(row)
            elif row.status == "open" and urgency > row.urgency:
                row.urgency, row.reason = float(urgency), reason
            s.flush()
            return _record(row)

    def help_request(self, request_id: int) -> HelpRequest | None:
        """One request (None: no such id)."""
        with Session(self._reader) as s:
            row = s.get(HelpRequestRow, request_id)
            return None if row is None else _record(row)

    def help_queue(
        self, *, statuses: tuple[str, ...] = ACTIVE_STATUSES, limit: int = 200
    ) -> list[HelpRequest]:
        """Requests in ``statuses``: open ones first, each status by urgency (highest first), then age
        (oldest first)."""
        bad = [x for x in statuses if x not in HELP_STATUSES]
        if bad:
            raise ValueError(f"status: expected some of {', '.join(HELP_STATUSES)}, got {bad[0]!r}")
        q = (
            select(HelpRequestRow)
            .where(HelpRequestRow.status.in_(statuses))
            .order_by(HelpRequestRow.urgency.desc(), HelpRequestRow.created_at, HelpRequestRow.id)
            .limit(limit)
        )
        with Session(self._reader) as s:
            rows = [_record(r) for r in s.scalars(q)]
        return sorted(rows, key=lambda r: statuses.index(r.status))  # stable: keeps urgency, age

    def recently_closed_help(self, limit: int = 10) -> list[HelpRequest]:
        """The ``limit`` requests closed last (resolved or expired), newest close first: what the operators
        (people or simulated ones) did, for the help queue page."""
        q = (
            select(HelpRequestRow)
            .where(HelpRequestRow.status.in_(("resolved", "expired")))
            .order_by(HelpRequestRow.closed_at.desc(), HelpRequestRow.id.desc())
            .limit(limit)
        )
        with Session(self._reader) as s:
            return [_record(r) for r in s.scalars(q)]

    def claim_help(
        self, operator: str, request_id: int | None = None, *, now: float | None = None
    ) -> HelpRequest:
        """``operator`` takes ``request_id``, or the next one (most urgent, then oldest, open request).
        One conditional update (``... WHERE status = 'open'``): of two people claiming the same request,
        exactly one gets it; the other gets :class:`HelpConflict` naming who has it. KeyError: no such
        request; HelpConflict: nothing open to take next."""
        _text("operator", operator, MAX_OPERATOR_CHARS)
        now = time.time() if now is None else now
        if request_id is not None:
            if self._take(request_id, operator, now):
                return self._must(request_id)
            got = self._must(request_id)
            who = f" by {got.claimed_by}" if got.claimed_by else ""
            raise HelpConflict(f"help request {request_id} is {got.status}{who}, not open")
        for r in self.help_queue(statuses=("open",), limit=20):  # lost a race for one: take the next
            if self._take(r.id, operator, now):
                return self._must(r.id)
        raise HelpConflict("no open help request to claim")

    def _take(self, request_id: int, operator: str, now: float) -> bool:
        with Session(self.engine) as s, s.begin():
            done = s.execute(
                update(HelpRequestRow)
                .where(HelpRequestRow.id == request_id, HelpRequestRow.status == "open")
                .values(status="claimed", claimed_by=operator, claimed_at=now)
            )
            return done.rowcount == 1  # type: ignore[attr-defined]

    def _must(self, request_id: int) -> HelpRequest:
        got = self.help_request(request_id)
        if got is None:
            raise KeyError(f"no help request {request_id}")
        return got

    def resolve_help(
        self, request_id: int, *, by: str, note: str = "", now: float | None = None
    ) -> HelpRequest:
        """Close an open or claimed request (``resolved``): by the person who claimed it, or (``by`` =
        the robot's id) by the robot that no longer needs help. HelpConflict when it is already closed or
        claimed by someone else."""
        _text("by", by, max(MAX_OPERATOR_CHARS, 128))
        _text("note", note, MAX_NOTE_CHARS, empty_ok=True)
        now = time.time() if now is None else now
        with Session(self.engine) as s, s.begin():
            row = s.scalars(
                select(HelpRequestRow).where(HelpRequestRow.id == request_id).with_for_update()
            ).first()
            if row is None:
                raise KeyError(f"no help request {request_id}")
            if row.status not in ACTIVE_STATUSES:
                raise HelpConflict(f"help request {request_id} is already {row.status}")
            if row.status == "claimed" and by not in (row.claimed_by, row.robot_id):
                raise HelpConflict(f"help request {request_id} is claimed by {row.claimed_by}, not {by}")
            row.status, row.closed_at, row.note = "resolved", now, note or f"resolved by {by}"
            s.flush()
            return _record(row)

    def expire_help(self, max_open_s: float, *, now: float | None = None) -> int:
        """Open requests older than ``max_open_s`` become ``expired`` (nobody took them in time: the robot
        carried on or its episode ended). Returns how many. Takes a write lock only when there is something
        to expire."""
        if not max_open_s > 0:
            raise ValueError(f"max_open_s: expected a number > 0, got {max_open_s!r}")
        now = time.time() if now is None else now
        stale = (HelpRequestRow.status == "open", HelpRequestRow.created_at < now - max_open_s)
        with Session(self._reader) as s:  # a read first: the page polls, and most polls expire nothing
            if not s.scalar(select(func.count()).where(*stale)):
                return 0
        with Session(self.engine) as s, s.begin():
            done = s.execute(
                update(HelpRequestRow)
                .where(*stale)
                .values(status="expired", closed_at=now, note=f"nobody claimed it within {max_open_s:g} s")
            )
            return int(done.rowcount)  # type: ignore[attr-defined]
