"""`vla-rl up --continuous` without services (in-process, a SQLite metadata DB with hand-made episodes): the
selection's close-time keys, a round's snapshot (nothing closed after it was queued leaks in), the
new-episode trigger counted from the previous round's snapshot, rounds that never overlap while the fleet
keeps closing episodes, and the fleet's activity (successful episodes per hour, utilisation, interventions
per robot-hour) per window and overall. The end-to-end run is in test_up_continuous_e2e.py."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vla_rl_client.meta import Controller, EpisodeMeta, Segment, SegmentKind
from vla_rl_client.spec import RobotSpec

from fleet.db import MetadataDB
from fleet.selection import EpisodeQuery, Selection
from fleet.store import EpisodeStore
from vla_rl.up import UpConfig
from vla_rl.up.activity import fleet_activity, overall, rates, wait_closed
from vla_rl.up.continuous import last_snapshot, new_episodes, snapshot_data, snapshot_of, wait_for_trigger

SPEC = RobotSpec(name="toy-arm", state_dim=3, action_dim=2, control_hz=10.0, instruction="reach")
SPEC_TOY = RobotSpec(name="toy", state_dim=2, action_dim=1, control_hz=10.0, instruction="do it")
TASK = "toy/Reach-v0"
T0 = 1_790_000_000.0
_ids = itertools.count()


def _meta(
    created: float,
    closed: float | None,
    robot: str = "sim-0",
    success: bool = True,
    takeovers: int = 0,
) -> EpisodeMeta:
    """An episode of ``robot`` created at ``created``, closed at ``closed`` (None: still open), with
    ``takeovers`` one-frame interventions."""
    length = 10 + 2 * takeovers
    segs = [Segment(0, SegmentKind.AUTONOMOUS, Controller.POLICY, 0, 10)]
    for k in range(takeovers):
        segs.append(Segment(len(segs), SegmentKind.INTERVENTION, Controller.HUMAN, 10 + 2 * k, 11 + 2 * k))
        segs.append(Segment(len(segs), SegmentKind.AUTONOMOUS, Controller.POLICY, 11 + 2 * k, 12 + 2 * k))
    outcome = None if closed is None else ("success" if success else "failure")
    return EpisodeMeta(
        episode_id=f"ep-{next(_ids):05d}",
        robot_id=robot,
        task=TASK,
        instruction="reach",
        spec=SPEC,
        chunk_len=8,
        created=created,
        length=length,
        status="open" if closed is None else "closed",
        segments=tuple(segs),
        outcome=outcome,
        success=None if outcome is None else success,
        closed=closed,
    )


@pytest.fixture
def db(tmp_path: Path) -> MetadataDB:
    return MetadataDB(f"sqlite:///{tmp_path / 'metadata.db'}")


def _add(db: MetadataDB, *metas: EpisodeMeta) -> list[str]:
    db.record_episodes(metas, "/store")
    return [m.episode_id for m in metas]


def test_close_time_keys_select_what_was_recorded_by_then(db: MetadataDB) -> None:
    early = _add(db, _meta(T0, T0 + 10), _meta(T0 + 1, T0 + 20))
    spanning = _add(db, _meta(T0 + 5, T0 + 40))  # created before the cut, closed after it
    _add(db, _meta(T0 + 6, None))  # open: no close time matches it
    late = _add(db, _meta(T0 + 30, T0 + 50))
    cut = T0 + 20
    assert db.select_ids(Selection(closed_until=cut)) == early  # at or before: the boundary is in
    assert db.select_ids(Selection(closed_since=cut + 1)) == spanning + late
    assert db.select_ids(Selection(closed_since=T0 + 15, closed_until=T0 + 45)) == early[1:] + spanning
    assert db.select_ids(Selection(until=cut)) == early + spanning  # creation time: the in-flight one too
    # both spellings, and the order check names the field
    text = Selection.parse(f"closed_since={T0},closed_until={cut}")
    assert text == Selection(closed_since=T0, closed_until=cut) == Selection.parse(text.to_text())
    url = EpisodeQuery.from_params({"closed_since": str(T0), "closed_until": str(cut)})
    assert url.filters() == text and EpisodeQuery.from_params(url.to_params()) == url
    with pytest.raises(ValueError, match=r"closed_until: expected >= closed_since"):
        Selection(closed_since=cut, closed_until=T0)
    with pytest.raises(ValueError, match="closed_until: expected unix seconds or an ISO date"):
        Selection.parse("closed_until=soon")


def test_a_rounds_snapshot_leaves_out_everything_closed_after_it(db: MetadataDB) -> None:
    """The round's data text selects the episodes closed when it was queued, whenever it is evaluated: an
    episode running then (created before, closed after) and one started later are not in it."""
    before = _add(db, _meta(T0, T0 + 10), _meta(T0 + 2, T0 + 12, robot="demo-0"))
    at = T0 + 15
    data = snapshot_data("success=true", at)
    assert data == f"success=true,closed_until={at!r}"
    assert Selection.parse(data, task=TASK).closed_until == at  # exact through the text
    _add(db, _meta(T0 + 14, T0 + 16), _meta(T0 + 20, T0 + 30))  # arrive after the snapshot
    _add(db, _meta(T0 + 3, T0 + 11, success=False))  # in the snapshot, not a success
    assert db.select_ids(Selection.parse(data, task=TASK)) == before
    assert db.select_ids(Selection.parse(snapshot_data(None, at), task=TASK))[: len(before)] == before
    assert len(db.select_ids(Selection.parse(snapshot_data(None, at), task=TASK))) == 3


def test_a_snapshot_is_read_back_from_the_rounds_config(db: MetadataDB) -> None:
    """The trigger counts from the last round's snapshot: a continuous round's ``closed_until``, a batch
    round's queue time (its batch had closed by then); none yet: every fleet episode is new."""
    assert last_snapshot(db) == 0.0
    batch = db.create_round(algo="awr", task=TASK, base_ref="x", config={"train": {"data": None}})
    rec = db.round(batch)
    assert rec is not None and snapshot_of(rec) == rec.created_at
    cont = db.create_round(
        algo="awr", task=TASK, base_ref="x", config={"train": {"data": snapshot_data("success=true", T0)}}
    )
    cont_rec = db.round(cont)
    assert cont_rec is not None and snapshot_of(cont_rec) == T0
    assert last_snapshot(db) == max(rec.created_at, T0)


