"""The metadata DB on SQLite and PostgreSQL: Alembic migrations (fresh, from the previous release, from a
pre-Alembic ``create_all``, concurrent first opens, one query at head), start-up errors naming the URL,
and concurrent writers / labeller / reader on one DB.

PostgreSQL is a real throwaway cluster (tests/pg_cluster.py, the session's ``pg`` fixture)."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from pg_cluster import PostgresCluster
from sqlalchemy import Engine, event, inspect, text
from vla_rl_client.meta import Controller, EpisodeMeta, Segment, SegmentKind
from vla_rl_client.spec import RobotSpec

from fleet.db import SCHEMA_HEAD, Base, Flag, MetadataDB, MetadataDBError, _alembic_config
from fleet.selection import EpisodeQuery

TASK = "toy/Task-v0"
SPEC = RobotSpec(name="toy-arm", state_dim=3, action_dim=2, control_hz=10.0, instruction="reach")
OLD_TABLES = ("episodes", "segments", "labels", "rounds")


def _engine(url: str) -> Engine:
    return MetadataDB.engine_for(url)


def _tables(url: str) -> set[str]:
    e = _engine(url)
    try:
        return set(inspect(e).get_table_names())
    finally:
        e.dispose()


def _version(url: str) -> list[str]:
    e = _engine(url)
    try:
        with e.connect() as c:
            return list(c.execute(text("SELECT version_num FROM alembic_version")).scalars())
    finally:
        e.dispose()


def _old_release_rows(url: str, stamp: bool) -> None:
    """The previous release's DB: baseline schema (0001, no round_jobs) with an episode, its segment, a
    label and a round. ``stamp=False``: written by ``create_all`` before Alembic (no alembic_version)."""
    e = _engine(url)
    try:
        with e.begin() as c:
            if stamp:
                command.upgrade(_alembic_config(c), "0001")
            else:
                Base.metadata.create_all(c, tables=[Base.metadata.tables[t] for t in OLD_TABLES])
            c.execute(
                text(
                    "INSERT INTO episodes (id, robot_id, task, instruction, store_path, status, outcome, success,"
                    " length, num_segments, created_at, closed_at, revisions) VALUES ('ep-old', 'r0', :t, 'do',"
                    " '/s', 'closed', 'success', :yes, 7, 1, 1.0, 2.0, '[\"abc\"]')"
                ),
                {"t": TASK, "yes": True},
            )
            c.execute(
                text(
                    'INSERT INTO segments (episode_id, "index", kind, controller, start, "end", reason)'
                    " VALUES ('ep-old', 0, 'autonomous', 'policy', 0, 7, NULL)"
                )
            )
            c.execute(
                text(
                    "INSERT INTO labels (episode_id, segment_index, key, value, author, created_at)"
                    " VALUES ('ep-old', NULL, 'quality', '\"good\"', 'alice', 3.0)"
                )
            )
            c.execute(
                text(
                    "INSERT INTO rounds (algo, task, base_ref, status, config, data, metrics, promoted,"
                    " created_at) VALUES ('awr', :t, 'hub://a/b@prod', 'succeeded', '{}', '{}',"
                    " '{\"success\": 0.5}', :no, 4.0)"
                ),
                {"t": TASK, "no": False},
            )
            c.execute(
                text(
                    "INSERT INTO rounds (algo, task, base_ref, status, config, data, metrics, promoted,"
                    " created_at) VALUES ('awr', :t, 'hub://a/b@prod', 'queued', '{}', '{}', '{}', :no, 5.0)"
                ),
                {"t": TASK, "no": False},
            )
    finally:
        e.dispose()


def _assert_old_rows_kept(db: MetadataDB, old_job: tuple[int, str | None] = (0, None)) -> None:
    (ep,) = db.episodes()
    assert (ep.id, ep.length, ep.success, ep.revisions) == ("ep-old", 7, True, ("abc",))
    assert [(s.kind, s.start, s.end) for s in ep.segments] == [(SegmentKind.AUTONOMOUS, 0, 7)]
    assert [(lb.key, lb.value, lb.author) for lb in db.labels()] == [("quality", "good", "alice")]
    # 0003: the old label is a human episode label in force; the revision list became join rows
    assert db.labels()[0].source == "human" and db.current_labels(["ep-old"]) == {
        "ep-old": {"quality": "good"}
    }
    assert [
        e.id for e in db.query_episodes(EpisodeQuery(revisions=("abc",), labels={"quality": "good"}))[0]
    ] == ["ep-old"]
    old, queued = db.rounds()
    assert (old.status, old.metrics, (old.attempts, old.worker)) == ("succeeded", {"success": 0.5}, old_job)
    # a round from before rounds were jobs has no job row; claiming it makes one
    got = db.claim_round("w1")
    assert got is not None and (got.id, got.attempts, got.worker) == (queued.id, 1, "w1")
    assert db.create_round(algo="awr", task=TASK, base_ref="x", config={}) == queued.id + 1


def _assert_schema_is_head(db: MetadataDB) -> None:
    assert _version(db.url) == [SCHEMA_HEAD]
    with db.engine.connect() as c:
        diff = compare_metadata(MigrationContext.configure(c, opts={"compare_type": True}), Base.metadata)
    assert diff == [], diff  # the migrations build exactly what the models say


# ---------------------------------------------------------------------------- migrations
def test_schema_head_is_the_newest_migration() -> None:
    from alembic.script import ScriptDirectory

    scripts = ScriptDirectory.from_config(_alembic_config())
    assert scripts.get_heads() == [SCHEMA_HEAD]  # one line of history, and db.py knows its end
    assert [s.revision for s in scripts.walk_revisions()][::-1][:5] == [
        "0001",
        "0002",
        "0003",
        "0004",
        "0005",
    ]  # baseline first


def test_a_fresh_db_is_migrated_to_head(db_url: str) -> None:
    db = MetadataDB(db_url)
    assert _tables(db_url) == {*Base.metadata.tables, "alembic_version"}
    _assert_schema_is_head(db)
    db.close()


def test_the_previous_releases_db_upgrades_in_place(db_url: str) -> None:
    _old_release_rows(db_url, stamp=True)
    assert _version(db_url) == ["0001"] and "round_jobs" not in _tables(db_url)
    db = MetadataDB(db_url)
    _assert_schema_is_head(db)
    _assert_old_rows_kept(db)


def test_a_0002_db_with_relabels_gets_current_values_and_revision_rows(db_url: str) -> None:
    """0003 derives each label's ``current`` from the event log and the revision rows from the JSON list."""
    e = _engine(db_url)
    with e.begin() as c:
        command.upgrade(_alembic_config(c), "0002")
        for eid, revs in (("ep-1", '["r1", "r2"]'), ("ep-2", '["r2"]')):
            c.execute(
                text(
                    "INSERT INTO episodes (id, robot_id, task, instruction, store_path, status, outcome, success,"
                    " length, num_segments, created_at, closed_at, revisions) VALUES (:id, 'r0', :t, 'do',"
                    " '/s', 'closed', 'failure', :no, 7, 0, 1.0, 2.0, :revs)"
                ),
                {"id": eid, "t": TASK, "no": False, "revs": revs},
            )
        for eid, key, value, seg in (
            ("ep-1", "quality", '"good"', None),
            ("ep-1", "quality", '"bad"', None),  # a relabel: the newer is current
            ("ep-1", "outcome", '"success"', None),
            ("ep-2", "quality", '"good"', 0),  # a segment label is not an episode-level value
        ):
            c.execute(
                text(
                    "INSERT INTO labels (episode_id, segment_index, key, value, author, created_at)"
                    " VALUES (:e, :seg, :k, :v, 'alice', 3.0)"
                ),
                {"e": eid, "seg": seg, "k": key, "v": value},
            )
    e.dispose()
    db = MetadataDB(db_url)
    _assert_schema_is_head(db)
    assert db.current_labels(["ep-1", "ep-2"]) == {
        "ep-1": {"quality": "bad", "outcome": "success"},
        "ep-2": {},
    }
    items, total = db.query_episodes(EpisodeQuery(revisions=("r2",), outcome="success"))
    assert (
        total == 1
        and items[0].id == "ep-1"
        and items[0].success is True
        and items[0].recorded_success is False
    )
    assert db.query_episodes(EpisodeQuery(revisions=("r1",)))[1] == 1
    assert [r.revision for r in db.revision_stats()] == ["r1", "r2"]


