"""The dashboard's first episode list, A/B between two source trees, interleaved: headless Chromium
(Playwright) against a real `vla-rl dashboard` process of each tree in turn (ABBA order), on the same
store and 10,000-row DB, under the same load.

Each start (a new dashboard process, its health answered, nothing else asked yet):
``just_started``: the Episodes page in a fresh browser context (navigation -> 50 rows drawn, the page's
own mark, as bench/dashboard.py measures it); ``fresh_browser``: another fresh context on that same
process (its first requests served); ``warm``: a reload in that context (HTTP cache warm). Every
load's waterfall (bench/dashboard.py ``LIST_WATERFALL``) goes into the JSON with ``uptime``.

    python bench/dashboard_ab.py --a /tmp/base --b . --starts 6 --out bench/results/dashboard_ab.json
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import table, write_results
from bench.dashboard import CHROMIUM, LIST_WATERFALL, Dashboard, bulk_rows, new_page, write_episode
from fleet.db import MetadataDB
from fleet.store import EpisodeStore

MEASURES = ("just_started", "fresh_browser", "warm")


def first_list(page: Any, url: str) -> tuple[float, dict[str, Any]]:
    """Go to the Episodes page; (navigation -> rows drawn in ms, its waterfall)."""
    t0 = time.time()
    page.goto(f"{url}/episodes")
    page.wait_for_function("window.vlaEpisodesRendered")
    assert page.locator("table.episodes tbody tr").count() == 50
    wf = {k: round(v, 1) for k, v in page.evaluate(LIST_WATERFALL).items() if v is not None}
    drawn = page.evaluate("window.vlaEpisodesRendered")
    wf["unix_s"] = round(t0, 3)  # when it began (to line up with the dashboard's own logs)
    # which tree's page it was (its script's URL carries that tree's asset hash)
    wf["script"] = page.evaluate("new URL(document.querySelector('script[type=module]').src).pathname")
    # the start-up sync's phase when the list was asked (an already-synced store: waiting or done)
    wf["sync_phase"] = drawn.get("sync")
    return float(drawn["at"]), wf


def one_start(browser: Any, store: Path, work: Path, code: Path) -> dict[str, Any]:
    dash = Dashboard(store, work, code=code)
    try:
        out: dict[str, Any] = {"ready_unix_s": round(time.time(), 3)}
        page = new_page(browser, dash.url)
        out["just_started"], out["just_started_waterfall"] = first_list(page, dash.url)
        page.context.close()
        page = new_page(browser, dash.url)
        out["fresh_browser"], out["fresh_browser_waterfall"] = first_list(page, dash.url)
        out["warm"], _ = first_list(page, dash.url)
        page.context.close()
        return out
    finally:
        dash.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", type=Path, required=True, help="source tree A (a checkout's root)")
    ap.add_argument("--b", type=Path, required=True, help="source tree B")
    ap.add_argument("--starts", type=int, default=6, help="dashboard starts per tree (ABBA order)")
    ap.add_argument("--episodes", type=int, default=10_000, help="episodes in the DB")
    ap.add_argument("--out", type=Path, default=None, help="results JSON (default: none)")
    args = ap.parse_args(argv)
    for name in ("a", "b"):
        if not (getattr(args, name) / "vla_rl" / "dashboard").is_dir():
            ap.error(
                f"--{name}: expected a checkout's root (with vla_rl/dashboard/), got {getattr(args, name)}"
            )
    if args.starts < 1:
        ap.error("--starts: expected >= 1")
    from playwright.sync_api import sync_playwright

    uptime = [subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()]
    print(uptime[0], flush=True)
    runs: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
    with tempfile.TemporaryDirectory(prefix="bench-dashboard-ab-") as tmp:
        root = Path(tmp)
        store = EpisodeStore(root / "store", create=True)
        db = MetadataDB.for_store(store.root)
        ids = [write_episode(store, db, f"arm-{i:02d}", 60, seed=100 + i) for i in range(4)]
        bulk_rows(db, store, ids, args.episodes)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            for k in range(args.starts):
                for name in ("a", "b") if k % 2 == 0 else ("b", "a"):
                    r = one_start(browser, store.root, root / "work", getattr(args, name).resolve())
                    runs[name].append(r)
                    print(f"{name}: " + ", ".join(f"{m} {r[m]:.0f} ms" for m in MEASURES), flush=True)
            browser.close()
    uptime.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    med = {n: {m: round(statistics.median(r[m] for r in runs[n]), 1) for m in MEASURES} for n in runs}
    rows = [[m, med["a"][m], med["b"][m], f"{med['b'][m] - med['a'][m]:+.1f}"] for m in MEASURES]
    print(uptime[1])
    print(table(rows, ["first list, ms (median)", f"A {args.a}", f"B {args.b}", "B - A"]))
    if args.out:
        results = {"a": str(args.a), "b": str(args.b), "uptime": uptime, "median_ms": med, "runs": runs}
        print(f"wrote {write_results('dashboard_ab', results, args.out)}")
    return 0


if __name__ == "__main__":
    if not Path(CHROMIUM).exists():
        print(f"{CHROMIUM} is missing: run scripts/setup.sh", file=sys.stderr)
        sys.exit(1)
    sys.exit(main())