def test_the_trigger_counts_fleet_episodes_closed_after_the_snapshot(db: MetadataDB) -> None:
    snap = T0 + 10
    _add(db, _meta(T0, T0 + 5), _meta(T0 + 1, snap))  # in the snapshot (its boundary included)
    _add(db, _meta(T0 + 2, None))  # open
    _add(db, _meta(T0 + 3, T0 + 12, robot="demo-0"))  # not the fleet's
    assert new_episodes(db, snap, "sim") == 0
    _add(db, _meta(T0 + 4, T0 + 11), _meta(T0 + 12, T0 + 13, robot="sim-1"))
    assert new_episodes(db, snap, "sim") == 2
    with pytest.raises(RuntimeError, match="the fleet closed 2 of the 3 new episodes a round needs"):
        wait_for_trigger(db, snap, 3, "sim", timeout_s=0.3, poll_s=0.05)
    checks: list[int] = []

    def later() -> None:
        time.sleep(0.3)
        _add(db, _meta(T0 + 14, T0 + 15))

    t = threading.Thread(target=later)
    t.start()
    before = time.time()
    at = wait_for_trigger(db, snap, 3, "sim", timeout_s=30, check=lambda: checks.append(1), poll_s=0.05)
    t.join()
    assert at >= before + 0.25 and len(checks) >= 2  # it waited, running the check every poll


