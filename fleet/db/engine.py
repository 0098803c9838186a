"""Opening a metadata DB: the engine with its connection setup (SQLite: WAL, busy timeout, ``BEGIN
IMMEDIATE``), the default SQLite URL beside a store, the error that names a bad URL, and what every
part of :class:`~fleet.db.MetadataDB` shares (:class:`DBPart`, id chunks for ``IN`` lists)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event, make_url
from sqlalchemy.engine import Engine
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from vla_rl.core.secrets import shown_url

_BUSY_TIMEOUT_S = 30  # how long a SQLite writer waits for another process's transaction

_URL_SETTING = (
    "the metadata DB URL (--db-url of `vla-rl round worker`, --db of `vla-rl collect` / `data` / `round`, "
    "db_url of a training config; unset = the SQLite file next to the episode store)"
)

_ID_CHUNK = 500  # ids per IN (...) list


class MetadataDBError(RuntimeError):
    """The metadata DB cannot be opened (unreachable server, refused credentials, missing database, a
    schema newer than this code); the message names the URL (password hidden) and how to fix it."""


def default_url(store_root: str | os.PathLike[str]) -> str:
    """The SQLite DB that sits next to an episode store."""
    if str(store_root).startswith("s3:/"):
        raise ValueError(
            f"db_url: the episode store {store_root} is on object storage and has no SQLite file beside "
            "it: give the metadata DB's URL (--db / --db-url / db_url)"
        )
    return f"sqlite:///{Path(store_root).absolute() / 'metadata.db'}"


def _sqlite_setup(engine: Engine) -> None:
    """WAL + busy timeout + foreign keys, and write-locking transactions.

    pysqlite's deferred BEGIN lets two processes both read and then both try to upgrade to a write
    lock; in WAL mode one of them then fails with SQLITE_BUSY without waiting. ``BEGIN IMMEDIATE``
    takes the write lock up front, so the busy timeout applies and writers queue.
    """

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_S * 1000}")
        cur.execute("PRAGMA journal_mode = WAL")
        cur.execute("PRAGMA synchronous = NORMAL")
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def engine_for(url: str) -> Engine:
    """An engine with this module's connection setup (SQLite: WAL, busy timeout, BEGIN IMMEDIATE)."""
    try:
        parsed = make_url(url)
        sqlite = parsed.get_backend_name() == "sqlite"
        # The driver-level timeout also covers the dialect's first queries, which run before our hook.
        connect_args: dict[str, Any] = {"timeout": _BUSY_TIMEOUT_S} if sqlite else {}
        if parsed.get_backend_name() == "postgresql" and parsed.get_driver_name() == "psycopg":
            connect_args = {"connect_timeout": 10}  # an unreachable host fails at start-up, soon
        engine = create_engine(parsed, connect_args=connect_args)
    except (ArgumentError, NoSuchModuleError, ImportError) as e:  # malformed URL, unknown backend
        shown = shown_url(url)
        raise MetadataDBError(
            f"{shown!r} is not a usable database URL ({e}); fix {_URL_SETTING}, e.g. "
            "postgresql://USER:PASSWORD@HOST:5432/DBNAME or sqlite:///PATH/metadata.db"
        ) from e
    if sqlite:
        _sqlite_setup(engine)
    return engine


class DBPart:
    """What every part of :class:`~fleet.db.MetadataDB` works on: the engine (writes) and the reader
    (reads that take several statements see one snapshot)."""

    url: str
    engine: Engine
    _reader: Engine


def _chunks(ids: list[str]) -> Iterator[list[str]]:
    for i in range(0, len(ids), _ID_CHUNK):
        yield ids[i : i + _ID_CHUNK]
