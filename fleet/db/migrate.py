"""The schema upgrade on open (Alembic, ``fleet/migrations``): one query when the DB is at head,
otherwise under a lock so concurrent first opens cannot race; a pre-Alembic DB is stamped by its tables."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError, OperationalError, ProgrammingError

from fleet.db.engine import _URL_SETTING, MetadataDBError

log = logging.getLogger(__name__)

_MIGRATIONS = Path(__file__).parents[1] / "migrations"
_PG_MIGRATION_LOCK = 0x766C615F726C  # pg_advisory_xact_lock key of schema upgrades ("vla_rl")
_BASELINE_TABLES = frozenset({"episodes", "segments", "labels", "rounds"})


def _alembic_config(connection: Connection | None = None) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    cfg.attributes["connection"] = connection
    return cfg


SCHEMA_HEAD = "0007"
"""The newest migration in fleet/migrations/versions (tests/test_metadata_db.py checks it): opening a DB
at this revision needs no Alembic import, only one query."""


def _legacy_revision(tables: set[str]) -> str | None:
    """The revision a DB without ``alembic_version`` (written by ``create_all`` before migrations) matches:
    the baseline's tables and round_jobs = 0002; the baseline's = 0001 (the release before rounds were
    jobs); else None (the baseline then creates only the tables that are missing)."""
    if tables >= _BASELINE_TABLES | {"round_jobs"}:
        # also when today's tables are all there: 0003-0005 add only what is missing (0003 re-derives
        # the labels' ``current`` and the revision rows from the rows themselves)
        return "0002"
    if tables >= _BASELINE_TABLES:
        return "0001"
    return None


def _current_revisions(conn: Connection) -> set[str] | None:
    """The DB's alembic revisions (one query); None when it has no ``alembic_version`` table (the
    transaction is then rolled back: PostgreSQL aborts it on the error)."""
    try:
        return set(conn.execute(text("SELECT version_num FROM alembic_version")).scalars())
    except (OperationalError, ProgrammingError) as e:
        if "alembic_version" not in str(e):
            raise
        conn.rollback()
        return None


def _explain(url: Any, e: BaseException) -> MetadataDBError:
    shown = url.render_as_string(hide_password=True)
    why = str(getattr(e, "orig", None) or e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    hint = (
        "check the file path and that its directory exists and is writable"
        if url.get_backend_name() == "sqlite"
        else "check host and port (is the server running and reachable?), user and password, and that the "
        "database exists (createdb NAME) and the user may create tables in it"
    )
    return MetadataDBError(f"cannot open the metadata DB {shown}: {why}. Fix {_URL_SETTING}: {hint}")


def upgrade_schema(engine: Engine) -> str:
    """Bring the DB to the newest migration (creating it when empty, stamping a pre-Alembic one by the
    tables it holds). One query when already there; otherwise under a lock, so concurrent first opens
    cannot race: SQLite's BEGIN IMMEDIATE, PostgreSQL's transaction-scoped advisory lock. Returns the
    revision it is at."""
    head = SCHEMA_HEAD
    try:
        with engine.connect() as conn:
            if _current_revisions(conn) == {head}:
                conn.rollback()
                return head
            conn.rollback()
            with conn.begin():  # SQLite: BEGIN IMMEDIATE (see _sqlite_setup), so writers wait here
                if conn.dialect.name == "postgresql":
                    conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_MIGRATION_LOCK})
                _upgrade_locked(conn, head)
    except MetadataDBError:
        raise
    except DBAPIError as e:
        raise _explain(engine.url, e) from e
    return head


@contextmanager
def _quiet_alembic() -> Iterator[None]:
    """Alembic logs each step at INFO; a CLI that opens a new DB must not start its output with that."""
    logger = logging.getLogger("alembic")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def _upgrade_locked(conn: Connection, head: str) -> None:
    with _quiet_alembic():
        from alembic import command
        from alembic.runtime.migration import MigrationContext
        from alembic.script import ScriptDirectory

        cfg = _alembic_config(conn)
        current = set(MigrationContext.configure(conn).get_current_heads())
        if current == {head}:
            return  # another process upgraded it while we waited for the lock
        known = {s.revision for s in ScriptDirectory.from_config(cfg).walk_revisions()}
        if current - known:
            raise MetadataDBError(
                f"the metadata DB {conn.engine.url.render_as_string(hide_password=True)} is at schema "
                f"revision {sorted(current - known)}, newer than this vla-rl knows (head {head}): upgrade vla-rl"
            )
        if not current:
            tables = set(inspect(conn).get_table_names()) - {"alembic_version"}
            legacy = _legacy_revision(tables) if tables else None
            if legacy is not None:
                command.stamp(cfg, legacy)
        command.upgrade(cfg, "head")
    log.debug("metadata DB schema upgraded", extra={"from": sorted(current), "to": head})
