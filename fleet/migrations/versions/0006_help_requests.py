"""Robots' help requests: ``help_requests`` (robot, episode, reason, urgency, status open -> claimed ->
resolved / expired, who claimed it and when; :mod:`fleet.db.help`). Skipped when the table already exists
(a DB written by ``create_all`` of these models).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    if "help_requests" in sa.inspect(op.get_bind()).get_table_names():
        return
    op.create_table(
        "help_requests",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("robot_id", sa.String(128), nullable=False),
        sa.Column("episode_id", sa.String(128), nullable=False),
        sa.Column("reason", sa.String(256), nullable=False),
        sa.Column("urgency", sa.Double(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("claimed_by", sa.String(64), nullable=True),
        sa.Column("claimed_at", sa.Double(), nullable=True),
        sa.Column("closed_at", sa.Double(), nullable=True),
        sa.Column("note", sa.String(256), nullable=True),
    )
    for col in ("robot_id", "episode_id", "status", "created_at"):
        op.create_index(f"ix_help_requests_{col}", "help_requests", [col])
    op.create_index("ix_help_requests_status_urgency", "help_requests", ["status", "urgency"])


def downgrade() -> None:
    op.drop_table("help_requests")
