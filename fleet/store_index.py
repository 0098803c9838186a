"""The metadata DB as a store's episode index: selecting a store's episodes in SQL.

The store is the truth about which episodes exist; its metadata DB answers every selection
(:mod:`fleet.selection`) in SQL. Writers handed a DB (the collector, ``vla-rl sim demos``, the CLI)
record each episode as they open and close it; :func:`index_store` records the closed store episodes a
DB lacks (a store written without one, a copied store), as the dashboard's start-up sync does.
:func:`select_episodes` indexes, then selects, and leaves out episodes the DB holds that this store does
not (one DB shared by several stores). An episode the DB still has as open is its writer's to record:
it is selected once its close reaches the DB.

**A store without a DB** (an ``s3://`` store opened without ``--db``, or a local one without its
``metadata.db`` file): its closed episodes are indexed into a throwaway SQLite file for that one
selection (reading every episode's metadata, once), so the same SQL answers. What only a DB knows is
refused with a ValueError naming the key and ``--db``: labels, rounds and auto-flags (``success`` and
``outcome`` are then the recorded ones).
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from sqlalchemy.exc import IntegrityError
from vla_rl_client.meta import EpisodeMeta, EpisodeRecord

from fleet.db import MetadataDB
from fleet.selection import Selection
from fleet.store import EpisodeStore

__all__ = ["index_store", "record_closed", "select_episode_ids", "select_episodes", "store_db"]

_NEEDS_DB = {
    "label": "label: selecting by label needs the metadata DB (--db)",
    "round": "round: selecting by round needs the metadata DB's rounds table (--db)",
    "flag": "flag: selecting by auto-flag needs the metadata DB (--db)",
    "flagged": "flagged: selecting by auto-flag needs the metadata DB (--db)",
}


def record_closed(store: EpisodeStore, db: MetadataDB, episode_ids: Sequence[str]) -> int:
    """Record the closed ones of ``episode_ids`` (store episodes the DB lacks) in one transaction;
    returns how many. Open episodes are skipped (their writer records them itself and would race with
    us), unreadable ones too; ids someone recorded meanwhile are skipped one at a time."""
    metas: list[EpisodeMeta] = []
    for eid in episode_ids:
        try:
            meta = store.read_metadata(eid)
        except (KeyError, ValueError, OSError):
            continue
        if meta.is_closed:
            metas.append(meta)
    if not metas:
        return 0
    try:
        return db.record_episodes(metas, str(store.root))
    except IntegrityError:
        n = 0
        for m in metas:
            with contextlib.suppress(IntegrityError):
                n += db.record_episodes([m], str(store.root))
        return n


def index_store(store: EpisodeStore, db: MetadataDB) -> set[str]:
    """Record the store's closed episodes that ``db`` lacks; returns the ids ``db`` holds that the store
    does not (episodes of another store sharing the DB)."""
    listed = store.episode_ids()
    known = set(db.episode_ids())
    record_closed(store, db, [e for e in listed if e not in known])
    return known.difference(listed)


def store_db(store: EpisodeStore, db: MetadataDB | None = None) -> MetadataDB | None:
    """The DB to select ``store``'s episodes from: ``db``, else the store's own (handed to it, or the
    ``metadata.db`` file of a local store, opened here), else None (it has none)."""
    if db is not None:
        return db
    if isinstance(store.db, MetadataDB):
        return store.db
    own = store.root / "metadata.db" if isinstance(store.root, Path) else None
    return MetadataDB.for_store(store.root) if own is not None and own.exists() else None


@contextlib.contextmanager
def _scratch_index(store: EpisodeStore) -> Iterator[MetadataDB]:
    """A throwaway SQLite DB holding the store's closed episodes (a store without a DB)."""
    with tempfile.TemporaryDirectory(prefix="vla-rl-index-") as tmp:
        db = MetadataDB(f"sqlite:///{Path(tmp) / 'index.db'}")
        try:
            record_closed(store, db, store.episode_ids())
            yield db
        finally:
            db.close()


def select_episodes(
    store: EpisodeStore, selection: Selection, db: MetadataDB | None = None
) -> list[EpisodeRecord]:
    """The closed episodes of ``store`` that ``selection`` selects, oldest first (created, then id),
    evaluated in SQL by ``db`` (default: :func:`store_db`; a store without one: see the module
    docstring). Indexes the store into the DB first (:func:`index_store`)."""
    mine = store_db(store, db)
    if mine is None:
        refused = selection.needs_db()
        if refused:
            raise ValueError(_NEEDS_DB[refused[0]])
        with _scratch_index(store) as scratch:
            return scratch.select_records(selection)
    try:
        others = index_store(store, mine)
        if others:
            selection = dataclasses.replace(selection, exclude=(*selection.exclude, *sorted(others)))
        return mine.select_records(selection)
    finally:
        if mine is not db and mine is not store.db:
            mine.close()


def select_episode_ids(store: EpisodeStore, selection: Selection, db: MetadataDB | None = None) -> list[str]:
    """The ids of :func:`select_episodes`."""
    return [r.id for r in select_episodes(store, selection, db)]
