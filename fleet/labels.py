"""The label schema: which label keys exist, their allowed values, and their keyboard shortcuts.

A project file (TOML; the default is ``fleet/labels.toml`` next to this module, the dashboard takes
``--labels PATH``), not code, so a team adds a failure class without a release::

    [[episode]]            # an episode-level key
    key = "outcome"
    values = ["success", "failure"]
    shortcut = "o"         # optional, one character
    description = "..."    # optional, shown as help
    [[span]]               # a span key: labels frames [start, end) of an episode
    key = "segment"
    values = ["progress", "idle", "failure-inducing", "recovery"]
    [[episode]]
    key = "note"
    free_text = true       # any non-empty text instead of a list of values

:meth:`LabelSchema.validate` is what a write goes through before it reaches the metadata DB: an unknown
key or value, or a span on an episode key (or none on a span key), is a ValueError naming the field and
what was expected. The metadata DB itself stores any JSON value; the schema is the dashboard's contract.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

DEFAULT_SCHEMA_PATH = Path(__file__).with_name("labels.toml")
Scope = Literal["episode", "span"]
RESERVED_SHORTCUTS = frozenset(" []?0123456789")
"""Keys the episode page uses itself (play/pause, mark a span, help, digits for span values)."""


@dataclass(frozen=True)
class LabelKey:
    """One key of the schema: its scope, allowed values (or free text), shortcut and help text."""

    key: str
    scope: Scope
    values: tuple[str, ...] = ()
    free_text: bool = False
    shortcut: str | None = None
    description: str = ""

    def __post_init__(self) -> None:
        where = f"{self.scope} key {self.key!r}"
        if not isinstance(self.key, str) or not self.key.strip():
            raise ValueError(f"key: expected a non-empty label key, got {self.key!r}")
        if self.scope not in ("episode", "span"):
            raise ValueError(f"scope: expected episode or span, got {self.scope!r}")
        if self.free_text and self.values:
            raise ValueError(f"{where}: expected either values or free_text = true, not both")
        if not self.free_text and not self.values:
            raise ValueError(f"{where}: values: expected a non-empty list of strings (or free_text = true)")
        if any(not isinstance(v, str) or not v.strip() for v in self.values):
            raise ValueError(f"{where}: values: expected non-empty strings, got {list(self.values)}")
        if len(set(self.values)) != len(self.values):
            raise ValueError(f"{where}: values: expected no duplicates, got {list(self.values)}")
        if self.shortcut is not None and (not isinstance(self.shortcut, str) or len(self.shortcut) != 1):
            raise ValueError(f"{where}: shortcut: expected one character, got {self.shortcut!r}")
        if self.shortcut is not None and self.shortcut in RESERVED_SHORTCUTS:
            raise ValueError(
                f"{where}: shortcut: {self.shortcut!r} is taken by the episode page (space, [, ], ?, digits)"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "values": list(self.values),
            "free_text": self.free_text,
            "shortcut": self.shortcut,
            "description": self.description,
        }


@dataclass(frozen=True)
class LabelSchema:
    """The episode keys and span keys of a project (see the module docstring)."""

    episode: tuple[LabelKey, ...] = ()
    span: tuple[LabelKey, ...] = ()
    source: str = "<memory>"
    """Where it was loaded from (named in errors)."""
    _by: dict[tuple[str, str], LabelKey] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        seen_shortcuts: dict[str, str] = {}
        for scope, keys in (("episode", self.episode), ("span", self.span)):
            for k in keys:
                if k.scope != scope:
                    raise ValueError(
                        f"{self.source}: {k.key!r} is listed under {scope} but has scope {k.scope}"
                    )
                if (scope, k.key) in self._by:
                    raise ValueError(f"{self.source}: {scope} key {k.key!r}: expected once, listed twice")
                self._by[(scope, k.key)] = k
                if k.shortcut is not None:
                    if k.shortcut in seen_shortcuts:
                        raise ValueError(
                            f"{self.source}: {scope} key {k.key!r}: shortcut {k.shortcut!r} is already "
                            f"{seen_shortcuts[k.shortcut]!r}'s"
                        )
                    seen_shortcuts[k.shortcut] = k.key

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: str | Path | None = None) -> LabelSchema:
        """Read a schema file (None = the default ``fleet/labels.toml``); ValueError naming the file and
        the field that is wrong."""
        p = Path(path) if path is not None else DEFAULT_SCHEMA_PATH
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"labels: cannot read the label schema {p}: {e.strerror or e}") from None
        return cls.from_toml(text, source=str(p))

    @classmethod
    def default(cls) -> LabelSchema:
        return cls.load(DEFAULT_SCHEMA_PATH)

    @classmethod
    def from_toml(cls, text: str, source: str = "<memory>") -> LabelSchema:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{source}: not valid TOML ({e})") from None
        return cls.from_dict(data, source=source)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<memory>") -> LabelSchema:
        unknown = set(data) - {"episode", "span"}
        if unknown:
            raise ValueError(f"{source}: unknown tables {sorted(unknown)}; expected [[episode]] and [[span]]")
        parsed: dict[str, list[LabelKey]] = {"episode": [], "span": []}
        for scope in ("episode", "span"):
            entries = data.get(scope, [])
            if not isinstance(entries, list):
                raise ValueError(f"{source}: {scope}: expected an array of tables ([[{scope}]])")
            for i, entry in enumerate(entries):
                where = f"{source}: {scope}[{i}]"
                if not isinstance(entry, dict):
                    raise ValueError(f"{where}: expected a table with key = ...")
                extra = set(entry) - {"key", "values", "free_text", "shortcut", "description"}
                if extra:
                    raise ValueError(
                        f"{where}: unknown fields {sorted(extra)}; expected key, values, free_text, shortcut, "
                        "description"
                    )
                values = entry.get("values", [])
                if not isinstance(values, list):
                    raise ValueError(f"{where}: values: expected a list of strings, got {values!r}")
                free = entry.get("free_text", False)
                if not isinstance(free, bool):
                    raise ValueError(f"{where}: free_text: expected true or false, got {free!r}")
                try:
                    parsed[scope].append(
                        LabelKey(
                            key=entry.get("key", ""),
                            scope=scope,  # type: ignore[arg-type]
                            values=tuple(values),
                            free_text=free,
                            shortcut=entry.get("shortcut"),
                            description=str(entry.get("description", "")),
                        )
                    )
                except ValueError as e:
                    raise ValueError(f"{where}: {e}") from None
        return cls(episode=tuple(parsed["episode"]), span=tuple(parsed["span"]), source=source)

    # ------------------------------------------------------------------ use
    def get(self, key: str, span: bool = False) -> LabelKey | None:
        return self._by.get(("span" if span else "episode", key))

    def validate(self, key: str, value: Any, span: tuple[int, int] | None = None) -> LabelKey:
        """Check a label before it is written: the key exists for this scope (a span label when ``span``
        is given), the value is one of its values (or non-empty text for a free-text key). Returns the
        key's schema; raises ValueError naming the field (key, value, start/end) and what was expected."""
        scope: Scope = "span" if span is not None else "episode"
        k = self._by.get((scope, key))
        if k is None:
            other = self._by.get(("episode" if span is not None else "span", key))
            if other is not None:
                raise ValueError(
                    f"start/end: {key!r} is a{'n episode' if span is not None else ' span'} label; expected "
                    + (
                        "no span (it is about the whole episode)"
                        if span is not None
                        else "a frame span [start, end)"
                    )
                )
            names = ", ".join(x.key for x in (self.episode if span is None else self.span)) or "none"
            raise ValueError(f"key: unknown {scope} label key {key!r}; expected one of {names}")
        if span is not None:
            start, end = span
            if (
                not all(isinstance(x, int) and not isinstance(x, bool) for x in span)
                or start < 0
                or end <= start
            ):
                raise ValueError(
                    f"start/end: expected frames 0 <= start < end (end exclusive), got {list(span)}"
                )
        if k.free_text:
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"value: expected non-empty text for {key!r}, got {value!r}")
        elif value not in k.values:
            raise ValueError(f"value: expected one of {', '.join(k.values)} for {key!r}, got {value!r}")
        return k

    def to_dict(self) -> dict[str, Any]:
        """The JSON of ``GET /api/v1/label-schema``: ``{"episode": [...], "span": [...]}``, each key with
        its values, free_text, shortcut and description; span values also carry their digit."""
        span = []
        digit = 1
        for k in self.span:
            d = k.to_dict()
            d["digits"] = {}
            for v in k.values:
                if digit <= 9:
                    d["digits"][str(digit)] = v
                    digit += 1
            span.append(d)
        return {"episode": [k.to_dict() for k in self.episode], "span": span}