class _FakeSup:
    """The supervisor as the continuous loop uses it: the fleet started once, checked every poll."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.events: list[str] = []
        self.checks = 0

    def start(self, name: str, argv: list[str], ready: Any, env: dict[str, str], stop_order: int = 0) -> bool:
        self.started.append(name)
        return True

    def check(self) -> None:
        self.checks += 1


def test_continuous_rounds_trigger_on_new_episodes_train_on_snapshots_and_never_overlap(
    db: MetadataDB, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop itself, with a fleet that closes an episode every few 10 ms throughout (rounds included) and
    rounds that 'train' for 1.5 s: each round is queued after the one before finished, once 4 episodes
    (robots x episodes) closed after that one's snapshot; its data is its own snapshot; episodes closed
    while it trained are in the next round's data, not its own."""
    import vla_rl.hub.registry as registry
    import vla_rl.rounds as rounds
    import vla_rl.up.loop as loop
    from vla_rl.up.workdir import Ports

    stop = threading.Event()
    store = EpisodeStore(tmp_path / "store", create=True, db=db)

    def fleet() -> None:
        for k in itertools.count():
            if stop.wait(0.02):
                return
            now = time.time()
            _worked(store, f"sim-{k % 2}", now - 0.02, now)

    queued: list[dict[str, Any]] = []

    def queue_round(cfg: Any, db_: MetadataDB) -> int:
        rid = db.create_round(algo="awr", task=TASK, base_ref="x", config={"train": {"data": cfg.train.data}})
        queued.append({"id": rid, "at": time.time(), "data": cfg.train.data})
        return rid

    def wait_round(db_: MetadataDB, rid: int, timeout_s: float) -> Any:
        time.sleep(1.5)  # training, while the fleet goes on
        return db.update_round(rid, status="succeeded", finished_at=time.time())

    monkeypatch.setattr(rounds, "queue_round", queue_round)
    monkeypatch.setattr(loop, "_wait_round", wait_round)
    monkeypatch.setattr(loop, "_round_config", lambda *a: _Cfg(a[-1]))
    monkeypatch.setattr(registry, "resolve", lambda ref: "rev")
    cfg = UpConfig(robots=2, episodes=2, rounds=3, continuous=True, workdir=tmp_path, task=TASK)
    sup = _FakeSup()
    prod, ports = "hub://up/policy@prod", Ports(1, 2, 3, 4)
    run = loop._Run(cfg, db, sup, tmp_path, tmp_path / "store", prod, "sqlite://", ports, {}, "p")  # type: ignore[arg-type]
    t = threading.Thread(target=fleet)
    t.start()
    try:
        rows = loop._continuous_rounds(run)
    finally:
        stop.set()
        t.join()
    assert sup.started == ["fleet"] and sup.checks >= 3  # started once, never stopped between rounds
    recs = db.rounds()
    assert [r["round"] for r in rows] == [r.id for r in recs] == [1, 2, 3]
    prev_snapshot = 0.0
    assert len(queued) == len(recs)
    for q in queued:
        snap = Selection.parse(q["data"]).closed_until
        assert snap is not None and snap <= q["at"]
        # the trigger: at least robots x episodes closed after the previous snapshot, by this one
        fresh = db.select_ids(Selection(robots=("sim-*",), closed_since=prev_snapshot, closed_until=snap))
        assert len(fresh) >= cfg.robots * cfg.episodes
        # no leak: what the round selects now (later) is what was closed at its snapshot
        selected = db.select_ids(Selection.parse(q["data"]))
        later_closed = db.select_ids(Selection(closed_since=snap + 1e-6))
        assert later_closed and not set(selected) & set(later_closed)
        prev_snapshot = snap
    for a, b in itertools.pairwise(recs):
        assert a.finished_at is not None and b.created_at >= a.finished_at  # never two at once
    for rec in recs:  # the fleet worked while each round trained
        assert rec.finished_at is not None
        assert db.select_ids(Selection(closed_since=rec.created_at, closed_until=rec.finished_at))
    assert all(r["mode"] == "continuous" and r["activity"]["episodes"] > 0 for r in rows)


class _Cfg:
    """The parts of a RoundConfig the fake queue reads."""

    def __init__(self, data: str | None) -> None:
        self.train = type("T", (), {"data": data})()


def _worked(
    store: EpisodeStore,
    robot: str,
    t0: float,
    t1: float,
    success: bool = True,
    takeovers: int = 0,
    close: bool = True,
) -> Any:
    """An episode of ``robot`` the robot worked on from ``t0`` to ``t1``: 5 frames stamped at the end of
    each fifth, with ``takeovers`` one-frame interventions (frames 1, 3); not ``close``: its writer."""
    w = store.create_episode(SPEC_TOY, robot_id=robot, task="toy", chunk_len=2)
    for i in range(5):
        human = i in (1, 3)[:takeovers]
        if human or (i in (2, 4) and i - 1 in (1, 3)[:takeovers]):
            w.begin_segment(*((SegmentKind.INTERVENTION, Controller.HUMAN) if human else ()))
        w.add_frame(
            cameras={},
            state=np.zeros(2, np.float32),
            action=np.zeros(1, np.float32),
            reward=0.0,
            terminated=i == 4,
            truncated=False,
            controller=Controller.HUMAN if human else Controller.POLICY,
            timestamp=t0 + (t1 - t0) * (i + 1) / 5,
        )
    if not close:
        w.flush()
        return w
    w.close(outcome="success" if success else "failure", success=success)
    return None


