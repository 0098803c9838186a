"""The dashboard tests' shared setup (tests/test_dashboard_api.py, tests/test_dashboard_browser.py and the
files that use their dashboard): a "world" of a Hub registry, a policy server serving the registry's
``prod``, a collector and a store the sim fleet recorded through it (simulated operator takeovers), on
the store's SQLite or a PostgreSQL database; the fixtures that give a test its world by backend; and the
app under uvicorn in a thread (:class:`Dashboard`, with one token per role).

Each file builds its worlds from these parts with its own base policy and fleet: the API tests a random
camera policy and 2 x 2 episodes, the browser tests an SFT base, 2 x 11 episodes and a `vla-rl dashboard`
process. A file that uses ``world`` imports ``backend`` and ``world`` from here and defines the module
fixtures ``sqlite_world`` and ``postgresql_world``; ``@BOTH`` runs a test on each.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from vla_rl_client.spec import RobotSpec

from fleet.collector import Collector
from fleet.db import MetadataDB
from server.config import ServerConfig
from server.policy_server import PolicyServer
from sim.fleet_runner import FleetConfig, run_sim_fleet
from sim.operator import OperatorRules
from vla_rl.dashboard import DashboardConfig
from vla_rl.dashboard.app import create_app
from vla_rl.dashboard.auth import parse_tokens
from vla_rl.hub.registry import configure_hub
from vla_rl.hub.server import HubServer

TOKENS = {
    "viewer": ("vic", "viewer-token-0123456789"),
    "labeller": ("ana", "labeller-token-0123456789"),
    "operator": ("olga", "operator-token-0123456789"),
}
""":class:`Dashboard`'s tokens: role -> (name, token)."""


@dataclass
class FleetWorld:
    root: Path
    store: Path
    hub: HubServer
    server: PolicyServer
    collector: Collector
    base_commit: str
    spec: RobotSpec | None = None
    """The robots' spec (where a file needs it)."""
    db_url: str | None = None
    """The metadata DB (None: the SQLite file in the store)."""
    owns_services: bool = True
    """False: the hub and policy server are another world's (:func:`stop_world` leaves them)."""
    dashboard: str = ""
    """The URL of this world's `vla-rl dashboard` process ("" when it has none)."""
    proc: subprocess.Popen[str] | None = None
    """That process."""

    @property
    def db(self) -> MetadataDB:
        return MetadataDB(self.db_url) if self.db_url else MetadataDB.for_store(self.store)

    def number_rounds_past(self, first: int) -> None:
        """A PostgreSQL world shares the SQLite world's Hub repo, whose ``round-N`` tags that run already
        pushed: number this database's rounds from ``first`` + 1 on (two fleets on one repo must not reuse
        round numbers). Nothing to do on the SQLite world."""
        if self.db_url and self.db_url.startswith("postgresql"):
            from sqlalchemy import text

            with self.db.engine.begin() as conn:
                conn.execute(text(f"SELECT setval(pg_get_serial_sequence('rounds', 'id'), {int(first)})"))


def start_registry(root: Path, token: str) -> HubServer:
    """A Hub registry on ``root/hub`` that this process's hub client is configured for (the settings are
    process-global, and children inherit HF_ENDPOINT/HF_TOKEN: one registry per process)."""
    hub = HubServer(root / "hub", token=token).start()
    configure_hub(hub.url, token)
    return hub


def serve_prod(repo: str, token: str | None = None, **kw: Any) -> PolicyServer:
    """A policy server on a free loopback port serving ``hub://REPO@prod`` as model ``reach`` (CPU, one
    torch thread; ``kw``: more :class:`ServerConfig` fields, e.g. ``follow="self"``)."""
    config = ServerConfig(
        checkpoint=f"hub://{repo}@prod", model_id="reach", port=0, torch_threads=1, device="cpu", **kw
    )
    return PolicyServer(config, token=token).start()


def record_fleet(
    w: FleetWorld, robots: int, episodes: int, rules: OperatorRules, collector_token: str
) -> None:
    """``robots`` simulated robots (20 steps an episode at most, ``rules``' operator) record ``episodes``
    episodes each under ``w``'s policy server through its collector, all of them written when it returns."""
    cfg = FleetConfig(
        progress=False,
        robots=robots,
        server=w.server.address,
        collector=w.collector.address,
        episodes=episodes,
        max_episode_steps=20,
        rules=rules,
        collector_token=collector_token,
    )
    result = run_sim_fleet(cfg)
    assert result.errors == [], result.errors
    assert w.collector.drain(60)


def stop_world(w: FleetWorld) -> None:
    """Stop the world's collector, and its hub and policy server where they are its own."""
    w.collector.stop()
    if w.owns_services:
        w.server.stop()
        w.hub.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------------------------------ fixtures
# Two worlds per file: the store's SQLite, and a PostgreSQL database. Tests read ``world``: the SQLite one,
# or with ``@BOTH`` each backend's in turn; ``dash`` is that world's dashboard where a file serves one.
@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    """The metadata DB backend of this test's world: sqlite, unless ``@BOTH`` parametrizes it."""
    return getattr(request, "param", "sqlite")


@pytest.fixture
def world(request: pytest.FixtureRequest, backend: str) -> FleetWorld:
    return request.getfixturevalue(f"{backend}_world")


@pytest.fixture
def dash(request: pytest.FixtureRequest, backend: str, world: FleetWorld) -> Dashboard:
    """The served dashboard of this test's world (the file's ``sqlite_dash`` / ``postgresql_dash``)."""
    return request.getfixturevalue(f"{backend}_dash")


BOTH = pytest.mark.parametrize("backend", ["sqlite", "postgresql"], indirect=True)
BOTH_PG_SLOW = pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)], indirect=True
)
"""PostgreSQL in the slow suite only (where its DB paths have a CI test elsewhere)."""


# ------------------------------------------------------------------------------------------ the app
class Dashboard:
    """The app under uvicorn in a thread; ``client(role)`` is an httpx client with that role's token."""

    def __init__(self, cfg: DashboardConfig) -> None:
        text = "".join(
            f'[[token]]\nname = "{name}"\nrole = "{role}"\ntoken = "{tok}"\n'
            for role, (name, tok) in TOKENS.items()
        )
        self.app = create_app(cfg, tokens=parse_tokens(text, "test tokens"))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the dashboard did not start"
            time.sleep(0.02)
        self._clients: list[httpx.Client] = []

    def client(self, role: str | None = "viewer", token: str | None = None) -> httpx.Client:
        token = token or (TOKENS[role][1] if role else None)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        c = httpx.Client(base_url=self.url, headers=headers, timeout=60.0)
        self._clients.append(c)
        return c

    def stop(self) -> None:
        for c in self._clients:
            c.close()
        self.server.should_exit = True
        self.thread.join(10)


def serve_dashboard(cfg: DashboardConfig) -> Iterator[Dashboard]:
    d = Dashboard(cfg)
    try:
        yield d
    finally:
        d.stop()


CHROMIUM = "/usr/bin/chromium"
"""Debian's chromium, which the browser tests drive headless (scripts/setup.sh installs it)."""
