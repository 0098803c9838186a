"""A throwaway PostgreSQL cluster for the tests: ``initdb`` into a temp dir, ``pg_ctl start`` on a free
loopback port, one fresh database per test, stopped and removed at the end of the session.

The server refuses to run as root, so as root the cluster belongs to an unprivileged user (``postgres``,
which Debian's package creates; else a ``vla_rl_pg`` system user added here) and its binaries run
through ``runuser``. Missing binaries are a failure, not a skip: scripts/setup.sh installs them.
"""

from __future__ import annotations

import atexit
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

PG_ROOT = Path("/usr/lib/postgresql")
USER = "vla_rl"  # the cluster's superuser (trust auth on loopback: no password)


def pg_bin_dir() -> Path:
    """The newest ``/usr/lib/postgresql/N/bin`` holding initdb and pg_ctl."""
    found = sorted(
        (d / "bin" for d in PG_ROOT.glob("*") if (d / "bin" / "initdb").exists() and d.name.isdigit()),
        key=lambda b: int(b.parent.name),
    )
    if not found:
        raise RuntimeError(
            f"PostgreSQL server binaries not found under {PG_ROOT}/*/bin (initdb, pg_ctl): the metadata DB "
            "tests run on a real PostgreSQL; run scripts/setup.sh (it installs Debian's postgresql package)"
        )
    return found[-1]


def _os_user() -> str | None:
    """Who runs the server: None = this user (not root), else an unprivileged account."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "vla_rl_pg"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            pass
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "vla_rl_pg"],
        check=True,
        capture_output=True,
    )
    return "vla_rl_pg"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresCluster:
    def __init__(self) -> None:
        self.bin = pg_bin_dir()
        self.os_user = _os_user()
        # /tmp, not $TMPDIR: the server's user must reach it (and the socket path must stay short)
        self.dir = Path(tempfile.mkdtemp(prefix="vla-rl-pg-", dir="/tmp"))
        self.data = self.dir / "data"
        self.port = _free_port()
        if self.os_user is not None:
            pw = pwd.getpwnam(self.os_user)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self._started = False

    def _run(self, *cmd: str, timeout: float = 120) -> str:
        argv = [str(self.bin / cmd[0]), *cmd[1:]]
        if self.os_user is not None:
            argv = ["runuser", "-u", self.os_user, "--", *argv]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=self.dir)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        return r.stdout

    def start(self) -> PostgresCluster:
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", USER, "--no-sync", "-E", "UTF8")
        # USER needs no password; every other role logs in over TCP with its password (for the tests of
        # refused credentials)
        (self.data / "pg_hba.conf").write_text(
            f"local all all trust\nhost all {USER} 127.0.0.1/32 trust\nhost all all 127.0.0.1/32 scram-sha-256\n"
        )
        # durability off: a test cluster that dies is thrown away anyway
        opts = (
            f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.dir / "log"), "-w", "start")
        self._started = True
        return self

    def url(self, database: str = "postgres", user: str = USER, port: int | None = None) -> str:
        return f"postgresql://{user}@127.0.0.1:{port or self.port}/{database}"

    def create_database(self, prefix: str = "t") -> str:
        """A new empty database; returns its URL."""
        import psycopg

        name = f"{prefix}_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(
            f"host=127.0.0.1 port={self.port} user={USER} dbname=postgres", autocommit=True
        ) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def sql(self, statement: str, database: str = "postgres") -> None:
        import psycopg

        conninfo = f"host=127.0.0.1 port={self.port} user={USER} dbname={database}"
        with psycopg.connect(conninfo, autocommit=True) as c:
            c.execute(statement)

    def stop(self) -> None:
        try:
            if self._started:
                self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", timeout=60)
        finally:
            self._started = False
            shutil.rmtree(self.dir, ignore_errors=True)


def start_cluster() -> PostgresCluster:
    t0 = time.monotonic()
    pg = PostgresCluster()
    try:
        pg.start()
    except BaseException:
        pg.stop()
        raise
    atexit.register(pg.stop)  # also when the session dies before its fixture teardown
    pg.start_seconds = time.monotonic() - t0  # type: ignore[attr-defined]
    return pg
