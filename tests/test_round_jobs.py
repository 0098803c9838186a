"""Rounds as jobs for many workers against one PostgreSQL (issue 21, item 3).

Three worker processes share one throwaway PostgreSQL cluster (tests/pg_cluster.py) and six queued
rounds. Each round runs exactly once (claims are ``SELECT ... FOR UPDATE SKIP LOCKED``); a worker
SIGKILLed in the middle of a round stops heartbeating, so its round is re-queued once the heartbeat
is stale and another worker finishes it; and no round pushes its tag twice.

* ``test_three_worker_processes_six_rounds_one_killed``: the real worker loop
  (:func:`vla_rl.round_worker.run_worker`) in three processes, each round's work a heartbeating wait
  (no training), so it runs in seconds in CI.
* ``test_three_real_workers_six_real_rounds_one_killed`` (slow): three ``vla-rl round worker``
  processes training, evaluating and pushing six tiny AWR rounds to a real Hub server; the killed
  worker's round is finished by another, and the Hub's history holds each round's push once.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
from pg_cluster import PostgresCluster
from queue_workers import fake_worker
from test_round_queue import _wait, base  # noqa: F401 - base is a fixture

from fleet.db import MetadataDB
from vla_rl.hub.registry import configure_hub, push_folder
from vla_rl.hub.server import HubServer
from vla_rl.hub.storage import HubStorage
from vla_rl.rounds import RoundConfig, queue_round
from vla_rl.train.algorithms import make_config

CLI = [sys.executable, "-m", "vla_rl.cli"]
TERMINAL = ("succeeded", "failed", "cancelled")


def _tiny_round(store: Path, ckpt: Path | str, out: Path, steps: int = 5, **kw: Any) -> RoundConfig:
    train = make_config(
        "awr",
        base=str(ckpt),
        store=store,
        out=out,
        steps=steps,
        value_steps=5,
        batch_size=16,
        threads=1,
        progress=False,
    )
    return RoundConfig(train=train, eval_episodes=2, eval_envs=1, **kw)


def _stop_all(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive() if hasattr(p, "is_alive") else p.poll() is None:
            p.terminate()
    for p in procs:
        (p.join if hasattr(p, "join") else p.wait)(30)
        if p.is_alive() if hasattr(p, "is_alive") else p.poll() is None:
            p.kill()


def test_three_worker_processes_six_rounds_one_killed(
    base: tuple[Path, Path],  # noqa: F811
    tmp_path: Path,
    pg: PostgresCluster,
) -> None:
    store, ckpt = base
    url = pg.create_database()
    db = MetadataDB(url)
    ids = [queue_round(_tiny_round(store, ckpt, tmp_path / "r", push=False), db) for _ in range(6)]
    marks = tmp_path / "marks"
    marks.mkdir()
    ctx = mp.get_context("spawn")
    procs = {
        f"w{i}": ctx.Process(target=fake_worker, args=(url, str(store), f"w{i}", str(marks)))
        for i in range(3)
    }
    for p in procs.values():
        p.start()
    try:
        _wait(lambda: any(marks.iterdir()), 60, "a worker to start a round")
        first = sorted(marks.iterdir(), key=lambda f: f.stat().st_mtime)[0].name
        victim_round, victim = int(first.split("-")[0]), first.split("-")[1]
        os.kill(procs[victim].pid, signal.SIGKILL)  # mid-round: it heartbeats for ~2 s
        procs[victim].join(10)
        _wait(lambda: all(db.round(i).status in TERMINAL for i in ids), 90, "every round to finish")
    finally:
        _stop_all(list(procs.values()))
    done = {i: db.round(i) for i in ids}
    assert all(r.status == "succeeded" for r in done.values()), [
        (r.id, r.status, r.error) for r in done.values()
    ]
    assert all(r.metrics["ran_by"] == r.worker for r in done.values())  # run by the one that claimed it
    killed = done[victim_round]
    assert killed.attempts == 2 and killed.worker != victim, killed
    assert all(r.attempts == 1 for i, r in done.items() if i != victim_round)
    starts = sorted(f.name for f in marks.iterdir())
    # Each round started once, except the killed one: by the victim, then by another worker.
    assert sorted(int(s.split("-")[0]) for s in starts) == sorted([*ids, victim_round]), starts
    assert f"{victim_round}-{victim}" in starts and f"{victim_round}-{killed.worker}" in starts


def _round_pushes(hub_dir: Path, repo: str) -> list[str]:
    """Summaries of every commit on the repo's main branch, newest first."""
    storage = HubStorage(hub_dir)
    sha: str | None = storage.refs(repo).branches["main"]
    out = []
    while sha:
        c = storage.commit(repo, sha)
        out.append(c.summary)
        sha = c.parent
    return out