def test_a_0003_db_with_flags_gains_an_empty_calibration_basis(db_url: str) -> None:
    """0004 adds the calibration basis columns to ``episode_flags``; the rows already there keep theirs
    NULL, so their high_uncertainty result counts as out of date (recomputed once) and the rest stand."""
    from fleet.flags import calibration_basis, needs_recalibration

    e = _engine(db_url)
    with e.begin() as c:
        command.upgrade(_alembic_config(c), "0003")
        c.execute(
            text(
                "INSERT INTO episodes (id, robot_id, task, instruction, store_path, status, outcome, success,"
                " length, num_segments, created_at, closed_at, revisions) VALUES ('ep-1', 'r0', :t, 'do',"
                " '/s', 'closed', 'success', :yes, 7, 1, 1.0, 2.0, '[\"v1\"]')"
            ),
            {"t": TASK, "yes": True},
        )
        for name, score, raised, detail in (
            ("stillness", 0.5, False, "no motion for 0.5 s (frames 1-5)"),
            (
                "high_uncertainty",
                1.25,
                False,
                "peak CUSUM 1.25 ...; calibrated on 9 successful episodes of v1",
            ),
        ):
            c.execute(
                text(
                    "INSERT INTO episode_flags (episode_id, name, score, raised, detail, computed_at)"
                    " VALUES ('ep-1', :n, :s, :r, :d, 10.0)"
                ),
                {"n": name, "s": score, "r": raised, "d": detail},
            )
    e.dispose()
    db = MetadataDB(db_url)
    _assert_schema_is_head(db)
    old = db.flags(["ep-1"], raised_only=False)["ep-1"]
    assert sorted(old) == ["high_uncertainty", "stillness"]
    hu, still = old["high_uncertainty"], old["stillness"]
    assert (hu.score, hu.raised, hu.computed_at) == (pytest.approx(1.25), False, pytest.approx(10.0))
    assert (hu.calibrated, hu.calibration_revision, hu.calibration_n) == (None, None, None)
    assert calibration_basis(hu) == ("", -1, False) and needs_recalibration(hu, db.calibration_counts())
    assert still.detail.startswith("no motion") and calibration_basis(still) is None
    # a new result stores its basis and reads it back
    new = Flag(hu.name, 2.0, "reworded for people", True, 20.0, True, "v1", 9)
    db.set_flags({"ep-1": [new]})
    got = db.flags(["ep-1"])["ep-1"]["high_uncertainty"]
    assert calibration_basis(got) == ("v1", 9, True)
    assert not needs_recalibration(got, {"v1": (17, 30.0)}) and needs_recalibration(got, {"v1": (18, 30.0)})
    db.close()


