"""Span labels and the outcome override change the transitions a trainer builds
(vla_rl/train/transitions.py), checked against hand-computed arrays; and selection filters on
current (not undone) labels. Store + metadata DB are real (SQLite and PostgreSQL)."""

from __future__ import annotations

import numpy as np
import pytest
from tolerances import RECOMPUTED_ATOL
from vla_rl_client.meta import Controller, SegmentKind
from vla_rl_client.spec import RobotSpec

from fleet.db import MetadataDB
from fleet.selection import Selection
from fleet.store import EpisodeStore
from vla_rl.train.transitions import (
    TransitionBuffer,
    credit_labels,
    load_transitions,
    select_episode_ids,
    span_effects,
)

P, H = int(Controller.POLICY), int(Controller.HUMAN)
SPEC = RobotSpec(name="toy", state_dim=2, action_dim=1, control_hz=10.0, instruction="do it")
CTRL = [P, P, P, P, H, H, P, P, P, P]  # a takeover at frame 4, back to the policy at 6; success at 9


def _record(store: EpisodeStore, success: bool = True) -> str:
    w = store.create_episode(SPEC, robot_id="arm-1", task="toy", chunk_len=2)
    for i, c in enumerate(CTRL):
        if i == 4:
            w.begin_segment(SegmentKind.INTERVENTION, Controller.HUMAN, reason="stall")
        if i == 6:
            w.begin_segment(SegmentKind.AUTONOMOUS, Controller.POLICY)
        w.add_frame(
            cameras={},
            state=np.full(2, i, np.float32),
            action=np.full(1, i, np.float32),
            reward=0.0,
            terminated=success and i == 9,
            truncated=not success and i == 9,
            controller=Controller(c),
            revision="r",
        )
    return w.close(outcome="success" if success else "failure", success=success).episode_id


def test_credit_labels_with_a_failure_inducing_span_by_hand() -> None:
    # no spans: the stretch before the takeover fails, the last one gets the outcome
    credit, cut = credit_labels(np.array(CTRL), success=True)
    assert credit.tolist() == [0, 0, 0, 0, -1, -1, 1, 1, 1, 1]
    assert np.flatnonzero(cut).tolist() == [3]
    # a failure-inducing span [6, 8): its last autonomous frame 7 ends the stretch 6..7 as a failure
    keep, failure_at, recovery = span_effects(10, np.array(CTRL), [("failure-inducing", 6, 8)])
    assert keep.all() and failure_at == [7] and not recovery.any()
    credit, cut = credit_labels(np.array(CTRL), success=True, failure_at=failure_at)
    assert credit.tolist() == [0, 0, 0, 0, -1, -1, 0, 0, 1, 1]
    assert np.flatnonzero(cut).tolist() == [3, 7]
    # a span over human frames only credits the autonomous stretch before it (frame 3, already cut)
    _, failure_at, _ = span_effects(10, np.array(CTRL), [("failure-inducing", 4, 6)])
    assert failure_at == [3]
    # idle frames are dropped unless a recovery span covers them; spans are clipped to the episode
    keep, _, recovery = span_effects(
        10, np.array(CTRL), [("idle", 0, 3), ("recovery", 0, 1), ("idle", 9, 40)]
    )
    assert np.flatnonzero(~keep).tolist() == [1, 2, 9] and np.flatnonzero(recovery).tolist() == [0]
    with pytest.raises(ValueError, match="span label segment: expected one of progress, idle"):
        span_effects(10, np.array(CTRL), [("napping", 0, 3)])


