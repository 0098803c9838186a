"""The dashboard's backend (vla_rl/dashboard): the real app under uvicorn on a loopback port, over a
store recorded by the sim fleet (a real policy server and collector, simulated operator takeovers, one
camera), a real Hub registry and the real metadata DB, talked to with httpx.

The world's parts, its fixtures and the served dashboard (``Dashboard``) are tests/dashboard_world.py's
(shared with tests/test_dashboard_browser.py and other dashboard tests).
"""

from __future__ import annotations

import io
import itertools
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import dashboard_world
import httpx
import imageio.v3
import numpy as np
import pytest
from dashboard_world import (
    BOTH,
    BOTH_PG_SLOW,
    TOKENS,
    Dashboard,
    FleetWorld,
    free_port,
    record_fleet,
    serve_dashboard,
    serve_prod,
    start_registry,
    stop_world,
)
from PIL import Image
from test_sim_fleet import tiny_checkpoint  # a random camera policy: weak, so the operator has work
from vla_rl_client.spec import RobotSpec

from fleet.collector import Collector, CollectorConfig
from fleet.db import MetadataDB
from fleet.store import EpisodeStore
from sim.operator import OperatorRules
from sim.registry import make_env
from vla_rl.dashboard import DashboardConfig
from vla_rl.hub.registry import push_folder

TASK = "kinematic/Reach-v0"
REPO = "fleet/reach-cam"
HUB_TOKEN = "dashboard-test-hub-token"
COLLECTOR_TOKEN = "dashboard-test-collector-token"
IMAGE = 32
# the fixtures (pytest finds them by name)
backend, world, dash = dashboard_world.backend, dashboard_world.world, dashboard_world.dash


def camera_spec() -> RobotSpec:
    with make_env(TASK, obs="rgb", image_size=IMAGE) as env:
        return env.spec


def fleet_world(
    root: Path, episodes: int = 2, db_url: str | None = None, shared: FleetWorld | None = None
) -> FleetWorld:
    """Hub with the base policy as ``prod``; a policy server serving it; 2 simulated robots (camera,
    operator takeovers from the uncertainty alarm and stalls) streaming through a collector into a store
    whose metadata DB is ``db_url`` (None: the store's SQLite). With ``shared``, that world's hub, base
    and policy server are used (one registry per process: the hub settings are process-global), with a
    store, collector and DB of this world's own. The server and collector keep running (the fleet page
    asks them); :func:`stop_world` stops them."""
    spec = camera_spec()
    if shared is None:
        hub = start_registry(root, HUB_TOKEN)
        base = tiny_checkpoint(root / "base", spec)
        base_commit = push_folder(base, REPO, message="base", tag="prod")
        server = serve_prod(REPO, follow="self", follow_interval=0.5)
    else:
        hub, server, base_commit = shared.hub, shared.server, shared.base_commit
    store = root / "store"
    collector = Collector(
        CollectorConfig(store=store, db=db_url, port=0, chunk_len=8), token=COLLECTOR_TOKEN
    ).start()
    w = FleetWorld(
        root,
        store,
        hub,
        server,
        collector,
        base_commit,
        spec=spec,
        db_url=db_url,
        owns_services=shared is None,
    )
    # a sloppy operator (noise) takes over a stalled policy for 3 steps at a time: episodes run long
    # enough to have autonomous and intervention segments both
    rules = OperatorRules(
        stall_steps=3, drive_steps=3, min_autonomous_steps=2, max_takeovers=2, max_fraction=0.5, noise=0.9
    )
    record_fleet(w, 2, episodes, rules, COLLECTOR_TOKEN)
    return w


# ------------------------------------------------------------------------------------------ fixtures
# Two worlds: the store's SQLite, and a PostgreSQL database (sharing the first one's hub and policy
# server). Tests read ``world`` / ``dash`` (dashboard_world's fixtures): the SQLite one, or with
# ``@BOTH`` each backend's in turn.
@pytest.fixture(scope="module")
def sqlite_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetWorld]:
    w = fleet_world(tmp_path_factory.mktemp("dash"))
    try:
        yield w
    finally:
        stop_world(w)


@pytest.fixture(scope="module")
def postgresql_world(
    sqlite_world: FleetWorld, pg: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FleetWorld]:
    w = fleet_world(tmp_path_factory.mktemp("dash-pg"), db_url=pg.create_database(), shared=sqlite_world)
    try:
        yield w
    finally:
        stop_world(w)


def _dashboard_of(world: FleetWorld) -> Iterator[Dashboard]:
    os.environ["VLA_RL_COLLECTOR_TOKEN"] = COLLECTOR_TOKEN  # how the dashboard asks the collector
    cfg = DashboardConfig(
        store=world.store,
        db=world.db_url,
        repo=REPO,
        server=(world.server.address, "127.0.0.1:1"),
        collector=world.collector.address,
        workdir=world.root / "dashboard",
    )
    served = serve_dashboard(cfg)
    d = next(served)
    # its start-up sync (auto-flags of the world's episodes) done: the list computes flags itself again
    anon = d.client(None)
    _wait(lambda: not anon.get("/api/v1/health").json()["sync"]["running"], 60, "the start-up sync")
    yield d
    next(served, None)  # stops it


@pytest.fixture(scope="module")
def sqlite_dash(sqlite_world: FleetWorld) -> Iterator[Dashboard]:
    yield from _dashboard_of(sqlite_world)


@pytest.fixture(scope="module")
def postgresql_dash(postgresql_world: FleetWorld) -> Iterator[Dashboard]:
    yield from _dashboard_of(postgresql_world)


def _detail(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"detail"} and {"field", "message", "expected"} <= set(body["detail"]), body
    return body["detail"]


def _wait(pred: Any, timeout_s: float, what: str) -> Any:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _episode_with_takeover(world: FleetWorld) -> str:
    store = EpisodeStore(world.store)
    for eid in store.episode_ids():
        meta = store.read_metadata(eid)
        if any(g.kind.value == "intervention" for g in meta.segments) and meta.length >= 8:
            return eid
    segs = {
        e: [(g.kind.value, g.start) for g in store.read_metadata(e).segments] for e in store.episode_ids()
    }
    raise AssertionError(f"the fleet recorded no episode with a takeover: {segs}")


# ------------------------------------------------------------------------------------------ tests
@BOTH
def test_health_session_roles_schema_and_pages(dash: Dashboard, world: FleetWorld) -> None:
    anon = dash.client(None)
    h = anon.get("/api/v1/health")
    assert h.status_code == 200 and h.json()["store"]["ok"] and h.json()["db"]["ok"]
    for role, (name, _) in TOKENS.items():
        assert dash.client(role).get("/api/v1/session").json() == {"name": name, "role": role}
    r = anon.get("/api/v1/session")
    assert r.status_code == 401 and _detail(r)["field"] == "authorization"
    r = dash.client(None, token="not-a-token-at-all").get("/api/v1/rounds")
    assert r.status_code == 401 and "unknown token" in _detail(r)["message"]
    paths = anon.get("/api/v1/openapi.json").json()["paths"]
    for route in (
        "/api/v1/health",
        "/api/v1/session",
        "/api/v1/label-schema",
        "/api/v1/fleet",
        "/api/v1/episodes",
        "/api/v1/episodes/{episode_id}",
        "/api/v1/episodes/{episode_id}/series",
        "/api/v1/episodes/{episode_id}/frames/{camera}/{t}.jpg",
        "/api/v1/episodes/{episode_id}/video/{camera}.mp4",
        "/api/v1/selection",
        "/api/v1/selection/from-filter",
        "/api/v1/refs",
        "/api/v1/algorithms",
        "/api/v1/rounds",
        "/api/v1/rounds/{n}",
        "/api/v1/rounds/{n}/events",
        "/api/v1/rounds/{n}/cancel",
        "/api/v1/rounds/{n}/promote",
        "/api/v1/refs/{ref}/rollback",
    ):
        assert route in paths, route
    for page in ("/", "/episodes", "/episodes/abc", "/rounds", "/fleet"):
        r = anon.get(page)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), page
        assert "/static/" in r.text and r.headers["cache-control"] == "no-cache"
    js = anon.get("/static/app.js")
    assert js.status_code == 200 and "max-age" in js.headers["cache-control"] and js.headers.get("etag")
    r = anon.get("/api/v1/no-such-route")
    assert r.status_code == 404 and _detail(r)["field"] == "path"


