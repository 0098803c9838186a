"""One episode-selection language: which episodes a round trains on, which the dashboard lists, which
``vla-rl up`` summarises.

A :class:`Selection` is a set of filters; every key narrows the set, alternatives within one key widen
it. One grammar, two spellings:

* **text** (``--data``, a trainer's or a round's ``data``, the dashboard's round form): comma-separated
  ``key=value`` pairs with ``|`` between alternatives, e.g.
  ``robot=arm-1|arm-2,since=2026-11-01,label.quality=good,success=true,max=200`` (:meth:`Selection.parse`,
  :meth:`Selection.to_text`);
* **URL query parameters** (the episode list and its saved links): the same keys as parameters,
  ``label=quality:good`` and ``flag=NAME`` repeatable, plus the list's ``sort``, ``page`` and ``per_page``
  (:class:`EpisodeQuery`, :meth:`EpisodeQuery.from_params`, :meth:`EpisodeQuery.to_params`).

``label.KEY=VALUE`` and ``label=KEY:VALUE`` are the same filter in both spellings. The keys:

============================ ==================================================================================
``task=ID``                  the task
``robot=ID|ID``              robot ids; a trailing ``*`` matches any rest (``robot=sim-*``)
``since=T``, ``until=T``     created at or after / at or before (unix seconds or an ISO date, local time)
``closed_since=T``, ...      ``closed_until=T``: closed at or after / at or before (open episodes never
                             match): a snapshot of what was recorded by then (``vla-rl up --continuous``)
``revision=REV|REV``         a checkpoint revision that acted in the episode
``round=N|N``                the checkpoint post-training round N produced acted in the episode
``success=true|false``       the effective success (an ``outcome`` label overrides the recorded one);
                             ``false`` = not a success (failures and unknown outcomes)
``outcome=NAME``             the effective outcome (``success``, ``failure``, ...; ``unknown``: none)
``label.KEY=VALUE``          the episode label's current value (case-insensitive); several must all match
``intervention=true|false``  a human took over at least once / never
``flag=NAME|NAME``           any of these auto-flags raised
``flagged=true|false``       any auto-flag raised / none
``status=open|closed``       still recording / closed (a round trains on closed episodes only)
``min_length=N``, ...        ``max_length=N``: frames
``max=N``                    the N most recent (after every other key)
``exclude=ID|ID``            leave these episodes out (before ``max``): an offline round's held-out ones
============================ ==================================================================================

The metadata DB evaluates a selection in SQL (:meth:`fleet.db.MetadataDB.select_ids`,
:meth:`~fleet.db.MetadataDB.query_episodes`); :func:`fleet.store_index.select_episode_ids` selects a
store's episodes (indexing the store into its DB first). This module parses and validates only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from vla_rl.core.text import check_text

__all__ = [
    "EPISODE_SORTS",
    "MAX_DB_INT",
    "MAX_PER_PAGE",
    "SORT_KEYS",
    "EpisodeQuery",
    "Selection",
    "parse_time",
]

SORT_KEYS: tuple[str, ...] = ("created_at", "length", "robot_id", "task")
EPISODE_SORTS: tuple[str, ...] = tuple(s for k in SORT_KEYS for s in (k, f"-{k}"))
"""The episode list's sort orders (``-`` = descending); ties are broken by episode id."""
MAX_PER_PAGE = 500
MAX_TEXT_CHARS = 4096
"""Longest name or value in a selection (the dashboard's bound on a whole selection text)."""
WILDCARD = "*"
"""A robot id ending in it matches every robot id starting with the rest."""


