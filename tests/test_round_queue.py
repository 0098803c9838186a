"""Rounds as jobs: queued in the metadata DB, claimed atomically by `vla-rl round worker` processes,
heartbeated, re-queued when their worker dies, cancelled, and never tagged twice.

Real SQLite DB shared by real worker processes; rounds train a tiny AWR step on the kinematic test bed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from pg_cluster import PostgresCluster
from queue_workers import claim_all, fake_round_worker

from fleet.db import MetadataDB, RoundLost
from fleet.store import EpisodeStore
from sim.demos import record_demos
from vla_rl.hub.registry import configure_hub, push_folder, resolve
from vla_rl.hub.server import HubServer
from vla_rl.round_worker import finished_by
from vla_rl.rounds import RoundConfig, RoundError, queue_round, run_round
from vla_rl.train.algorithms import make_config
from vla_rl.train.sft import SFTConfig, train_sft

TASK = "kinematic/Reach-v0"
CLI = [sys.executable, "-m", "vla_rl.cli"]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(store with 6 demos, a tiny SFT checkpoint folder) on the kinematic task."""
    root = tmp_path_factory.mktemp("queue")
    store = root / "store"
    record_demos(EpisodeStore(store, create=True), TASK, episodes=6, noise=0.5, seed=0, progress=False)
    sft = train_sft(
        SFTConfig(
            task=TASK,
            store=store,
            out=root / "sft",
            steps=30,
            batch_size=16,
            chunk_len=4,
            n_exec=2,
            d_model=32,
            n_layers=1,
            expert_n_layers=1,
            instruction_encoder="none",
            threads=1,
            progress=False,
        )
    )
    return store, sft.checkpoint


def _round(store: Path, ckpt: Path, out: Path, steps: int = 5, **kw: Any) -> RoundConfig:
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
    return RoundConfig(train=train, push=False, eval_episodes=2, eval_envs=1, **kw)


