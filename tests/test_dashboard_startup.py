"""The dashboard's start-up sync (vla_rl/dashboard/startup.py) lets requests go first: the request gate
on its own, and a real app (uvicorn on loopback, real Zarr store, real SQLite) starting on a store of
many episodes its DB has never seen: the list answers while the sync runs, with rows that match the
store, and once the sync is done every episode is in the DB with its auto-flags."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import uvicorn
from vla_rl_client.meta import Controller, SegmentKind
from vla_rl_client.spec import RobotSpec

from bench.dashboard import clone_episodes
from fleet.db import MetadataDB
from fleet.flags import FLAG_NAMES
from fleet.store import EpisodeStore
from vla_rl.dashboard import DashboardConfig, create_app
from vla_rl.dashboard.auth import parse_tokens
from vla_rl.dashboard.startup import RequestGate, Startup

SPEC = RobotSpec(name="toy", state_dim=2, action_dim=2, control_hz=10.0, instruction="do it")
TOKEN = "startup-test-viewer-token-0123"
CLONES = 30


def test_request_gate_waits_for_a_quiet_moment() -> None:
    gate = RequestGate()
    t0 = time.monotonic()
    assert gate.wait_quiet(0.05, 1.0) and time.monotonic() - t0 < 0.5  # never a request: at once
    gate.enter()
    t0 = time.monotonic()
    assert not gate.wait_quiet(0.05, 0.3)  # a request in flight: gives up after max_wait_s
    assert 0.3 <= time.monotonic() - t0 < 2.0
    got: list[tuple[bool, float]] = []

    def wait() -> None:
        s = time.monotonic()
        got.append((gate.wait_quiet(0.1, 10.0), time.monotonic() - s))

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.3)
    assert not got and gate.active == 1  # still waiting while the request runs
    gate.leave()
    waiter.join(10)
    quiet, waited = got[0]
    assert quiet and 0.4 - 0.05 <= waited < 5.0  # 0.3 s in flight + 0.1 s quiet after it ended
    with pytest.raises(ValueError, match="flag_batch: expected an integer >= 1"):
        Startup(flag_batch=0)


def _template(store: EpisodeStore, seed: int, human: bool) -> str:
    """A real closed episode (not in any DB): smooth actions, a takeover in the middle if ``human``."""
    rng = np.random.default_rng(seed)
    w = store.create_episode(SPEC, robot_id="arm-1", task="toy", chunk_len=8, db=None)
    actions = np.tanh(np.cumsum(rng.normal(0, 0.1, (40, 2)), axis=0)).astype(np.float32)
    for i, a in enumerate(actions):
        if human and i == 10:
            w.begin_segment(SegmentKind.INTERVENTION, Controller.HUMAN, reason="stall")
        if human and i == 20:
            w.begin_segment(SegmentKind.AUTONOMOUS, Controller.POLICY)
        w.add_frame(
            cameras={},
            state=np.zeros(2, np.float32),
            action=a,
            reward=0.0,
            terminated=i == len(actions) - 1,
            truncated=False,
            controller=Controller.HUMAN if human and 10 <= i < 20 else Controller.POLICY,
            revision="r",
        )
    return w.close(outcome="success", success=True).episode_id


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Any, EpisodeStore]]:
    store = EpisodeStore(tmp_path / "store", create=True)
    templates = [_template(store, 0, human=False), _template(store, 1, human=True)]
    clone_episodes(store, templates, CLONES)
    cfg = DashboardConfig(store=store.root, workdir=tmp_path / "w")
    app = create_app(
        cfg, tokens=parse_tokens(f'[[token]]\nname = "v"\nrole = "viewer"\ntoken = "{TOKEN}"\n', "t")
    )
    startup = app.state.ctx.startup
    startup.record_batch, startup.flag_batch = 8, 4  # many small steps: the list runs between them
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the dashboard did not start"
        time.sleep(0.01)
    try:
        yield url, startup, store
    finally:
        server.should_exit = True
        thread.join(15)


def test_startup_sync_serves_requests_meanwhile_and_computes_every_flag(
    served: tuple[str, Any, EpisodeStore],
) -> None:
    url, startup, store = served
    lengths = {e: store.read_metadata(e).length for e in store.episode_ids()}
    n = len(lengths)
    assert n == CLONES + 2
    seen_running, totals, slowest = 0, [], 0.0
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as c:
        held = False
        deadline = time.monotonic() + 120
        while True:
            t0 = time.monotonic()
            r = c.get("/api/v1/episodes", params={"per_page": 500})
            slowest = max(slowest, time.monotonic() - t0)
            assert r.status_code == 200, r.text
            body = r.json()
            ids = [x["id"] for x in body["items"]]
            # consistent rows: what the DB has so far, each a store episode as the store has it
            assert body["total"] == len(ids) == len(set(ids)) and set(ids) <= set(lengths)
            assert all(x["length"] == lengths[x["id"]] and x["status"] == "closed" for x in body["items"])
            totals.append(body["total"])
            if not body["sync"]["running"]:
                break
            seen_running += 1
            if body["sync"]["phase"] == "flags" and not held:
                # a request in flight holds the sync back: at most the step under way finishes
                db = MetadataDB.for_store(store.root)
                before = len(db.closed_lacking_flags(FLAG_NAMES))
                startup.gate.enter()
                try:
                    time.sleep(0.6)  # ~2 pauses of MAX_WAIT_S pass; a batch needs flag_batch + 1
                    after = len(db.closed_lacking_flags(FLAG_NAMES))
                finally:
                    startup.gate.leave()
                db.close()
                assert before - after <= startup.flag_batch, (before, after)
                held = True
            assert time.monotonic() < deadline, f"the start-up sync did not finish: {body['sync']}"
            # a lull lets the sync begin (FIRST_QUIET_S); then polls closer than QUIET_S hold it back to a
            # step per MAX_WAIT_S (so the test sees it running); after the check, quiet gaps let it run
            time.sleep(0.6 if held else 1.2 if body["sync"]["phase"] == "waiting" else 0.1)
        assert seen_running >= 2 and held, "the sync finished before the test could watch it"
        assert totals == sorted(totals)  # rows only ever appear
        assert slowest < 5.0  # answered while the sync ran (it never waited for the whole sync)
        health = c.get("/api/v1/health").json()["sync"]
        assert health == body["sync"] and health["phase"] == "done"
        assert health["recorded"] == n and health["to_flag"] == health["flagged"] == n
        db = MetadataDB.for_store(store.root)
        try:
            assert len(db.episode_ids()) == n and db.closed_lacking_flags(FLAG_NAMES) == []
            flags = db.flags(list(lengths), raised_only=False)
            assert all(set(f) == set(FLAG_NAMES) for f in flags.values())
            took_over = {e for e, f in flags.items() if f["takeovers"].raised}
            assert len(took_over) == CLONES // 2 + 1  # the takeover template and its clones
        finally:
            db.close()
        flagged = c.get("/api/v1/episodes", params={"flag": "takeovers", "per_page": 500}).json()
        assert {x["id"] for x in flagged["items"]} == took_over


def test_no_sync_db_reports_off(tmp_path: Path) -> None:
    store = EpisodeStore(tmp_path / "store", create=True)
    cfg = DashboardConfig(store=store.root, workdir=tmp_path / "w", sync_db=False)
    app = create_app(
        cfg, tokens=parse_tokens(f'[[token]]\nname = "v"\nrole = "viewer"\ntoken = "{TOKEN}"\n', "t")
    )
    from fastapi.testclient import TestClient

    with TestClient(app) as c:
        assert c.get("/api/v1/health").json()["sync"]["phase"] == "off"
        got = c.get("/api/v1/episodes", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        assert got["sync"]["running"] is False and got["total"] == 0