@pytest.mark.parametrize("written_by", ["previous release", "current release"])
def test_a_db_created_before_alembic_is_stamped_by_its_tables(db_url: str, written_by: str) -> None:
    _old_release_rows(db_url, stamp=False)
    if written_by == "current release":  # create_all of today's models: round_jobs too, with a row
        e = _engine(db_url)
        with e.begin() as c:
            Base.metadata.create_all(c)
            c.execute(
                text(
                    "INSERT INTO round_jobs (round_id, worker, attempts, cancel_requested, progress)"
                    " VALUES (1, 'w0', 1, :no, '{}')"
                ),
                {"no": False},
            )
        e.dispose()
    assert "alembic_version" not in _tables(db_url)
    db = MetadataDB(db_url)
    _assert_schema_is_head(db)
    # stamped, not rebuilt: the round_jobs row is still there
    _assert_old_rows_kept(db, old_job=(1, "w0") if written_by == "current release" else (0, None))


def test_a_db_at_head_opens_with_one_query(db_url: str) -> None:
    MetadataDB(db_url).close()
    statements: list[str] = []

    def count(_conn: Any, _cur: Any, statement: str, *_a: Any) -> None:
        if not statement.upper().startswith(("BEGIN", "PRAGMA")):
            statements.append(statement)

    event.listen(Engine, "before_cursor_execute", count)
    try:
        t0 = time.perf_counter()
        db = MetadataDB(db_url)
        took = time.perf_counter() - t0
    finally:
        event.remove(Engine, "before_cursor_execute", count)
    assert statements == ["SELECT version_num FROM alembic_version"], statements
    assert took < 2.0
    db.close()


def _open(url: str, out: Any) -> None:
    try:
        db = MetadataDB(url)
        db.create_round(algo="awr", task=TASK, base_ref="x", config={})
        out.put("ok")
    except Exception as e:
        out.put(repr(e))