def _wait(pred: Any, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


# ---------------------------------------------------------------------------- the queue itself
def test_queue_transitions(base: tuple[Path, Path], tmp_path: Path, db_url: str) -> None:
    store, ckpt = base
    db = MetadataDB(db_url)
    a, b = (queue_round(_round(store, ckpt, tmp_path), db) for _ in range(2))
    assert [r.status for r in db.rounds()] == ["queued", "queued"]
    ra = db.claim_round("w1")
    rb = db.claim_round("w2")
    assert (ra.id, rb.id) == (a, b) and ra.status == "running" and ra.attempts == 1 and ra.worker == "w1"
    assert db.claim_round("w3") is None  # nothing left
    assert db.heartbeat_round(a, "w1", progress={"phase": "training"}) is False
    assert db.round(a).progress == {"phase": "training"}
    with pytest.raises(RoundLost):
        db.heartbeat_round(a, "w2")  # not w2's round
    assert db.requeue_stale_rounds(stale_after_s=3600, max_attempts=2) == []  # heartbeats are fresh
    # both workers "die": a cutoff in the future makes every heartbeat stale
    assert {r.id for r in db.requeue_stale_rounds(stale_after_s=-1, max_attempts=2)} == {a, b}
    assert db.round(a).status == "queued" and "stopped heartbeating" in db.round(a).error
    with pytest.raises(RoundLost):
        db.heartbeat_round(a, "w1")  # a worker that comes back learns its round is gone
    assert db.claim_round("w4").attempts == 2
    (gave_up,) = db.requeue_stale_rounds(stale_after_s=-1, max_attempts=2)
    assert gave_up.status == "failed" and "gave up after 2 attempt(s)" in gave_up.error
    # cancel: a queued round at once, a running one through its heartbeat; a finished one refuses
    assert db.cancel_round(b).status == "cancelled" and db.claim_round("w5") is None
    c = queue_round(_round(store, ckpt, tmp_path), db)
    db.claim_round("w6")
    assert db.cancel_round(c).status == "running" and db.heartbeat_round(c, "w6") is True
    with pytest.raises(ValueError, match="already failed"):
        db.cancel_round(a)


def test_cancel_and_commit_decide_in_one_transaction(
    base: tuple[Path, Path], tmp_path: Path, db_url: str
) -> None:
    """A cancel either lands before the round begins committing (push + promote), and wins: the round never
    pushes and its row says cancelled; or after, and no longer applies: the round finishes and its own record
    (succeeded, promoted) stands. A finished round is never written over (it could end cancelled while
    prod had moved)."""
    store, ckpt = base
    db = MetadataDB(db_url)
    late, early, done = (queue_round(_round(store, ckpt, tmp_path), db) for _ in range(3))
    for rid in (late, early, done):
        assert db.claim_round("w1", rid) is not None
    # late: committing first, then the cancel
    assert db.begin_commit(late, "w1") is True
    assert db.cancel_round(late).status == "running"  # the flag is set
    assert db.cancel_running(late).status == "running"  # but the round is pushing: it finishes
    db.update_round(late, status="succeeded", promoted=True, finished_at=time.time())
    assert db.cancel_running(late).status == "succeeded" and db.round(late).promoted is True
    # early: the cancel first, then the round asks to commit
    db.cancel_round(early)
    assert db.begin_commit(early, "w1") is False
    rec = db.cancel_running(early)
    assert rec.status == "cancelled" and rec.error == "cancelled while running"
    with pytest.raises(RoundLost):
        db.begin_commit(early, "w1")
    # done: a finished round keeps its record
    db.update_round(done, status="failed", error="boom", finished_at=time.time())
    assert db.cancel_running(done).status == "failed" and db.round(done).error == "boom"
    with pytest.raises(RoundLost):
        db.begin_commit(done, "w1")


def test_a_result_recorded_between_heartbeats_is_not_a_lost_round(
    base: tuple[Path, Path], tmp_path: Path, db_url: str
) -> None:
    """The round's process records its result and exits; a heartbeat that falls in between fails, and
    the worker must read that as the round finished (by it), not as the round taken away."""
    store, ckpt = base
    db = MetadataDB(db_url)
    a, b = (queue_round(_round(store, ckpt, tmp_path), db) for _ in range(2))
    db.claim_round("w1"), db.claim_round("w2")
    db.update_round(a, status="succeeded", finished_at=time.time())
    with pytest.raises(RoundLost):
        db.heartbeat_round(a, "w1")
    assert finished_by(db, a, "w1") == "succeeded"
    assert finished_by(db, a, "w2") is None  # someone else's round
    db.requeue_stale_rounds(stale_after_s=-1, max_attempts=2)  # b re-queued: taken away from w2
    assert finished_by(db, b, "w2") is None


def test_concurrent_claims_take_each_round_once(base: tuple[Path, Path], tmp_path: Path, db_url: str) -> None:
    store, ckpt = base
    url = db_url  # on PostgreSQL, FOR UPDATE SKIP LOCKED does the work
    db = MetadataDB(url)
    ids = [queue_round(_round(store, ckpt, tmp_path), db) for _ in range(24)]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=claim_all, args=(url, f"w{i}", out)) for i in range(3)]
    for p in procs:
        p.start()
    claimed = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    flat = [i for got in claimed for i in got]
    assert sorted(flat) == ids, claimed  # every round exactly once
    assert all(r.attempts == 1 for r in db.rounds())


def test_three_workers_run_six_queued_rounds_each_once(
    base: tuple[Path, Path], tmp_path: Path, db_url: str
) -> None:
    store, ckpt = base
    db = MetadataDB(db_url)
    ids = [queue_round(_round(store, ckpt, tmp_path), db) for _ in range(6)]
    ctx = mp.get_context("spawn")
    out, go = ctx.Queue(), ctx.Barrier(3)
    procs = [
        ctx.Process(target=fake_round_worker, args=(db_url, str(store), f"w{i}", go, out)) for i in range(3)
    ]
    for p in procs:
        p.start()
    ran = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert sum(ran.values()) == 6, ran
    done = [db.round(i) for i in ids]
    assert all(r.status == "succeeded" and r.attempts == 1 for r in done), done
    assert all(r.metrics["ran_by"] == r.worker for r in done)  # run by the worker that claimed it
    by_worker = {w: sum(r.worker == w for r in done) for w in ran}
    assert by_worker == ran


