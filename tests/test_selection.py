"""One selection language (fleet/selection.py), evaluated in SQL (fleet/db/query.py) for a store
(fleet/store_index.py): it selects exactly what the Python scan of every episode selected before, on a
store with labels (undone ones, outcome overrides), rounds, revisions, outcomes, takeovers and time ranges,
on SQLite and PostgreSQL; a store without a DB is answered from a throwaway index; both spellings
(text and URL) read the same; a round selects once and its gate is typed; `vla-rl up`'s fleet summary
comes from the DB."""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
from test_transitions import SPEC
from test_transitions import _record as record
from vla_rl_client.meta import EpisodeMeta, SegmentKind

from fleet import store_index
from fleet.db import MetadataDB, effective_outcome
from fleet.selection import EpisodeQuery, Selection
from fleet.store import EpisodeStore

ROBOTS = ("arm-1", "arm-2", "sim-0")
REVS = ("rev-a", "rev-b", "rev-c")


def _record(store: EpisodeStore, rng: random.Random) -> str:
    """A closed 6-frame episode of a random robot, outcome and revision, taken over now and then."""
    human_at = rng.randrange(6) if rng.random() < 0.3 else None
    return record(store, rng.choice(ROBOTS), rng.random() < 0.5, rng.choice(REVS), human_at=human_at)


def _record_open(store: EpisodeStore) -> str:
    w = store.create_episode(SPEC, robot_id=ROBOTS[0], task="toy", chunk_len=4)
    w.add_frames({"state": np.zeros((3, 2), np.float32), "action": np.zeros((3, 1), np.float32)})
    w.flush()
    return w.episode_id


def old_scan(
    store: EpisodeStore, sel: Selection, db: MetadataDB | None, rounds: Mapping[int, Sequence[str]]
) -> list[str]:
    """The Python scan of every episode that selected training data before (its semantics verbatim:
    revisions and rounds together are one set of revisions; labels compared as ``str().lower()``)."""
    revisions = set(sel.revisions)
    for r in sel.rounds:
        revisions.update(rounds[r])
    metas = [store.read_metadata(e) for e in store.episode_ids()]
    metas = [
        m
        for m in metas
        if m.task == sel.task
        and m.is_closed
        and (not sel.robots or m.robot_id in sel.robots)
        and (sel.since is None or m.created >= sel.since)
        and (sel.until is None or m.created <= sel.until)
        and (not revisions or revisions.intersection(m.revisions))
        and m.episode_id not in sel.exclude
    ]
    current = db.current_labels([m.episode_id for m in metas]) if db is not None else {}
    if sel.success is not None:
        metas = [
            m
            for m in metas
            if bool(effective_outcome(m.outcome, m.success, current.get(m.episode_id, {}))[1]) == sel.success
        ]
    if sel.labels:
        metas = [
            m
            for m in metas
            if all(
                k in current[m.episode_id] and str(current[m.episode_id][k]).lower() == str(v).lower()
                for k, v in sel.labels.items()
            )
        ]
    metas.sort(key=lambda m: (m.created, m.episode_id))
    if sel.max_episodes is not None:
        metas = metas[-sel.max_episodes :]
    return [m.episode_id for m in metas]


