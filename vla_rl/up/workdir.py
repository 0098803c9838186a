"""What ``vla-rl up`` keeps in its workdir: the ports of its services (``up.json``), their tokens
(``secrets/``) and which metadata DB the run uses (its URL, the password kept out of command lines)."""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from vla_rl.core.secrets import read_secret_file
from vla_rl.core.supervisor import free_port, port_free

DASHBOARD_PORT = 8780  # `vla-rl dashboard`'s own default; another free port when it is taken


@dataclass
class Ports:
    hub: int
    server: int
    collector: int
    dashboard: int

    @classmethod
    def load_or_pick(cls, path: Path) -> Ports:
        """The ports an earlier run in this workdir used where they are still free, else new ones (the
        dashboard's preferably its usual 8780, so its URL stays the same)."""
        old = json.loads(path.read_text()).get("ports", {}) if path.exists() else {}
        preferred = {"dashboard": DASHBOARD_PORT}
        picked: dict[str, int] = {}
        for k in ("hub", "server", "collector", "dashboard"):
            for candidate in (old.get(k), preferred.get(k)):
                if candidate and candidate not in picked.values() and port_free(candidate):
                    picked[k] = candidate
                    break
            else:
                picked[k] = free_port()
        return cls(**picked)


def workdir_secret(path: Path) -> str:
    """The token kept in ``path``, made (random, mode 0600 in a 0700 folder) the first time."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.parent.chmod(0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(16) + "\n")
    return read_secret_file(path)


def shown_db_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (what up.json records and messages show)."""
    from sqlalchemy import make_url

    return make_url(url).render_as_string(hide_password=True)


def split_db_password(url: str) -> tuple[str, dict[str, str]]:
    """``url`` without its password, and the environment that carries it instead (``PGPASSWORD``, which
    libpq reads): children get the DB on their command line, and a password never belongs in argv (nor
    in the round configs the DB records). A URL without a password, or not PostgreSQL, is kept."""
    from sqlalchemy import URL, make_url

    u = make_url(url)
    if u.password is None or u.get_backend_name() != "postgresql":
        return url, {}
    bare = URL.create(u.drivername, u.username, None, u.host, u.port, u.database, u.query)
    return bare.render_as_string(hide_password=False), {"PGPASSWORD": str(u.password)}


def workdir_db(given: str | None, recorded: str | None, store: Path) -> str:
    """The metadata DB URL of this run: ``given`` (--db), else the SQLite file in ``store``. A workdir
    whose earlier run recorded (password hidden) another DB is refused: its episodes, rounds and labels
    are there, a run against another DB would start over inside the same store and registry."""
    from sqlalchemy.exc import ArgumentError

    from fleet.db import default_url

    url = given or default_url(store)
    try:
        shown = shown_db_url(url)
    except ArgumentError as e:  # not a URL at all
        raise ValueError(
            f"db: expected an SQLAlchemy URL (e.g. postgresql://host/vla_rl), got {url!r}"
        ) from e
    if recorded is not None and recorded != shown:
        raise ValueError(
            f"db: this workdir's earlier run used the metadata DB {recorded}, not {shown}: resume with "
            f"--db {recorded} (its password too), or start over in another --workdir"
        )
    return url
