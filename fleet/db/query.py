"""The episode list's query (:class:`EpisodeQuery`: filters, sort, page; from and to URL parameters)
and the SQL it compiles to, with the building blocks the statistics share (the effective outcome,
human segments)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Text, and_, case, cast, func, or_, select
from sqlalchemy.orm import aliased
from vla_rl_client.meta import Controller

from fleet.db.engine import _is_int
from fleet.db.labels import OUTCOME_KEY, _episode_level
from fleet.db.schema import EpisodeFlagRow, EpisodeRevisionRow, EpisodeRow, LabelRow, RoundRow, SegmentRow


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


def _parse_bool(key: str, v: str) -> bool:
    low = v.strip().lower()
    if low in ("true", "1", "yes"):
        return True
    if low in ("false", "0", "no"):
        return False
    raise ValueError(f"{key}: expected true or false, got {v!r}")


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
