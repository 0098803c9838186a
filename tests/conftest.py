"""Fixtures shared by several test files: a free loopback port, a `vla-rl serve` process, and the metadata
DB on both backends (``db_url``: SQLite, and a database in a throwaway PostgreSQL cluster;
``store_db_url``: the same, with None for the store's own SQLite file)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pg_cluster import PostgresCluster, start_cluster

from vla_rl.core.scheduling import leave_realtime

CLI = [sys.executable, "-m", "vla_rl.cli"]


# The files that take longest (a minute or more each on 2 cores), longest first. `make test` runs whole files
# per xdist worker (--dist loadfile), handed out in collection order as workers run dry; xdist's own order
# (most tests first) leaves a long file with few tests (test_up.py) for last, when the other worker has
# nothing left to do. These start first, so the many short files fill in at the end. A file that grows
# long belongs here; one missing only costs wall time.
LONG_FILES = (
    "test_sim.py",
    "test_qam.py",
    "test_up.py",
    "test_round_queue.py",
    "test_rounds.py",
    "test_lerobot_io.py",
    "test_success_gate.py",
    "test_store.py",
    "test_rtc_trained_lerobot.py",
    "test_up_failure.py",
    "test_dashboard_api.py",
    "test_s3_store.py",
    "test_demos_cli.py",
    "test_help_queue_desk.py",
    "test_metadata_db.py",
    "test_hindsight.py",
    "test_replay.py",
)


def pytest_configure(config: pytest.Config) -> None:
    """Keep the file order :func:`pytest_collection_modifyitems` sets (xdist would re-sort it by count)."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files in :data:`LONG_FILES` first, in its order; then the rest, most tests first (xdist's own order).
    Each file's tests stay together and in their order, so module fixtures are built once."""
    count = Counter(item.path.name for item in items)

    def rank(item: pytest.Item) -> tuple[int, int]:
        name = item.path.name
        return (LONG_FILES.index(name), 0) if name in LONG_FILES else (len(LONG_FILES), -count[name])

    items.sort(key=rank)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(autouse=True)
def _normal_scheduling() -> None:
    """Run every test under the normal scheduler. Seen in CI (running as root): a LeRobot video export
    (SVT-AV1's encoder init) raised an xdist worker's main thread to SCHED_FIFO 99, and the threads it
    started later (Mesa's llvmpipe ones among them) with it, so every process it started later (PostgreSQL,
    Chromium, a dashboard) inherited real-time priority, and a browser test spun at FIFO 99 on both cores
    while the dashboard it waited for starved. The export now resets itself; this stays as a backstop."""
    leave_realtime(
        "test worker", logging.DEBUG
    )  # every thread of it (the culprit: vla_rl/core/scheduling.py)


@pytest.fixture(autouse=True)
def _restore_root_log_handlers() -> Iterator[None]:
    """In-process CLI calls point the root logger at the test's captured stderr (``setup_logging``), which
    pytest closes after the test; restore the handlers so later tests' logs do not hit a closed file."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="session")
def pg() -> Iterator[PostgresCluster]:
    """A PostgreSQL cluster of this test session (tests/pg_cluster.py), started on first use (~1-3 s) and
    removed at the end. Missing server binaries fail the test: run scripts/setup.sh."""
    try:
        cluster = start_cluster()
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)
    yield cluster
    cluster.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A fresh, empty metadata DB URL: a SQLite file, or a new database on the session's PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path_factory.mktemp('db') / 'metadata.db'}"
    return request.getfixturevalue("pg").create_database()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_db_url(request: pytest.FixtureRequest) -> str | None:
    """The metadata DB as a user would name it: None = the SQLite file inside the store (no --db, what
    every command defaults to), or a new database on the session's PostgreSQL (passed with --db)."""
    if request.param == "sqlite":
        return None
    return request.getfixturevalue("pg").create_database()


@pytest.fixture
def free_port() -> int:
    """A loopback port that was free a moment ago (for servers that must come back on the same port)."""
    return _free_port()


@pytest.fixture
def cli_server() -> Iterator[Callable[..., str]]:
    """``start(*serve_args, env=None, timeout_s=120) -> "127.0.0.1:PORT"``: `vla-rl serve *serve_args` in its
    own process on a free port, returned once its health service says SERVING; stopped with SIGINT (as a
    user would) after the test, killed if it does not stop within 20 s."""
    from vla_rl_client.policy_client import PolicyClient, PolicyError

    procs: list[subprocess.Popen[str]] = []

    def start(*serve_args: str, env: dict[str, str] | None = None, timeout_s: float = 120) -> str:
        port = _free_port()
        proc = subprocess.Popen(
            [*CLI, "serve", *serve_args, "--port", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=None if env is None else os.environ | env,
        )
        procs.append(proc)
        address = f"127.0.0.1:{port}"
        with PolicyClient(address, timeout_s=2.0) as probe:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    if probe.health() == "SERVING":
                        return address
                except PolicyError:
                    pass
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                assert time.monotonic() < deadline, "server did not come up"
                time.sleep(0.5)

    yield start
    for proc in procs:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Debian chromium for the dashboard's browser tests (one per test module)."""
    from dashboard_world import CHROMIUM

    if not Path(CHROMIUM).exists():
        pytest.fail(
            f"{CHROMIUM} is missing: run scripts/setup.sh (it installs Debian's chromium)", pytrace=False
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()
