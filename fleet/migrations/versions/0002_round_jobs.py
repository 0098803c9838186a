"""round_jobs: rounds become jobs (worker, heartbeat, attempts, cancel, progress).

Rounds recorded before this have no job row; ``MetadataDB`` creates one when it first claims or cancels
such a round.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "round_jobs",
        sa.Column("round_id", sa.Integer(), sa.ForeignKey("rounds.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("worker", sa.String(128), nullable=True),
        sa.Column("claimed_at", sa.Double(), nullable=True),
        sa.Column("heartbeat_at", sa.Double(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("progress", sa.JSON(), nullable=False),
    )
    op.create_index("ix_round_jobs_heartbeat_at", "round_jobs", ["heartbeat_at"])


def downgrade() -> None:
    op.drop_index("ix_round_jobs_heartbeat_at", table_name="round_jobs")
    op.drop_table("round_jobs")