def test_span_labels_change_the_transitions_a_trainer_builds(tmp_path, db_url: str) -> None:
    db = MetadataDB(db_url)
    store = EpisodeStore(tmp_path / "store", create=True, db=db)
    eid = _record(store)
    plain = TransitionBuffer.from_store(store, [eid], reward="sparse", gamma=0.5, db=db)
    assert len(plain) == 10
    # by hand, γ = 0.5, sparse reward 1 at frame 9, returns cut (scored 0) at the takeover's frame 3
    assert plain.array("credit").tolist() == [0, 0, 0, 0, -1, -1, 1, 1, 1, 1]
    np.testing.assert_allclose(
        plain.array("mc_return"), [0, 0, 0, 0, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1], atol=RECOMPUTED_ATOL
    )

    db.add_label(eid, "segment", "idle", author="ana", start=0, end=3)
    db.add_label(eid, "segment", "recovery", author="ana", start=0, end=1)
    db.add_label(eid, "segment", "recovery", author="ana", start=4, end=6)
    db.add_label(eid, "segment", "failure-inducing", author="ana", start=6, end=8)
    db.add_label(eid, "segment", "progress", author="ana", start=8, end=10)  # changes nothing
    undone = db.add_label(eid, "segment", "idle", author="bob", start=8, end=10)
    db.undo_label(undone, author="bob")  # an undone span changes nothing either
    buf = TransitionBuffer.from_store(store, [eid], reward="sparse", gamma=0.5, db=db)
    # by hand: frames 1, 2 dropped (idle; 0 is kept by the recovery span); frame 0 is a recovery, so
    # positive (credit 1) although its stretch was taken over; 6..7 end as a failure at 7 (cut, return
    # 0), so the returns before it (human 4, 5) are 0 too; 8..9 keep the success
    assert buf.array("frame").tolist() == [0, 3, 4, 5, 6, 7, 8, 9]
    assert buf.array("credit").tolist() == [1, 0, -1, -1, 0, 0, 1, 1]
    assert buf.array("bc").tolist() == [True, False, True, True, False, False, False, False]
    np.testing.assert_allclose(buf.array("mc_return"), [0, 0, 0, 0, 0, 0, 1 / 2, 1], atol=RECOMPUTED_ATOL)
    # a window never crosses the dropped stretch: frame 0 is a run of its own (no next state, padded)
    b = buf.batch(np.array([0, 1, 7]), horizon=3, n_step=2)
    assert b["action"][0, :, 0].tolist() == [0, 0, 0] and b["action_is_pad"][0].tolist() == [
        False,
        True,
        True,
    ]
    assert (b["bootstrap"][0].item(), b["valid"][0].item()) == (0.0, 0.0)
    assert b["action"][1, :, 0].tolist() == [3, 4, 5] and b["next.state"][1, 0].item() == 5.0
    assert (b["bootstrap"][2].item(), b["valid"][2].item()) == (0.0, 1.0)  # past the terminal end
    assert b["bc"].tolist() == [True, False, False]
    assert buf.snapshot()["frames"] == 8 and buf.snapshot()["digest"] != plain.snapshot()["digest"]
    # without the DB the labels do not apply
    assert len(TransitionBuffer.from_store(store, [eid], reward="sparse", gamma=0.5)) == 10


def test_an_outcome_label_overrides_success_for_selection_and_credit(tmp_path, db_url: str) -> None:
    db = MetadataDB(db_url)
    store = EpisodeStore(tmp_path / "store", create=True, db=db)
    a, b = _record(store, success=True), _record(store, success=False)
    assert select_episode_ids(store, Selection.parse("success=true", task="toy"), db=db) == [a]
    db.add_label(a, "outcome", "failure", author="ana")
    lid = db.add_label(b, "outcome", "success", author="ana")
    assert select_episode_ids(store, Selection.parse("success=true", task="toy"), db=db) == [b]
    buf = load_transitions(store, Selection.parse("success=true", task="toy"), db=db, gamma=0.5)
    # b is now a success: its last stretch is credited 1 and earns the sparse reward at frame 9
    assert buf.array("credit").tolist() == [0, 0, 0, 0, -1, -1, 1, 1, 1, 1]
    assert float(buf.array("reward")[-1]) == 1.0
    # a relabelled failure: no reward, the last stretch credited 0
    buf_a = load_transitions(store, Selection.parse("success=false", task="toy"), db=db, gamma=0.5)
    assert buf_a.episode_ids == [a] and buf_a.array("credit").tolist()[-4:] == [0, 0, 0, 0]
    db.undo_label(lid, author="ana")  # b is a failure again: nothing is a success now
    with pytest.raises(ValueError, match="no closed episodes"):
        select_episode_ids(store, Selection.parse("success=true", task="toy"), db=db)


def test_label_selection_uses_the_current_value(tmp_path, db_url: str) -> None:
    db = MetadataDB(db_url)
    store = EpisodeStore(tmp_path / "store", create=True, db=db)
    a, b = _record(store), _record(store)
    db.add_label(a, "quality", "good", author="ana")
    db.add_label(b, "quality", "good", author="ana")
    db.add_label(b, "quality", "bad", author="bob")  # relabelled: b is no longer good
    sel = Selection.parse("label.quality=good", task="toy")
    assert select_episode_ids(store, sel, db=db) == [a]
    undo = db.add_label(a, "quality", "bad", author="bob")
    db.undo_label(undo, author="ana")  # undone: a is good again
    assert select_episode_ids(store, sel, db=db) == [a]
    db.add_label(a, "quality", "good", author="x", start=0, end=2)  # a span is not the episode's value
    assert select_episode_ids(store, Selection.parse("label.quality=bad", task="toy"), db=db) == [b]


def test_load_transitions_finds_the_stores_own_db(tmp_path) -> None:
    """The default DB (SQLite next to the store, by definition): its labels apply without --db."""
    root = tmp_path / "store"
    db = MetadataDB.for_store(root)
    store = EpisodeStore(root, create=True, db=db)
    eid = _record(store, success=True)
    db.add_label(eid, "segment", "idle", author="ana", start=0, end=3)
    buf = load_transitions(root, Selection.parse("", task="toy"), gamma=0.5)
    assert buf.array("frame").tolist() == [3, 4, 5, 6, 7, 8, 9]
