"""The child processes of the round-queue tests (tests/test_round_queue.py, tests/test_round_jobs.py):
workers claiming rounds from one metadata DB. In a module of their own because a spawned child imports
the module its target lives in: here that is the DB and the worker loop, not a test module's trainers
and simulators (several seconds more for each child)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fleet.db import MetadataDB


def claim_all(url: str, worker: str, out: Any) -> None:
    db = MetadataDB(url)
    got = []
    while (r := db.claim_round(worker)) is not None:
        got.append(r.id)
    out.put(got)


def fake_round_worker(url: str, store: str, worker: str, go: Any, out: Any) -> None:
    """The real worker loop (:func:`run_worker`: re-queue stale rounds, claim, run, repeat) with each
    round's work faked (heartbeat, a short sleep, succeeded): many workers, no training."""
    import vla_rl.round_worker as rw

    def run_claimed(
        db: MetadataDB, round_id: int, config: dict[str, Any], w: str, heartbeat_s: float, nice: int = 0
    ) -> str:
        db.heartbeat_round(round_id, w, progress={"phase": "training"})
        time.sleep(0.3)
        db.update_round(round_id, status="succeeded", metrics={"ran_by": w}, finished_at=time.time())
        return "succeeded"

    rw.run_claimed = run_claimed
    go.wait(120)
    n = rw.run_worker(rw.WorkerConfig(store=Path(store), db_url=url, once=True, heartbeat_s=1), worker)
    out.put((worker, n))


def fake_worker(url: str, store: str, name: str, marks: str) -> None:
    """The real worker loop with each round's work faked: it heartbeats for ~2 s (leaving a mark that it
    started), then records success."""
    import vla_rl.round_worker as rw

    def run_claimed(
        db: MetadataDB, round_id: int, config: dict[str, Any], w: str, heartbeat_s: float, nice: int = 0
    ) -> str:
        Path(marks, f"{round_id}-{w}").touch()
        for _ in range(7):
            db.heartbeat_round(round_id, w, progress={"phase": "training"})
            time.sleep(heartbeat_s)
        db.update_round(round_id, status="succeeded", metrics={"ran_by": w}, finished_at=time.time())
        return "succeeded"

    rw.run_claimed = run_claimed
    cfg = rw.WorkerConfig(store=Path(store), db_url=url, poll_s=0.2, heartbeat_s=0.3, stale_after_s=1.5)
    rw.run_worker(cfg, name)
