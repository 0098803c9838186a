"""What the routes read and write: the episode store, the metadata DB, the Hub, and the label schema.

Opening either of the first two may fail (a store path that is not there, a DB server that is down):
the app still starts, ``/api/v1/health`` says what is wrong, and every other API call answers 503 with
a message that names the store path or DB URL and how to fix it (the page shows it as a banner).
A failed open is retried at most every ``retry_s`` seconds, so the dashboard recovers by itself.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from fleet.db import MetadataDB, MetadataDBError, default_url
from fleet.store import EpisodeStore
from vla_rl.core.secrets import shown_url
from vla_rl.dashboard.config import DashboardConfig
from vla_rl.dashboard.errors import ApiError

log = logging.getLogger("vla_rl.dashboard")


class Resources:
    """Lazily opened store and DB, shared by all requests (both are safe to use from several threads)."""

    def __init__(self, cfg: DashboardConfig, retry_s: float = 2.0) -> None:
        self.cfg = cfg
        self.retry_s = retry_s
        self.db_url = cfg.db or default_url(cfg.store)
        self.db_shown = shown_url(self.db_url)
        self._lock = threading.Lock()
        self._store: EpisodeStore | None = None
        self._db: MetadataDB | None = None
        self._store_error: str | None = None
        self._db_error: str | None = None
        self._store_tried = self._db_tried = -1e9

    # ------------------------------------------------------------------ store
    def _open_store(self) -> None:
        root = self.cfg.store
        try:
            self._store = EpisodeStore(root)
            self._store_error = None
        except (FileNotFoundError, ValueError, OSError) as e:
            self._store = None
            self._store_error = (
                f"the episode store {root} cannot be read ({e}); check --store (record one with "
                f"`vla-rl collect --store {root}` or `vla-rl sim demos --store {root}`)"
            )

    def store(self) -> EpisodeStore:
        """The store, or a 503 naming its path."""
        with self._lock:
            if self._store is None and time.monotonic() - self._store_tried >= self.retry_s:
                self._store_tried = time.monotonic()
                self._open_store()
            if self._store is None:
                raise ApiError(
                    503, "store", self._store_error or "episode store unavailable", "a readable store"
                )
            return self._store

    def store_health(self) -> dict[str, Any]:
        try:
            store = self.store()
            if store.remote is not None:  # an object store: its root document still answers
                if not store.remote.exists("zarr.json"):
                    raise FileNotFoundError(f"{store.root}/zarr.json")
            elif not store.episodes_dir.is_dir():
                raise FileNotFoundError(store.episodes_dir)
        except ApiError as e:
            return {"ok": False, "error": e.message, "path": str(self.cfg.store)}
        except (OSError, ValueError) as e:  # ValueError: fleet.objstore.StoreURLError
            with self._lock:
                self._store = None
                self._store_error = f"the episode store {self.cfg.store} went away ({e}); check --store"
            return {"ok": False, "error": self._store_error, "path": str(self.cfg.store)}
        return {"ok": True, "error": None, "path": str(self.cfg.store)}

    # ------------------------------------------------------------------ DB
    def db_error_message(self, e: BaseException) -> str:
        why = str(getattr(e, "orig", None) or e).strip().splitlines()
        return (
            f"the metadata DB {self.db_shown} is unreachable ({why[0] if why else type(e).__name__}); "
            "check --db (is the server running and reachable? for SQLite: does the file's folder exist?)"
        )

    def db(self) -> MetadataDB:
        """The metadata DB, or a 503 naming its URL (password hidden)."""
        with self._lock:
            if self._db is None and time.monotonic() - self._db_tried >= self.retry_s:
                self._db_tried = time.monotonic()
                try:
                    self._db = MetadataDB(self.db_url)
                    self._db_error = None
                except MetadataDBError as e:
                    self._db_error = f"{e} (the dashboard's --db)"
                except (DBAPIError, OSError) as e:
                    self._db_error = self.db_error_message(e)
            if self._db is None:
                raise ApiError(
                    503, "db", self._db_error or "metadata DB unavailable", "a reachable metadata DB"
                )
            return self._db

    def db_health(self) -> dict[str, Any]:
        try:
            db = self.db()
            with db.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
                conn.rollback()
        except ApiError as e:
            return {"ok": False, "error": e.message, "url": self.db_shown}
        except (DBAPIError, OSError) as e:
            return {"ok": False, "error": self.db_error_message(e), "url": self.db_shown}
        return {"ok": True, "error": None, "url": self.db_shown}

    def map_exception(self, e: BaseException) -> ApiError | None:
        """A 503 for an exception that means the DB or the store went away mid-request (else None)."""
        if isinstance(e, OperationalError | InterfaceError):
            return ApiError(503, "db", self.db_error_message(e), "a reachable metadata DB")
        if isinstance(e, DBAPIError):  # reachable, but the query failed (e.g. its tables were dropped)
            why = str(getattr(e, "orig", None) or e).strip().splitlines()
            return ApiError(
                503,
                "db",
                f"the metadata DB {self.db_shown} failed a query ({why[0] if why else type(e).__name__}); "
                "is --db the store's metadata DB, at the schema this vla-rl writes?",
                "a working metadata DB",
            )
        if isinstance(e, FileNotFoundError | PermissionError) and str(self.cfg.store) in str(e):
            return ApiError(
                503, "store", f"the episode store {self.cfg.store} cannot be read ({e})", "a readable store"
            )
        return None

    def close(self) -> None:
        if self._db is not None:
            self._db.close()


def labels_path(cfg: DashboardConfig) -> Path:
    """The label schema file: --labels, else the project's fleet/labels.toml."""
    if cfg.labels is not None:
        return cfg.labels
    import fleet

    return Path(fleet.__file__).with_name("labels.toml")