@pytest.mark.slow
def test_three_real_workers_six_real_rounds_one_killed(
    base: tuple[Path, Path],  # noqa: F811
    tmp_path: Path,
    pg: PostgresCluster,
) -> None:
    store, ckpt = base
    url = pg.create_database()
    db = MetadataDB(url)
    hub = HubServer(tmp_path / "hub", token="t").start()
    saved_env = dict(os.environ)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        configure_hub(hub.url, "t")
        os.environ.update(VLA_RL_HUB=hub.url, VLA_RL_HUB_TOKEN="t")  # what the workers' CLI reads
        push_folder(ckpt, "fleet/reach", message="base", tag="prod")
        base_ref = "hub://fleet/reach@prod"
        # The first (oldest) round is long enough to be killed while it trains.
        cfgs = [_tiny_round(store, base_ref, tmp_path / "r", steps=3000, margin=-0.99)]
        cfgs += [_tiny_round(store, base_ref, tmp_path / "r", margin=-0.99) for _ in range(5)]
        ids = [queue_round(c, db) for c in cfgs]
        long_round = ids[0]
        logs = [open(tmp_path / f"worker-{i}.log", "wb") for i in range(3)]  # noqa: SIM115
        args = ["--db-url", url, "--poll-s", "0.2", "--heartbeat-s", "0.5", "--stale-after-s", "3"]
        procs = [
            subprocess.Popen([*CLI, "round", "worker", "--store", str(store), *args], stdout=f, stderr=f)
            for f in logs
        ]
        by_pid = {p.pid: p for p in procs}
        _wait(
            lambda: (
                (db.round(long_round).progress or {}).get("phase") == "training"
                or db.round(long_round).status in TERMINAL
            ),
            300,
            "the long round to train",
        )
        assert db.round(long_round).status == "running", db.round(long_round).error
        victim = db.round(long_round).worker
        victim_pid = int(victim.rsplit(":", 1)[1])
        children = psutil.Process(victim_pid).children()
        os.kill(victim_pid, signal.SIGKILL)
        by_pid[victim_pid].wait(10)
        # Its round process notices and exits: the re-queued round never runs twice at once.
        _wait(
            lambda: not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children),
            15,
            "the orphaned round process to exit",
        )
        # The retry need not train 3000 steps.
        rec = db.round(long_round)
        db.update_round(long_round, config={**rec.config, "train": {**rec.config["train"], "steps": 5}})
        _wait(lambda: all(db.round(i).status in TERMINAL for i in ids), 900, "every round to finish")
        done = {i: db.round(i) for i in ids}
        logs_text = "\n".join(
            (tmp_path / f"worker-{i}.log").read_text(errors="replace")[-3000:] for i in range(3)
        )
        assert all(r.status == "succeeded" for r in done.values()), (
            [(r.id, r.status, r.error) for r in done.values()],
            logs_text,
        )
        assert done[long_round].attempts == 2 and done[long_round].worker != victim
        assert all(r.attempts == 1 for i, r in done.items() if i != long_round)
        assert len({r.worker for r in done.values()}) >= 2
        # No tag twice: each round-N tag exists, and the Hub's history has exactly one push per round.
        storage = HubStorage(tmp_path / "hub")
        tags = storage.refs("fleet/reach").tags
        assert {f"round-{i}" for i in ids} <= set(tags)
        pushes = [s for s in _round_pushes(tmp_path / "hub", "fleet/reach") if s.startswith("round ")]
        assert sorted(pushes) == sorted({s for s in pushes}) and len(pushes) == 6, pushes
        for i, r in done.items():
            assert (
                r.checkpoint_ref == f"hub://fleet/reach@round-{i}"
                and r.checkpoint_revision == tags[f"round-{i}"]
            )
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        os.environ.clear()
        os.environ.update(saved_env)
        hub.stop()