def test_a_real_worker_runs_a_round_from_postgresql(
    base: tuple[Path, Path], tmp_path: Path, pg: PostgresCluster
) -> None:
    store, ckpt = base
    url = pg.create_database()
    db = MetadataDB(url)
    rid = queue_round(_round(store, ckpt, tmp_path / "rounds"), db)
    w = _worker(store, "--once", "--db-url", url, "--heartbeat-s", "1", "--stale-after-s", "30")
    log = w.communicate(timeout=600)[0]
    assert w.returncode == 0, log
    rec = db.round(rid)
    assert rec.status == "succeeded" and rec.attempts == 1 and rec.worker, (rec.status, rec.error, log)
    assert Path(rec.checkpoint_ref).is_dir() and f"round-{rid}" in rec.checkpoint_ref
    assert "ran 1" in log and url.rsplit("/", 1)[1] in log  # it says which DB it worked from


# ---------------------------------------------------------------------------- workers
def _worker(store: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*CLI, "round", "worker", "--store", str(store), "--poll-s", "0.2", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


# slow: kept out of CI's short run for time (make test <= 15 min on 2 cores); run with -m slow
@pytest.mark.slow
def test_two_workers_run_each_queued_round_once(base: tuple[Path, Path], tmp_path: Path) -> None:
    store, ckpt = base
    ids = [queue_round(_round(store, ckpt, tmp_path / "rounds")) for _ in range(3)]
    workers = [_worker(store, "--once", "--heartbeat-s", "1", "--stale-after-s", "30") for _ in range(2)]
    logs = [w.communicate(timeout=600)[0] for w in workers]
    assert all(w.returncode == 0 for w in workers), logs
    db = MetadataDB.for_store(store)
    done = [db.round(i) for i in ids]
    assert [r.status for r in done] == ["succeeded"] * 3, [(r.status, r.error) for r in done]
    assert [r.attempts for r in done] == [1, 1, 1] and all(r.worker for r in done)
    for i, r in zip(ids, done, strict=True):  # each trained in its own round-N folder
        assert Path(r.checkpoint_ref).is_dir() and f"round-{i}" in r.checkpoint_ref
    ran = sum(int(line.split()[1]) for log in logs for line in log.splitlines() if line.startswith("ran "))
    assert ran == 3


def test_a_killed_workers_round_is_requeued_and_its_process_stops(
    base: tuple[Path, Path], tmp_path: Path
) -> None:
    store, ckpt = base
    rid = queue_round(_round(store, ckpt, tmp_path / "rounds", steps=3000))  # long enough to be killed
    db = MetadataDB.for_store(store)
    first = _worker(store, "--once", "--heartbeat-s", "0.5", "--stale-after-s", "2")
    try:
        _wait(lambda: (db.round(rid).progress or {}).get("phase") == "training", 180, "the round to train")
        children = psutil.Process(first.pid).children()
        assert children, "the round runs in a child process"
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        # the orphaned round process notices its worker is gone and exits (no second copy can run)
        _wait(
            lambda: not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children),
            15,
            "the orphaned round process to exit",
        )
    finally:
        if first.poll() is None:
            first.kill()
    assert db.round(rid).status == "running"  # until someone notices the stale heartbeat
    db.update_round(
        rid, config={**db.round(rid).config, "train": {**db.round(rid).config["train"], "steps": 5}}
    )
    # a worker starts in about a second: let the heartbeat go stale first, or --once finds nothing to do
    _wait(lambda: time.time() - (db.round(rid).heartbeat_at or 0) > 2.5, 10, "the heartbeat to go stale")
    second = _worker(store, "--once", "--heartbeat-s", "0.5", "--stale-after-s", "2")
    log = second.communicate(timeout=600)[0]
    rec = db.round(rid)
    assert rec.status == "succeeded" and rec.attempts == 2, (rec.status, rec.error, log)


def test_cancel_stops_a_running_round(base: tuple[Path, Path], tmp_path: Path) -> None:
    store, ckpt = base
    rid = queue_round(_round(store, ckpt, tmp_path / "rounds", steps=100_000))
    db = MetadataDB.for_store(store)
    worker = _worker(store, "--once", "--heartbeat-s", "0.5", "--stale-after-s", "5")
    try:
        _wait(lambda: (db.round(rid).progress or {}).get("phase") == "training", 180, "the round to train")
        r = subprocess.run(
            [*CLI, "round", "cancel", str(rid), "--store", str(store)], capture_output=True, text=True
        )
        assert r.returncode == 0, r.stderr
        log = worker.communicate(timeout=60)[0]
    finally:
        if worker.poll() is None:
            worker.kill()
    rec = db.round(rid)
    assert rec.status == "cancelled" and rec.error == "cancelled while running", log
    r = subprocess.run(
        [*CLI, "round", "cancel", str(rid), "--store", str(store)], capture_output=True, text=True
    )
    assert r.returncode == 2 and "already cancelled" in r.stderr


