"""Service configs as files: a config dataclass to and from a JSON object.

A long-running service (the policy server, the collector, the Hub registry, the dashboard, the round
worker, the sim fleet) is configured by one dataclass: its command's flags are that dataclass's fields
(parsed by tyro), and the same dataclass is passed whole to the code that runs the service. This module
turns such a dataclass into a JSON object and back, so a supervisor (``vla-rl up``) writes one file per
service and starts ``vla-rl COMMAND --config FILE`` instead of spelling every flag as argv, and a person
can read, diff and keep the exact configuration a service ran with.

Secrets never go into a file: a field declared with ``metadata=SECRET`` (a token given on the command
line or from the environment) is left out by :func:`to_dict`, and a file that names one is refused; tokens
reach a service through its environment or a token file. Unknown keys are refused by name, values are
checked against the field types (a path from a string, a tuple from a list, a nested config from an
object), and the dataclass's own ``__post_init__`` validates the rest.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path, PurePath
from typing import Any, Literal, Union

SECRET: Mapping[str, Any] = types.MappingProxyType({"secret": True})
"""``field(metadata=SECRET)``: never written to a config file, refused in one."""


def is_secret(f: dataclasses.Field[Any]) -> bool:
    return bool(f.metadata.get("secret"))


def to_dict(cfg: Any) -> dict[str, Any]:
    """``cfg``'s fields as a JSON-safe object (paths as strings, tuples as lists, nested configs as objects),
    secrets left out."""
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise TypeError(f"expected a dataclass instance, got {type(cfg).__name__}")
    return {f.name: _plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if not is_secret(f)}


def _plain(v: Any) -> Any:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return to_dict(v)
    if isinstance(v, PurePath):
        return str(v)
    if isinstance(v, tuple | list):
        return [_plain(x) for x in v]
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    return v


def values(cls: type, data: Any, where: str = "config") -> dict[str, Any]:
    """``data`` (a JSON object) checked against ``cls``'s fields and converted to their types: the keyword
    arguments that build ``cls``. Errors name ``where``, the key and what was expected."""
    if not isinstance(data, Mapping):
        raise ValueError(
            f"{where}: expected a JSON object of {cls.__name__}'s fields, got {type(data).__name__}"
        )
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; {cls.__name__} has {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    out = {}
    for key, value in data.items():
        if is_secret(fields[key]):
            raise ValueError(
                f"{where}: {key} is a secret and is never read from a config file: give it through the "
                "environment or a token file (see the command's --help)"
            )
        out[key] = _convert(value, hints[key], f"{where}: {key}")
    return out


def from_dict[T](cls: type[T], data: Any, where: str = "config") -> T:
    """An instance of ``cls`` from ``data`` (see :func:`values`), validated by its ``__post_init__``."""
    return cls(**values(cls, data, where))


def load(cls: type, path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checked values of the config file ``path`` for ``cls`` (see :func:`values`); a missing or
    malformed file raises ValueError naming it."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{p}: no such config file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{p}: cannot read it ({e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    return values(cls, data, str(p))


MAX_INT = 2**53
"""No config integer is larger (JSON's exact integers; every knob's own bound is far below)."""

Bounds = Callable[[str], tuple[float, float] | None]
"""A field name -> the inclusive range its numbers must lie in (None: any finite value)."""


def check_values(cfg: Any, bounds: Bounds) -> None:
    """Every field of ``cfg`` holds what its annotation says (an int is an int: not 1.5, not a bool; a float
    a finite number: not Infinity, not NaN; a Literal one of its values; tuples element-wise) and every
    number lies in ``bounds(name)``: the shared validation of configs anybody outside may fill (the CLI,
    the dashboard's API, a queued round). ValueError names the field and what was expected."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if value is None or dataclasses.is_dataclass(value):
            continue  # a missing value is the config's own check to name; a nested config checks itself
        _convert(_plain(value), hints[f.name], f.name)
        limits = bounds(f.name)
        for x in _numbers(value):
            if isinstance(x, float) and not math.isfinite(x):
                raise ValueError(f"{f.name}: expected a finite number, got {x}")
            if limits is not None and not limits[0] <= x <= limits[1]:
                raise ValueError(f"{f.name}: expected {_span(limits)}, got {x}")
            if isinstance(x, int) and abs(x) > MAX_INT:
                raise ValueError(f"{f.name}: expected an integer of magnitude <= 2**53, got {x}")


def _numbers(v: Any) -> list[int | float]:
    if isinstance(v, bool):
        return []
    if isinstance(v, int | float):
        return [v]
    if isinstance(v, tuple | list):
        return [x for item in v for x in _numbers(item)]
    return []


def _span(limits: tuple[float, float]) -> str:
    lo, hi = (
        f"{int(x):_}" if x != math.inf and x == int(x) and abs(x) >= 10_000 else f"{x:g}" for x in limits
    )
    return f">= {lo}" if limits[1] == math.inf else f"{lo}..{hi}"


def save(cfg: Any, path: str | os.PathLike[str]) -> Path:
    """Write ``cfg`` (secrets left out) to ``path`` as indented JSON, atomically; returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(to_dict(cfg), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, p)
    return p


def _convert(v: Any, tp: Any, where: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return v
    if origin in (Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(v, arg, where)
            except ValueError as e:
                errors.append(str(e).removeprefix(f"{where}: "))
        raise ValueError(f"{where}: {' or '.join(errors)}")
    if origin is Literal:
        if v in args:
            return v
        names = [str(a) for a in args]
        either = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
        raise ValueError(f"{where}: expected {either}, got {v!r}")
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, v, where)  # type: ignore[arg-type]
    if isinstance(tp, type) and issubclass(tp, PurePath):
        return tp(_expect(v, str, "a path (string)", where))
    if tp is bool:
        return _expect(v, bool, "true or false", where)
    if tp is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{where}: expected an integer, got {v!r}")
        return v
    if tp is float:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"{where}: expected a number, got {v!r}")
        return float(v)
    if tp is str:
        return _expect(v, str, "a string", where)
    if origin is tuple:
        items = _expect(v, list, "a list", where)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(x, args[0], f"{where}[{i}]") for i, x in enumerate(items))
        if args and len(args) != len(items):
            raise ValueError(f"{where}: expected a list of {len(args)} values, got {len(items)}")
        return tuple(
            _convert(x, a, f"{where}[{i}]") for i, (x, a) in enumerate(zip(items, args, strict=True))
        )
    if origin is list:
        return [
            _convert(x, args[0], f"{where}[{i}]") for i, x in enumerate(_expect(v, list, "a list", where))
        ]
    if origin is dict:
        return dict(_expect(v, dict, "an object", where))
    return v


def _expect(v: Any, kind: type, what: str, where: str) -> Any:
    if not isinstance(v, kind):
        raise ValueError(f"{where}: expected {what}, got {v!r}")
    return v
