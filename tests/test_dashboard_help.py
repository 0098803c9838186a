"""The help queue end to end: robots ask through a real collector (loopback gRPC), the dashboard's API
lists and hands out their requests (SQLite and PostgreSQL), and the page in headless Chromium shows a new
request without a reload, takes the next robot with one click and links to its episode, and shows a
simulated operator's claim and resolution (sim/help_queue_desk.py) as they happen."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dashboard_world import TOKENS, Dashboard
from vla_rl_client.help_client import HelpClient

from fleet.collector import Collector, CollectorConfig
from vla_rl.dashboard import DashboardConfig


@pytest.fixture
def desk(tmp_path: Path, store_db_url: str | None) -> Iterator[tuple[Collector, Dashboard]]:
    """A collector and a dashboard on one store and metadata DB (the store's SQLite, or PostgreSQL)."""
    store = tmp_path / "store"
    c = Collector(CollectorConfig(store=store, port=0, chunk_len=16, db=store_db_url)).start()
    d = Dashboard(DashboardConfig(store=store, db=store_db_url, workdir=tmp_path / "dash", sync_db=False))
    try:
        yield c, d
    finally:
        d.stop()
        c.stop()


def test_the_api_orders_hands_out_and_closes_requests(desk: tuple[Collector, Dashboard]) -> None:
    c, d = desk
    with HelpClient(c.address, "arm-1") as a1, HelpClient(c.address, "arm-2") as a2:
        low = a1.ask("arm-1-ep", "uncertainty: CUSUM 3.9 > 3.5", 3.9)
        high = a2.ask("arm-2-ep", "failure predictor: 0.91 > 0.6", 5.0)
        viewer, op = d.client("viewer"), d.client("operator")
        got = viewer.get("/api/v1/help").json()
        assert [r["id"] for r in got["requests"]] == [high.request_id, low.request_id] and got["open"] == 2
        assert (
            got["requests"][0]["episode_url"] == "/episodes/arm-2-ep" and got["requests"][0]["waited_s"] >= 0
        )
        r = viewer.post("/api/v1/help/claim", json={})
        assert r.status_code == 403 and "operator role" in r.json()["detail"]["message"]

        # two clicks on the same request at once: exactly one takes it
        codes: list[int] = []
        barrier = threading.Barrier(2)

        def click() -> None:
            barrier.wait()
            codes.append(op.post("/api/v1/help/claim", json={"request_id": high.request_id}).status_code)

        threads = [threading.Thread(target=click) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(codes) == [200, 409], codes
        assert a2.status(high.request_id).claimed_by == TOKENS["operator"][0]  # the robot learns who

        nxt = op.post("/api/v1/help/claim").json()  # no body: the next one
        assert (nxt["id"], nxt["status"]) == (low.request_id, "claimed")
        r = op.post("/api/v1/help/claim")
        assert r.status_code == 409 and r.json()["detail"]["field"] == "request_id"
        r = op.post(f"/api/v1/help/{low.request_id}/resolve", json={"note": "x" * 257})
        assert r.status_code == 422 and "note" in json.dumps(r.json()["detail"])
        r = op.post(f"/api/v1/help/{low.request_id}/resolve", json={"note": "regrasped"})
        assert r.status_code == 200 and r.json()["status"] == "resolved"
        assert a1.status(low.request_id).note == "regrasped"
        assert op.post("/api/v1/help/999/resolve").status_code == 404
        assert [x["id"] for x in viewer.get("/api/v1/help").json()["requests"]] == [high.request_id]
        closed = viewer.get("/api/v1/help", params={"closed": "true"}).json()["requests"]
        assert {x["status"] for x in closed} == {"claimed", "resolved"}
        recent = viewer.get("/api/v1/help").json()["recent"]  # closed last, newest first
        assert [(x["id"], x["claimed_by"], x["note"]) for x in recent] == [
            (low.request_id, TOKENS["operator"][0], "regrasped")
        ]


@pytest.mark.parametrize("store_db_url", ["sqlite"], indirect=True)
def test_the_page_shows_new_requests_live_and_takes_the_next_robot(
    browser: Any, desk: tuple[Collector, Dashboard]
) -> None:
    c, d = desk
    ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    ctx.add_init_script(
        f"localStorage.setItem('vla-rl-dashboard-token', {json.dumps(TOKENS['operator'][1])})"
    )
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.set_default_timeout(15_000)
    page.goto(d.url + "/")
    page.click("nav a[href='/help']")  # linked from the navigation
    page.wait_for_url("**/help")
    page.wait_for_selector("text=No robot is asking for help.")
    with HelpClient(c.address, "arm-1") as a1, HelpClient(c.address, "arm-2") as a2:
        first = a1.ask("arm-1-ep", "uncertainty: CUSUM 3.9 > 3.5", 3.9)
        page.wait_for_selector(f"tr[data-request='{first.request_id}']")  # no reload: the page polls
        urgent = a2.ask("arm-2-ep", "failure predictor: 0.91 > 0.6", 5.0)
        page.wait_for_selector(f"tr[data-request='{urgent.request_id}']")
        order = page.eval_on_selector_all("table.help tbody tr", "rs => rs.map(r => r.dataset.request)")
        assert order == [str(urgent.request_id), str(first.request_id)]  # most urgent first
        assert "failure predictor" in page.locator(f"tr[data-request='{urgent.request_id}']").text_content()
        page.click("#help-take-next")  # one click: the robot at the head of the queue
        page.wait_for_selector(f"tr[data-request='{urgent.request_id}'][data-status='claimed']")
        assert a2.status(urgent.request_id).claimed  # the robot polls and hands control over
        assert a1.status(first.request_id).status == "open"
        held = page.locator(".help-held")
        assert "arm-2" in held.text_content()
        # its cameras and timeline are one click away: the episode page
        link = page.locator(f"tr[data-request='{urgent.request_id}'] a.help-episode")
        assert link.get_attribute("href") == "/episodes/arm-2-ep"
        held.locator("button.help-resolve").click()
        page.wait_for_selector(f"tr[data-request='{urgent.request_id}']", state="detached")
        assert a2.status(urgent.request_id).status == "resolved"
        link = page.locator(f"tr[data-request='{first.request_id}'] a.help-episode")
        link.click()
        page.wait_for_url("**/episodes/arm-1-ep")
        page.keyboard.press("g")
        page.keyboard.press("h")  # back to the queue from the keyboard
        page.wait_for_url("**/help")
        page.wait_for_selector(f"tr[data-request='{first.request_id}']")
    assert errors == []
    ctx.close()


@pytest.mark.parametrize("store_db_url", ["sqlite"], indirect=True)
def test_the_page_shows_a_simulated_operators_claim_and_resolution(
    browser: Any, desk: tuple[Collector, Dashboard]
) -> None:
    """A robot asks through the queue desk, a simulated operator claims it through the collector: the page
    shows it claimed by sim-operator-0 without a reload; the operator's hands hand back and the request
    moves to "Closed last" with what happened; a person's "Take next" finds nothing left to take."""
    from sim.help_queue_desk import QueueDesk, SimOperators

    c, d = desk
    ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    ctx.add_init_script(
        f"localStorage.setItem('vla-rl-dashboard-token', {json.dumps(TOKENS['operator'][1])})"
    )
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.set_default_timeout(15_000)
    page.goto(d.url + "/")
    page.click("nav a[href='/help']")
    page.wait_for_url("**/help")
    page.wait_for_selector("text=No robot is asking for help.")
    ops = SimOperators(c.address, 1)
    robots = QueueDesk(c.address, ["arm-1"], operators=ops)
    try:
        robots.ask(0, 2.5, now=0.0, reason="failure predictor: 0.83 on this chunk", episode_id="arm-1-ep")
        rid = robots.request_id(0)
        row = page.wait_for_selector(f"table.help tr[data-request='{rid}'][data-status='claimed']")
        assert "claimed by sim-operator-0" in row.text_content()  # (a row with no button for this person)
        assert page.locator("div.err-slot").inner_text() == ""
        assert page.locator(".help-held").count() == 0  # not the person's
        assert robots.poll(0, now=0.1)  # the robot learns it was claimed; the operator drives
        robots.release(0, now=1.0, note="handed back: drove 15 steps")
        page.wait_for_selector(f"table.help tr[data-request='{rid}']", state="detached")
        done = page.wait_for_selector(f"table.help-closed tr[data-closed='{rid}'][data-status='resolved']")
        assert done.query_selector(".help-by").text_content() == "sim-operator-0"
        assert done.query_selector(".help-note").text_content() == "handed back: drove 15 steps"
        assert page.is_disabled("#help-take-next")  # nothing open for a person to take
    finally:
        robots.close()
        ops.stop()
    assert errors == []
    ctx.close()
