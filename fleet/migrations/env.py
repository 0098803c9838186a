"""Alembic environment of the metadata DB.

``MetadataDB`` runs migrations itself, on a connection it already holds inside a locked transaction
(``config.attributes["connection"]``). The ``alembic`` command line (``alembic -c fleet/migrations/alembic.ini
-x url=URL ...``) gets its own engine from ``-x url=`` or ``sqlalchemy.url``.
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context

from fleet.db.schema import Base

config = context.config
target_metadata = Base.metadata
if config.config_file_name is not None and config.attributes.get("connection") is None:
    fileConfig(config.config_file_name)  # the alembic command line: its logging from alembic.ini


def _configure(connection: object) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=True,  # SQLite cannot ALTER most things: batch mode copies the table instead
        compare_type=True,
    )


def run_migrations_offline() -> None:
    context.configure(
        url=context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:  # MetadataDB: its connection, its transaction, its lock
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("give the metadata DB URL: alembic -c fleet/migrations/alembic.ini -x url=URL ...")
    from fleet.db.engine import engine_for

    # through MetadataDB's engine setup (SQLite pragmas + BEGIN IMMEDIATE), without its upgrade-on-open
    engine = engine_for(url)
    try:
        with engine.begin() as conn:
            _configure(conn)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