def test_activity_counts_successes_work_and_takeovers_per_window(tmp_path: Path) -> None:
    """Two robots over a 100 s window, from the frames' timestamps: successes counted where their robot
    finished them, work time split at the window's edges, takeovers per hour of robot work."""
    db = MetadataDB.for_store(tmp_path / "store")
    store = EpisodeStore(tmp_path / "store", create=True, db=db)
    t = time.time() - 1000  # the frames are stamped in the past; the store closes them now
    start, end = t, t + 100
    _worked(store, "sim-0", t - 20, t + 20, takeovers=2)  # 20 s inside
    _worked(store, "sim-0", t + 30, t + 60, success=False, takeovers=1)  # 30 s
    _worked(store, "sim-0", t + 70, t + 130)  # 30 s inside, finished after the window
    _worked(store, "sim-1", t + 10, t + 50)  # 40 s
    _worked(store, "sim-1", t + 95, t + 100)  # finished at the end: this window's, not the next's
    running = _worked(store, "sim-1", t + 100, t + 101, close=False)  # not closed yet: left out
    _worked(store, "demo-0", t + 10, t + 50)  # not the fleet's
    a = fleet_activity(db, store, start, end, robots=2, robot_prefix="sim")
    assert (a["episodes"], a["successes"], a["interventions"]) == (4, 3, 3)
    assert a["busy_seconds"] == pytest.approx(125.0)
    assert a["utilisation"] == pytest.approx(125.0 / 200.0)
    assert a["successes_per_hour"] == pytest.approx(3 / (100 / 3600))
    assert a["interventions_per_robot_hour"] == pytest.approx(3 / (125 / 3600))
    b = fleet_activity(db, store, end, end + 100, robots=2, robot_prefix="sim")
    assert b["episodes"] == 1 and b["busy_seconds"] == pytest.approx(30.0)  # the rest of the spanning one
    whole = overall([a, b])
    assert whole is not None and whole["seconds"] == 200 and whole["successes"] == 4
    assert whole["utilisation"] == pytest.approx(155.0 / 400.0)
    assert (whole["start"], whole["end"]) == (t, t + 200)
    assert overall([]) is None
    idle = fleet_activity(db, store, t + 1000, t + 1000, robots=2, robot_prefix="sim")
    assert idle["utilisation"] is None and idle["successes_per_hour"] is None
    # waiting for the episodes started in a window (the DB's creation time) to close
    assert not wait_closed(db, t, time.time(), "sim", timeout_s=0.2)  # the running one
    running.close(outcome="success", success=True)
    assert wait_closed(db, t, time.time(), "sim", timeout_s=5)


def test_continuous_is_validated_and_the_default_follows_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    import vla_rl.up.config as config

    monkeypatch.setattr(config.os, "cpu_count", lambda: 2)
    assert UpConfig().continuous is False
    monkeypatch.setattr(config.os, "cpu_count", lambda: 4)
    assert UpConfig().continuous is True
    assert UpConfig(continuous=False).continuous is False
    with pytest.raises(ValueError, match=r"trainer_nice: expected a niceness in 0\.\.19, got 20"):
        UpConfig(trainer_nice=20)
    with pytest.raises(ValueError, match="data: with continuous each round selects the episodes closed"):
        UpConfig(continuous=True, data="success=true,closed_until=5")
    assert UpConfig(continuous=False, data="closed_until=5").data == "closed_until=5"


def test_the_bench_reports_each_mode_per_round_and_overall() -> None:
    from bench.continuous import report

    def act(seconds: float, successes: int, busy: float) -> dict[str, Any]:
        sums = {"start": 0.0, "end": seconds, "seconds": seconds, "robots": 4, "episodes": successes + 1}
        return rates({**sums, "successes": successes, "interventions": 2, "busy_seconds": busy})

    runs = [
        {"mode": "batch", "rounds": [{"round": 1, "activity": act(600, 10, 480)}]},
        {"mode": "continuous", "rounds": [{"round": 1, "activity": act(600, 30, 2160)}]},
    ]
    for run in runs:
        run["overall"] = overall([r["activity"] for r in run["rounds"]])
    lines = report(runs).splitlines()
    assert len(lines) == 2 + 4  # header, rule, a round and "all" per mode
    assert "| batch " in lines[2] and "| 60 " in lines[2] and "| 20% " in lines[2]
    assert "| continuous " in lines[5] and "| 180 " in lines[5] and "| 90% " in lines[5]