def test_concurrent_first_opens_migrate_once(db_url: str) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_open, args=(db_url, out)) for _ in range(4)]
    for p in procs:
        p.start()
    got = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    assert got == ["ok"] * 4, got
    db = MetadataDB(db_url)
    _assert_schema_is_head(db)
    assert len(db.rounds()) == 4


def test_a_newer_schema_is_refused(db_url: str) -> None:
    MetadataDB(db_url).close()
    e = _engine(db_url)
    with e.begin() as c:
        c.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    e.dispose()
    with pytest.raises(MetadataDBError, match=r"revision \['9999'\], newer than this vla-rl knows"):
        MetadataDB(db_url)


# ---------------------------------------------------------------------------- start-up errors
def test_an_unreachable_postgresql_url_fails_at_start_naming_the_setting(pg: PostgresCluster) -> None:
    # nothing listens there
    with pytest.raises(MetadataDBError) as e:
        MetadataDB(pg.url(port=1))
    msg = str(e.value)
    assert "cannot open the metadata DB postgresql://vla_rl@127.0.0.1:1/postgres" in msg, msg
    assert "--db-url" in msg and "check host and port" in msg
    # a database that does not exist
    with pytest.raises(MetadataDBError, match=r'database "nope" does not exist.*createdb NAME'):
        MetadataDB(pg.url("nope"))
    # a wrong password: named, never shown
    pg.sql("CREATE ROLE fleet_user LOGIN PASSWORD 'right-secret'")
    pg.sql("CREATE DATABASE fleet OWNER fleet_user")
    url = pg.url("fleet").replace("vla_rl@", "fleet_user:wrong-secret@")
    with pytest.raises(MetadataDBError, match="password authentication failed") as e:
        MetadataDB(url)
    assert "wrong-secret" not in str(e.value) and "fleet_user:***@" in str(e.value)
    ok = MetadataDB(url.replace("wrong-secret", "right-secret"))  # the right one works
    assert "right-secret" not in repr(ok)


def test_a_bad_sqlite_path_or_url_fails_at_start_naming_the_setting(tmp_path: Any) -> None:
    with pytest.raises(MetadataDBError, match=r"cannot open the metadata DB sqlite:///.*--db-url"):
        MetadataDB(f"sqlite:///{tmp_path / 'missing-dir' / 'metadata.db'}")
    with pytest.raises(
        MetadataDBError, match=r"'nosuchdb://u:\*\*\*@h/d' is not a usable database URL.*--db-url"
    ):
        MetadataDB("nosuchdb://u:secret@h/d")
    with pytest.raises(MetadataDBError, match="is not a usable database URL"):
        MetadataDB("not a url")