def test_cancel_stops_a_round_started_in_its_own_process(base: tuple[Path, Path], tmp_path: Path) -> None:
    """`vla-rl round start` runs the round in the same process (no worker): `round cancel` stops it too, at
    its next progress report after a heartbeat, and the row says cancelled (it said running, forever)."""
    store, ckpt = base
    args = ["--base", str(ckpt), "--store", str(store), "--out", str(tmp_path / "r"), "--no-push"]
    args += [
        "--steps",
        "100000",
        "--value-steps",
        "5",
        "--batch-size",
        "16",
        "--threads",
        "1",
        "--no-progress",
    ]
    db = MetadataDB.for_store(store)
    before = {r.id for r in db.rounds()}
    proc = subprocess.Popen(
        [*CLI, "round", "start", "--algo", "awr", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait(lambda: {r.id for r in db.rounds()} - before, 60, "the round to be queued")
        [rid] = {r.id for r in db.rounds()} - before
        _wait(lambda: (db.round(rid).progress or {}).get("phase") == "training", 180, "the round to train")
        r = subprocess.run(
            [*CLI, "round", "cancel", str(rid), "--store", str(store)], capture_output=True, text=True
        )
        assert r.returncode == 0, r.stderr
        _, err = proc.communicate(timeout=60)  # a heartbeat (5 s) and the next training step
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1 and f"round {rid} was cancelled while running" in err, err[-3000:]
    rec = db.round(rid)
    assert (
        rec.status == "cancelled" and rec.error == "cancelled while running" and rec.finished_at is not None
    )


def test_a_round_never_pushes_its_tag_twice(base: tuple[Path, Path], tmp_path: Path) -> None:
    store, ckpt = base
    hub = HubServer(tmp_path / "hub", token="t").start()
    try:
        configure_hub(hub.url, "t")
        push_folder(ckpt, "fleet/reach", message="base", tag="prod")
        prod = resolve("hub://fleet/reach@prod")
        train = make_config(
            "awr",
            base="hub://fleet/reach@prod",
            store=store,
            out=tmp_path / "r",
            steps=5,
            value_steps=5,
            batch_size=16,
            threads=1,
            progress=False,
        )
        cfg = RoundConfig(train=train, eval_episodes=2, eval_envs=1, margin=-0.99)
        db = MetadataDB(f"sqlite:///{tmp_path / 'q.db'}")
        rid = queue_round(cfg, db)
        # an earlier attempt of this round pushed its tag, then its worker died before recording it
        push_folder(ckpt, "fleet/reach", message="earlier attempt", tag=f"round-{rid}")
        assert db.claim_round("w") is not None
        with pytest.raises(RoundError, match=f"round-{rid} already exists"):
            run_round(cfg, rid, db, "w")
        rec = db.round(rid)
        assert rec.status == "failed" and "never tags twice" in rec.error and "--repo" in rec.error
        assert not (tmp_path / "r" / f"round-{rid}").exists()  # checked before training, not after it
        assert resolve("hub://fleet/reach@prod") == prod  # prod untouched though the gate would pass

        # another fleet takes the next round's tag while this round trains: the push-time check catches it
        rid2 = queue_round(cfg, db)
        taken: list[bool] = []

        def take_tag_once() -> bool:  # asked at every progress report
            if not taken and (tmp_path / "r" / f"round-{rid2}").exists():  # training has begun
                push_folder(ckpt, "fleet/reach", message="another fleet", tag=f"round-{rid2}")
                taken.append(True)
            return False

        assert db.claim_round("w") is not None
        with pytest.raises(RoundError, match=f"round-{rid2} already exists"):
            run_round(cfg, rid2, db, "w", cancel_requested=take_tag_once)
        assert taken and (tmp_path / "r" / f"round-{rid2}").exists()  # it trained, then refused to push
        assert db.round(rid2).status == "failed"
        assert resolve("hub://fleet/reach@prod") == prod
    finally:
        hub.stop()
