"""`vla-rl up` end to end at CI scale: the loop runs, resumes in the same workdir, rides through a killed
collector with every frame stored once, stops everything on Ctrl-C within 10 s, and rides through a killed
policy server and round worker.

Real processes throughout (registry, policy server following prod, collector, round worker, simulated
fleet with its operator) on the kinematic test bed, with a smoke-test round recipe (``tiny-awr``): this
checks the machinery, not learning (bench/loop.py is where learning is measured).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from processes import run_watching, still_running

from fleet.store import EpisodeStore
from vla_rl.cli.common import open_db

CLI = [sys.executable, "-m", "vla_rl.cli"]
ROBOTS, EPISODES = 2, 2


def _up(work: Path, rounds: int, db: str | None) -> list[str]:
    return [
        *CLI, "up", "--task", "kinematic/Reach-v0", "--robots", str(ROBOTS), "--episodes", str(EPISODES),
        "--rounds", str(rounds), "--base-demos", "4", "--base-steps", "20", "--base-preset", "kinematic-sft",
        "--preset", "tiny-awr", "--eval-episodes", "4", "--workdir", str(work), "--no-progress", "--no-continuous",
        *(["--db", db] if db else []),
    ]  # fmt: skip


def _verify(work: Path, db: str | None) -> subprocess.CompletedProcess[str]:
    """`vla-rl store verify` of the workdir's store against its metadata DB."""
    cmd = [*CLI, "store", "verify", str(work / "store"), *(["--db", db] if db else [])]
    return subprocess.run(cmd, capture_output=True, text=True)