def test_missing_postgresql_binaries_fail_pointing_at_setup(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    import pg_cluster

    monkeypatch.setattr(pg_cluster, "PG_ROOT", tmp_path / "no-postgresql")
    with pytest.raises(RuntimeError, match=r"not found under .*run scripts/setup\.sh"):
        pg_cluster.pg_bin_dir()


# ---------------------------------------------------------------------------- concurrency
N_EPISODES = 40


def _meta(eid: str, robot: str, closed: bool) -> EpisodeMeta:
    segs = (
        (
            Segment(0, SegmentKind.AUTONOMOUS, Controller.POLICY, 0, 5),
            Segment(1, SegmentKind.INTERVENTION, Controller.HUMAN, 5, 9, "slip"),
        )
        if closed
        else ()
    )
    return EpisodeMeta(
        episode_id=eid,
        robot_id=robot,
        task=TASK,
        instruction="reach",
        spec=SPEC,
        chunk_len=8,
        status="closed" if closed else "open",
        length=9 if closed else 0,
        created=time.time(),
        closed=time.time() if closed else None,
        outcome="success" if closed else None,
        success=True if closed else None,
        revisions=("rev-a",),
        segments=segs,
    )


def _recorder(url: str, robot: str, go: Any, read_once: Any, out: Any) -> None:
    db = MetadataDB(url)
    go.wait(120)
    for i in range(N_EPISODES):
        if i == N_EPISODES // 2:  # half written: hold until the reader has taken a snapshot, so it
            read_once.wait(120)  # reads mid-write however the scheduler orders the processes
        eid = f"{robot}-{i:03d}"
        db.record_episode_open(_meta(eid, robot, closed=False), "/store")
        db.record_episode_closed(_meta(eid, robot, closed=True))
    out.put(("recorder", robot))


def _labeller(url: str, want: int, go: Any, out: Any) -> None:
    db = MetadataDB(url)
    go.wait(120)
    done: set[str] = set()
    deadline = time.monotonic() + 120
    while len(done) < want and time.monotonic() < deadline:
        for ep in db.episodes():
            if ep.id not in done:
                db.add_label(ep.id, "quality", "good", author="labeller")
                done.add(ep.id)
    out.put(("labeller", len(done)))


def _reader(url: str, want: int, go: Any, read_once: Any, out: Any) -> None:
    """What a round snapshots: the closed episodes (with all their segments) and their labels. Every
    snapshot must be whole: no closed episode missing segments, no duplicate, nothing lost later."""
    db = MetadataDB(url)
    go.wait(120)
    seen: set[str] = set()
    problems: list[str] = []
    snaps = 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        eps = db.episodes(task=TASK, status="closed")
        ids = [e.id for e in eps]
        if len(ids) != len(set(ids)):
            problems.append(f"duplicate episodes in a snapshot: {ids}")
        for e in eps:
            if len(e.segments) != 2 or e.length != 9:
                problems.append(f"{e.id}: closed with {len(e.segments)} segments, length {e.length}")
        if not seen <= set(ids):
            problems.append(f"episodes vanished: {sorted(seen - set(ids))}")
        seen |= set(ids)
        labels = db.labels(key="quality")
        if len({lb.episode_id for lb in labels}) != len(labels):
            problems.append("an episode labelled twice")
        db.round_revisions()
        snaps += 1
        read_once.set()
        if len(ids) == want and len(labels) == want:
            break
    out.put(("reader", snaps, problems[:5]))


def test_two_recorders_a_labeller_and_a_reader_at_once(db_url: str) -> None:
    MetadataDB(db_url).close()
    want = 2 * N_EPISODES
    ctx = mp.get_context("spawn")
    out, go, read_once = ctx.Queue(), ctx.Barrier(4), ctx.Event()  # all four start together
    procs = [
        ctx.Process(target=_recorder, args=(db_url, "arm-a", go, read_once, out)),
        ctx.Process(target=_recorder, args=(db_url, "arm-b", go, read_once, out)),
        ctx.Process(target=_labeller, args=(db_url, want, go, out)),
        ctx.Process(target=_reader, args=(db_url, want, go, read_once, out)),
    ]
    for p in procs:
        p.start()
    got = [out.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    by = {g[0]: g for g in got}
    assert by["labeller"] == ("labeller", want)
    _, snaps, problems = by["reader"]
    assert problems == [] and snaps > 1, (snaps, problems)  # it read mid-write, then again
    db = MetadataDB(db_url)
    eps = db.episodes()
    assert sorted(e.id for e in eps) == sorted(f"arm-{r}-{i:03d}" for r in "ab" for i in range(N_EPISODES))
    assert all(e.status == "closed" and [s.index for s in e.segments] == [0, 1] for e in eps)
    labels = db.labels()
    assert sorted(lb.episode_id for lb in labels) == sorted(e.id for e in eps)  # each exactly once


def test_a_postgresql_read_is_one_snapshot(pg: PostgresCluster) -> None:
    """``episodes()`` reads episodes, then their segments (two statements): an episode closed between the
    two must not come back half open, half closed (READ COMMITTED would give "open" with segments)."""
    url = pg.create_database()
    reader, writer = MetadataDB(url), MetadataDB(url)
    writer.record_episode_open(_meta("ep", "arm", closed=False), "/store")
    fired: list[str] = []

    def close_between(_conn: Any, _cur: Any, statement: str, *_a: Any) -> None:
        if "FROM segments" in statement and not fired:
            fired.append(statement)
            writer.record_episode_closed(_meta("ep", "arm", closed=True))  # commits mid-read

    event.listen(reader.engine, "before_cursor_execute", close_between)
    try:
        (ep,) = reader.episodes()
    finally:
        event.remove(reader.engine, "before_cursor_execute", close_between)
    assert fired, "the read took one statement: nothing to test"
    assert (ep.status, ep.segments) == ("open", ())  # the state before the close, whole
    (ep,) = reader.episodes()
    assert ep.status == "closed" and len(ep.segments) == 2
