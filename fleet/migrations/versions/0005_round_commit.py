"""A running round's job records when it started committing (pushing and promoting): ``round_jobs`` gains
``committing_at`` (nullable float). From then on a cancel no longer applies (the round finishes and its row
says what it did), and before it a cancel wins (the round never pushes); both are decided in one
transaction on the round's row (:meth:`fleet.db.MetadataDB.begin_commit`,
:meth:`fleet.db.MetadataDB.cancel_running`). A column that already exists is skipped (a DB written by
``create_all`` of these models).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    have = {c["name"] for c in sa.inspect(op.get_bind()).get_columns("round_jobs")}
    if "committing_at" not in have:
        with op.batch_alter_table("round_jobs") as batch:
            batch.add_column(sa.Column("committing_at", sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("round_jobs") as batch:
        batch.drop_column("committing_at")
