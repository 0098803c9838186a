"""The dashboard at its edges (issue 45): what an outsider sends or reads back.

- a viewer never reads the metadata DB's password: not in a route's answer, a log line or a round's record
  (the PostgreSQL world's DB needs a password here);
- text is checked where it comes in (valid Unicode, no control characters) and text a DB already holds
  (a lone surrogate written before the checks) is sent safely, never a 500;
- numbers at the extremes and refs that must not move are 422 naming the field, never a 500;
- video encodes share a bounded pool, the video cache is bounded, and a chunked body over --max-body-kb
  is 413.

The worlds are tests/test_dashboard_api.py's (a sim fleet recorded through a collector, a Hub, a policy
server), one on the store's SQLite and one on a PostgreSQL database whose role logs in with a password.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dashboard_world
import httpx
import pytest
import test_dashboard_api
from dashboard_world import BOTH, Dashboard, FleetWorld, serve_dashboard, stop_world
from sqlalchemy.orm import Session
from test_dashboard_api import COLLECTOR_TOKEN, REPO, TASK, TINY_ROUND, _detail, fleet_world

from fleet.db.schema import LabelRow
from fleet.store import EpisodeStore
from vla_rl.dashboard import DashboardConfig
from vla_rl.dashboard.frames import FrameReader, VideoCache

PASSWORD = "Pw-" + uuid.uuid4().hex  # what no answer, log line or round record may carry
# the fixtures (pytest finds them by name)
backend, world, dash = dashboard_world.backend, dashboard_world.world, dashboard_world.dash
sqlite_world = test_dashboard_api.sqlite_world  # the API tests' world (built again for this file)


def _password_db(pg: Any) -> str:
    """A new database owned by a new role that logs in with PASSWORD (the cluster's own user needs none)."""
    role, name = f"r_{uuid.uuid4().hex[:10]}", f"h_{uuid.uuid4().hex[:10]}"
    pg.sql(f"CREATE ROLE {role} LOGIN PASSWORD '{PASSWORD}'")
    pg.sql(f'CREATE DATABASE "{name}" OWNER {role}')
    return f"postgresql://{role}:{PASSWORD}@127.0.0.1:{pg.port}/{name}"


@pytest.fixture(scope="module")
def postgresql_world(
    sqlite_world: FleetWorld, pg: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FleetWorld]:
    w = fleet_world(tmp_path_factory.mktemp("hard-pg"), db_url=_password_db(pg), shared=sqlite_world)
    try:
        yield w
    finally:
        stop_world(w)


def _dashboard_of(world: FleetWorld, **kw: Any) -> Iterator[Dashboard]:
    os.environ["VLA_RL_COLLECTOR_TOKEN"] = COLLECTOR_TOKEN
    cfg = DashboardConfig(
        store=world.store,
        db=world.db_url,
        repo=REPO,
        server=(world.server.address,),
        collector=world.collector.address,
        workdir=world.root / "dashboard",
        **kw,
    )
    yield from serve_dashboard(cfg)


@pytest.fixture(scope="module")
def sqlite_dash(sqlite_world: FleetWorld) -> Iterator[Dashboard]:
    yield from _dashboard_of(sqlite_world)


@pytest.fixture(scope="module")
def postgresql_dash(postgresql_world: FleetWorld) -> Iterator[Dashboard]:
    yield from _dashboard_of(postgresql_world)


def _refused(r: httpx.Response, status: int, field: str) -> str:
    assert r.status_code == status and _detail(r)["field"] == field, (r.request.url, r.status_code, r.text)
    return _detail(r)["message"]


def _an_episode(world: FleetWorld) -> str:
    return next(e.id for e in world.db.episodes() if e.status == "closed")


# ------------------------------------------------------------------------------------------ item 1
def _every_viewer_get(c: httpx.Client, eid: str, rid: int) -> dict[str, str]:
    """Every GET route of the API's OpenAPI schema, answered to a viewer: path -> the answer's text."""
    schema = c.get("/api/v1/openapi.json").json()
    values = {"episode_id": eid, "camera": "top_camera", "t": "0", "n": str(rid)}
    seen = {"/api/v1/openapi.json": json.dumps(schema)}
    for path, ops in schema["paths"].items():
        if "get" not in ops:
            continue
        url = path.format(**values)
        if url.endswith("/events"):  # a stream: its first event
            with c.stream("GET", url, timeout=30) as r:
                assert r.status_code == 200, url
                seen[url] = next(line for line in r.iter_lines() if line.startswith("data: "))
            continue
        r = c.get(url)
        assert r.status_code < 500, (url, r.text)
        seen[url] = (
            r.text if r.headers.get("content-type", "").startswith(("application/json", "text")) else ""
        )
    assert {"/api/v1/rounds", f"/api/v1/rounds/{rid}", "/api/v1/health", f"/api/v1/episodes/{eid}"} <= set(
        seen
    )
    return seen


def test_no_route_log_line_or_round_record_carries_the_db_password(
    postgresql_world: FleetWorld, postgresql_dash: Dashboard, pg: Any, caplog: pytest.LogCaptureFixture
) -> None:
    w, dash = postgresql_world, postgresql_dash
    assert PASSWORD in (w.db_url or "")  # the world's DB does need it
    caplog.set_level(logging.DEBUG)
    op, viewer = dash.client("operator"), dash.client("viewer")
    r = op.post(
        "/api/v1/rounds",
        json={"preset": "tiny-awr", "base": f"hub://{REPO}@prod", "margin": 0.5, "options": TINY_ROUND},
    )
    assert r.status_code == 201, r.text
    rid = r.json()["id"]
    answers = _every_viewer_get(viewer, _an_episode(w), rid)
    answers["404"] = viewer.get("/api/v1/rounds/999999").text  # an error that names the DB
    leaked = [path for path, text in answers.items() if PASSWORD in text]
    assert leaked == [], leaked
    assert "***@" in json.loads(answers["/api/v1/health"])["db"]["url"]
    # the round's record: no URL at all (the worker that claims it trains against its own DB)
    rec = w.db.round(rid)
    assert PASSWORD not in json.dumps(rec.config) and rec.config["train"]["db_url"] is None
    w.db.cancel_round(rid)
    # a round queued before configs were stored without the password: shown masked
    legacy = {**rec.config, "train": {**rec.config["train"], "db_url": w.db_url}}
    old = w.db.create_round(algo="awr", task=TASK, base_ref=f"hub://{REPO}@prod", config=legacy)
    shown = viewer.get(f"/api/v1/rounds/{old}").json()["config"]["train"]["db_url"]
    assert PASSWORD not in shown and ":***@" in shown
    w.db.cancel_round(old)
    # a DB that refuses the password, and one that is not there: the messages name the URL, masked
    role_url = w.db_url or ""
    for bad in (role_url.replace(PASSWORD, PASSWORD + "-wrong"), role_url.replace(f":{pg.port}/", ":1/")):
        cfg = DashboardConfig(store=w.store, db=bad, workdir=w.root / "dash-bad", sync_db=False)
        for d in serve_dashboard(cfg):
            c = d.client("viewer")
            texts = [d.client(None).get("/api/v1/health").text, c.get("/api/v1/episodes").text]
            assert not any(PASSWORD in t for t in texts) and "***@" in texts[0], texts
    logged = [rec.getMessage() + json.dumps(vars(rec), default=str) for rec in caplog.records]
    assert logged and not [line for line in logged if PASSWORD in line]


# ------------------------------------------------------------------------------------------ item 2
@BOTH
def test_text_is_checked_where_it_comes_in(dash: Dashboard, world: FleetWorld) -> None:
    ana, op = dash.client("labeller"), dash.client("operator")
    eid = _an_episode(world)
    n_labels, n_rounds = len(world.db.labels()), len(world.db.rounds())
    bad_labels = [
        ({"value": "\ud800"}, "value"),  # a lone surrogate: what broke an episode for everyone
        ({"value": "ok", "note": "rang\u0007"}, "note"),
        ({"value": "left\u202eright"}, "value"),
        ({"value": "x", "key": "no\nte"}, "key"),
        ({"value": "x", "episode_ids": [eid + "\x00"]}, "episode_ids.0"),
    ]
    for change, field in bad_labels:
        body = {"episode_ids": [eid], "key": "note", **change}
        r = ana.post("/api/v1/labels", content=json.dumps(body), headers={"content-type": "application/json"})
        assert r.status_code == 422 and _detail(r)["field"].startswith(field), (change, r.text)
    r = ana.post("/api/v1/labels", json={"filter": {"robot": "sim\x00"}, "key": "note", "value": "x"})
    assert _refused(r, 422, "filter.robot")
    # free text may hold newlines and tabs
    r = ana.post("/api/v1/labels", json={"episode_ids": [eid], "key": "note", "value": "two\nlines\tok"})
    assert r.status_code == 201, r.text
    ana.post(f"/api/v1/labels/{r.json()['ids'][0]}/undo")
    r = ana.post("/api/v1/labels/1/undo", json={"note": "\x1b[31m"})
    assert _refused(r, 422, "note")
    base = f"hub://{REPO}@prod"
    for body, field in (
        ({"preset": "tiny-awr", "base": base, "data": "robot=sim-0\nsuccess=true"}, "data"),
        ({"preset": "tiny-awr", "base": base, "task": TASK + "\x00"}, "task"),
        ({"preset": "tiny-awr", "base": base, "options": {"repo": "org/x\r"}}, "options"),
        ({"preset": "tiny-awr", "base": base + "\u2066"}, "base"),
    ):
        message = _refused(op.post("/api/v1/rounds", json=body), 422, field)
        assert message.startswith("options.repo:" if field == "options" else f"{field}:"), message
    assert len(world.db.labels()) == n_labels + 2 and len(world.db.rounds()) == n_rounds  # label + its undo


@BOTH
def test_a_stored_lone_surrogate_is_sent_safely_not_a_500(dash: Dashboard, world: FleetWorld) -> None:
    """A label value written before the checks (or by another tool) holding a lone surrogate: the episode
    list and the episode page still answer, with U+FFFD in its place."""
    eid = _an_episode(world)
    db = world.db
    with Session(db.engine) as s, s.begin():
        row = LabelRow(
            episode_id=eid,
            key="failure",
            value="bad\ud800",
            author="old-tool",
            created_at=time.time(),
            current=True,
        )
        s.add(row)
        s.flush()
        lid = row.id
    viewer = dash.client("viewer")
    try:
        r = viewer.get("/api/v1/episodes", params={"per_page": 500})
        assert r.status_code == 200, r.text
        (item,) = [x for x in r.json()["items"] if x["id"] == eid]
        assert item["labels"]["failure"] == "bad\ufffd"
        r = viewer.get(f"/api/v1/episodes/{eid}")
        assert r.status_code == 200, r.text
        assert r.json()["labels"]["failure"] == "bad\ufffd"
        assert any(h["value"] == "bad\ufffd" for h in r.json()["history"])
        # retracting it: the history keeps the event, and the page still answers
        assert dash.client("labeller").post(f"/api/v1/labels/{lid}/undo").status_code == 201
        r = viewer.get(f"/api/v1/episodes/{eid}")
        assert r.status_code == 200 and "failure" not in r.json()["labels"], r.text
    finally:
        with Session(db.engine) as s, s.begin():
            s.query(LabelRow).filter(LabelRow.episode_id == eid, LabelRow.author == "old-tool").delete()
            s.query(LabelRow).filter(LabelRow.undoes == lid).delete()


# ------------------------------------------------------------------------------------------ item 4
@BOTH
def test_numbers_at_the_extremes_and_refs_that_must_not_move_are_422(
    dash: Dashboard, world: FleetWorld
) -> None:
    from vla_rl.hub.registry import resolve

    viewer, ana, op = dash.client("viewer"), dash.client("labeller"), dash.client("operator")
    huge = str(10**30)
    for name in ("page", "per_page", "min_length", "max_length", "round", "max"):
        _refused(viewer.get("/api/v1/episodes", params={name: huge}), 422, name)
    for name, value in (("since", "1e400"), ("until", "nan")):
        _refused(viewer.get("/api/v1/episodes", params={name: value}), 422, name)
    _refused(viewer.get("/api/v1/selection/from-filter", params={"min_length": huge}), 422, "min_length")
    _refused(viewer.get("/api/v1/selection", params={"data": f"round={huge}", "task": TASK}), 422, "data")
    for path in (f"/api/v1/rounds/{huge}", f"/api/v1/rounds/{huge}/events"):
        _refused(viewer.get(path), 422, "n")
    _refused(op.post(f"/api/v1/rounds/{huge}/cancel"), 422, "n")
    _refused(op.post(f"/api/v1/rounds/{huge}/promote"), 422, "n")
    _refused(ana.post(f"/api/v1/labels/{huge}/undo"), 422, "label_id")
    eid = _an_episode(world)
    span = {"episode_ids": [eid], "key": "segment", "value": "idle"}
    _refused(ana.post("/api/v1/labels", json=span | {"start": 0, "end": 10**30}), 422, "end")
    body = {"filter": {"min_length": huge}, "key": "note", "value": "x"}
    _refused(ana.post("/api/v1/labels", json=body), 422, "filter.min_length")

    # promote with a ref that is no ref, rollback of main (its history) or of ".."
    db = world.db
    main = resolve(f"hub://{REPO}@main")
    rid = db.create_round(algo="awr", task=TASK, base_ref=f"hub://{REPO}@prod", config={}, status="running")
    db.update_round(
        rid,
        status="succeeded",
        base_revision=world.base_commit,
        checkpoint_ref=f"hub://{REPO}@main",
        checkpoint_revision=main,
        promoted=True,  # as if its gate had moved a ref to main's commit
        finished_at=time.time(),
    )
    try:
        for ref in ("../x", "a..b", "main", "x" * 300):
            _refused(op.post(f"/api/v1/rounds/{rid}/promote", json={"ref": ref}), 422, "ref")
        _refused(op.post("/api/v1/refs/main/rollback"), 422, "ref")
        _refused(op.post("/api/v1/refs/%2E%2E/rollback"), 422, "ref")
        assert resolve(f"hub://{REPO}@main") == main
    finally:
        db.update_round(rid, promoted=False)


# ------------------------------------------------------------------------------------------ item 5
def test_video_encodes_share_a_bounded_pool(
    sqlite_world: FleetWorld, sqlite_dash: Dashboard, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One viewer asking for 8 videos at once: at most --video-encoders (2) ffmpeg encodes run at once."""
    running, most, lock = 0, 0, threading.Lock()
    encode = VideoCache._encode

    def slow_encode(self: VideoCache, *a: Any) -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        try:
            time.sleep(0.4)  # long enough for every request to arrive while the first ones encode
            encode(self, *a)
        finally:
            with lock:
                running -= 1

    monkeypatch.setattr(VideoCache, "_encode", slow_encode)
    ids = [e.id for e in sqlite_world.db.episodes() if e.status == "closed" and e.length > 0][:8]
    assert len(ids) >= 4
    c = sqlite_dash.client("viewer")
    answers: list[int] = []
    threads = [
        threading.Thread(
            target=lambda e=e: answers.append(c.get(f"/api/v1/episodes/{e}/video/top_camera.mp4").status_code)
        )
        for e in ids
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert answers == [200] * len(ids) and most == 2, (answers, most)


def test_the_video_cache_is_bounded_least_recently_used_out_first(
    sqlite_world: FleetWorld, tmp_path: Path
) -> None:
    store = EpisodeStore(sqlite_world.store)
    metas = [store.read_metadata(e.id) for e in sqlite_world.db.episodes() if e.status == "closed"][:3]
    cache = VideoCache(tmp_path / "video", FrameReader(store), max_bytes=10**9)
    a, b, c = (cache.get(m, "top_camera") for m in metas)
    for i, p in enumerate((a, b, c)):
        os.utime(p, (i + 1, i + 1))  # used in that order
    assert cache.get(metas[0], "top_camera") == a  # a cache hit is a use: b is now the least recent
    cache.max_bytes = a.stat().st_size + c.stat().st_size
    assert cache.prune() == [b] and a.is_file() and c.is_file() and not b.parent.exists()
    # an encode prunes by itself, and keeps what it just encoded even when that alone is over the bound
    cache.max_bytes = 1
    assert cache.get(metas[1], "top_camera") == b and b.is_file() and not a.exists() and not c.exists()
    with pytest.raises(ValueError, match="video_encoders"):
        DashboardConfig(store=sqlite_world.store, video_encoders=0)
    with pytest.raises(ValueError, match="video_cache_mb"):
        DashboardConfig(store=sqlite_world.store, video_cache_mb=0)


def test_a_chunked_body_over_the_limit_is_413(sqlite_dash: Dashboard) -> None:
    op = sqlite_dash.client("operator")

    def chunks(n: int) -> Iterator[bytes]:
        yield b'{"base": "'
        for _ in range(n):
            yield b"x" * 65536
        yield b'"}'

    r = op.post("/api/v1/rounds", content=chunks(80), headers={"content-type": "application/json"})
    assert r.request.headers.get("transfer-encoding") == "chunked"
    assert _refused(r, 413, "body").startswith("request body over the dashboard's limit")
    # a chunked body under the limit still reaches the route (which refuses it on its merits)
    r = op.post("/api/v1/rounds", content=chunks(1), headers={"content-type": "application/json"})
    assert r.status_code == 422 and _detail(r)["field"] in ("base", "algo"), r.text
