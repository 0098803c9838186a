"""Alembic migrations of the metadata DB (:mod:`fleet.db`). ``MetadataDB(url)`` upgrades to head on open;
see docs/store.md ("Migrations") for adding one."""

from __future__ import annotations

from typing import Any


def add_missing_columns(table: str, columns: tuple[tuple[str, Any], ...]) -> None:
    """Add ``columns`` (name, SQLAlchemy type; nullable) to ``table``, skipping those it has already (a DB
    written by ``create_all`` of the models). For a migration's ``upgrade()``."""
    import sqlalchemy as sa
    from alembic import op

    have = {c["name"] for c in sa.inspect(op.get_bind()).get_columns(table)}
    missing = [(n, t) for n, t in columns if n not in have]
    if missing:
        with op.batch_alter_table(table) as batch:
            for name, type_ in missing:
                batch.add_column(sa.Column(name, type_, nullable=True))


def drop_columns(table: str, columns: tuple[tuple[str, Any], ...]) -> None:
    """Drop ``columns`` from ``table`` (last first). For a migration's ``downgrade()``."""
    from alembic import op

    with op.batch_alter_table(table) as batch:
        for name, _type in reversed(columns):
            batch.drop_column(name)
