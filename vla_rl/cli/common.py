"""Shared pieces of the command line: user-facing errors, parsing a command's dataclass with tyro,
named presets as defaults, and opening stores / DBs / tasks with errors that say how to fix them."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, make_dataclass
from pathlib import Path
from typing import Annotated, Any

import tyro


class CliError(Exception):
    """A user-facing error: printed as one line with a hint, exit code 2."""


@contextlib.contextmanager
def user_errors(*types: type[Exception], prefix: str = "", suffix: str = "") -> Iterator[None]:
    """Turn the listed exceptions (bad input the user can fix) into one ``CliError`` line: prefix, the
    exception's own message, suffix (usually which flag, or how to fix it)."""
    try:
        yield
    except types as e:
        raise CliError(f"{prefix}{e}{suffix}") from None


@contextlib.contextmanager
def hub_errors() -> Iterator[None]:
    """Hub failures a user can fix, as one line each: no registry, offline mode, a missing repo or ref,
    a refused token (the Hub client's own exceptions carry a page of HTTP detail)."""
    import httpx
    from huggingface_hub.errors import (
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    from vla_rl.hub.registry import DEFAULT_HUB, HubUnavailable

    endpoint = os.environ.get("HF_ENDPOINT", DEFAULT_HUB)
    try:
        yield
    except HubUnavailable as e:
        raise CliError(str(e)) from None
    except OfflineModeIsEnabled:
        raise CliError(
            f"HF_HUB_OFFLINE=1 blocks the Hub registry at {endpoint}: unset it (or set HF_HUB_OFFLINE=0)"
        ) from None
    except RevisionNotFoundError as e:
        raise CliError(
            f"no such tag, branch or commit at {endpoint}: {_first_line(e)}; list refs with the Hub's "
            "/api/models/ORG/NAME/refs or push one with `vla-rl hub push`"
        ) from None
    except RepositoryNotFoundError as e:
        raise CliError(
            f"no such repo at {endpoint} (or it is private and the token may not read it): {_first_line(e)}"
        ) from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status in (401, 403):
            raise CliError(
                f"the Hub at {endpoint} refused the request ({status}): check VLA_RL_HUB_TOKEN (or HF_TOKEN)"
            ) from None
        raise
    except (httpx.ConnectError, httpx.ConnectTimeout):
        raise CliError(
            f"no Hub registry at {endpoint}: start one with `vla-rl hub serve`, or set --hub / VLA_RL_HUB"
        ) from None


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def check_port(host: str, port: int, flag: str = "--port") -> None:
    """Fail before loading anything when ``host:port`` is taken (0 = any free port: never taken)."""
    import errno
    import socket

    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise CliError(
                    f"{flag} {port}: {host}:{port} is already in use (another vla-rl process?); stop it or "
                    f"pick another port"
                ) from None
            raise CliError(f"{flag} {port}: cannot bind {host}:{port}: {e.strerror}") from None


# ---------------------------------------------------------------------------- parsing
def parse(cls: type, argv: Sequence[str], prog: str, description: str, default: Any = None) -> Any:
    """``argv`` -> an instance of the dataclass ``cls``: flags from its fields (kebab-case), ``--help``
    from their docstrings, choices from Literal types; bad values exit 2 naming the flag."""
    return tyro.cli(cls, args=list(argv), prog=prog, description=description, default=default)


def parse_config(cls: type, argv: Sequence[str], prog: str, description: str | None = None) -> Any:
    """:func:`parse` for a service's config dataclass, which validates itself in ``__post_init__`` and
    whose field names are its flags': ``--config FILE`` (taken out of ``argv``) gives the defaults the
    flags override (:mod:`vla_rl.core.configs`; secrets are never read from it), tyro fills an unvalidated
    copy of ``cls`` (it would draw its own box around a ValueError), then the config is built here with
    :func:`build_config`, whose errors name the flag."""
    from vla_rl.core import configs

    argv = list(argv)
    unvalidated = type(cls.__name__, (cls,), {"__post_init__": _no_checks, "__module__": cls.__module__})
    path, default = pop_option(argv, "--config"), None
    if path is not None:
        with user_errors(ValueError, prefix="--config "):
            default = partial(unvalidated, configs.load(cls, path))
    doc = f"{description or cls.__doc__ or ''}\n\n{CONFIG_HELP}"
    raw = parse(unvalidated, argv, prog, doc, default)
    return build_config(cls, {f.name: getattr(raw, f.name) for f in dataclasses.fields(cls) if f.init})


def _no_checks(self: Any) -> None:
    """``__post_init__`` of the copy tyro fills: the real config checks the values afterwards."""


def build_config(cls: type, values: dict[str, Any]) -> Any:
    """``cls(**values)``; its ValueError ("max_queue: expected ...") becomes one CliError line naming the
    flag ("--max-queue: expected ...")."""
    try:
        return cls(**values)
    except ValueError as e:
        field, sep, rest = str(e).partition(":")
        if sep and field.isidentifier():
            raise CliError(f"--{field.replace('_', '-')}:{rest}") from None
        raise CliError(str(e)) from None


def partial(cls: type, values: dict[str, Any]) -> Any:
    """An instance of dataclass ``cls`` holding ``values`` and the field defaults, required fields left
    as ``tyro.MISSING``, built without ``__post_init__``: tyro's ``default=`` for a preset (the result
    of parsing is constructed, and so validated, normally)."""
    obj = object.__new__(cls)
    for f in dataclasses.fields(cls):
        if f.name in values:
            v = values[f.name]
            if isinstance(v, tuple | list) and isinstance(f.default, tuple):
                v = tuple(v)
            elif isinstance(v, str) and str(f.type).startswith("Path"):
                v = Path(v)
        elif f.default is not dataclasses.MISSING:
            v = f.default
        elif f.default_factory is not dataclasses.MISSING:
            v = f.default_factory()
        else:
            v = tyro.MISSING
        object.__setattr__(obj, f.name, v)
    return obj


def with_options(name: str, inner: type, options: type) -> type:
    """A dataclass whose flags are ``inner``'s (field ``inner``) and ``options``' (field ``options``),
    both without a prefix: e.g. a trainer config plus the round's gate and push options."""
    return make_dataclass(
        name,
        [
            ("inner", Annotated[inner, tyro.conf.OmitArgPrefixes]),
            ("options", Annotated[options, tyro.conf.OmitArgPrefixes]),
        ],
        kw_only=True,
    )


CONFIG_HELP = (
    "--config FILE: a JSON object of these flags' values (as snake_case keys; flags given as well win; "
    "secrets are never read from it). `vla-rl up` writes one per service in WORKDIR/configs."
)


def pop_option(argv: list[str], flag: str) -> str | None:
    """Remove ``flag VALUE`` (or ``flag=VALUE``) from ``argv`` and return VALUE (None if absent)."""
    for i, a in enumerate(argv):
        if a == flag:
            if i + 1 >= len(argv):
                raise CliError(f"{flag}: expected a value")
            value = argv[i + 1]
            del argv[i : i + 2]
            return value
        if a.startswith(flag + "="):
            del argv[i]
            return a.partition("=")[2]
    return None


# ---------------------------------------------------------------------------- resources
def open_db(store_root: Path, url: str | None) -> Any:
    from fleet.db import MetadataDB

    return MetadataDB(url) if url else MetadataDB.for_store(store_root)


def open_store(path: Path, create: bool = False, db_url: str | None = None) -> tuple[Any, Any]:
    """The store at ``path`` with its metadata DB (passed in, so labels and episodes land in it).

    An object store (``s3://...``) has no SQLite file beside it: without ``db_url`` its DB is None."""
    from fleet.objstore import is_remote
    from fleet.store import EpisodeStore

    if is_remote(path):
        with user_errors(ValueError, FileNotFoundError):  # each names the URL and the setting to fix
            store = EpisodeStore(path, create=create)
        with user_errors(ValueError):
            db = open_db(path, db_url) if db_url else None
        return EpisodeStore(path, db=db) if db is not None else store, db
    with user_errors(
        FileNotFoundError, ValueError, suffix=f". Create one with: vla-rl sim demos --store {path} ..."
    ):
        EpisodeStore(path, create=create)  # no store: fail here, before a DB file is made in its place
        db = open_db(path, db_url)
        return EpisodeStore(path, db=db), db


def task_arg(name: str) -> str:
    """The full task id for a --task value, or a one-line error pointing at `vla-rl sim list`."""
    from sim.registry import resolve_task

    with user_errors(ValueError, prefix="--task ", suffix=". See: vla-rl sim list"):
        return resolve_task(name).name


@dataclass(frozen=True)
class Command:
    """One ``vla-rl`` command: its words, the dataclass its flags come from, and what it runs."""

    path: tuple[str, ...]
    summary: str
    args: Any
    """The dataclass (or a zero-argument callable returning one, to import heavy modules lazily)."""
    run: Any
    """``run(parsed_args) -> exit code``; or ``run(argv, prog) -> exit code`` when ``args`` is None
    (commands that parse their own flags, e.g. to pick a preset first)."""
    description: str = ""
    config_file: bool = False
    """A service: also takes ``--config FILE``, a JSON object of its config's fields (secrets aside; see
    :mod:`vla_rl.core.configs`) whose values are the defaults the flags override."""
