"""Labels become append-only events; episodes gain a revision join table and auto-flags.

* ``labels`` gains ``start`` / ``end`` (a frame span, end exclusive; null = the whole episode), ``note``,
  ``source`` (``human`` | ``auto``; existing rows become ``human``) and ``undoes`` (the id of the label an
  undo event retracts) and ``current`` (the event is in force: an episode key's latest event not undone,
  a span not undone; backfilled here, kept by every write), plus indexes for "current value" lookups.
* ``episode_revisions`` (episode_id, revision): one row per checkpoint revision that acted in an episode,
  so revision / round filters are one indexed join on SQLite and PostgreSQL alike (the JSON list column
  ``episodes.revisions`` stays, as the source the rows are backfilled from).
* ``episode_flags`` (episode_id, name): auto-flag results (score, raised, detail, computed_at).
* ``ix_episodes_created_at``: the episode list sorts by creation time.

Every step is skipped where its result already exists (a DB written by ``create_all`` of these models
before it was stamped, see ``fleet.db.migrate._legacy_revision``).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_LABEL_COLUMNS = (
    ("start", sa.Integer(), {}),
    ("end", sa.Integer(), {}),
    ("note", sa.Text(), {}),
    ("source", sa.String(16), {"nullable": False, "server_default": "human"}),
    ("undoes", sa.Integer(), {}),
    ("current", sa.Boolean(), {"nullable": False, "server_default": sa.false()}),
)


def _inspector() -> sa.Inspector:
    return sa.inspect(op.get_bind())


def _indexes(table: str) -> set[str]:
    return {ix["name"] for ix in _inspector().get_indexes(table) if ix.get("name")}


def upgrade() -> None:
    have = {c["name"] for c in _inspector().get_columns("labels")}
    missing = [(n, t, kw) for n, t, kw in _LABEL_COLUMNS if n not in have]
    if missing:
        with op.batch_alter_table("labels") as batch:
            for name, type_, kw in missing:
                batch.add_column(sa.Column(name, type_, nullable=kw.get("nullable", True), **_server(kw)))
    label_ix = _indexes("labels")
    if "ix_labels_undoes" not in label_ix:
        op.create_index("ix_labels_undoes", "labels", ["undoes"])
    if "ix_labels_episode_key" not in label_ix:
        op.create_index("ix_labels_episode_key", "labels", ["episode_id", "key"])
    if "ix_labels_key_current" not in label_ix:
        op.create_index("ix_labels_key_current", "labels", ["key", "current"])
    _backfill_current()  # derived from the event log, so recomputing it is always right
    if "ix_episodes_created_at" not in _indexes("episodes"):
        op.create_index("ix_episodes_created_at", "episodes", ["created_at"])

    if not _inspector().has_table("episode_revisions"):
        op.create_table(
            "episode_revisions",
            sa.Column(
                "episode_id",
                sa.String(128),
                sa.ForeignKey("episodes.id", ondelete="CASCADE"),
                primary_key=True,
            ),
            sa.Column("revision", sa.String(128), primary_key=True),
        )
        op.create_index("ix_episode_revisions_revision", "episode_revisions", ["revision"])
    _backfill_revisions()

    if not _inspector().has_table("episode_flags"):
        op.create_table(
            "episode_flags",
            sa.Column(
                "episode_id",
                sa.String(128),
                sa.ForeignKey("episodes.id", ondelete="CASCADE"),
                primary_key=True,
            ),
            sa.Column("name", sa.String(64), primary_key=True),
            sa.Column("score", sa.Double(), nullable=False),
            sa.Column("raised", sa.Boolean(), nullable=False),
            sa.Column("detail", sa.Text(), nullable=False),
            sa.Column("computed_at", sa.Double(), nullable=False),
        )
        op.create_index("ix_episode_flags_name", "episode_flags", ["name"])


def _server(kw: dict[str, object]) -> dict[str, object]:
    return {"server_default": kw["server_default"]} if "server_default" in kw else {}


def _backfill_current() -> None:
    """Mark the events in force: per (episode, key) the latest episode-level event not undone, and every
    span / segment label not undone (undo events never)."""
    bind = op.get_bind()
    labels = sa.table(
        "labels",
        sa.column("id", sa.Integer()),
        sa.column("episode_id", sa.String()),
        sa.column("key", sa.String()),
        sa.column("segment_index", sa.Integer()),
        sa.column("start", sa.Integer()),
        sa.column("undoes", sa.Integer()),
        sa.column("current", sa.Boolean()),
    )
    rows = list(
        bind.execute(
            sa.select(
                labels.c.id,
                labels.c.episode_id,
                labels.c.key,
                labels.c.segment_index,
                labels.c.start,
                labels.c.undoes,
            ).order_by(labels.c.id)
        )
    )
    undone = {r.undoes for r in rows if r.undoes is not None}
    latest: dict[tuple[str, str], int] = {}
    keep: list[int] = []
    for r in rows:
        if r.undoes is not None or r.id in undone:
            continue
        if r.start is None and r.segment_index is None:
            latest[(r.episode_id, r.key)] = r.id
        else:
            keep.append(r.id)
    keep += latest.values()
    bind.execute(sa.update(labels).values(current=False))
    for i in range(0, len(keep), 500):
        bind.execute(sa.update(labels).where(labels.c.id.in_(keep[i : i + 500])).values(current=True))


def _backfill_revisions() -> None:
    """One ``episode_revisions`` row per (episode, revision) of the existing JSON lists (adding only the
    missing ones)."""
    bind = op.get_bind()
    episodes = sa.table("episodes", sa.column("id", sa.String()), sa.column("revisions", sa.Text()))
    target = sa.table(
        "episode_revisions", sa.column("episode_id", sa.String()), sa.column("revision", sa.String())
    )
    have = set(bind.execute(sa.select(target.c.episode_id, target.c.revision)).tuples())
    rows = []
    for eid, revs in bind.execute(sa.select(episodes.c.id, sa.cast(episodes.c.revisions, sa.Text()))):
        for rev in dict.fromkeys(json.loads(revs) if revs else []):
            if (eid, str(rev)) not in have:
                rows.append({"episode_id": eid, "revision": str(rev)})
    for i in range(0, len(rows), 5000):
        bind.execute(sa.insert(target), rows[i : i + 5000])


def downgrade() -> None:
    op.drop_index("ix_episode_flags_name", table_name="episode_flags")
    op.drop_table("episode_flags")
    op.drop_index("ix_episode_revisions_revision", table_name="episode_revisions")
    op.drop_table("episode_revisions")
    op.drop_index("ix_episodes_created_at", table_name="episodes")
    op.drop_index("ix_labels_key_current", table_name="labels")
    op.drop_index("ix_labels_episode_key", table_name="labels")
    op.drop_index("ix_labels_undoes", table_name="labels")
    with op.batch_alter_table("labels") as batch:
        for name, _type, _kw in reversed(_LABEL_COLUMNS):
            batch.drop_column(name)
