"""Auto-flags keep what a ``high_uncertainty`` result was judged on as columns, not only in its detail text.

``episode_flags`` gains ``calibration_revision`` (the checkpoint revision whose calibration the result
depends on), ``calibration_n`` (how many of its successful episodes that calibration had) and
``calibrated`` (whether there were enough to calibrate), all nullable (:class:`fleet.db.Flag`). Rows
already there keep NULL: a ``high_uncertainty`` result without a recorded basis is out of date and
recomputed on the next refresh (as results from before per-revision calibration always were), the other
checks have none. Columns that already exist are skipped (a DB written by ``create_all`` of these models,
see ``fleet.db.migrate._legacy_revision``).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from fleet.migrations import add_missing_columns, drop_columns

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = (
    ("calibration_revision", sa.String(128)),
    ("calibration_n", sa.Integer()),
    ("calibrated", sa.Boolean()),
)


def upgrade() -> None:
    add_missing_columns("episode_flags", _COLUMNS)


def downgrade() -> None:
    drop_columns("episode_flags", _COLUMNS)
