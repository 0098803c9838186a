"""``vla-rl round worker``: claim queued rounds from the metadata DB and run them, one at a time.

Rounds are jobs (:func:`vla_rl.rounds.queue_round` puts one in the ``rounds`` table as ``queued``). A worker

1. re-queues rounds whose worker stopped heartbeating (``stale_after_s``), or fails them with the reason
   once they were tried ``max_attempts`` times;
2. claims the oldest queued round atomically (SQLite: one writer at a time; PostgreSQL:
   ``SELECT ... FOR UPDATE SKIP LOCKED``), so several workers on several machines never run one twice;
3. runs it in a child process (a crash or OOM fails that round, not the worker; a cancel terminates it)
   while heartbeating from this one; the child exits by itself if this worker dies, so a re-queued round
   never runs twice at once;
4. never pushes a tag twice: a round whose ``round-N`` tag already exists fails instead (see
   :func:`vla_rl.rounds.run_round`).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet.db import FINISHED_STATUSES, MetadataDB, RoundLost, default_url, worker_id
from vla_rl.core.lifeline import exit_with_parent
from vla_rl.core.scheduling import leave_realtime

log = logging.getLogger(__name__)


@dataclass
class WorkerConfig:
    """Claim queued post-training rounds from the metadata DB and run them, one at a time; several
    workers (on several machines, against one PostgreSQL) share a queue."""

    store: Path
    """Episode store whose metadata DB holds the round queue."""
    db_url: str | None = None
    """Metadata DB as an SQLAlchemy URL; None = the SQLite file next to the store."""
    once: bool = False
    """Run what is queued, then exit (instead of waiting for more)."""
    poll_s: float = 2.0
    """Seconds between looks at an empty queue."""
    heartbeat_s: float = 5.0
    """Seconds between heartbeats of the running round."""
    stale_after_s: float = 60.0
    """A running round whose heartbeat is older than this is re-queued (its worker is taken for dead)."""
    max_attempts: int = 2
    """Claims of one round before a dead worker's round fails instead of being re-queued."""
    max_rounds: int | None = None
    """Exit after running this many rounds (None = no limit)."""
    nice: int = 0
    """Niceness added to each round's process (0..19), not to the worker's: its heartbeats keep their pace
    while the round yields the cores to the processes that share the machine (``vla-rl up --continuous``:
    the fleet, the policy server, the collector)."""

    def __post_init__(self) -> None:
        self.store = Path(self.store)
        for name in ("poll_s", "heartbeat_s", "stale_after_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected > 0, got {getattr(self, name)}")
        if self.stale_after_s <= 2 * self.heartbeat_s:
            raise ValueError(
                f"stale_after_s: expected > 2 x heartbeat_s ({2 * self.heartbeat_s}), got {self.stale_after_s}"
            )
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts: expected >= 1, got {self.max_attempts}")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"nice: expected a niceness in 0..19, got {self.nice}")


def run_worker(cfg: WorkerConfig, worker: str | None = None) -> int:
    """The worker loop; returns how many rounds it ran."""
    db = MetadataDB(cfg.db_url or default_url(cfg.store))
    worker = worker or worker_id()
    ran = 0
    log.info("round worker up", extra={"worker": worker, "db": repr(db)})
    while cfg.max_rounds is None or ran < cfg.max_rounds:
        for r in db.requeue_stale_rounds(cfg.stale_after_s, cfg.max_attempts):
            log.warning("stale round", extra={"round": r.id, "status": r.status, "why": r.error})
        rec = db.claim_round(worker)
        if rec is None:
            if cfg.once:
                break
            time.sleep(cfg.poll_s)
            continue
        run_claimed(db, rec.id, rec.config, worker, cfg.heartbeat_s, nice=cfg.nice)
        ran += 1
    return ran


