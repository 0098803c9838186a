"""The dashboard in a real browser: Debian's headless Chromium (driven by Playwright) against a real
`vla-rl dashboard` process, over a store recorded by the sim fleet (real policy server, collector and
simulated operator with takeovers) on the physics-free kinematic task with a camera.

What a labeller, a viewer and an operator do: open an episode, play it, scrub, mark and label a span
from the keyboard, reload and see it, find it in the DB with its author; bulk-label 20 episodes from
a filter; a viewer is refused (403) and the page says why; an operator queues a round from the page,
cancels one, and (slow) watches one finish in a real round worker, promotes it, and a policy server
started with --follow serves the new commit. The tests take the README's screenshots on the way; they land
in docs/img/ only when ``VLA_RL_SCREENSHOTS=1`` is set (a test run leaves the checkout as it found it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dashboard_world
import pytest
import torch
from dashboard_world import (
    BOTH,
    BOTH_PG_SLOW,
    FleetWorld,
    free_port,
    record_fleet,
    serve_prod,
    start_registry,
    stop_world,
)

from fleet.collector import Collector, CollectorConfig
from fleet.store import EpisodeStore
from sim.demos import record_demos
from sim.operator import OperatorRules
from vla_rl.hub.registry import push_folder, resolve
from vla_rl.train.sft import SFTConfig, train_sft

torch.set_num_threads(1)
CLI = [sys.executable, "-m", "vla_rl.cli"]
TASK = "kinematic/Reach-v0"
REPO = "fleet/reach"
HUB_TOKEN = "hub-token-for-dashboard-tests"
COLLECTOR_TOKEN = "collector-token-for-dashboard"
IMG = Path(__file__).resolve().parents[1] / "docs" / "img"
"""Where ``VLA_RL_SCREENSHOTS=1`` writes the README's screenshots (otherwise the world's own folder)."""
TOKENS = {
    "ana": ("labeller", "ana-labeller-token-0123456789"),
    "vic": ("viewer", "vic-viewer-token-0123456789"),
    "ops": ("operator", "ops-operator-token-0123456789"),
}
FLEET_ROBOTS, FLEET_EPISODES = 2, 11
backend, world = dashboard_world.backend, dashboard_world.world  # the fixtures (pytest finds them by name)


def build_store(root: Path, hub_url: str) -> tuple[Path, Path]:
    """A store with 4 scripted demos (rgb, 32 px) and a tiny SFT base trained on them, pushed as prod."""
    store = root / "store"
    record_demos(
        EpisodeStore(store, create=True),
        TASK,
        episodes=4,
        noise=0.3,
        obs="rgb",
        image_size=64,
        robot_prefix="demo",
        progress=False,
    )
    sft = train_sft(
        SFTConfig(
            task=TASK,
            store=store,
            out=root / "sft",
            steps=20,
            batch_size=16,
            chunk_len=4,
            n_exec=2,
            d_model=32,
            n_layers=1,
            expert_n_layers=1,
            instruction_encoder="none",
            checkpoint_every=20,
            threads=1,
            progress=False,
        )
    )
    push_folder(sft.checkpoint, REPO, message="base", tag="prod")
    return store, sft.checkpoint


def start_dashboard(
    world: FleetWorld, *extra: str, store: Path | None = None
) -> tuple[str, subprocess.Popen[str]]:
    port = free_port()
    tokens = world.root / "tokens.toml"
    tokens.write_text(
        "".join(f'[[token]]\nname = "{n}"\nrole = "{r}"\ntoken = "{t}"\n\n' for n, (r, t) in TOKENS.items())
    )
    env = os.environ | {
        "VLA_RL_DASHBOARD_TOKENS_FILE": str(tokens),
        "VLA_RL_COLLECTOR_TOKEN": COLLECTOR_TOKEN,
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        *CLI, "dashboard", "--store", str(store or world.store), "--hub", world.hub.url, "--repo", REPO,
        "--server", world.server.address, "--collector", world.collector.address,
        "--workdir", str(world.root / "dash"), "--port", str(port), *extra,
    ]  # fmt: skip
    log = world.root / f"dashboard-{port}.log"
    with log.open("w") as out:  # a file, not a pipe nobody reads (a full pipe blocks the server's logging)
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/api/v1/health", timeout=1).status_code == 200:
                return url, proc
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the dashboard did not come up in 60 s"
        time.sleep(0.3)


def stop(proc: subprocess.Popen[str] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _fleet_into(w: FleetWorld) -> None:
    """22 sim-fleet episodes with takeovers through ``w``'s collector, then ``w``'s dashboard started."""
    rules = OperatorRules(stall_steps=3, drive_steps=4, max_takeovers=2, max_fraction=0.6)
    record_fleet(w, FLEET_ROBOTS, FLEET_EPISODES, rules, COLLECTOR_TOKEN)
    w.dashboard, w.proc = start_dashboard(w)


# Two worlds: the store's SQLite, and a PostgreSQL database (sharing the first one's hub, base and policy
# server: the hub settings are process-global). Tests read ``world``: the SQLite one, or with ``@BOTH``
# each backend's in turn.
@pytest.fixture(scope="module")
def sqlite_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetWorld]:
    """Hub with the base at prod, a policy server and collector, 22 sim-fleet episodes with takeovers
    (+ 4 demos) in the store, and the dashboard serving it."""
    root = tmp_path_factory.mktemp("dash")
    hub = start_registry(root, HUB_TOKEN)  # children (dashboard, worker, serve) inherit HF_ENDPOINT/HF_TOKEN
    store, _ = build_store(root, hub.url)
    server = serve_prod(REPO, token="x")
    collector = Collector(CollectorConfig(store=store, port=0, chunk_len=16), token=COLLECTOR_TOKEN).start()
    w = FleetWorld(root, store, hub, server, collector, resolve(f"hub://{REPO}@prod"))
    try:
        _fleet_into(w)
        yield w
    finally:
        stop(w.proc)
        stop_world(w)


@pytest.fixture(scope="module")
def postgresql_world(
    sqlite_world: FleetWorld, pg: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FleetWorld]:
    """The same episodes on a PostgreSQL database: a copy of the SQLite world's store (its Zarr data, not
    its DB), which the dashboard (--db URL) records into the empty database on start (its sync of a store
    written without the DB), as it would a store `vla-rl sim demos` wrote. The collector is the SQLite
    world's (the collector's own PostgreSQL path: tests/test_collector.py, tests/test_up.py)."""
    import shutil

    root = tmp_path_factory.mktemp("dash-pg")
    url, store = pg.create_database(), root / "store"
    shutil.copytree(
        sqlite_world.store, store, ignore=shutil.ignore_patterns("metadata.db*", "wal", "collector.lock")
    )
    w = FleetWorld(
        root,
        store,
        sqlite_world.hub,
        sqlite_world.server,
        sqlite_world.collector,
        sqlite_world.base_commit,
        db_url=url,
        owns_services=False,
    )
    try:
        w.dashboard, w.proc = start_dashboard(w, "--db", url)
        want, deadline = len(EpisodeStore(store).episode_ids()), time.monotonic() + 60
        while len(w.db.episodes()) < want and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(w.db.episodes()) == want == 4 + FLEET_ROBOTS * FLEET_EPISODES
        yield w
    finally:
        stop(w.proc)


def screenshot(page: Any, world: FleetWorld, name: str) -> None:
    """The README's screenshot ``NAME`` (from the SQLite world's run only): into docs/img/ with
    ``VLA_RL_SCREENSHOTS=1``, into the world's temporary folder otherwise."""
    if world.db_url is None:
        folder = IMG if os.environ.get("VLA_RL_SCREENSHOTS") == "1" else world.root / "screenshots"
        folder.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(folder / name), full_page=True)
        assert (folder / name).stat().st_size > 10_000  # a page was drawn, not a blank


