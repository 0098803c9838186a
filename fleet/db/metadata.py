"""The metadata DB as one object: :class:`MetadataDB` composed from its per-job parts."""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy.engine import Engine

from fleet.db.engine import default_url, engine_for
from fleet.db.episodes import EpisodesPart
from fleet.db.flags import FlagsPart
from fleet.db.help import HelpPart
from fleet.db.labels import LabelsPart
from fleet.db.migrate import upgrade_schema
from fleet.db.rounds import RoundsPart
from fleet.db.stats import StatsPart


class MetadataDB(EpisodesPart, LabelsPart, FlagsPart, StatsPart, RoundsPart, HelpPart):
    """Episodes, segments and labels. Safe to use from several processes (each opens its own).

    One class composed from per-job parts (mixins over the same engine, :class:`~fleet.db.engine.DBPart`):
    callers keep one object and one method namespace (``db.add_label``, ``db.claim_round``), while each
    job's methods and SQL live in a file of their own."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = self.engine_for(url)
        # Reads that take several statements (a row, then its segments or job) see one snapshot: on
        # PostgreSQL that needs REPEATABLE READ (READ COMMITTED snapshots each statement); SQLite reads
        # run in one transaction (BEGIN IMMEDIATE) anyway.
        self._reader = (
            self.engine.execution_options(isolation_level="REPEATABLE READ")
            if self.engine.dialect.name == "postgresql"
            else self.engine
        )
        try:
            upgrade_schema(self.engine)
        except BaseException:
            self.engine.dispose()
            raise

    @staticmethod
    def engine_for(url: str) -> Engine:
        """An engine with this module's connection setup (SQLite: WAL, busy timeout, BEGIN IMMEDIATE)."""
        return engine_for(url)

    @classmethod
    def for_store(cls, store_root: str | os.PathLike[str]) -> MetadataDB:
        """The SQLite DB in the store's directory (created if missing, so the DB can be opened first and
        handed to ``EpisodeStore(store_root, create=True, db=...)``)."""
        url = default_url(store_root)  # refuses an object store before any folder is made
        Path(store_root).mkdir(parents=True, exist_ok=True)
        return cls(url)

    def __repr__(self) -> str:
        return f"MetadataDB({self.engine.url.render_as_string(hide_password=True)!r})"

    def close(self) -> None:
        self.engine.dispose()
