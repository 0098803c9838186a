"""The Episodes page in a real browser (Debian's headless Chromium, Playwright) against the real app
(uvicorn on loopback, a real Zarr store and SQLite DB of 120 episodes): how its first rows get on screen
and what the table does once it is there.

The rows are one HTML string (pages/episodes.js): every value from the DB is escaped, so a task, an
instruction, a label or an id holding markup shows as text and runs nothing; checkboxes, the header box,
a click on a row, a sort header and the keys work through the table's delegated handlers. The first
load draws the filters in the same frame as the rows (the form is attached with them), the early
requests of index.html ask the list alone first (the session and the label schema once it has
answered), and the page marks when the rows' frame was painted (``vla:episodes-painted``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from dashboard_world import CHROMIUM, TOKENS, Dashboard
from vla_rl_client.meta import Controller
from vla_rl_client.spec import RobotSpec

from fleet.db import MetadataDB
from fleet.store import EpisodeStore
from vla_rl.dashboard import DashboardConfig

SPEC = RobotSpec(name="toy", state_dim=2, action_dim=2, control_hz=10.0, instruction="do it")
NAME, TOKEN = TOKENS["labeller"]
EVIL = '<img class="pwn" src="x" onerror="window.pwned = 1">'
ROWS = 120

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is missing")


def _episode(store: EpisodeStore, db: MetadataDB, seed: int) -> str:
    rng = np.random.default_rng(seed)
    w = store.create_episode(SPEC, robot_id="arm-1", task="toy", chunk_len=8, db=db)
    for i in range(30):
        w.add_frame(
            cameras={},
            state=np.zeros(2, np.float32),
            action=rng.normal(0, 0.1, 2).astype(np.float32),
            reward=0.0,
            terminated=i == 29,
            truncated=False,
            controller=Controller.POLICY,
            revision="r",
        )
    return w.close(outcome="success", success=True).episode_id


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, MetadataDB, str]]:
    root = tmp_path_factory.mktemp("list-page")
    store = EpisodeStore(root / "store", create=True)
    db = MetadataDB.for_store(store.root)
    template = store.read_metadata(_episode(store, db, 0))
    now = time.time()
    clones = [
        dataclasses.replace(
            template,
            episode_id=f"row-{i:04d}",
            task=f"toy {EVIL}" if i == ROWS - 1 else "toy",
            instruction=f"say {EVIL}",
            length=10 + i,
            created=now + 1 + i,  # newer than the template
            closed=now + 2 + i,
        )
        for i in range(ROWS)
    ]
    db.record_episodes(clones, str(store.root))
    newest = clones[-1].episode_id
    db.add_labels([newest], "note", EVIL, author=NAME)
    dash = Dashboard(DashboardConfig(store=store.root, workdir=root / "w"))
    try:
        yield dash.url, db, newest
    finally:
        dash.stop()


# Before the page's own scripts: note whether the rows were in the DOM when the filters form arrived.
WATCH_FORM = """
window.vlaFormWithRows = null;
new MutationObserver((_, obs) => {
  if (!document.querySelector("form.filters")) return;
  window.vlaFormWithRows = document.querySelectorAll("table.episodes tbody tr").length;
  obs.disconnect();
}).observe(document, { childList: true, subtree: true });
"""


def _page(
    browser: Any,
    url: str,
    path: str = "/episodes",
    route: Any = None,
    wait: bool = True,
    skeleton_wait_ms: int = 300,
) -> Any:
    """A fresh context on ``path`` with the token set; ``route``: a Playwright handler for the list's
    requests; ``wait``: until the rows are drawn; ``skeleton_wait_ms``: how long the page waits for the
    list before it puts the filters up alone (the page's own default is 300 ms)."""
    ctx = browser.new_context(viewport={"width": 1440, "height": 1000})
    ctx.add_init_script(
        f"localStorage.setItem('vla-rl-dashboard-token', '{TOKEN}');"
        f"window.vlaSkeletonWaitMs = {int(skeleton_wait_ms)};{WATCH_FORM}"
    )
    page = ctx.new_page()
    page.set_default_timeout(30_000)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    if route is not None:
        page.route("**/api/v1/episodes*", route)
    page.goto(url + path)
    if wait:
        page.wait_for_function("window.vlaEpisodesRendered")
    page.errors = errors
    return page


def test_first_load_draws_rows_with_the_filters_and_asks_the_list_first(
    served: tuple[str, MetadataDB, str], browser: Any
) -> None:
    url, _, _ = served
    # a wait no loaded CI machine overruns: this test is about the fast path (the slow one is below)
    page = _page(browser, url, skeleton_wait_ms=20_000)
    assert page.locator("table.episodes tbody tr").count() == 50
    assert page.evaluate("window.vlaFormWithRows") == 50  # the form came with the rows, not before
    page.wait_for_function("performance.getEntriesByName('vla:episodes-painted').length > 0")
    marks = page.evaluate(
        "['vla:episodes-rendered', 'vla:episodes-painted'].map((n) => performance.getEntriesByName(n)[0].startTime)"
    )
    assert marks[0] <= marks[1]
    # the session and the label schema were asked only once the list had answered
    timing = page.evaluate(
        """() => Object.fromEntries(performance.getEntriesByType('resource')
            .filter((e) => e.name.includes('/api/v1/'))
            .map((e) => [new URL(e.name).pathname, [e.startTime, e.responseStart]]))"""
    )
    list_answered = timing["/api/v1/episodes"][1]
    assert timing["/api/v1/session"][0] >= list_answered, timing
    assert timing["/api/v1/label-schema"][0] >= list_answered, timing
    # ...and they still arrive: the header names the session, the bulk bar has the schema's keys
    page.wait_for_function(f"document.querySelector('#session').textContent === '{NAME} (labeller)'")
    page.wait_for_selector("select[name='bulk-key']")
    # the health banner's first check waits 0.5 s after the first page (not into the rows' first frame)
    page.wait_for_function(
        "performance.getEntriesByType('resource').some((e) => e.name.endsWith('/api/v1/health'))"
    )
    health = page.evaluate(
        "performance.getEntriesByType('resource').find((e) => e.name.endsWith('/api/v1/health')).startTime"
    )
    in_dom = page.evaluate("performance.getEntriesByName('vla:episodes-in-dom')[0].startTime")
    assert health >= in_dom + 500 and health > marks[1], (health, in_dom, marks)
    assert page.errors == []
    page.context.close()


def test_rows_escape_what_the_db_holds_and_the_table_still_works(
    served: tuple[str, MetadataDB, str], browser: Any
) -> None:
    url, _, newest = served
    page = _page(browser, url)
    first = page.locator("table.episodes tbody tr").first
    assert first.get_attribute("data-id") == newest  # newest first
    cells = first.locator("td")
    assert cells.nth(3).text_content() == f"toy {EVIL}"
    assert cells.nth(3).get_attribute("title") == f"say {EVIL}"
    assert cells.nth(8).text_content() == f"note={EVIL}"
    assert page.locator("img.pwn").count() == 0 and page.evaluate("window.pwned") is None
    assert first.locator("a").get_attribute("href") == f"/episodes/{newest}"

    # a row's checkbox, then the header box (the whole page), through the table's delegated handlers
    page.locator("table.episodes tbody tr input[type=checkbox]").nth(2).check()
    page.wait_for_selector("button:has-text('Label 1 selected')")
    page.check("table.episodes thead input[type=checkbox]")
    page.wait_for_selector("button:has-text('Label 50 selected')")
    assert page.locator("table.episodes tbody input[type=checkbox]:checked").count() == 50
    page.uncheck("table.episodes thead input[type=checkbox]")
    page.wait_for_selector("button:has-text('Label 0 selected')")

    # a click on a row moves the cursor there; j moves it down
    page.locator("table.episodes tbody tr").nth(4).locator("td").nth(2).click()
    assert page.locator("tr.cursor").get_attribute("data-i") == "4"
    page.keyboard.press("j")
    assert page.locator("tr.cursor").get_attribute("data-i") == "5"
    assert page.locator("tr.cursor").count() == 1

    # a sort header (click, then Enter on it) re-queries
    prev = page.evaluate("window.vlaEpisodesRendered.at")
    page.click("th[data-sort=length]")
    page.wait_for_function(f"window.vlaEpisodesRendered.at > {prev}")
    assert "sort=length" in page.url
    assert page.locator("table.episodes tbody tr").first.get_attribute("data-id") == "row-0000"
    prev = page.evaluate("window.vlaEpisodesRendered.at")
    page.focus("th[data-sort=length]")
    page.keyboard.press("Enter")
    page.wait_for_function(f"window.vlaEpisodesRendered.at > {prev}")
    assert "sort=-length" in page.url
    assert page.locator("th[data-sort=length]").text_content() == "length ▼"
    assert page.errors == []
    page.context.close()


def test_util_formats_counts_and_escapes_without_intl(
    served: tuple[str, MetadataDB, str], browser: Any
) -> None:
    url, _, _ = served
    page = _page(browser, url)
    assert page.locator(".summary").text_content() == f"{ROWS + 1} episodes"
    got = page.evaluate(
        """async () => {
          const u = await import("/static/util.js");  // the source module, as served beside the bundle
          return {
            counts: [0, 7, 999, 1000, 10000, 1234567, -1234].map(u.thousands),
            esc: u.esc(`<a href="x" title='y'>&</a>`),
            none: [u.esc(null), u.esc(undefined), u.esc(0)],
            badge: u.badgeHtml("<b>", "oc-<x>", 'say "hi"'),
          };
        }"""
    )
    assert got["counts"] == ["0", "7", "999", "1,000", "10,000", "1,234,567", "-1,234"]
    assert got["esc"] == "&lt;a href=&quot;x&quot; title=&#39;y&#39;&gt;&amp;&lt;/a&gt;"
    assert got["none"] == ["", "", "0"]
    assert got["badge"] == '<span class="badge oc-&lt;x&gt;" title="say &quot;hi&quot;">&lt;b&gt;</span>'
    assert page.errors == []
    page.context.close()


def test_a_slow_or_failing_list_still_shows_the_filters(
    served: tuple[str, MetadataDB, str], browser: Any
) -> None:
    url, _, _ = served

    def slow(route: Any) -> None:
        time.sleep(1.0)  # the page's 0.3 s fallback puts the filters up meanwhile
        route.continue_()

    page = _page(browser, url, route=slow)
    assert page.evaluate("window.vlaFormWithRows") == 0  # the filters came alone, before the rows
    assert page.locator("table.episodes tbody tr").count() == 50
    assert page.errors == []
    page.context.close()

    def down(route: Any) -> None:
        detail = {"field": "db", "message": "db: the metadata DB is down", "expected": "a reachable DB"}
        route.fulfill(status=503, json={"detail": detail})

    page = _page(browser, url, route=down, wait=False)
    page.wait_for_selector(".err-slot .error")
    assert "the metadata DB is down" in page.locator(".err-slot").text_content()
    assert page.locator("form.filters").is_visible() and page.evaluate("window.vlaFormWithRows") == 0
    page.context.close()