def open_page(
    browser: Any, world: FleetWorld, who: str | None, path: str = "/", base: str | None = None
) -> Any:
    """A fresh browser context (own localStorage) with ``who``'s token, at ``path``."""
    ctx = browser.new_context(viewport={"width": 1440, "height": 1000})
    if who is not None:
        token = TOKENS[who][1]
        ctx.add_init_script(f"localStorage.setItem('vla-rl-dashboard-token', {json.dumps(token)})")
    page = ctx.new_page()
    page.errors = []  # type: ignore[attr-defined]
    page.on("pageerror", lambda e: page.errors.append(str(e)))  # type: ignore[attr-defined]
    page.set_default_timeout(15_000)
    page.goto((base or world.dashboard) + path)
    return page


def frame_of(page: Any) -> int:
    return int(page.evaluate("window.vlaPlayer.t"))


def episode_with_takeover(world: FleetWorld) -> tuple[str, int]:
    db = world.db
    for e in db.episodes(task=TASK):
        if (
            e.robot_id.startswith("sim-")
            and any(g.kind.value == "intervention" for g in e.segments)
            and e.length >= 12
        ):
            return e.id, e.length
    raise AssertionError("no fleet episode with a takeover")


# ------------------------------------------------------------------------------------------ episode
@BOTH_PG_SLOW
def test_play_scrub_label_a_span_from_the_keyboard_reload_and_find_it_in_the_db(
    browser: Any, world: FleetWorld
) -> None:
    eid, length = episode_with_takeover(world)
    page = open_page(browser, world, "ana", f"/episodes?robot={eid and ''}")
    page.goto(f"{world.dashboard}/episodes?intervention=true")
    page.wait_for_selector(f"tr[data-id='{eid}']")
    page.click(f"tr[data-id='{eid}'] a")
    page.wait_for_url(f"**/episodes/{eid}")
    page.wait_for_function("window.vlaPlayer && window.vlaPlayer.firstShown")
    # the control lane shows the takeover with its reason as tooltip
    human = page.locator("svg.timeline g.ctl-human").first
    assert "takeover" in human.locator("title").text_content()
    assert page.locator("figure.camera canvas").count() == 1
    # the policy's per-chunk uncertainty (recorded by the sim fleet from the server) is plotted
    page.locator(".plot-title", has_text="policy uncertainty").wait_for()

    page.keyboard.press("Space")  # play
    page.wait_for_function("window.vlaPlayer.t >= 3")
    page.keyboard.press("Space")  # pause
    assert page.evaluate("window.vlaPlayer.playing") is False

    # scrub: click the middle of the timeline, then step with the arrows
    box = page.locator("svg.timeline").bounding_box()
    page.mouse.click(box["x"] + box["width"] * 0.25, box["y"] + 10)
    start = frame_of(page)
    assert abs(start - length // 4) <= 1
    page.keyboard.press("ArrowRight")
    assert frame_of(page) == start + 1
    page.keyboard.press("ArrowLeft")
    assert frame_of(page) == start

    # mark [start, start+3] with [ and ], label it "idle" (digit 2 = the schema's second span value)
    page.keyboard.press("BracketLeft")
    for _ in range(3):
        page.keyboard.press("ArrowRight")
    page.keyboard.press("BracketRight")
    with page.expect_response(
        lambda r: r.url.endswith("/api/v1/labels") and r.request.method == "POST"
    ) as resp:
        page.keyboard.press("2")
    assert resp.value.status in (200, 201), resp.value.text()
    page.wait_for_selector("svg.timeline g.label-span[data-value='idle']")
    page.wait_for_function(f"location.search.includes('t={start + 3}')")

    # reload (the URL deep-links the frame) and the span is still there
    page.reload()
    page.wait_for_function("window.vlaPlayer && window.vlaPlayer.firstShown")
    assert frame_of(page) == start + 3
    span = page.locator("svg.timeline g.label-span[data-value='idle']")
    assert span.count() == 1 and span.get_attribute("data-start") == str(start)
    assert span.get_attribute("data-end") == str(start + 4)
    assert "ana" in page.locator(".history-list").text_content()

    # in the DB, with its author
    spans = [lb for lb in world.db.labels(eid) if lb.key == "segment"]
    assert [(lb.value, lb.author) for lb in spans] == [("idle", "ana")]
    got = vars(spans[0])
    assert (got.get("start"), got.get("end")) == (start, start + 4), got

    # an episode label from the side panel, then undo it with Ctrl+Z
    page.select_option("select[name='failure']", "timeout")
    page.wait_for_selector(".history-list li:has-text('failure=timeout')")
    page.keyboard.press("Control+z")
    page.wait_for_selector(".history-list li.undone:has-text('failure=timeout')")
    screenshot(page, world, "dashboard-episode.png")
    assert page.errors == []  # type: ignore[attr-defined]
    page.context.close()


# ------------------------------------------------------------------------------------------ episodes
@BOTH
def test_bulk_label_20_episodes_from_a_filter(browser: Any, world: FleetWorld) -> None:
    page = open_page(browser, world, "ana", "/episodes")
    page.wait_for_selector("table.episodes tbody tr")
    # filters live in the URL and reach the server
    page.select_option("select[name='per_page']", "25")
    page.fill("input[name='robot']", "sim-0")
    page.keyboard.press("Enter")
    page.wait_for_function("location.search.includes('robot=sim-0')")
    page.wait_for_function(f"document.querySelector('.summary').textContent.startsWith('{FLEET_EPISODES} ')")
    page.fill("input[name='robot']", "")
    page.keyboard.press("Enter")
    page.fill("input[name='task']", TASK)
    page.keyboard.press("Enter")
    page.wait_for_function("!location.search.includes('robot=')")
    page.select_option("select[name='per_page']", "25")
    # 20 fleet episodes: sort by robot so the page holds sim-0's and sim-1's, per_page 20 via the URL
    page.goto(f"{world.dashboard}/episodes?task={TASK}&sort=robot_id&per_page=20&min_length=1")
    page.wait_for_selector("table.episodes tbody tr")
    assert page.locator("table.episodes tbody tr").count() == 20
    ids = page.eval_on_selector_all("table.episodes tbody tr", "rows => rows.map(r => r.dataset.id)")
    page.check("table.episodes thead input[type=checkbox]")
    page.select_option("select[name='bulk-key']", "quality")
    page.select_option("select[name='bulk-value']", "good")
    page.click("button:has-text('Label 20 selected')")
    page.wait_for_selector(".bulk-msg .ok")
    assert "labelled 20" in page.locator(".bulk-msg").text_content()
    db = world.db
    for eid in ids:
        assert [(lb.value, lb.author) for lb in db.labels(eid) if lb.key == "quality"] == [("good", "ana")]
    # the label filter finds exactly them, and the filter survives a reload
    page.goto(f"{world.dashboard}/episodes?label=quality:good&per_page=50")
    page.wait_for_function(
        "document.querySelector('.summary') && document.querySelector('.summary').textContent.startsWith('20 ')"
    )
    page.reload()
    page.wait_for_function(
        "document.querySelector('.summary') && document.querySelector('.summary').textContent.startsWith('20 ')"
    )
    assert page.input_value("input[name='label']") == "quality:good"
    assert page.errors == []  # type: ignore[attr-defined]
    page.context.close()


@BOTH_PG_SLOW
def test_a_viewer_cannot_label_and_the_page_says_why(browser: Any, world: FleetWorld) -> None:
    eid, _ = episode_with_takeover(world)
    page = open_page(browser, world, None, f"/episodes/{eid}")
    # no token: the page asks for one; a wrong one is refused; the viewer's is taken
    page.wait_for_selector("#token-dialog[open]")
    page.fill("#token-input", "not-a-token-at-all-000")
    page.click("#token-form button[type=submit]")
    page.wait_for_selector("#token-dialog[open]")
    assert "rejected" in page.locator("#token-reason").text_content()
    page.fill("#token-input", TOKENS["vic"][1])
    page.click("#token-form button[type=submit]")
    page.wait_for_function("document.getElementById('session').textContent.includes('vic (viewer)')")
    page.wait_for_function("window.vlaPlayer && window.vlaPlayer.firstShown")
    before = len(world.db.labels(eid))
    page.keyboard.press("BracketLeft")
    page.keyboard.press("ArrowRight")
    page.keyboard.press("BracketRight")
    with page.expect_response(lambda r: r.url.endswith("/api/v1/labels")) as resp:
        page.keyboard.press("1")
    assert resp.value.status == 403
    alert = page.locator(".msg .error")
    alert.wait_for()
    assert "your role (viewer) cannot label" in alert.text_content()
    assert len(world.db.labels(eid)) == before
    page.context.close()


def test_a_link_with_another_token_asks_before_switching_identity(browser: Any, world: FleetWorld) -> None:
    """A link carrying #token=<someone else's token> never replaces the stored one silently: the page asks,
    naming both identities, and the header always says who you are."""
    token_key = "localStorage.getItem('vla-rl-dashboard-token')"
    header = "document.getElementById('session').textContent"
    page = open_page(browser, world, "vic", f"/episodes#token={TOKENS['ops'][1]}")
    page.wait_for_selector("#switch-dialog[open]")
    text = page.locator("#switch-text").text_content()
    assert "ops (operator)" in text and "vic (viewer)" in text, text
    assert page.evaluate("location.hash") == ""  # the token left the address bar at once
    page.wait_for_function(f"{header} === 'vic (viewer)'")  # still vic until asked
    page.click("#switch-keep")
    page.wait_for_function("!document.getElementById('switch-dialog').open")
    assert page.evaluate(token_key) == TOKENS["vic"][1]
    assert page.evaluate(header) == "vic (viewer)"
    # the same link again, taken this time: the header follows
    page.goto(world.dashboard + f"/episodes#token={TOKENS['ops'][1]}")
    page.wait_for_selector("#switch-dialog[open]")
    page.click("#switch-use")
    page.wait_for_function(f"{header} === 'ops (operator)'")
    assert page.evaluate(token_key) == TOKENS["ops"][1]
    # a link whose token the dashboard rejects: said so, and nothing to switch to
    page.evaluate("location.hash = '#token=not-a-known-token-0123456789'")
    page.wait_for_selector("#switch-dialog[open]")
    assert "rejects" in page.locator("#switch-text").text_content()
    assert page.locator("#switch-use").is_hidden()
    page.click("#switch-keep")
    assert page.evaluate(token_key) == TOKENS["ops"][1]
    assert page.errors == []  # type: ignore[attr-defined]
    page.context.close()
    # no token stored yet (the one-time URL `vla-rl dashboard` prints): taken without a question
    page = open_page(browser, world, None, f"/#token={TOKENS['ana'][1]}")
    page.wait_for_function(f"{header} === 'ana (labeller)'")
    assert page.evaluate(token_key) == TOKENS["ana"][1] and page.evaluate("location.hash") == ""
    assert not page.locator("#switch-dialog").evaluate("d => d.open")
    page.context.close()


# ------------------------------------------------------------------------------------------ fleet
@BOTH_PG_SLOW
def test_fleet_page_shows_robots_servers_and_revisions(browser: Any, world: FleetWorld) -> None:
    page = open_page(browser, world, "vic", "/")
    page.wait_for_selector("table.robots tr[data-robot='sim-0']")
    assert page.locator("table.robots tr[data-robot='sim-1']").count() == 1
    server_row = page.locator(f"table.servers tr[data-address='{world.server.address}']")
    server_row.wait_for()
    assert page.locator("#banner").is_hidden()
    page.wait_for_timeout(300)  # plots drawn
    screenshot(page, world, "dashboard-fleet.png")
    assert page.errors == []  # type: ignore[attr-defined]
    page.context.close()


def test_an_unreachable_store_and_db_show_a_banner_not_a_blank_page(browser: Any, world: FleetWorld) -> None:
    missing = world.root / "no-store"
    url, proc = start_dashboard(world, "--db", f"sqlite:///{world.root}/nodir/x/metadata.db", store=missing)
    try:
        page = open_page(browser, world, "vic", "/episodes", base=url)
        banner = page.locator("#banner")
        banner.wait_for()
        text = banner.text_content()
        assert "episode store is down" in text and str(missing) in text and "metadata DB is down" in text
        alert = page.locator("main .error[role=alert]").first
        alert.wait_for()
        assert alert.text_content().startswith("episodes: ")
        assert page.errors == []  # type: ignore[attr-defined]
        page.context.close()
    finally:
        stop(proc)


# ------------------------------------------------------------------------------------------ rounds
@BOTH_PG_SLOW
def test_queue_a_round_from_the_episode_filter_and_cancel_it(browser: Any, world: FleetWorld) -> None:
    page = open_page(browser, world, "ops", "/episodes?robot=sim-0")
    page.wait_for_selector("table.episodes tbody tr")
    page.click("a:has-text('Train a round on this selection')")
    page.wait_for_url("**/rounds?**")
    # filled in once the server has translated the filter (GET /selection/from-filter, asynchronous)
    page.wait_for_function("(document.querySelector(\"input[name='data']\") || {}).value")
    assert page.input_value("input[name='data']") == "robot=sim-0"
    page.wait_for_function(
        f"document.querySelector('.selection-count').textContent.includes('selects {FLEET_EPISODES} episodes')"
    )
    # the algorithms and presets are the server's (GET /api/v1/algorithms), not a list in the page
    from vla_rl.train.algorithms import ALGORITHMS
    from vla_rl.train.presets import PRESETS

    options = "(sel) => [...document.querySelectorAll(sel + ' option')].map((o) => o.value)"
    assert page.evaluate(options, "select[name='algo']") == list(ALGORITHMS)
    page.select_option("select[name='algo']", "qam")
    qam_presets = [n for n, p in PRESETS.items() if p.algorithm == "qam"]
    assert page.evaluate(options, "select[name='preset']") == ["", *qam_presets]
    page.select_option("select[name='algo']", "awr")
    page.select_option("select[name='preset']", "tiny-awr")
    assert PRESETS["tiny-awr"].summary in page.text_content(".algo-about")
    assert page.input_value("select[name='base']") == f"hub://{REPO}@prod"
    # a selection that matches nothing: 4xx naming the field, nothing queued
    n_before = len(world.db.rounds())
    page.fill("input[name='data']", "robot=nobody")
    page.click("button:has-text('Start round')")
    alert = page.locator(".round-form div.error[role=alert]")
    alert.wait_for()
    assert alert.text_content().startswith("data: ")
    assert len(world.db.rounds()) == n_before
    page.fill("input[name='data']", "robot=sim-0")
    page.fill("textarea[name='options']", json.dumps({"eval_episodes": 2, "eval_envs": 1}))
    page.click("button:has-text('Start round')")
    page.wait_for_url(re.compile(r".*/rounds/\d+$"))
    n = int(page.url.rsplit("/", 1)[1])
    assert world.db.round(n).status == "queued"
    page.wait_for_selector(f"table.rounds tr[data-round='{n}']")
    page.click("button:has-text('Cancel round')")
    page.click("dialog.confirm button:has-text('Cancel round')")
    page.wait_for_selector(".round-detail .badge.st-cancelled")
    assert world.db.round(n).status == "cancelled"
    # the rounds screenshot is the slow test's (a promoted round), not this cancelled one
    assert page.errors == []  # type: ignore[attr-defined]
    page.context.close()


@pytest.mark.slow
@BOTH
def test_a_round_started_from_the_page_finishes_is_promoted_and_served(
    browser: Any, world: FleetWorld, cli_server: Any
) -> None:
    """A real round worker trains the round queued from the page; the page follows its progress over SSE
    until it succeeds; Promote (confirmed) moves prod; a server following prod swaps to the new commit.
    (The two backends' worlds share one hub, so the PostgreSQL run starts from the prod the SQLite run
    promoted.)"""
    from vla_rl_client.policy_client import PolicyClient

    prod_before = resolve(f"hub://{REPO}@prod")
    world.number_rounds_past(1000)

    addr = cli_server(
        "--checkpoint",
        f"hub://{REPO}@prod",
        "--follow",
        "self",
        "--follow-interval",
        "1",
        "--device",
        "cpu",
        env={"VLA_RL_HUB": world.hub.url, "OMP_NUM_THREADS": "1"},
    )
    with PolicyClient(addr) as c:
        assert next(iter(c.info().values())).commit == prod_before
    worker = subprocess.Popen(
        [*CLI, "round", "worker", "--store", str(world.store), "--poll-s", "0.5", "--heartbeat-s", "1"]
        + (["--db-url", world.db_url] if world.db_url else []),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=os.environ | {"VLA_RL_HUB": world.hub.url, "OMP_NUM_THREADS": "1"},
    )
    try:
        page = open_page(browser, world, "ops", "/rounds?new=1&filter=" + "robot%3Dsim-0%26robot%3Dsim-1")
        page.wait_for_selector("select[name='base'] option", state="attached")
        page.select_option("select[name='algo']", "awr")
        page.fill("input[name='data']", "robot=sim-0|sim-1")
        page.fill("input[name='margin']", "0.99")  # the gate cannot pass: promotion is the operator's call
        page.fill(
            "textarea[name='options']",
            json.dumps(
                {
                    "steps": 40,
                    "value_steps": 10,
                    "batch_size": 8,
                    "threads": 1,
                    "eval_episodes": 2,
                    "eval_envs": 1,
                }
            ),
        )
        page.click("button:has-text('Start round')")
        page.wait_for_url(re.compile(r".*/rounds/\d+$"))
        n = int(page.url.rsplit("/", 1)[1])
        page.wait_for_selector(".round-detail .badge.st-succeeded", timeout=400_000)
        # the worker's step counts drawn as a bar (kept once trained): 40 of 40 policy steps
        steps = page.locator(".round-detail .progress .bar-train progress")
        assert steps.evaluate("(p) => [p.value, p.max]") == [40, 40]
        rec = world.db.round(n)
        assert rec.status == "succeeded" and not rec.promoted and rec.checkpoint_revision, rec.error
        page.click("button:has-text('Promote')")
        page.click("dialog.confirm button:has-text('Promote')")
        page.wait_for_selector(".round-detail .badge.promoted")
        assert resolve(f"hub://{REPO}@prod") == rec.checkpoint_revision
        deadline = time.monotonic() + 60
        with PolicyClient(addr) as c:
            while next(iter(c.info().values())).commit != rec.checkpoint_revision:
                assert time.monotonic() < deadline, "the --follow server did not swap to the promoted commit"
                time.sleep(0.5)
        screenshot(page, world, "dashboard-rounds.png")
        assert page.errors == []  # type: ignore[attr-defined]
        page.context.close()
    finally:
        worker.send_signal(signal.SIGINT)
        try:
            worker.wait(timeout=20)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