def test_the_page_loads_versioned_immutable_assets(dash: Dashboard, tmp_path: Path) -> None:
    """The page names its assets under /static/<content hash>/ (cached forever, immutable) and runs the
    bundle of every module (vla_rl.dashboard.assets.bundle): one script, whatever the route; the hash
    changes with any asset's bytes."""
    import re

    from vla_rl.dashboard.assets import BUNDLE, STATIC, static_version

    anon = dash.client(None)
    page = anon.get("/episodes").text
    version = static_version()
    assert re.fullmatch(r"[0-9a-f]{12}", version)
    for path in ("/episodes", "/episodes/abc", "/rounds/3", "/"):
        html = anon.get(path).text
        scripts = re.findall(r'<script type="module" src="([^"]+)"', html)
        assert scripts == [f"/static/{version}/{BUNDLE}"] and "modulepreload" not in html, path
    js = anon.get(f"/static/{version}/{BUNDLE}").text
    modules = re.findall(r"^// ---- (\S+)$", js, re.M)
    every = sorted(p.relative_to(STATIC).as_posix() for p in STATIC.rglob("*.js"))
    assert sorted(modules) == every and modules[-1] == "app.js"  # each module once, the entry last
    assert page == html
    for asset in ("app.js", "pages/rounds.js", "style.css"):
        r = anon.get(f"/static/{version}/{asset}")
        assert r.status_code == 200 and r.content == (STATIC / asset).read_bytes()
        assert r.headers["cache-control"] == "public, max-age=31536000, immutable"
    assert anon.get("/static/0123456789ab/app.js").status_code == 404  # another version's URL
    copy = tmp_path / "static"
    copy.mkdir()
    (copy / "a.js").write_text("export const a = 1;\n")
    first = static_version(copy)
    (copy / "a.js").write_text("export const a = 2;\n")
    assert static_version(copy) != first


def test_algorithms_lists_every_trainer_and_preset_with_their_knobs(dash: Dashboard) -> None:
    """``GET /api/v1/algorithms`` is the algorithm and preset tables (what the rounds form offers and
    ``POST /rounds`` accepts), with which learn offline / online and the knobs ``options`` may set."""
    from vla_rl.train.algorithms import ALGORITHMS
    from vla_rl.train.presets import PRESETS

    assert dash.client(None).get("/api/v1/algorithms").status_code == 401
    got = dash.client("viewer").get("/api/v1/algorithms").json()
    algos = {a["name"]: a for a in got["algorithms"]}
    assert list(algos) == list(ALGORITHMS)
    assert {n: (a["offline"], a["online"]) for n, a in algos.items()} == {
        "sft": (True, False),
        "awr": (True, False),
        "awr-pi": (True, True),
        "recap": (True, False),
        "qam": (True, True),
        "fql": (True, False),
        "flow-noise": (False, True),
        "flow-sde": (False, True),
        "distill": (True, False),
    }
    assert algos["sft"]["needs_base"] is False and algos["awr"]["needs_base"] is True
    assert algos["recap"]["summary"] == ALGORITHMS["recap"].summary and algos["recap"]["fixed"] == {
        "variant": "recap"
    }
    presets = {p["name"]: (a["name"], p) for a in got["algorithms"] for p in a["presets"]}
    assert {n: algo for n, (algo, _) in presets.items()} == {n: p.algorithm for n, p in PRESETS.items()}
    assert presets["tiny-awr"][1]["values"]["steps"] == 20
    assert presets["kinematic-qam-offline"][1]["values"]["critic_hidden"] == [256, 256]
    awr = {k["name"]: k for k in algos["awr"]["knobs"]}
    assert awr["steps"]["type"] == "int" and isinstance(awr["steps"]["default"], int)
    assert not {"base", "store", "out", "progress", "variant"} & set(awr)  # set by the dashboard / the name
    assert {"eval_episodes", "push", "repo"} <= {k["name"] for k in got["round_knobs"]}
    assert "/api/v1/algorithms" in dash.client(None).get("/api/v1/openapi.json").json()["paths"]