def parse_time(field_name: str, value: str | float) -> float:
    """Unix seconds from a number or an ISO date/time (``2026-11-01``, ``2026-11-01T12:00:00+00:00``; a
    date without a zone is local time, as everywhere in the CLI); ValueError naming ``field_name`` (also
    for a number that is not finite: ``nan``, ``inf``, ``1e400``)."""
    text_value = str(value).strip()
    number: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value) if abs(value) < 1e300 else math.inf
    else:
        with contextlib.suppress(ValueError):
            number = float(text_value)
    if number is not None:
        if not math.isfinite(number):
            raise ValueError(f"{field_name}: expected finite unix seconds or an ISO date, got {text_value!r}")
        return number
    try:
        return datetime.fromisoformat(text_value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise ValueError(
            f"{field_name}: expected unix seconds or an ISO date (2026-11-01), got {text_value!r}"
        ) from None


MAX_DB_INT = 2**63 - 1
"""The largest integer a query may compare with or page by: a metadata DB's 64-bit integer (a larger one
cannot be bound to an SQLite INTEGER parameter at all)."""
MAX_PAGE = MAX_DB_INT // MAX_PER_PAGE
"""The last page the episode list may be asked for (its row offset stays a 64-bit integer)."""


def is_int(v: Any) -> bool:
    """A plain integer (``True`` is not one)."""
    return isinstance(v, int) and not isinstance(v, bool)


# ------------------------------------------------------------------------------------------ the keys
def _text(key: str, value: str) -> str:
    return value.strip()


def _texts(key: str, value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split("|") if v.strip())


def _bool(key: str, value: str) -> bool:
    low = value.strip().lower()
    if low in ("true", "1", "yes"):
        return True
    if low in ("false", "0", "no"):
        return False
    raise ValueError(f"{key}: expected true or false, got {value!r}")


def _count(key: str, value: str) -> int:
    try:
        return int(value.strip())
    except ValueError:
        raise ValueError(f"{key}: expected an integer, got {value!r}") from None


def _rounds(key: str, value: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in _texts(key, value))
    except ValueError:
        raise ValueError(f"round: expected round numbers (3 or 3|4), got {value!r}") from None


@dataclass(frozen=True)
class _Key:
    """One key of the grammar: the :class:`Selection` field it sets and how its text value reads."""

    field: str
    read: Callable[[str, str], Any]


KEYS: dict[str, _Key] = {
    "task": _Key("task", _text),
    "robot": _Key("robots", _texts),
    "since": _Key("since", parse_time),
    "until": _Key("until", parse_time),
    "closed_since": _Key("closed_since", parse_time),
    "closed_until": _Key("closed_until", parse_time),
    "revision": _Key("revisions", _texts),
    "round": _Key("rounds", _rounds),
    "success": _Key("success", _bool),
    "outcome": _Key("outcome", _text),
    "label": _Key("labels", _text),  # KEY:VALUE (label.KEY=VALUE is rewritten to it)
    "intervention": _Key("intervention", _bool),
    "flag": _Key("flags", _texts),
    "flagged": _Key("flagged", _bool),
    "status": _Key("status", _text),
    "min_length": _Key("min_length", _count),
    "max_length": _Key("max_length", _count),
    "max": _Key("max_episodes", _count),
    "exclude": _Key("exclude", _texts),
}
"""The selection keys (module docstring), by the name users write."""
REPEATABLE = ("label", "flag")
"""Keys that may be given more than once (labels must all match; flags: any of them)."""
_KEY_OF = {k.field: name for name, k in KEYS.items()}  # field -> the key users write


def _read(pairs: Iterable[tuple[str, str]]) -> dict[str, Any]:
    """Selection fields from ``(key, value)`` pairs of either spelling (keys already checked)."""
    kw: dict[str, Any] = {}
    labels: dict[str, str] = {}
    flags: list[str] = []
    for key, value in pairs:
        if key == "label":
            k, sep, v = value.partition(":")
            if not sep or not k.strip() or not v.strip():
                raise ValueError(f"label: expected key:value (e.g. quality:good), got {value!r}")
            labels[k.strip()] = v.strip()
        elif _is_label_key(key):
            labels[key[len("label.") :]] = value.strip()
        elif key == "flag":
            flags += _texts(key, value)
        else:
            spec = KEYS[key]
            kw[spec.field] = spec.read(key, value)
    if labels:
        kw["labels"] = labels
    if flags:
        kw["flags"] = tuple(dict.fromkeys(flags))
    return kw


def _is_label_key(key: str) -> bool:
    """``label.KEY`` (the text spelling of ``label=KEY:VALUE``)."""
    return key.startswith("label.") and len(key) > len("label.")


def _known(key: str) -> bool:
    return key in KEYS or _is_label_key(key)


def _check_once(key: str, values: list[str]) -> None:
    if key not in REPEATABLE and len(values) > 1:
        alternatives = (
            f"; alternatives are one value: {key}={'|'.join(values)}" if key in _ALTERNATIVES else ""
        )
        raise ValueError(f"{key}: expected one value, got {len(values)} ({values}){alternatives}")


_ALTERNATIVES = ("robot", "revision", "round", "flag", "exclude")


# --------------------------------------------------------------------------------------- selection
@dataclass(frozen=True)
class Selection:
    """Which episodes: every field narrows the set, empty means "any" (see the module docstring for the
    text and URL spellings). Evaluated in SQL by the metadata DB."""

    task: str | None = None
    robots: tuple[str, ...] = ()
    """Robot ids (any of them); one ending in ``*`` matches every id starting with the rest."""
    since: float | None = None
    """Unix seconds; created at or after it."""
    until: float | None = None
    """Unix seconds; created at or before it."""
    closed_since: float | None = None
    """Unix seconds; closed at or after it (open episodes do not match)."""
    closed_until: float | None = None
    """Unix seconds; closed at or before it (open episodes do not match): what was recorded by then."""
    revisions: tuple[str, ...] = ()
    """Episodes in which any of these checkpoint revisions acted."""
    rounds: tuple[int, ...] = ()
    """Episodes in which the checkpoint any of these post-training rounds produced acted."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """Current episode-level label values that must all match (key -> value as text, case-insensitive)."""
    success: bool | None = None
    """True: the effective success (an ``outcome`` label overrides the recorded one); False: not a
    success (a failure, or no outcome known)."""
    outcome: str | None = None
    """The effective outcome (an ``outcome`` label overrides the recorded one); ``unknown`` = none."""
    intervention: bool | None = None
    """True: at least one human segment; False: none."""
    flags: tuple[str, ...] = ()
    """Episodes with any of these auto-flags raised."""
    flagged: bool | None = None
    """True: any auto-flag raised; False: none raised."""
    status: str | None = None
    """``open`` or ``closed``."""
    min_length: int | None = None
    max_length: int | None = None
    max_episodes: int | None = None
    """Keep the most recent this many (after the other filters; the ``max`` key)."""
    exclude: tuple[str, ...] = ()
    """Episode ids left out (before ``max``): e.g. the held-out episodes an offline round evaluates on."""

    def __post_init__(self) -> None:
        for name in ("robots", "revisions", "rounds", "flags", "exclude"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "labels", dict(self.labels))
        for name in ("task", "outcome", "status"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise ValueError(f"{_KEY_OF[name]}: expected a non-empty string, got {v!r}")
        for name in ("robots", "revisions", "flags", "exclude"):
            for v in getattr(self, name):
                if not isinstance(v, str) or not v.strip():
                    raise ValueError(f"{_KEY_OF[name]}: expected non-empty names, got {v!r}")
        if any(WILDCARD in r[:-1] for r in self.robots):
            raise ValueError(f"robot: {WILDCARD} may only end a robot id (a prefix), got {self.robots}")
        if self.status is not None and self.status not in ("open", "closed"):
            raise ValueError(f"status: expected open or closed, got {self.status!r}")
        for r in self.rounds:
            if not is_int(r) or not 1 <= r <= MAX_DB_INT:
                raise ValueError(f"round: expected a round number >= 1 (at most {MAX_DB_INT}), got {r!r}")
        for k, v in self.labels.items():
            if not isinstance(k, str) or not k.strip():
                raise ValueError(f"label: expected key:value with a non-empty key, got {k!r}")
            if not isinstance(v, str) or not v.strip():
                raise ValueError(f"label: expected key:value with a non-empty value, got {k}:{v!r}")
        for name in ("min_length", "max_length"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= MAX_DB_INT):
                raise ValueError(f"{name}: expected an integer >= 0 (at most {MAX_DB_INT}), got {v!r}")
        if self.min_length is not None and self.max_length is not None and self.max_length < self.min_length:
            raise ValueError(f"max_length: expected >= min_length ({self.min_length}), got {self.max_length}")
        if self.since is not None and self.until is not None and self.until < self.since:
            raise ValueError(f"until: expected >= since ({self.since}), got {self.until}")
        if (
            self.closed_since is not None
            and self.closed_until is not None
            and self.closed_until < self.closed_since
        ):
            raise ValueError(
                f"closed_until: expected >= closed_since ({self.closed_since}), got {self.closed_until}"
            )
        if self.max_episodes is not None and (
            not is_int(self.max_episodes) or not 1 <= self.max_episodes <= MAX_DB_INT
        ):
            raise ValueError(
                f"max: expected a positive integer (at most {MAX_DB_INT}), got {self.max_episodes!r}"
            )
        self._check_texts()

    def _check_texts(self) -> None:
        """Every name and value is one line of valid Unicode (:func:`vla_rl.core.text.check_text`): a
        selection is stored with a round and compared in SQL (a NUL is no PostgreSQL text)."""
        names = [(n, getattr(self, n)) for n in ("task", "outcome", "status") if getattr(self, n) is not None]
        names += [(n, v) for n in ("robots", "revisions", "flags", "exclude") for v in getattr(self, n)]
        names += [("labels", x) for kv in self.labels.items() for x in kv]
        for name, v in names:
            check_text(v, _KEY_OF[name], max_chars=MAX_TEXT_CHARS)

    # ------------------------------------------------------------------------------ text spelling
    @classmethod
    def parse(cls, text: str | None, *, task: str | None = None) -> Selection:
        """The text spelling (module docstring), for ``task`` unless the text names one (they must then
        agree). Raises ValueError naming the bad key."""
        pairs: list[tuple[str, str]] = []
        for part in filter(None, (p.strip() for p in (text or "").split(","))):
            key, sep, value = part.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or not value:
                raise ValueError(f"data selection: expected key=value, got {part!r}")
            if not _known(key):
                raise ValueError(
                    f"data selection: unknown key {key!r}; expected {', '.join(k for k in KEYS if k != 'label')}"
                    " or label.<name>"
                )
            pairs.append((key, value))
        seen: dict[str, list[str]] = {}
        for key, value in pairs:
            seen.setdefault(key, []).append(value)
        for key, values in seen.items():
            _check_once(key, values)
        kw = _read(pairs)
        named = kw.get("task")
        if named is not None and task is not None and named != task:
            raise ValueError(f"task: the selection names {named!r}, but it selects for {task!r}")
        return cls(**{**kw, "task": named or task})

    def to_text(self) -> str:
        """The text spelling, without the task (``parse(sel.to_text(), task=sel.task) == sel``)."""
        return ",".join(f"{k}={v}" for k, v in self._pairs(label_spelling="text") if k != "task")

    # ------------------------------------------------------------------------------ both spellings
    def _pairs(self, label_spelling: str) -> list[tuple[str, str]]:
        """``(key, value)`` of every key set, in :data:`KEYS` order."""
        out: list[tuple[str, str]] = []
        for key, spec in KEYS.items():
            v = getattr(self, spec.field)
            if key == "label":
                # URL: label=KEY:VALUE, unless the key holds a colon (then label.KEY=VALUE, as in text)
                out += [
                    (f"label.{k}", lv) if label_spelling == "text" or ":" in k else ("label", f"{k}:{lv}")
                    for k, lv in v.items()
                ]
            elif isinstance(v, tuple):
                if v:
                    out.append((key, "|".join(map(str, v))))
            elif isinstance(v, bool):
                out.append((key, "true" if v else "false"))
            elif v is not None:
                out.append((key, str(v)))
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (a round's and a checkpoint's record of what it selected)."""
        out = dataclasses.asdict(self)
        for name, v in out.items():
            if isinstance(v, tuple):
                out[name] = list(v)
        return out

    def with_excluded(self, episode_ids: Iterable[str]) -> Selection:
        """This selection with ``episode_ids`` added to its ``exclude``."""
        ids = [*self.exclude, *(e for e in episode_ids if e not in self.exclude)]
        return dataclasses.replace(self, exclude=tuple(dict.fromkeys(ids)))

    def filters(self) -> Selection:
        """Just the selection (an :class:`EpisodeQuery` without its sort and page)."""
        return Selection(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Selection)})

    def needs_db(self) -> list[str]:
        """The keys set that only the metadata DB answers (labels, rounds, auto-flags): a store without
        a DB cannot evaluate them."""
        wanted = {"label": self.labels, "round": self.rounds, "flag": self.flags}
        return [k for k, v in wanted.items() if v] + (["flagged"] if self.flagged is not None else [])


