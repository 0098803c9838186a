"""Baseline: the schema of the release before rounds were jobs (episodes, segments, labels, rounds).

Each table is created only where it is missing: a DB that ``create_all`` wrote before migrations existed
may hold some of them already (see ``fleet.db.migrate._legacy_revision``).

Revision ID: 0001
Revises:
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _missing(name: str) -> bool:
    return not sa.inspect(op.get_bind()).has_table(name)


def upgrade() -> None:
    if _missing("episodes"):
        op.create_table(
            "episodes",
            sa.Column("id", sa.String(128), primary_key=True),
            sa.Column("robot_id", sa.String(128), nullable=False),
            sa.Column("task", sa.String(256), nullable=False),
            sa.Column("instruction", sa.Text(), nullable=False),
            sa.Column("store_path", sa.Text(), nullable=False),
            sa.Column("status", sa.String(16), nullable=False),
            sa.Column("outcome", sa.String(64), nullable=True),
            sa.Column("success", sa.Boolean(), nullable=True),
            sa.Column("length", sa.Integer(), nullable=False),
            sa.Column("num_segments", sa.Integer(), nullable=False),
            sa.Column("created_at", sa.Double(), nullable=False),
            sa.Column("closed_at", sa.Double(), nullable=True),
            sa.Column("revisions", sa.JSON(), nullable=False),
        )
        for col in ("robot_id", "task", "status"):
            op.create_index(f"ix_episodes_{col}", "episodes", [col])
    if _missing("segments"):
        op.create_table(
            "segments",
            sa.Column(
                "episode_id",
                sa.String(128),
                sa.ForeignKey("episodes.id", ondelete="CASCADE"),
                primary_key=True,
            ),
            sa.Column("index", sa.Integer(), primary_key=True),
            sa.Column("kind", sa.String(32), nullable=False),
            sa.Column("controller", sa.String(32), nullable=False),
            sa.Column("start", sa.Integer(), nullable=False),
            sa.Column("end", sa.Integer(), nullable=True),
            sa.Column("reason", sa.Text(), nullable=True),
        )
    if _missing("labels"):
        op.create_table(
            "labels",
            sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
            sa.Column(
                "episode_id", sa.String(128), sa.ForeignKey("episodes.id", ondelete="CASCADE"), nullable=False
            ),
            sa.Column("segment_index", sa.Integer(), nullable=True),
            sa.Column("key", sa.String(128), nullable=False),
            sa.Column("value", sa.JSON(), nullable=False),
            sa.Column("author", sa.String(128), nullable=False),
            sa.Column("created_at", sa.Double(), nullable=False),
        )
        op.create_index("ix_labels_episode_id", "labels", ["episode_id"])
        op.create_index("ix_labels_key", "labels", ["key"])
    if _missing("rounds"):
        op.create_table(
            "rounds",
            sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
            sa.Column("algo", sa.String(32), nullable=False),
            sa.Column("task", sa.String(256), nullable=False),
            sa.Column("base_ref", sa.Text(), nullable=False),
            sa.Column("base_revision", sa.String(128), nullable=True),
            sa.Column("status", sa.String(16), nullable=False),
            sa.Column("config", sa.JSON(), nullable=False),
            sa.Column("data", sa.JSON(), nullable=False),
            sa.Column("metrics", sa.JSON(), nullable=False),
            sa.Column("checkpoint_ref", sa.Text(), nullable=True),
            sa.Column("checkpoint_revision", sa.String(128), nullable=True),
            sa.Column("promoted", sa.Boolean(), nullable=False),
            sa.Column("error", sa.Text(), nullable=True),
            sa.Column("created_at", sa.Double(), nullable=False),
            sa.Column("finished_at", sa.Double(), nullable=True),
        )
        for col in ("algo", "task", "status"):
            op.create_index(f"ix_rounds_{col}", "rounds", [col])


def downgrade() -> None:
    for name in ("rounds", "labels", "segments", "episodes"):
        op.drop_table(name)
