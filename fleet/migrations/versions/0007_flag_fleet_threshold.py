"""Auto-flags judged against the fleet keep their threshold: ``episode_flags`` gains ``threshold`` (the value
the score had to pass) and ``reference_n`` (how many other episodes of the task the threshold rested on),
both nullable (:class:`fleet.db.Flag`, :mod:`fleet.flag_fleet`). Rows already there keep NULL and are judged
again on the next refresh. Columns that already exist are skipped (a DB written by ``create_all``).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from fleet.migrations import add_missing_columns, drop_columns

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = (("threshold", sa.Double()), ("reference_n", sa.Integer()))


def upgrade() -> None:
    add_missing_columns("episode_flags", _COLUMNS)


def downgrade() -> None:
    drop_columns("episode_flags", _COLUMNS)