# ------------------------------------------------------------------------------------ episode list
_PAGE_PARAMS = ("sort", "page", "per_page")


@dataclass(frozen=True)
class EpisodeQuery(Selection):
    """A filtered, sorted page of the episode list (docs/dashboard.md "Episode list"): a
    :class:`Selection` plus its sort and page; :meth:`fleet.db.MetadataDB.query_episodes` runs it in
    SQL."""

    sort: str = "-created_at"
    """One of :data:`EPISODE_SORTS`."""
    page: int = 1
    """1-based."""
    per_page: int = 50
    """1..500."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sort not in EPISODE_SORTS:
            raise ValueError(f"sort: expected one of {', '.join(EPISODE_SORTS)}, got {self.sort!r}")
        if not is_int(self.page) or not 1 <= self.page <= MAX_PAGE:
            raise ValueError(f"page: expected an integer >= 1 (at most {MAX_PAGE}), got {self.page!r}")
        if not is_int(self.per_page) or not 1 <= self.per_page <= MAX_PER_PAGE:
            raise ValueError(f"per_page: expected an integer in 1..{MAX_PER_PAGE}, got {self.per_page!r}")

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | Iterable[tuple[str, str]]) -> EpisodeQuery:
        """From URL query parameters (a plain mapping of str or list-of-str values, a multi-dict with
        ``getlist`` such as Starlette's ``QueryParams``, or ``(name, value)`` pairs as :meth:`to_params`
        gives them): the selection keys (module docstring;
        ``label=key:value`` and ``flag=NAME`` repeat, ``label.KEY=VALUE`` is the same as ``label=``),
        ``sort``, ``page`` and ``per_page``. Raises ValueError naming the parameter."""
        if not isinstance(params, Mapping):
            grouped: dict[str, list[str]] = {}
            for name, value in params:
                grouped.setdefault(name, []).append(value)
            params = grouped
        getlist = getattr(params, "getlist", None)
        pairs: list[tuple[str, str]] = []
        paging: dict[str, Any] = {}
        for name in params:
            raw = getlist(name) if getlist is not None else params[name]
            items = list(raw) if isinstance(raw, list | tuple) else [raw]
            values = [str(v) for v in items if v is not None and str(v) != ""]
            if not _known(name) and name not in _PAGE_PARAMS:
                known = [*(k for k in KEYS if k not in ("max", "exclude")), *_PAGE_PARAMS, "max", "exclude"]
                raise ValueError(
                    f"{name}: unknown episode-list parameter; expected one of {', '.join(known)} or label.<name>"
                )
            _check_once(name, values)
            if name == "sort" and values:
                paging["sort"] = values[0]
            elif name in ("page", "per_page") and values:
                paging[name] = _count(name, values[0])
            else:
                pairs += [(name, v) for v in values]
        return cls(**_read(pairs), **paging)

    def to_params(self) -> list[tuple[str, str]]:
        """The URL query parameters (the inverse of :meth:`from_params`; defaults left out)."""
        out = self._pairs(label_spelling="url")
        defaults = EpisodeQuery()
        out += [(k, str(getattr(self, k))) for k in _PAGE_PARAMS if getattr(self, k) != getattr(defaults, k)]
        return out