def _texts(created: list[float], ids: list[str]) -> list[str]:
    """Single keys, and pairs of them (never revision with round: their meaning changed, see below)."""
    mid, late = created[len(created) // 3], created[2 * len(created) // 3]
    single = [
        "",
        "robot=arm-1",
        "robot=arm-2|sim-0",
        f"since={mid}",
        f"until={late}",
        f"since={mid},until={late}",
        "revision=rev-b",
        "revision=rev-a|rev-c",
        "round=1",
        "round=1|2",
        "success=true",
        "success=false",
        "label.quality=good",
        "label.quality=GOOD",
        "label.quality=bad",
        "label.quality=good,label.reviewed=true",
        "max=3",
        f"exclude={ids[0]}|{ids[3]}",
    ]

    def keys(text: str) -> set[str]:
        return {part.split("=")[0] for part in text.split(",")}

    pairs = [
        f"{a},{b}"
        for a, b in itertools.combinations(single[1:], 2)
        if not keys(a) & keys(b) and not {"revision", "round"} <= keys(a) | keys(b)
    ]
    return single + pairs


def test_sql_selects_what_the_python_scan_selected(tmp_path: Path, db_url: str) -> None:
    rng = random.Random(7)
    store = EpisodeStore(tmp_path / "store", create=True)  # written without a DB: the DB indexes it
    ids = [_record(store, rng) for _ in range(36)]
    _record_open(store)  # still recording: never selected
    db = MetadataDB(db_url)
    assert store_index.index_store(store, db) == set()
    assert sorted(db.episode_ids()) == sorted(ids)  # the closed ones
    for eid in rng.sample(ids, 20):
        db.add_label(eid, "quality", rng.choice(["good", "bad", "Good"]), author="ana")
    for eid in rng.sample(ids, 8):  # relabelled, then undone: the earlier value is current again
        db.undo_label(db.add_label(eid, "quality", "meh", author="bob"), author="bob")
    for eid in rng.sample(ids, 10):
        db.add_label(eid, "outcome", rng.choice(["success", "failure"]), author="ana")
    for eid in rng.sample(ids, 12):
        db.add_label(eid, "reviewed", True, author="ana")
    db.add_label(ids[1], "quality", "good", author="ana", start=0, end=1)  # a span: not the episode's
    for rev in ("rev-a", "rev-c", None):
        rid = db.create_round(algo="awr", task="toy", base_ref="x", config={})
        db.update_round(rid, checkpoint_revision=rev, status="succeeded" if rev else "failed")
    rounds = {1: ["rev-a"], 2: ["rev-c"]}
    created = sorted(store.read_metadata(e).created for e in ids)
    nonempty = 0
    for text in _texts(created, ids):
        sel = Selection.parse(text, task="toy")
        want = old_scan(store, sel, db, rounds)
        assert store_index.select_episode_ids(store, sel, db) == want, text
        nonempty += bool(want)
    assert nonempty > 100  # the filters select something most of the time
    # revision and round together: every key narrows (the scan took the union of their revisions)
    both = Selection.parse("revision=rev-b,round=1", task="toy")
    assert store_index.select_episode_ids(store, both, db) == []
    either = Selection.parse("revision=rev-a|rev-b,round=1", task="toy")
    assert store_index.select_episode_ids(store, either, db) == old_scan(
        store, Selection.parse("round=1", task="toy"), db, rounds
    )
    # a robot prefix, the list's keys in the same language
    prefix = store_index.select_episode_ids(store, Selection.parse("robot=arm-*", task="toy"), db)
    assert prefix == old_scan(store, Selection.parse("robot=arm-1|arm-2", task="toy"), db, rounds)
    human = {
        e for e in ids if any(g.kind == SegmentKind.INTERVENTION for g in store.read_metadata(e).segments)
    }
    taken = store_index.select_episode_ids(store, Selection.parse("intervention=true", task="toy"), db)
    assert set(taken) == human and taken
    # a round that produced no checkpoint selects nothing (the scan said it did not exist)
    assert store_index.select_episode_ids(store, Selection.parse("round=3", task="toy"), db) == []
    with pytest.raises(ValueError, match="round: no round 9 in the metadata DB"):
        store_index.select_episode_ids(store, Selection.parse("round=9", task="toy"), db)


def test_outcome_labels_of_any_value_override_as_effective_outcome_says(tmp_path: Path) -> None:
    """``success=`` follows :func:`effective_outcome` exactly: the label's value is compared as is
    ("SUCCESS" is not a success), and a JSON null label is no override."""
    db = MetadataDB.for_store(tmp_path / "store")
    store = EpisodeStore(tmp_path / "store", create=True, db=db)
    rng = random.Random(1)
    ids = [_record(store, rng) for _ in range(8)]
    for eid, value in zip(ids, ["SUCCESS", None, "success", "failure", True, "Success"], strict=False):
        db.add_label(eid, "outcome", value, author="ana")
    for text in ("success=true", "success=false"):
        sel = Selection.parse(text, task="toy")
        assert store_index.select_episode_ids(store, sel, db) == old_scan(store, sel, db, {}), text


def test_a_store_without_a_db_is_answered_from_a_throwaway_index(tmp_path: Path) -> None:
    rng = random.Random(3)
    store = EpisodeStore(tmp_path / "store", create=True)
    ids = [_record(store, rng) for _ in range(10)]
    created = sorted(store.read_metadata(e).created for e in ids)
    for text in ("", "robot=arm-1", "success=false", f"since={created[4]},max=2", "revision=rev-a|rev-b"):
        sel = Selection.parse(text, task="toy")
        assert store_index.select_episode_ids(store, sel) == old_scan(store, sel, None, {}), text
    for text, key in (
        ("label.quality=good", "label: selecting by label needs the metadata DB"),
        ("round=1", "round: selecting by round needs the metadata DB's rounds table"),
        ("flag=jerk", "flag: selecting by auto-flag needs the metadata DB"),
        ("flagged=false", "flagged: selecting by auto-flag needs the metadata DB"),
    ):
        with pytest.raises(ValueError, match=key):
            store_index.select_episode_ids(store, Selection.parse(text, task="toy"))
    assert not (store.root / "metadata.db").exists()  # nothing written into the store
    assert store_index.store_db(store) is None


def test_a_shared_db_selects_only_this_stores_episodes(tmp_path: Path, db_url: str) -> None:
    db = MetadataDB(db_url)
    rng = random.Random(5)
    one = EpisodeStore(tmp_path / "one", create=True, db=db)
    two = EpisodeStore(tmp_path / "two", create=True, db=db)
    mine = [_record(one, rng) for _ in range(4)]
    [_record(two, rng) for _ in range(5)]
    assert store_index.select_episode_ids(one, Selection(task="toy"), db) == mine
    assert store_index.select_episode_ids(one, Selection(task="toy", max_episodes=2), db) == mine[-2:]
    assert len(db.select_ids(Selection(task="toy"))) == 9  # the DB alone: every store's


def test_both_spellings_read_the_same() -> None:
    text = "robot=arm-1|arm-*,since=2026-11-01,revision=r1,round=3|4,success=false,label.quality=good,max=5"
    sel = Selection.parse(text, task="t")
    url = EpisodeQuery.from_params(
        {
            "task": "t",
            "robot": "arm-1|arm-*",
            "since": "2026-11-01",
            "revision": "r1",
            "round": "3|4",
            "success": "false",
            "label": "quality:good",
            "max": "5",
        }
    )
    assert url.filters() == sel and Selection.parse(sel.to_text(), task="t") == sel
    assert EpisodeQuery.from_params(url.to_params()) == url
    assert Selection.parse("label=quality:good", task="t") == Selection.parse("label.quality=good", task="t")
    for bad, message in (
        ("robot=a,robot=b", r"robot: expected one value, got 2 .*robot=a\|b"),
        ("task=u", "task: the selection names 'u', but it selects for 't'"),
        ("robot=a*b", r"robot: \* may only end a robot id"),
        ("max=0", "max: expected a positive integer"),
        ("status=done", "status: expected open or closed"),
        ("round=x", r"round: expected round numbers"),
        ("label.quality", "data selection: expected key=value"),
    ):
        with pytest.raises(ValueError, match=message):
            Selection.parse(bad, task="t")
    assert Selection.parse("", task="t").to_dict()["exclude"] == []  # JSON-ready


def test_a_round_selects_once_and_holds_out_the_newest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An offline round (no simulator for the task): one parse, one store open, one select; the newest
    fifth is held out of training (through ``exclude=``)."""
    import vla_rl.rounds as rounds
    from vla_rl.train.algorithms import make_config

    db = MetadataDB.for_store(tmp_path / "store")
    store = EpisodeStore(tmp_path / "store", create=True, db=db)
    rng = random.Random(2)
    ids = [_record(store, rng) for _ in range(10)]
    calls = {"parse": 0, "open": 0, "select": 0}
    real_parse, real_store, real_select = Selection.parse, rounds.EpisodeStore, rounds.select_episode_ids

    def counting(name: str, fn):  # type: ignore[no-untyped-def]
        def call(*a, **kw):  # type: ignore[no-untyped-def]
            calls[name] += 1
            return fn(*a, **kw)

        return call

    monkeypatch.setattr(rounds.Selection, "parse", counting("parse", real_parse))
    monkeypatch.setattr(rounds, "EpisodeStore", counting("open", real_store))
    monkeypatch.setattr(rounds, "select_episode_ids", counting("select", real_select))
    train = make_config(
        "sft",
        base=str(tmp_path / "base"),
        store=store.root,
        out=tmp_path / "out",
        data="robot=arm-1|arm-2|sim-0",
    )
    cfg = rounds.RoundConfig(train=train, push=False, eval_episodes=50)
    data = rounds.round_data(cfg, db, "toy")
    assert calls == {"parse": 1, "open": 1, "select": 1}
    assert data.episode_ids == ids and data.held_out == ids[-2:]  # min(50, 10 // 5)
    trains_on = Selection.parse(data.training_data(train.data), task="toy")
    assert trains_on.exclude == tuple(ids[-2:]) and trains_on.robots == ("arm-1", "arm-2", "sim-0")
    assert data.excludes_held_out


def test_the_gate_is_a_typed_result() -> None:
    from vla_rl.rounds import SimGate

    gate = SimGate(
        metric="success",
        candidate=0.6,
        base=0.4,
        margin=0.1,
        promote=True,
        why="success 60% vs base 40% (delta +20%, needs > +10%)",
        candidate_ci95=(0.4, 0.8),
        base_ci95=[0.2, 0.6],
        base_source="evaluated",
        eval_episodes=10,
        eval_seed=3,
    )
    m = gate.round_metrics()
    assert m["delta"] == pytest.approx(0.2) and m["success"] == 0.6 and m["base_success"] == 0.4
    assert m["ci95"] == [0.4, 0.8] and m["base_eval_source"] == "evaluated"
    assert gate.checkpoint_metrics() == {
        "success_rate": 0.6,
        "success_ci95": [0.4, 0.8],
        "eval_episodes": 10,
        "eval_seed": 3,
        "base_success_rate": 0.4,
    }


def test_up_summarises_the_fleet_from_the_db(tmp_path: Path) -> None:
    from vla_rl.up.report import fleet_summary

    db = MetadataDB.for_store(tmp_path / "store")
    store = EpisodeStore(tmp_path / "store", create=True, db=db)
    rng = random.Random(4)
    ids = [_record(store, rng) for _ in range(12)]
    metas: list[EpisodeMeta] = [store.read_metadata(e) for e in ids]
    since = sorted(m.created for m in metas)[3]
    fleet = [m for m in metas if m.robot_id.startswith("sim") and m.created >= since]
    assert fleet and len(fleet) < len(metas)
    got = fleet_summary(db, since, "sim")
    assert got["episodes"] == len(fleet) and got["frames"] == sum(m.length for m in fleet)
    human = [s for m in fleet for s in m.segments if s.kind == SegmentKind.INTERVENTION]
    assert got["success"] == pytest.approx(sum(bool(m.success) for m in fleet) / len(fleet))
    assert got["takeovers_per_episode"] == pytest.approx(len(human) / len(fleet))