def test_episode_detail_series_frame_and_video(dash: Dashboard, world: FleetWorld) -> None:
    c = dash.client("viewer")
    eid = _episode_with_takeover(world)
    ep = EpisodeStore(world.store).read_episode(eid)
    d = c.get(f"/api/v1/episodes/{eid}").json()
    assert d["id"] == eid and d["length"] == ep.length and d["status"] == "closed"
    assert d["cameras"] == [{"name": "top_camera", "height": IMAGE, "width": IMAGE}]
    assert [(g["kind"], g["start"], g["reason"]) for g in d["segments"]] == [
        (g.kind.value, g.start, g.reason) for g in ep.meta.segments
    ]
    assert any(g["kind"] == "intervention" and g["reason"] for g in d["segments"])

    s = c.get(f"/api/v1/episodes/{eid}/series").json()
    assert s["length"] == ep.length and s["controller"] == ep.controller.tolist()
    assert s["segment"] == ep.segment.tolist()
    np.testing.assert_allclose(np.array(s["action"]), ep.action, atol=1e-5)
    np.testing.assert_allclose(np.array(s["state"]), ep.state, atol=1e-5)
    np.testing.assert_allclose(np.array(s["reward"]), ep.reward, atol=1e-5)
    human = ep.controller == 1
    assert human.any() and all(s["proposed_action"][i] is None for i in np.flatnonzero(human))
    policy = np.flatnonzero(~human)
    np.testing.assert_allclose(
        np.array([s["proposed_action"][i] for i in policy]), ep.proposed_action[policy], atol=1e-5
    )
    # the policy's chunk scores (recorded by the sim fleet from the server): null on human frames
    u = s["uncertainty"]
    assert u is not None and all(u[i] is None for i in np.flatnonzero(human))
    assert ep.uncertainty is not None
    np.testing.assert_allclose(np.array([u[i] for i in policy]), ep.uncertainty[policy], atol=1e-5)

    for t in (0, ep.length // 2, ep.length - 1):
        r = c.get(f"/api/v1/episodes/{eid}/frames/top_camera/{t}.jpg", params={"quality": 95})
        assert r.status_code == 200 and r.headers["content-type"] == "image/jpeg"
        assert "immutable" in r.headers["cache-control"]
        got = np.asarray(Image.open(io.BytesIO(r.content)).convert("RGB")).astype(float)
        want = ep.cameras["top_camera"][t].astype(float)
        assert got.shape == want.shape and np.abs(got - want).mean() < 4.0, (t, np.abs(got - want).mean())
    # a different frame really differs (the check above is not vacuous)
    assert np.abs(ep.cameras["top_camera"][0].astype(float) - ep.cameras["top_camera"][-1]).mean() > 1.0

    t0 = time.monotonic()
    v = c.get(f"/api/v1/episodes/{eid}/video/top_camera.mp4")
    first_s = time.monotonic() - t0
    assert (
        v.status_code == 200
        and v.headers["content-type"] == "video/mp4"
        and v.headers["x-frames"] == str(ep.length)
    )
    mp4 = dash.app.state.ctx.cfg.workdir / "video" / eid / f"top_camera-{ep.length}.mp4"
    assert mp4.is_file() and mp4.read_bytes() == v.content
    mtime = mp4.stat().st_mtime_ns
    frames = list(imageio.v3.imiter(mp4, plugin="pyav"))
    assert len(frames) == ep.length and frames[0].shape == (IMAGE, IMAGE, 3)
    assert np.abs(frames[3].astype(float) - ep.cameras["top_camera"][3]).mean() < 12.0
    with av.open(str(mp4)) as f:
        stream = f.streams.video[0]
        assert stream.codec_context.name == "h264" and stream.codec_context.pix_fmt == "yuv420p"
    assert v.content.find(b"moov") < v.content.find(b"mdat")  # faststart: the index before the data
    part = c.get(f"/api/v1/episodes/{eid}/video/top_camera.mp4", headers={"Range": "bytes=0-99"})
    assert part.status_code == 206 and len(part.content) == 100
    assert mp4.stat().st_mtime_ns == mtime  # served from the cache
    print(f"video encode ({ep.length} frames, cold): {first_s * 1000:.0f} ms")


@BOTH_PG_SLOW
def test_open_episode_frames_follow_the_committed_length(dash: Dashboard, world: FleetWorld) -> None:
    """An episode a writer is still appending to: only committed frames are served, and frames committed
    after a chunk was cached are read anew."""
    store = EpisodeStore(world.store, db=world.db)
    rng = np.random.default_rng(0)
    spec = world.spec
    w = store.create_episode(spec, robot_id="open-robot", task=TASK, chunk_len=8)
    # smooth images (JPEG keeps them), each frame another colour
    ramp = np.linspace(0, 1, IMAGE)[None, :, None] * np.linspace(0, 1, IMAGE)[:, None, None]
    frames = np.stack([(ramp * rng.uniform(60, 250, 3)).astype(np.uint8) for _ in range(20)])

    def append(i: int) -> None:
        w.add_frame(
            cameras={"top_camera": frames[i]},
            state=np.zeros(spec.state_dim, np.float32),
            action=np.zeros(spec.action_dim, np.float32),
            reward=0.0,
            controller="policy",
            timestamp=time.time(),
        )

    try:
        for i in range(5):
            append(i)
        w.flush()
        c = dash.client("viewer")
        eid = w.episode_id
        assert c.get(f"/api/v1/episodes/{eid}").json()["status"] == "open"
        r = c.get(f"/api/v1/episodes/{eid}/frames/top_camera/4.jpg", params={"quality": 100})
        assert r.status_code == 200 and "no-cache" in r.headers["cache-control"]
        got = np.asarray(Image.open(io.BytesIO(r.content))).astype(float)
        assert np.abs(got - frames[4]).mean() < 3
        assert c.get(f"/api/v1/episodes/{eid}/frames/top_camera/5.jpg").status_code == 404  # not committed
        for i in range(5, 12):  # frame 5..7 land in the chunk already cached with 5 rows
            append(i)
        w.flush()
        r = c.get(f"/api/v1/episodes/{eid}/frames/top_camera/6.jpg", params={"quality": 100})
        got = np.asarray(Image.open(io.BytesIO(r.content))).astype(float)
        assert r.status_code == 200 and np.abs(got - frames[6]).mean() < 3
        assert np.abs(frames[6].astype(float) - frames[4]).mean() > 10
        v = c.get(f"/api/v1/episodes/{eid}/video/top_camera.mp4")
        assert v.status_code == 200 and v.headers["x-frames"] == "12"
    finally:
        w.close("aborted", success=False)


@BOTH_PG_SLOW
def test_bad_input_is_4xx_naming_the_field(dash: Dashboard, world: FleetWorld) -> None:
    c = dash.client("viewer")
    eid = _episode_with_takeover(world)
    cases = [
        (c.get("/api/v1/episodes/bad%20id"), 422, "episode_id"),
        (c.get("/api/v1/episodes/no-such-episode"), 404, "episode_id"),
        (c.get(f"/api/v1/episodes/{eid}/frames/nocam/0.jpg"), 404, "camera"),
        (c.get(f"/api/v1/episodes/{eid}/frames/top_camera/99999.jpg"), 404, "t"),
        (c.get(f"/api/v1/episodes/{eid}/frames/top_camera/x.jpg"), 422, "t"),
        (c.get(f"/api/v1/episodes/{eid}/frames/top_camera/0.jpg", params={"quality": 0}), 422, "quality"),
        (c.get(f"/api/v1/episodes/{eid}/video/nocam.mp4"), 404, "camera"),
        (c.get("/api/v1/episodes", params={"per_page": 501}), 422, "per_page"),
        (c.get("/api/v1/selection", params={"data": "colour=red", "task": TASK}), 422, "data"),
        (c.get("/api/v1/rounds/999"), 404, "round"),
        (c.get("/api/v1/rounds/x"), 422, "n"),
    ]
    for r, status, field in cases:
        assert r.status_code == status and _detail(r)["field"] == field, (
            r.request.url,
            r.status_code,
            r.text,
        )
    # writes need the role, and name it
    r = c.post("/api/v1/rounds", json={"algo": "awr", "base": f"hub://{REPO}@prod"})
    assert r.status_code == 403 and "operator" in _detail(r)["message"]
    op = dash.client("operator")
    before = len(world.db.rounds())
    bad_rounds = [
        ({"algo": "nope", "base": f"hub://{REPO}@prod"}, "algo"),
        ({"preset": "no-such-preset", "base": f"hub://{REPO}@prod"}, "preset"),
        ({"algo": "qam", "preset": "tiny-awr", "base": f"hub://{REPO}@prod"}, "preset"),
        ({"algo": "awr", "base": f"hub://{REPO}@no-such-ref"}, "base"),
        ({"algo": "awr", "base": "hub://nobody/nothing@prod"}, "base"),
        ({"algo": "awr", "base": "not a ref"}, "base"),
        ({"algo": "awr", "base": f"hub://{REPO}@prod", "data": "robot=nobody"}, "data"),
        ({"algo": "awr", "base": f"hub://{REPO}@prod", "data": "colour=red"}, "data"),
        ({"algo": "awr", "base": f"hub://{REPO}@prod", "margin": 2}, "margin"),
        ({"algo": "awr", "base": f"hub://{REPO}@prod", "task": "maniskill/PushCube-v1"}, "task"),
        (
            {"algo": "awr", "base": f"hub://{REPO}@prod", "options": {"no_such_knob": 1}},
            "options.no_such_knob",
        ),
        ({"algo": "awr", "base": f"hub://{REPO}@prod", "options": {"store": "/elsewhere"}}, "options.store"),
        ({"algo": "awr", "base": f"hub://{REPO}@prod", "options": {"steps": -5}}, "steps"),
        ({"algo": "awr", "base": f"hub://{REPO}@prod", "surprise": 1}, "surprise"),
        ({"base": f"hub://{REPO}@prod"}, "algo"),
    ]
    for body, field in bad_rounds:
        r = op.post("/api/v1/rounds", json=body)
        assert r.status_code == 422 and _detail(r)["field"] == field, (body, r.text)
    r = op.post(
        "/api/v1/rounds",
        content=b"{" + b" " * (5 * 1024 * 1024) + b"}",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413 and _detail(r)["field"] == "body"
    assert len(world.db.rounds()) == before  # nothing written


@BOTH
def test_selection_counts_what_a_round_would_train_on(dash: Dashboard, world: FleetWorld) -> None:
    from fleet import store_index
    from fleet.selection import Selection
    from vla_rl.train.transitions import select_episode_ids

    c = dash.client("viewer")
    store = EpisodeStore(world.store)
    for data in ("", "robot=sim-0", "success=false", "robot=sim-1,max=1"):
        got = c.get("/api/v1/selection", params={"data": data, "task": TASK}).json()
        ids = select_episode_ids(store, Selection.parse(data, task=TASK), world.db)
        assert got["episodes"] == len(ids) and got["frames"] == sum(
            store.read_metadata(i).length for i in ids
        ), data
    assert c.get("/api/v1/selection", params={"data": "robot=sim-0"}).json()["task"] == TASK  # the only task
    # the page pre-fills a round's data from the episode filter it shows: every filter carries over
    got = c.get(
        "/api/v1/selection/from-filter", params={"robot": "sim-0", "intervention": "true", "page": 2}
    ).json()
    assert got["data"] == "robot=sim-0,intervention=true" and got["task"] == TASK and "dropped" not in got
    taken_over = Selection.parse("robot=sim-0,intervention=true", task=TASK)
    ids = store_index.select_episode_ids(store, taken_over, world.db)  # none is an answer too: no raise
    assert got["episodes"] == len(ids) and got["frames"] == sum(store.read_metadata(i).length for i in ids)
    r = c.get("/api/v1/selection/from-filter", params={"colour": "red"})
    assert r.status_code == 422 and _detail(r)["field"] == "colour"


def _sse(c: httpx.Client, path: str, until: str = "done", timeout_s: float = 120) -> list[tuple[str, Any]]:
    events: list[tuple[str, Any]] = []
    with c.stream("GET", path, timeout=timeout_s) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name, data = None, []
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data.append(line[len("data: ") :])
            elif not line and name:
                events.append((name, json.loads("\n".join(data))))
                if name == until:
                    break
                name, data = None, []
    return events


TINY_ROUND = {"value_steps": 5, "steps": 5, "batch_size": 8, "threads": 1, "eval_episodes": 2, "eval_envs": 1}


@BOTH
def test_queue_a_round_watch_it_over_sse_and_cancel_it(dash: Dashboard, world: FleetWorld) -> None:
    op = dash.client("operator")
    r = op.post(
        "/api/v1/rounds",
        json={
            "preset": "tiny-awr",
            "base": f"hub://{REPO}@prod",
            "data": "robot=sim-0|sim-1",
            "margin": 0.5,
            "options": TINY_ROUND,
        },
    )
    assert r.status_code == 201, r.text
    rid = r.json()["id"]
    assert r.json()["status"] == "queued" and r.json()["queued_by"] == "olga" and r.json()["episodes"] >= 1
    rec = world.db.round(rid)
    assert rec.status == "queued" and rec.algo == "awr" and rec.config["margin"] == 0.5
    assert rec.config["train"]["data"] == "robot=sim-0|sim-1" and rec.config["preset"] == "tiny-awr"
    assert Path(rec.config["train"]["store"]) == world.store.resolve()

    viewer = dash.client("viewer")
    assert viewer.get(f"/api/v1/rounds/{rid}").json()["live_curve"] is None  # nothing logged yet
    from torch.utils.tensorboard import SummaryWriter  # what every trainer logs into <out>/round-N/tb

    with SummaryWriter(str(Path(rec.config["train"]["out"]) / f"round-{rid}" / "tb")) as tb:
        for step in range(1, 301):
            tb.add_scalar("train/loss", 1.0 / step, step)
    curve = viewer.get(f"/api/v1/rounds/{rid}").json()["live_curve"]["train/loss"]
    assert len(curve) == 200 and curve[0] == [1.0, 1.0] and curve[-1] == [300.0, pytest.approx(1 / 300)]
    listed = viewer.get("/api/v1/rounds").json()["rounds"]
    assert listed[0]["id"] == rid and listed[0]["preset"] == "tiny-awr"
    assert viewer.post(f"/api/v1/rounds/{rid}/cancel").status_code == 403
    done: list[Any] = []
    t = threading.Thread(target=lambda: done.extend(_sse(viewer, f"/api/v1/rounds/{rid}/events")))
    t.start()
    time.sleep(1.0)
    assert op.post(f"/api/v1/rounds/{rid}/cancel").json()["status"] == "cancelled"
    t.join(30)
    assert done[0][0] == "progress" and done[0][1]["status"] == "queued"
    assert done[-1] == ("done", {"id": rid, "status": "cancelled"})
    r = op.post(f"/api/v1/rounds/{rid}/cancel")
    assert r.status_code == 409 and "already cancelled" in _detail(r)["message"]
    assert viewer.get(f"/api/v1/rounds/{rid}").json()["config"]["train"]["steps"] == 5


def _fake_round(world: FleetWorld, seed: int) -> tuple[int, str]:
    """A succeeded round row whose checkpoint (another random policy) is pushed as round-N, as a worker
    would leave it, without training (the slow test runs a real one)."""
    db = world.db
    rid = db.create_round(algo="awr", task=TASK, base_ref=f"hub://{REPO}@prod", config={}, status="running")
    ckpt = tiny_checkpoint(world.root / f"cand-{rid}", world.spec, seed=seed)
    sha = push_folder(ckpt, REPO, message=f"round {rid}", tag=f"round-{rid}")
    db.update_round(
        rid,
        status="succeeded",
        base_revision=world.base_commit,
        checkpoint_ref=f"hub://{REPO}@round-{rid}",
        checkpoint_revision=sha,
        metrics={"success": 0.5, "base_success": 0.5, "delta": 0.0, "gate": {"passed": False}},
        finished_at=time.time(),
    )
    return rid, sha


def _serving(world: FleetWorld) -> str:
    return world.server.slots["reach"].active.commit


@BOTH_PG_SLOW
def test_promote_moves_the_ref_a_following_server_swaps_and_rollback_returns(
    dash: Dashboard, world: FleetWorld
) -> None:
    from vla_rl.hub.registry import resolve

    rid, sha = _fake_round(world, seed=7)
    op, viewer = dash.client("operator"), dash.client("viewer")
    refs = viewer.get("/api/v1/refs").json()
    assert (
        refs["repo"] == REPO and {"name": "prod", "commit": world.base_commit, "kind": "tag"} in refs["refs"]
    )
    assert viewer.post(f"/api/v1/rounds/{rid}/promote").status_code == 403
    assert _serving(world) == world.base_commit
    r = op.post(f"/api/v1/rounds/{rid}/promote")
    assert r.status_code == 200, r.text
    assert r.json()["from"] == world.base_commit and r.json()["to"] == sha and r.json()["by"] == "olga"
    assert resolve(f"hub://{REPO}@prod") == sha
    _wait(lambda: _serving(world) == sha, 60, "the server following prod to serve the promoted commit")
    rec = world.db.round(rid)
    assert rec.promoted and rec.metrics["promotions"][-1]["action"] == "promote"
    assert rec.metrics["success"] == 0.5  # the round's own metrics are kept
    lineage = viewer.get("/api/v1/fleet").json()["lineage"]
    assert {"round": rid, "tag": f"round-{rid}", "promoted": True}.items() <= next(
        x for x in lineage if x["round"] == rid
    ).items()

    r = op.post("/api/v1/refs/prod/rollback")
    assert r.status_code == 200, r.text
    assert r.json()["round"] == rid and r.json()["to"] == world.base_commit and r.json()["by"] == "olga"
    assert resolve(f"hub://{REPO}@prod") == world.base_commit
    _wait(lambda: _serving(world) == world.base_commit, 60, "the server to follow the rollback")
    rec = world.db.round(rid)
    assert not rec.promoted and [e["action"] for e in rec.metrics["promotions"]] == ["promote", "rollback"]
    r = op.post("/api/v1/refs/prod/rollback")  # nothing recorded before the base
    assert r.status_code == 409 and _detail(r)["field"] == "ref"
    r = op.post("/api/v1/refs/nope/rollback")
    assert r.status_code == 404 and _detail(r)["field"] == "ref"
    queued = world.db.create_round(algo="awr", task=TASK, base_ref=f"hub://{REPO}@prod", config={})
    r = op.post(f"/api/v1/rounds/{queued}/promote")
    assert r.status_code == 409 and _detail(r)["field"] == "round"
    world.db.cancel_round(queued)


@BOTH
def test_fleet_page_data(dash: Dashboard, world: FleetWorld) -> None:
    from vla_rl_client.policy_client import PolicyClient

    with make_env(TASK, obs="rgb", image_size=IMAGE) as env, PolicyClient(world.server.address) as client:
        obs, _ = env.reset(seed=0)  # a request within GetInfo's 60 s latency window, however slow the run
        for _ in range(3):
            client.act(
                {"state": obs["state"], "cameras": obs["cameras"], "instruction": obs["instruction"]}, seed=0
            )
    f = dash.client("viewer").get("/api/v1/fleet").json()
    robots = {r["robot_id"]: r for r in f["robots"]}
    assert {"sim-0", "sim-1"} <= set(robots)
    store = EpisodeStore(world.store)
    info = store.info()["robots"]
    metas = [store.read_metadata(e) for e in store.episode_ids()]
    stats = {r.robot_id: r for r in world.collector.stats().robots}
    for rid in ("sim-0", "sim-1"):
        r = robots[rid]
        assert r["episodes"] == info[rid]["episodes"] and r["episodes_hour"] == info[rid]["episodes"]
        closed = [m for m in metas if m.robot_id == rid and m.is_closed]
        with_takeover = [m for m in closed if any(g.kind.value == "intervention" for g in m.segments)]
        assert r["intervention_rate"] == pytest.approx(len(with_takeover) / len(closed))
        assert (
            r["frames_received"] == stats[rid].frames_received
            and r["frames_stored"] == stats[rid].frames_stored
        )
        assert r["revision"] == world.base_commit and r["connected"] is False
    assert f["collector"]["ok"]
    ok, down = f["servers"]
    assert ok["ok"] and ok["commit"] and ok["followed_ref"] == f"hub://{REPO}@prod" and ok["served"] > 0
    assert ok["p50_ms"] > 0 and ok["p99_ms"] >= ok["p50_ms"]
    assert (
        down == {"address": "127.0.0.1:1", "ok": False, "error": down["error"], "models": []}
        and down["error"]
    )
    rev = next(x for x in f["revisions"] if x["revision"] == world.base_commit)
    assert rev["episodes"] >= 4 and 0 <= rev["intervention_rate"] <= 1
    assert f["timeline"] and all(
        set(x) == {"t", "revision", "episodes", "success_rate", "intervention_rate"} for x in f["timeline"]
    )
    assert all(x["revision"] for x in f["revisions"] + f["timeline"])  # human frames' "" is no revision


def test_revision_stats_skip_the_empty_revision(tmp_path: Path, db_url: str) -> None:
    """Demonstrations and human-driven frames carry revision "": it is not a checkpoint, so neither the
    per-revision numbers nor the timeline list it; an episode that mixes a policy's frames with human
    ones counts for the policy's revision."""
    from vla_rl_client.meta import EpisodeMeta

    db = MetadataDB(db_url)
    spec = RobotSpec(name=TASK, state_dim=2, action_dim=2, control_hz=10.0, instruction="reach")
    metas = [
        EpisodeMeta(f"ep-{i}", "arm-1", TASK, "reach", spec, 4, 1000.0 + i, 10, "closed", revs, success=ok)
        for i, (revs, ok) in enumerate(
            ((("",), True), (("r1",), False), (("", "r1"), True), (("r2", ""), True))
        )
    ]
    assert db.record_episodes(metas, str(tmp_path)) == 4
    stats = {r.revision: r for r in db.revision_stats()}
    assert set(stats) == {"r1", "r2"}
    assert stats["r1"].episodes == 2 and stats["r1"].success_rate == pytest.approx(0.5)
    assert stats["r2"].episodes == 1 and stats["r2"].first_seen == pytest.approx(1003.0)
    timeline = db.revision_timeline(bucket_s=3600.0)
    assert sorted(p.revision for p in timeline) == ["r1", "r2"]
    assert sum(p.episodes for p in timeline) == 3


def _scored_episode(store: EpisodeStore, name: str, t: int, outcome: str, **scores: np.ndarray | None) -> str:
    """A closed, policy-driven episode ``ep-NAME`` of ``t`` frames (smooth actions, revision ``rev-1``)
    with the given per-frame scores (``uncertainty=...``, ``failure=...``)."""
    from vla_rl_client.meta import Controller

    spec = RobotSpec(name=TASK, state_dim=2, action_dim=2, control_hz=10.0, instruction="reach")
    w = store.create_episode(spec, robot_id="arm-1", task=TASK, episode_id=f"ep-{name}")
    x = np.linspace(0, 3, t, dtype=np.float32)
    w.add_frames(
        {
            "cameras": {},
            "state": np.zeros((t, 2), np.float32),
            "action": 0.5 * np.stack([np.sin(x), np.cos(x)], 1),
            "controller": Controller.POLICY,
            "revision": "rev-1",
            **scores,
        }
    )
    return w.close(outcome).episode_id


def test_high_uncertainty_flag_is_listed_filtered_and_plotted(tmp_path: Path) -> None:
    """An episode with a burst of high chunk scores gets the ``high_uncertainty`` badge and the flag
    filter finds it alone; a calm one and one without scores do not; the series carries the scores (null
    where there are none)."""
    store = EpisodeStore(tmp_path / "store", create=True, db=MetadataDB.for_store(tmp_path / "store"))
    calm = np.repeat(np.float32([0.55, 0.62, 0.58, 0.65, 0.6, 0.57, 0.63, 0.59, 0.61, 0.56]), 2)
    burst = calm.copy()
    burst[8:14] = np.repeat(np.float32([1.2, 1.3, 1.25]), 2)
    rng = np.random.default_rng(0)
    # the revision's calibration: nine more calm successful episodes (alpha 0.1 needs nine besides the
    # one judged); the burst failed, so it is judged against all ten
    calibration = [
        (f"cal{i}", np.repeat(rng.normal(0.6, 0.05, 10).astype(np.float32), 2), "success") for i in range(9)
    ]
    ids = {}
    for name, u, outcome in (
        *calibration,
        ("burst", burst, "failure"),
        ("calm", calm, "success"),
        ("unscored", None, "success"),
    ):
        ids[name] = _scored_episode(store, name, len(calm), outcome, uncertainty=u)
    cfg = DashboardConfig(store=tmp_path / "store", workdir=tmp_path / "w")
    for d in serve_dashboard(cfg):
        c = d.client("viewer")
        # the start-up sync computes every closed episode's flags (the list waits for it to do so)
        _wait(lambda c=c: not c.get("/api/v1/health").json()["sync"]["running"], 60, "the start-up sync")
        everything = c.get("/api/v1/episodes", params={"per_page": 20}).json()["items"]
        flags = {x["id"]: sorted(x["flags"]) for x in everything}
        assert flags[ids["burst"]] == ["high_uncertainty"] and flags[ids["calm"]] == []
        assert flags[ids["unscored"]] == []
        got = c.get("/api/v1/episodes", params={"flag": "high_uncertainty"}).json()
        found = {x["id"]: x for x in got["items"]}
        # the filter finds the burst; of the ten successful ones at most alpha (one) is raised, the one
        # whose peak tops the other nine's (split conformal, by construction)
        assert ids["burst"] in found and len(found) <= 2 and ids["calm"] not in found
        assert {k: sorted(v) for k, v in flags.items() if v} == {e: ["high_uncertainty"] for e in found}
        f = found[ids["burst"]]["flags"]["high_uncertainty"]
        assert f["detail"].startswith("peak CUSUM") and f["detail"].endswith(
            "calibrated on 10 successful episodes of rev-1"
        )
        assert "high_uncertainty" in c.get(f"/api/v1/episodes/{ids['burst']}").json()["flags"]
        series = c.get(f"/api/v1/episodes/{ids['burst']}/series").json()
        np.testing.assert_allclose(series["uncertainty"], burst, atol=1e-5)
        unscored = c.get(f"/api/v1/episodes/{ids['unscored']}/series").json()["uncertainty"]
        assert unscored == [None] * len(calm)


def test_failure_score_flag_is_listed_filtered_and_plotted(tmp_path: Path) -> None:
    """An episode the failure predictor was sure about gets the ``failure_score`` badge and the flag filter
    finds it alone; a calm one and one without scores do not; the series carries the scores (null where
    there are none)."""
    store = EpisodeStore(tmp_path / "store", create=True, db=MetadataDB.for_store(tmp_path / "store"))
    calm = np.repeat(np.float32([0.1, 0.2, 0.15, 0.3, 0.2]), 2)
    sure = calm.copy()
    sure[6:8] = 0.93
    ids = {}
    for name, p in (("sure", sure), ("calm", calm), ("unscored", None)):
        ids[name] = _scored_episode(store, name, len(calm), "failure", failure=p)
    cfg = DashboardConfig(store=tmp_path / "store", workdir=tmp_path / "w")
    for d in serve_dashboard(cfg):
        c = d.client("viewer")
        _wait(lambda c=c: not c.get("/api/v1/health").json()["sync"]["running"], 60, "the start-up sync")
        everything = c.get("/api/v1/episodes", params={"per_page": 20}).json()["items"]
        flags = {x["id"]: sorted(x["flags"]) for x in everything}
        assert flags == {ids["sure"]: ["failure_score"], ids["calm"]: [], ids["unscored"]: []}
        got = c.get("/api/v1/episodes", params={"flag": "failure_score"}).json()["items"]
        assert [x["id"] for x in got] == [ids["sure"]]
        f = got[0]["flags"]["failure_score"]
        assert f["score"] == pytest.approx(0.93, abs=1e-5)
        assert f["detail"].startswith("peak failure score 0.93 (frame 6); fixed threshold 0.5")
        series = c.get(f"/api/v1/episodes/{ids['sure']}/series").json()
        np.testing.assert_allclose(series["failure"], sure, atol=1e-5)
        unscored = c.get(f"/api/v1/episodes/{ids['unscored']}/series").json()["failure"]
        assert unscored == [None] * len(calm)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_unreachable_store_and_db_answer_503_naming_them(tmp_path: Path, backend: str) -> None:
    missing = tmp_path / "no-store"
    if backend == "sqlite":
        db, where = f"sqlite:///{tmp_path}/nodir/x/metadata.db", "nodir"
    else:  # a loopback port nothing listens on
        where = f"127.0.0.1:{free_port()}"
        db = f"postgresql://vla_rl@{where}/metadata"
    cfg = DashboardConfig(store=missing, db=db, workdir=tmp_path / "w")
    for d in serve_dashboard(cfg):
        c = d.client("viewer")
        h = c.get("/api/v1/health").json()
        assert not h["store"]["ok"] and str(missing) in h["store"]["error"]
        assert not h["db"]["ok"] and where in h["db"]["error"]
        r = c.get("/api/v1/episodes/x/series")
        assert (
            r.status_code == 503 and _detail(r)["field"] == "store" and str(missing) in _detail(r)["message"]
        )
        r = c.get("/api/v1/rounds")
        assert r.status_code == 503 and _detail(r)["field"] == "db" and "--db" in _detail(r)["message"]
        assert c.get("/").status_code == 200  # the page still loads (and shows the banner)


@BOTH
def test_episode_list_filters_sorts_and_pages_in_the_db(dash: Dashboard, world: FleetWorld) -> None:
    c = dash.client("viewer")
    db = world.db
    everything = db.episodes()
    r = c.get("/api/v1/episodes", params={"per_page": 500})
    # the list's phases in its Server-Timing (what a browser's network tab shows), beside the app's total
    phases = dict(p.strip().split(";dur=") for p in r.headers["server-timing"].split(","))
    assert list(phases) == ["query", "flags", "json", "app"] and all(float(v) >= 0 for v in phases.values())
    assert r.headers["content-type"] == "application/json"
    got = r.json()
    assert got["total"] == len(everything) and got["page"] == 1 and got["per_page"] == 500
    created = [x["created_at"] for x in got["items"]]
    assert created == sorted(created, reverse=True)  # default -created_at
    item = got["items"][0]
    assert {
        "id",
        "robot_id",
        "task",
        "outcome",
        "success",
        "length",
        "revisions",
        "intervention_frames",
        "takeovers",
        "labels",
        "flags",
    } <= set(item)
    pages = [c.get("/api/v1/episodes", params={"per_page": 2, "page": p}).json()["items"] for p in (1, 2)]
    assert [x["id"] for x in pages[0] + pages[1]] == [x["id"] for x in got["items"][:4]]
    sim0 = c.get("/api/v1/episodes", params={"robot": "sim-0", "sort": "length"}).json()
    assert sim0["total"] == sum(1 for e in everything if e.robot_id == "sim-0")
    assert [x["length"] for x in sim0["items"]] == sorted(x["length"] for x in sim0["items"])
    helped = c.get("/api/v1/episodes", params={"intervention": "true"}).json()
    assert helped["total"] >= 1 and all(x["takeovers"] >= 1 for x in helped["items"])
    assert all("takeovers" in x["flags"] for x in helped["items"])  # auto-flags, computed for the page
    flagged = c.get("/api/v1/episodes", params={"flag": "takeovers", "per_page": 500}).json()
    assert {x["id"] for x in flagged["items"]} >= {
        x["id"] for x in helped["items"] if x["status"] == "closed"
    }
    for params, field in (
        ({"colour": "red"}, "colour"),
        ({"sort": "-nope"}, "sort"),
        ({"per_page": 501}, "per_page"),
        ({"since": "yesterday"}, "since"),
        ({"round": 999}, "round"),
    ):
        r = c.get("/api/v1/episodes", params=params)
        assert r.status_code == 422 and _detail(r)["field"] == field, (params, r.text)


@BOTH
def test_labels_roles_bulk_spans_undo_and_bad_input(dash: Dashboard, world: FleetWorld) -> None:
    db = world.db
    viewer, ana = dash.client("viewer"), dash.client("labeller")
    eid = _episode_with_takeover(world)
    length = db.episode(eid).length
    schema = viewer.get("/api/v1/label-schema").json()
    assert "outcome" in [k["key"] for k in schema["episode"]] and schema["span"][0]["digits"]["2"] == "idle"

    r = viewer.post("/api/v1/labels", json={"episode_ids": [eid], "key": "outcome", "value": "failure"})
    assert r.status_code == 403 and "labeller" in _detail(r)["message"]
    n_labels = len(db.labels())
    bad = [
        ({"episode_ids": [eid], "key": "colour", "value": "red"}, 422, "key"),
        ({"episode_ids": [eid], "key": "outcome", "value": "meh"}, 422, "value"),
        (
            {"episode_ids": [eid], "key": "segment", "value": "idle", "start": 2, "end": length + 5},
            422,
            "end",
        ),
        ({"episode_ids": [eid], "key": "segment", "value": "idle", "start": 5, "end": 2}, 422, "start"),
        ({"episode_ids": [eid], "key": "segment", "value": "idle", "start": 2}, 422, "end"),
        ({"episode_ids": [eid], "key": "outcome", "value": "failure", "start": 0, "end": 2}, 422, "start"),
        ({"episode_ids": [eid], "key": "segment", "value": "idle"}, 422, "start"),  # a span key needs a span
        ({"episode_ids": [eid, "no-such-episode"], "key": "outcome", "value": "failure"}, 404, "episode_ids"),
        (
            {"episode_ids": [f"e{i}" for i in range(10_001)], "key": "outcome", "value": "failure"},
            422,
            "episode_ids",
        ),
        ({"episode_ids": [], "key": "outcome", "value": "failure"}, 422, "episode_ids"),
        ({"key": "outcome", "value": "failure"}, 422, "episode_ids"),
        ({"filter": {"colour": "red"}, "key": "outcome", "value": "failure"}, 422, "filter.colour"),
        ({"filter": {"robot": "nobody"}, "key": "outcome", "value": "failure"}, 422, "filter"),
        ({"episode_ids": [eid], "key": "note", "value": "x" * 5000}, 422, "value"),
        ({"episode_ids": [eid], "key": "note", "value": "ok", "note": "y" * 5000}, 422, "note"),
        ({"episode_ids": [eid], "key": "outcome", "value": "failure", "author": "mallory"}, 422, "author"),
    ]
    for body, status, field in bad:
        r = ana.post("/api/v1/labels", json=body)
        assert r.status_code == status and _detail(r)["field"] == field, (
            body.get("key"),
            field,
            r.text[:300],
        )
    assert len(db.labels()) == n_labels  # nothing written

    r = ana.post(
        "/api/v1/labels", json={"episode_ids": [eid], "key": "outcome", "value": "failure", "note": "slipped"}
    )
    assert r.status_code == 201 and len(r.json()["ids"]) == 1
    first = r.json()["ids"][0]
    (lb,) = [x for x in db.labels(eid) if x.id == first]
    assert (lb.key, lb.value, lb.author, lb.source, lb.note) == (
        "outcome",
        "failure",
        "ana",
        "human",
        "slipped",
    )
    r = ana.post(
        "/api/v1/labels", json={"episode_ids": [eid], "key": "segment", "value": "idle", "start": 1, "end": 4}
    )
    span_id = r.json()["ids"][0]
    d = viewer.get(f"/api/v1/episodes/{eid}").json()
    assert d["labels"]["outcome"] == "failure" and d["outcome"] == "failure" and d["success"] is False
    assert [(x["key"], x["value"], x["start"], x["end"], x["author"]) for x in d["spans"]] == [
        ("segment", "idle", 1, 4, "ana")
    ]
    assert [x["id"] for x in d["history"]] == [x.id for x in db.labels(eid)]

    # bulk: every match of a filter, in one transaction; the list filters on the label
    target = c_total = viewer.get("/api/v1/episodes", params={"robot": "sim-0"}).json()["total"]
    r = ana.post("/api/v1/labels", json={"filter": {"robot": "sim-0"}, "key": "quality", "value": "good"})
    assert r.status_code == 201 and r.json()["episodes"] == target == len(r.json()["ids"])
    assert viewer.get("/api/v1/episodes", params={"label": "quality:good"}).json()["total"] == c_total
    assert db.current_labels([x.id for x in db.episodes() if x.robot_id == "sim-0"]) and all(
        v.get("quality") == "good"
        for k, v in db.current_labels([x.id for x in db.episodes() if x.robot_id == "sim-0"]).items()
    )

    # undo: the current value falls back; twice is refused; an unknown label is 404
    assert viewer.post(f"/api/v1/labels/{first}/undo").status_code == 403
    r = ana.post(f"/api/v1/labels/{first}/undo")
    assert r.status_code == 201 and r.json()["undoes"] == first and r.json()["label"]["author"] == "ana"
    d = viewer.get(f"/api/v1/episodes/{eid}").json()
    assert "outcome" not in d["labels"] and d["outcome"] == d["recorded_outcome"]
    assert ana.post(f"/api/v1/labels/{first}/undo").status_code == 409
    assert ana.post("/api/v1/labels/999999/undo").status_code == 404
    ana.post(f"/api/v1/labels/{span_id}/undo")
    assert viewer.get(f"/api/v1/episodes/{eid}").json()["spans"] == []


@pytest.mark.slow
@BOTH
def test_round_from_the_api_runs_in_a_worker_streams_progress_and_ships(
    dash: Dashboard, world: FleetWorld
) -> None:
    """End to end: queue a tiny AWR round through the API, a real `round worker` runs it (its own
    process), the event stream shows its phases until it succeeded, then promote it through the API and
    the policy server following `prod` serves the round's commit."""
    from vla_rl.hub.registry import resolve
    from vla_rl.round_worker import WorkerConfig, run_worker

    op = dash.client("operator")
    world.number_rounds_past(1000)
    knobs = {**TINY_ROUND, "steps": 150}  # long enough for the stream (polling twice a second) to see steps
    r = op.post(
        "/api/v1/rounds",
        json={"preset": "tiny-awr", "base": f"hub://{REPO}@prod", "margin": 0.99, "options": knobs},
    )
    assert r.status_code == 201, r.text
    rid = r.json()["id"]
    ran: list[int] = []
    worker = threading.Thread(
        target=lambda: ran.append(
            run_worker(
                WorkerConfig(
                    store=world.store,
                    db_url=world.db_url,
                    once=True,
                    max_rounds=1,
                    poll_s=0.5,
                    heartbeat_s=1.0,
                )
            )
        )
    )
    t0 = time.monotonic()
    worker.start()
    events = _sse(dash.client("viewer"), f"/api/v1/rounds/{rid}/events", timeout_s=600)
    worker.join(60)
    took = time.monotonic() - t0
    assert ran == [1]
    phases = [e[1]["progress"].get("phase") for e in events if e[0] == "progress"]
    statuses = [e[1]["status"] for e in events if e[0] == "progress"]
    assert events[-1] == ("done", {"id": rid, "status": "succeeded"}), events[-3:]
    assert "running" in statuses and statuses[-1] == "succeeded"
    # (the 2-episode evaluations can fall between two polls of the stream: their episode counts, kept in
    # the progress through the later phases, are what _assert_step_progress checks)
    assert {"training", "pushing"} <= set(phases), phases
    _assert_step_progress([e[1]["progress"] for e in events if e[0] == "progress"], knobs, watched=True)
    rec = world.db.round(rid)
    assert (
        rec.checkpoint_ref == f"hub://{REPO}@round-{rid}" and not rec.promoted
    )  # the gate (margin 0.99) said no
    summary = dash.client("viewer").get(f"/api/v1/rounds/{rid}").json()
    assert (
        summary["metrics"]["curve"] and summary["success"] is not None and summary["base_success"] is not None
    )
    assert summary["live_curve"]["train/loss"]  # read from the worker's TensorBoard logs

    r = op.post(f"/api/v1/rounds/{rid}/promote")
    assert r.status_code == 200 and r.json()["to"] == rec.checkpoint_revision, r.text
    assert resolve(f"hub://{REPO}@prod") == rec.checkpoint_revision
    _wait(lambda: _serving(world) == rec.checkpoint_revision, 60, "the following server to serve the round")
    r = op.post("/api/v1/refs/prod/rollback")
    assert r.status_code == 200 and r.json()["to"] == world.base_commit
    _wait(lambda: _serving(world) == world.base_commit, 60, "the following server to roll back")
    print(f"round {rid}: queued -> succeeded in {took:.0f} s")


def _assert_step_progress(seen: list[dict[str, Any]], knobs: dict[str, Any], *, watched: bool) -> None:
    """The progress a round showed (in order): the steps of the policy stage only go up and reach its
    total (kept through the later phases); the candidate's evaluation reaches ``eval_episodes``. With
    ``watched`` (training long enough for the watcher to look several times): the trainer's reports
    were seen while training, at two step counts at least."""
    train = [(p["stage"], p["step"], p["total_steps"]) for p in seen if p.get("stage")]
    policy = [(s, t) for stage, s, t in train if stage == "train"]
    assert policy and policy[-1] == (knobs["steps"], knobs["steps"]), train
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(policy)), policy
    if watched:
        assert any(p.get("phase") == "training" and p.get("stage") for p in seen), seen
        assert len({s for s, _ in policy}) >= 2, f"only one step count seen: {policy}"
    cand = [(p["episodes_done"], p["episodes_total"]) for p in seen if p.get("evaluating") == "candidate"]
    assert cand and cand[-1] == (knobs["eval_episodes"],) * 2, cand
    assert seen[-1]["step"] == knobs["steps"] and seen[-1]["total_steps"] == knobs["steps"]


@BOTH_PG_SLOW
def test_a_running_round_reports_its_steps_and_evaluation_episodes(
    dash: Dashboard, world: FleetWorld
) -> None:
    """A round queued through the API and run by ``run_round`` (what a worker's round process runs, here
    in a thread of this process to keep it short) writes the trainer's step counts and the evaluation's
    episodes into its progress, which the API shows; see
    test_round_from_the_api_runs_in_a_worker_streams_progress_and_ships (slow) for the worker process
    and a stream that sees the steps go up, test_progress_writer_throttles_to_one_write_a_second for
    the writes."""
    from vla_rl.rounds import config_from_json, run_round

    knobs = {**TINY_ROUND, "steps": 10, "push": False}
    op, viewer = dash.client("operator"), dash.client("viewer")
    r = op.post("/api/v1/rounds", json={"preset": "tiny-awr", "base": f"hub://{REPO}@prod", "options": knobs})
    assert r.status_code == 201, r.text
    rid, db = r.json()["id"], world.db
    rec = db.claim_round("test-worker", rid)
    assert rec is not None
    failed: list[BaseException] = []

    def work() -> None:
        try:
            run_round(config_from_json(rec.config), rid, db, "test-worker")
        except BaseException as e:
            failed.append(e)

    t = threading.Thread(target=work)
    t.start()
    seen: list[dict[str, Any]] = []
    while t.is_alive():
        p = viewer.get(f"/api/v1/rounds/{rid}").json()["progress"]
        if p and (not seen or p != seen[-1]):
            seen.append(p)
        time.sleep(0.03)
    t.join()
    assert not failed, failed
    final = viewer.get(f"/api/v1/rounds/{rid}").json()
    assert final["status"] == "succeeded", final["error"]
    seen.append(final["progress"])
    _assert_step_progress(seen, knobs, watched=False)  # 10 steps can be over before a look
    etas = [p["eta_s"] for p in seen if p.get("stage") == "train" and p["step"] < p["total_steps"]]
    assert all(e is None or e >= 0 for e in etas)
    assert final["progress"]["eta_s"] == 0 and final["progress"]["phase"] == "evaluating"


@BOTH
def test_progress_writer_throttles_to_one_write_a_second(world: FleetWorld) -> None:
    """1,000 trainer steps over 10 s (a fake clock) become ~1 DB write a second: the phase, the first
    report of each stage, one a second, the last step of a stage; the row holds the latest numbers and an
    ETA from the stage's rate; a held-back report is written by flush; a round that is not the writer's
    raises RoundLost."""
    from fleet.db import RoundLost
    from vla_rl.rounds import ProgressWriter
    from vla_rl.train.base import StepProgress, reporting_progress

    db = world.db
    rid = db.create_round(algo="awr", task=TASK, base_ref=f"hub://{REPO}@prod", config={})
    assert db.claim_round("w1", rid) is not None
    now = [0.0]
    w = ProgressWriter(db, rid, "w1", interval_s=1.0, clock=lambda: now[0])
    w.phase("training")
    with reporting_progress(w), StepProgress(1000, stage="train", show=False) as bar:
        for i in range(1000):
            now[0] += 0.01
            bar.update(1)
            if i == 499:
                mid = db.round(rid).progress
    assert 1 + 1 + 9 <= w.writes <= 1 + 1 + 10 + 1, w.writes
    assert mid["phase"] == "training" and mid["stage"] == "train" and mid["total_steps"] == 1000
    assert 400 <= mid["step"] <= 500 and mid["eta_s"] == pytest.approx(5.0, abs=1.2)
    p = db.round(rid).progress
    assert (p["step"], p["total_steps"], p["eta_s"]) == (1000, 1000, 0)
    # an evaluation: its own keys, the training numbers stay
    with reporting_progress(w), StepProgress(4, stage="eval", show=False) as bar:
        now[0] += 0.1
        bar.update(1)  # held back (< 1 s since the stage's first report)
        before = w.writes
        w.flush()
        assert w.writes == before + 1 and db.round(rid).progress["episodes_done"] == 1
        w.flush()  # nothing held back: no write
        assert w.writes == before + 1
        bar.update(3)
    p = db.round(rid).progress
    assert (p["episodes_done"], p["episodes_total"], p["step"]) == (4, 4, 1000)
    db.update_round(rid, status="failed", error="test over", finished_at=time.time())
    with pytest.raises(RoundLost):
        w.phase("evaluating")


def test_two_collectors_the_dashboard_labelling_and_a_round_snapshot_at_once_on_postgresql(
    tmp_path: Path, pg: Any
) -> None:
    """Issue 21's concurrency on one PostgreSQL database, with the real parts (tests/test_metadata_db.py
    has the same at the DB API, on both backends): two collectors (two stores) record 2 robots' episodes
    each, the dashboard labels every closed episode it lists as it appears, and a round's data selection
    (``label.quality=good``, what a round snapshots) reads at the same time. Every snapshot is whole (no
    episode twice, none vanishing, each selected one closed and labelled); at the end every episode is in
    the DB once, closed with its 3 segments, with exactly one label."""
    from test_collector import SPEC, stream_episodes
    from test_collector import TOKEN as ROBOT_TOKEN
    from vla_rl_client.robot_client import RobotClient

    from fleet.selection import Selection
    from vla_rl.train.transitions import select_episode_ids

    url, task, per_robot = pg.create_database(), "t", 4
    stores = [tmp_path / "s1", tmp_path / "s2"]
    collectors = [
        Collector(
            CollectorConfig(store=s, db=url, port=0, chunk_len=8, store_writers=0), token=ROBOT_TOKEN
        ).start()
        for s in stores
    ]
    d = Dashboard(DashboardConfig(store=stores[0], db=url, workdir=tmp_path / "dash"))
    done, labelled_all = threading.Event(), threading.Event()  # the robots' streams; the last label pass
    failures: list[str] = []

    def robots(c: Collector, name: str) -> None:
        try:
            clients = [RobotClient(c.address, f"{name}-{i}", SPEC, task, token=ROBOT_TOKEN) for i in range(2)]
            ts = [
                threading.Thread(target=stream_episodes, args=(cl, per_robot, 12, i))
                for i, cl in enumerate(clients)
            ]
            for t in ts:
                t.start()
            for t in ts:
                t.join(120)
            assert all(cl.close(60) for cl in clients) and c.drain(60)
        except BaseException as e:
            failures.append(f"{name}: {e!r}")

    labelled: set[str] = set()

    def labeller() -> None:
        ana = d.client("labeller")
        give_up = time.monotonic() + 300
        while True:
            # the last pass once the robots are done AND every episode reads closed: a drained collector
            # may still be committing an episode's close to the DB
            last = done.is_set() and (len(labelled) == 2 * 2 * per_robot or time.monotonic() > give_up)
            items = ana.get("/api/v1/episodes", params={"per_page": 500, "status": "closed"}).json()["items"]
            new = [x["id"] for x in items if x["id"] not in labelled]
            if new:
                r = ana.post("/api/v1/labels", json={"episode_ids": new, "key": "quality", "value": "good"})
                if r.status_code != 201:
                    failures.append(f"label: {r.status_code} {r.text[:200]}")
                    labelled_all.set()
                    return
                labelled.update(new)
            if last:
                labelled_all.set()
                return
            time.sleep(0.05)

    snaps: list[list[str]] = []

    def round_snapshot() -> None:
        try:
            read_snapshots()
        except BaseException as e:
            failures.append(f"round snapshot: {e!r}")

    def read_snapshots() -> None:
        db, store = MetadataDB(url), EpisodeStore(stores[0])
        sel = Selection.parse("label.quality=good", task=task)
        while True:
            last = labelled_all.is_set()
            try:
                ids = select_episode_ids(store, sel, db)
            except ValueError as e:  # nothing labelled yet: a round would refuse to start
                if "no closed episodes" not in str(e):
                    raise
                ids = []
            snaps.append(ids)
            if len(ids) != len(set(ids)):
                failures.append(f"a snapshot holds an episode twice: {ids}")
            if snaps[:-1] and not set(snaps[-2]) <= set(ids):
                failures.append(f"episodes vanished: {sorted(set(snaps[-2]) - set(ids))}")
            labels = db.current_labels(ids)
            if any(labels.get(e, {}).get("quality") != "good" for e in ids):
                failures.append("a selected episode is not labelled")
            if last:
                return
            time.sleep(0.02)

    try:
        writers = [
            threading.Thread(target=robots, args=(c, n)) for c, n in zip(collectors, ("a", "b"), strict=True)
        ]
        readers = [threading.Thread(target=labeller), threading.Thread(target=round_snapshot)]
        for t in writers + readers:
            t.start()
        for t in writers:
            t.join(180)
        done.set()
        for t in readers:
            t.join(60)
    finally:
        d.stop()
        for c in collectors:
            c.stop()
    assert failures == [], failures[:5]
    db = MetadataDB(url)
    want = {e for s in stores for e in EpisodeStore(s).episode_ids()}
    eps = db.episodes()
    assert len(want) == 2 * 2 * per_robot and sorted(e.id for e in eps) == sorted(want)  # once each
    assert all(e.status == "closed" and len(e.segments) == 3 for e in eps)
    labels = db.labels(key="quality")
    assert sorted(lb.episode_id for lb in labels) == sorted(want)  # exactly one label each
    assert len(snaps) > 2 and len({len(x) for x in snaps}) > 1, [
        len(x) for x in snaps
    ]  # it read as they wrote
    assert set(snaps[-1]) == set(EpisodeStore(stores[0]).episode_ids())  # the round sees all of its store's