def run_claimed(
    db: MetadataDB, round_id: int, config: dict[str, Any], worker: str, heartbeat_s: float, nice: int = 0
) -> str:
    """Run a round this worker claimed in a child process (``nice`` added to its niceness), heartbeating
    meanwhile; returns its final status."""
    ctx = mp.get_context("spawn")
    child = ctx.Process(
        target=_child_main,
        args=(db.url, round_id, config, worker, os.getpid(), nice),
        name=f"round-{round_id}",
    )
    child.start()
    log.info("round running", extra={"round": round_id, "worker": worker, "pid": child.pid})
    try:
        return _watch(db, child, round_id, worker, heartbeat_s)
    except KeyboardInterrupt:  # the worker is told to stop: so is the round (re-queued once stale)
        log.warning("stopping: the round's process too", extra={"round": round_id})
        _stop(child, timeout_s=2.0)
        raise


def _watch(db: MetadataDB, child: Any, round_id: int, worker: str, heartbeat_s: float) -> str:
    """Heartbeat ``round_id`` while its process ``child`` runs; its final status."""
    cancel_noted = False
    while child.is_alive():
        child.join(heartbeat_s)
        if not child.is_alive():
            break
        try:
            cancel = db.heartbeat_round(round_id, worker)
        except RoundLost as e:
            finished = finished_by(db, round_id, worker)
            if finished is not None:  # our child recorded its result and is exiting: not lost
                child.join(10)
                if child.is_alive():
                    _stop(child)
                return finished
            log.error("round lost; stopping it", extra={"round": round_id, "error": str(e)})
            _stop(child)
            return "lost"
        except Exception as e:  # a DB hiccup: keep running, beat again next time
            log.warning("heartbeat failed", extra={"round": round_id, "error": str(e)})
            continue
        if cancel:
            # the transition decides (one transaction with the round's begin_commit): before the round
            # began pushing, the cancel wins and the round is stopped; after, it finishes as it records
            rec = db.cancel_running(round_id)
            if rec.status == "cancelled":
                _stop(child)
                log.info("round cancelled", extra={"round": round_id})
                return "cancelled"
            if not cancel_noted:
                log.info("cancel came after the round began pushing: it finishes", extra={"round": round_id})
                cancel_noted = True
    rec = db.round(round_id)
    if rec is not None and rec.status == "running" and rec.worker == worker:
        db.update_round(
            round_id,
            status="failed",
            error=f"the round's process exited with code {child.exitcode} without recording a result",
            finished_at=time.time(),
        )
    final = db.round(round_id)
    return final.status if final is not None else "missing"


def finished_by(db: MetadataDB, round_id: int, worker: str) -> str | None:
    """The round's final status when ``worker`` ran it to the end (its process recorded the result
    between two heartbeats), else None: then a failed heartbeat means the round was taken away."""
    rec = db.round(round_id)
    if rec is not None and rec.status in FINISHED_STATUSES and rec.worker == worker:
        return rec.status
    return None


def _stop(child: Any, timeout_s: float = 10.0) -> None:
    """Terminate the round's process; kill it if it is still there after ``timeout_s``."""
    child.terminate()
    child.join(timeout_s)
    if child.is_alive():
        child.kill()
        child.join()


def _child_main(
    db_url: str, round_id: int, config: dict[str, Any], worker: str, parent_pid: int, nice: int = 0
) -> None:
    """The round's process: exits by itself when the worker that started it dies (so a re-queued round
    never runs twice at once), records its own success or failure in the DB; ``nice`` is added to its
    niceness first (every thread and process it starts inherits it)."""
    from vla_rl.core.logs import setup_logging
    from vla_rl.rounds import config_from_json, run_round

    exit_with_parent(parent_pid, code=3, interval_s=1.0, where=f"round {round_id} process")
    setup_logging("info", os.environ.get("VLA_RL_LOG_FORMAT", "text"))
    leave_realtime(f"round {round_id} process")
    if nice:
        os.nice(nice)
    db = MetadataDB(db_url)
    try:
        cfg = config_from_json(config)
    except (TypeError, ValueError) as e:  # e.g. queued by an older version with other knobs
        db.update_round(round_id, status="failed", error=f"config: {e}", finished_at=time.time())
        os._exit(1)
    try:
        run_round(cfg, round_id, db, worker)
    except Exception:
        os._exit(1)  # run_round recorded the failure (or the round was lost)
