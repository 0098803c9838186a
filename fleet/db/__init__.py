"""Metadata DB: episodes, their segments, labels, and post-training rounds (SQLAlchemy 2.0).

The episode store holds frames; this DB holds what we query and what we change after the fact.
Labels live only here, so relabelling never rewrites frames. SQLite is the default
(``sqlite:///<store root>/metadata.db``, WAL journal + busy timeout + ``BEGIN IMMEDIATE`` so several
writer processes take turns instead of failing); PostgreSQL (``postgresql://user:password@host/db``,
psycopg 3) is tested too, and is the one to use for workers on several machines.

The schema is Alembic's (``fleet/migrations``): opening a DB upgrades it to the newest revision, under a
lock (SQLite: ``BEGIN IMMEDIATE``; PostgreSQL: an advisory lock), so several processes may open it at
once; a DB already at head costs one query.

Timestamps are unix seconds (float), like the store's.

The package splits the DB by job: ``schema`` (the ORM rows), ``engine`` (opening one), ``migrate`` (the
schema upgrade), ``episodes``, ``labels``, ``flags``, ``stats``, ``rounds`` (rounds and their job queue), ``help`` (robots' help requests),
``query`` (a :class:`fleet.selection.Selection` in SQL); :class:`MetadataDB` (``metadata``) is composed from
their parts. Import from here: ``from fleet.db import MetadataDB``.
"""

from fleet.db.engine import MetadataDBError, default_url
from fleet.db.episodes import EpisodeSummary
from fleet.db.flags import Flag
from fleet.db.help import HELP_STATUSES, HelpConflict, HelpRequest, HelpStatus
from fleet.db.labels import LABEL_SOURCES, OUTCOME_KEY, Label, LabelSource, effective_outcome
from fleet.db.metadata import MetadataDB
from fleet.db.migrate import SCHEMA_HEAD, _alembic_config, upgrade_schema
from fleet.db.rounds import (
    FINISHED_STATUSES,
    ROUND_STATUSES,
    RoundLost,
    RoundRecord,
    RoundStatus,
    worker_id,
)
from fleet.db.schema import (
    Base,
    EpisodeFlagRow,
    EpisodeRevisionRow,
    EpisodeRow,
    HelpRequestRow,
    LabelRow,
    RoundJobRow,
    RoundRow,
    SegmentRow,
)
from fleet.db.stats import RevisionStats, RobotStats, TimelinePoint

__all__ = [
    "FINISHED_STATUSES",
    "HELP_STATUSES",
    "LABEL_SOURCES",
    "OUTCOME_KEY",
    "ROUND_STATUSES",
    "SCHEMA_HEAD",
    "Base",
    "EpisodeFlagRow",
    "EpisodeRevisionRow",
    "EpisodeRow",
    "EpisodeSummary",
    "Flag",
    "HelpConflict",
    "HelpRequest",
    "HelpRequestRow",
    "HelpStatus",
    "Label",
    "LabelRow",
    "LabelSource",
    "MetadataDB",
    "MetadataDBError",
    "RevisionStats",
    "RobotStats",
    "RoundJobRow",
    "RoundLost",
    "RoundRecord",
    "RoundRow",
    "RoundStatus",
    "SegmentRow",
    "TimelinePoint",
    "_alembic_config",
    "default_url",
    "effective_outcome",
    "upgrade_schema",
    "worker_id",
]