def _ensure_rounds(work: Path, db: str | None, n: int) -> None:
    """Set-up for a test that goes on from an earlier one's workdir (when run alone, e.g. -m slow): a
    run of ``n`` rounds, unless the workdir holds them already."""
    done = len(open_db(work / "store", db).rounds()) if (work / "up.json").exists() else 0
    if done < n:
        r = subprocess.run(_up(work, n, db), capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def _fleet_episodes(work: Path) -> int:
    store = EpisodeStore(work / "store")
    return sum(store.read_metadata(e).robot_id.startswith("sim-") for e in store.episode_ids())


def _wait(pred: object, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def up_db(request: pytest.FixtureRequest) -> str | None:
    """The loop's metadata DB: None = the store's SQLite (no --db), or a PostgreSQL database (--db URL)."""
    return None if request.param == "sqlite" else request.getfixturevalue("pg").create_database()


# the PostgreSQL run of the tests that go on from the first one's workdir: in the slow suite only (each
# `vla-rl up` of them costs a minute or more); the first, the loop itself, runs on both in CI
PG_SLOW = pytest.mark.parametrize(
    "up_db", ["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)], indirect=True, scope="module"
)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory, up_db: str | None) -> Path:
    return tmp_path_factory.mktemp("up")


def _dashboard_lists_episodes(work: Path) -> bool:
    """The dashboard child answers, with up's operator token, an episode list holding the fleet's."""
    import httpx

    try:
        port = json.loads((work / "up.json").read_text())["ports"]["dashboard"]
        token = (work / "secrets" / "dashboard").read_text().strip()
        r = httpx.get(
            f"http://127.0.0.1:{port}/api/v1/episodes?robot=sim-0",
            headers={"Authorization": f"Bearer {token}"},
            timeout=2,
        )
        return r.status_code == 200 and r.json()["total"] > 0
    except (OSError, KeyError, ValueError, httpx.HTTPError):
        return False


def test_up_runs_rounds_and_prints_a_row_per_round(work: Path, up_db: str | None) -> None:
    r, dashboard_seen = run_watching(
        _up(work, 1, up_db), work.parent / work.name, 600, lambda: _dashboard_lists_episodes(work)
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "dashboard  http://127.0.0.1:" in r.stdout and "operator token in" in r.stdout
    assert dashboard_seen, "the dashboard child never listed the fleet's episodes"
    assert "[base] training SFT" in r.stdout and "registry   http://127.0.0.1:" in r.stdout
    assert "stop with Ctrl-C" in r.stdout and "round 1: awr" in r.stdout
    assert "autonomous success (95% CI)" in r.stdout  # the final table
    db = open_db(work / "store", up_db)
    (rec,) = db.rounds()
    assert rec.status == "succeeded" and rec.checkpoint_ref == "hub://up/policy@round-1"
    row = json.loads((work / "rounds.jsonl").read_text().splitlines()[-1])
    assert row["fleet"]["episodes"] == ROBOTS * EPISODES and row["fleet"]["frames"] > 0
    assert 0.0 <= row["fleet"]["intervention_rate"] <= 1.0 and row["success"] is not None
    assert _fleet_episodes(work) == ROBOTS * EPISODES
    # every fleet episode and the demos reached the loop's DB (collector) and nothing else was opened
    assert len(db.episodes()) == len(EpisodeStore(work / "store").episode_ids())
    assert (work / "store" / "metadata.db").exists() is (up_db is None)
    assert _verify(work, up_db).returncode == 0


def test_a_resumed_run_must_name_the_same_db(
    work: Path, up_db: str | None, pg: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The workdir's episodes, rounds and labels are in its DB: a run naming another one is refused
    before anything starts (exit 2, one line naming the recorded DB). In this process: it is refused
    before any child would start."""
    from vla_rl.cli import main

    _ensure_rounds(work, up_db, 1)
    other = None if up_db else pg.url("elsewhere")
    before = (work / "up.json").read_text()
    assert main(_up(work, 5, other)[len(CLI) :]) == 2
    err = capsys.readouterr().err
    recorded = json.loads(before)["db"]
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "db: this workdir's earlier run used the metadata DB" in err and recorded in err
    assert (work / "up.json").read_text() == before  # nothing rewritten
    assert recorded == (up_db or f"sqlite:///{(work / 'store').resolve() / 'metadata.db'}")


@PG_SLOW
def test_up_resumes_and_rides_through_a_killed_collector(work: Path, up_db: str | None) -> None:
    _ensure_rounds(work, up_db, 1)
    proc = subprocess.Popen(_up(work, 2, up_db), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # once round 2's fleet is running, SIGKILL the collector under it
        _wait(lambda: (work / "logs" / "fleet-round-2.log").exists(), 300, "round 2's fleet")
        up = psutil.Process(proc.pid)
        (collector,) = [c for c in up.children() if "collect" in c.cmdline()]
        collector.kill()
        out = proc.communicate(timeout=600)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    assert "[base]" not in out, "the base is cached: a second run does not train it again"
    assert "supervisor: collector exited with code -9; restarting it" in out
    db = open_db(work / "store", up_db)
    assert [r.id for r in db.rounds()] == [1, 2] and db.rounds()[-1].status == "succeeded"
    assert _fleet_episodes(work) == 2 * ROBOTS * EPISODES  # every episode once, none lost, none twice
    v = _verify(work, up_db)
    assert v.returncode == 0, v.stdout + v.stderr


@PG_SLOW
def test_ctrl_c_stops_everything_within_10_s(work: Path, up_db: str | None) -> None:
    _ensure_rounds(work, up_db, 2)
    proc = subprocess.Popen(_up(work, 3, up_db), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait(lambda: (work / "logs" / "fleet-round-3.log").exists(), 300, "round 3's fleet")
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 4  # registry, server, collector, worker (and the fleet)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=30)[0]
        stopped_in = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert stopped_in <= 10.0, (stopped_in, out[-2000:])
    gone = still_running(children, timeout=5)
    assert not gone, f"still running after Ctrl-C: {[p.cmdline() for p in gone]}"
    assert not _running_in(work), "a process of this run outlived up"
    v = _verify(work, up_db)
    assert v.returncode == 0, v.stdout + v.stderr  # nothing half-written


@PG_SLOW
def test_up_rides_through_a_killed_server_and_worker(work: Path, up_db: str | None) -> None:
    """SIGKILL the policy server while the fleet acts through it, then the round worker while it runs the
    round: the supervisor restarts both, the robots ride through on their retries, the dead worker's round
    is re-queued and run again by the restarted one (claimed twice, tagged once), and the store is clean."""
    _ensure_rounds(work, up_db, 2)
    db = open_db(work / "store", up_db)
    target = len(db.rounds()) + 1
    proc = subprocess.Popen(
        _up(work, target, up_db), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        up = psutil.Process(proc.pid)

        def fleet_driving() -> bool:  # this run's fleet (a log from an interrupted run may exist already)
            fleets = [c for c in up.children() if "fleet" in c.cmdline()]
            return bool(fleets) and len(fleets[0].children()) >= ROBOTS

        _wait(fleet_driving, 300, f"round {target}'s fleet")
        (server,) = [c for c in up.children() if "serve" in c.cmdline() and "hub" not in c.cmdline()]
        server.kill()
        _wait(
            lambda: any(r.id == target and r.status == "running" for r in db.rounds()),
            600,
            f"round {target} running",
        )
        (worker,) = [c for c in up.children() if "worker" in c.cmdline()]
        worker.kill()
        out = proc.communicate(timeout=900)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    assert "server exited with code -9; restarting it" in out, out[-4000:]
    assert "worker exited with code -9; restarting it" in out, out[-4000:]
    rounds = db.rounds()
    assert [r.id for r in rounds] == list(range(1, target + 1))
    assert rounds[-1].status == "succeeded" and rounds[-1].attempts == 2, rounds[-1]
    v = _verify(work, up_db)
    assert v.returncode == 0, v.stdout + v.stderr  # every acknowledged frame once, nothing half-written


def _running_in(work: Path) -> list[list[str]]:
    """Command lines of the processes that name ``work`` (up's children do; the fleet's robots do not:
    the tests track them as up's descendants)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if any(str(work) in part for part in cmd) and p.pid != os.getpid():
            found.append(cmd)
    return found


@pytest.mark.slow
def test_nothing_outlives_a_killed_up(work: Path, up_db: str | None) -> None:
    """`up` SIGKILLed mid-round (no chance to stop anything): every process it started, and theirs (the
    fleet's robots, the collector's store writer), stops by itself within seconds (vla_rl/core/lifeline.py);
    the next run resumes with every acknowledged episode stored once."""
    _ensure_rounds(work, up_db, 2)
    done = len(open_db(work / "store", up_db).rounds())
    proc = subprocess.Popen(
        _up(work, done + 1, up_db), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, text=True
    )
    try:
        up = psutil.Process(proc.pid)

        def fleet_driving() -> bool:
            fleets = [c for c in up.children() if "fleet" in c.cmdline()]
            return bool(fleets) and len(fleets[0].children()) >= ROBOTS

        _wait(fleet_driving, 300, "the fleet's robots")
        everything = up.children(recursive=True)
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    alive = still_running(everything, timeout=10)
    assert not alive, f"outlived a killed up: {[p.cmdline() for p in alive]}"
    assert not _running_in(work)
    v = _verify(work, up_db)
    assert v.returncode == 0, v.stdout + v.stderr
