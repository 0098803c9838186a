"""Labels as append-only events in the metadata DB (SQLite and PostgreSQL): episode and span labels,
bulk labelling in one transaction, undo, history vs current values, the outcome override; and the label
schema project file (fleet/labels.py, fleet/labels.toml)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from vla_rl_client.meta import Controller, EpisodeMeta, Segment, SegmentKind
from vla_rl_client.spec import RobotSpec

from fleet.db import Label, MetadataDB, effective_outcome
from fleet.labels import DEFAULT_SCHEMA_PATH, LabelSchema

SPEC = RobotSpec(name="toy-arm", state_dim=3, action_dim=2, control_hz=10.0, instruction="reach")


def _meta(eid: str, length: int = 20, closed: bool = True, created: float = 1000.0) -> EpisodeMeta:
    segs = (
        (
            Segment(0, SegmentKind.AUTONOMOUS, Controller.POLICY, 0, 8),
            Segment(1, SegmentKind.INTERVENTION, Controller.HUMAN, 8, length, "slip"),
        )
        if closed
        else ()
    )
    return EpisodeMeta(
        episode_id=eid,
        robot_id="arm-1",
        task="toy/Task-v0",
        instruction="reach",
        spec=SPEC,
        chunk_len=8,
        status="closed" if closed else "open",
        length=length if closed else 0,
        created=created,
        closed=created + 1 if closed else None,
        outcome="failure" if closed else None,
        success=False if closed else None,
        revisions=("rev-a",),
        segments=segs,
    )


@pytest.fixture
def db(db_url: str) -> MetadataDB:
    d = MetadataDB(db_url)
    d.record_episodes([_meta(f"ep-{i}") for i in range(3)] + [_meta("ep-open", closed=False)], "/store")
    return d


def test_episode_labels_history_and_current_value(db: MetadataDB) -> None:
    first = db.add_label("ep-0", "quality", "good", author="ana")
    second = db.add_label("ep-0", "quality", "bad", author="bob", note="gripper slipped")
    assert db.current_labels(["ep-0", "ep-1"]) == {"ep-0": {"quality": "bad"}, "ep-1": {}}
    undo = db.undo_label(second, author="ana")
    # the current value falls back to the latest event not undone; the history keeps all three
    assert db.current_labels(["ep-0"]) == {"ep-0": {"quality": "good"}}
    hist = db.labels("ep-0")
    assert [(lb.id, lb.value, lb.author, lb.undoes, lb.undone_by) for lb in hist] == [
        (first, "good", "ana", None, None),
        (second, "bad", "bob", None, undo),
        (undo, "bad", "ana", second, None),
    ]
    assert hist[1].note == "gripper slipped" and hist[0].source == "human"
    assert db.label(second) == hist[1]
    with pytest.raises(ValueError, match=f"label_id: label {second} was already undone"):
        db.undo_label(second, author="ana")
    with pytest.raises(ValueError, match="is an undo event"):
        db.undo_label(undo, author="ana")
    with pytest.raises(KeyError, match="no label 9999"):
        db.undo_label(9999, author="ana")
    db.undo_label(first, author="ana")
    assert db.current_labels(["ep-0"]) == {"ep-0": {}}
    assert len(db.labels("ep-0")) == 4  # append-only


def test_span_labels_and_their_validation(db: MetadataDB) -> None:
    idle = db.add_label("ep-1", "segment", "idle", author="ana", start=2, end=6)
    rec = db.add_label("ep-1", "segment", "recovery", author="ana", segment_index=1)  # the segment's frames
    auto = db.add_label("ep-1", "segment", "progress", author="flagger", start=0, end=2, source="auto")
    spans = db.current_spans(["ep-1"])["ep-1"]
    assert [(lb.id, lb.value, lb.start, lb.end, lb.source) for lb in spans] == [
        (auto, "progress", 0, 2, "auto"),
        (idle, "idle", 2, 6, "human"),
        (rec, "recovery", 8, 20, "human"),
    ]
    assert db.current_labels(["ep-1"]) == {"ep-1": {}}  # spans are not episode-level values
    db.undo_label(idle, author="bob")
    assert [lb.id for lb in db.current_spans(["ep-1"])["ep-1"]] == [auto, rec]
    before = len(db.labels())
    with pytest.raises(ValueError, match=r"end: expected <= 20 \(the length of episode 'ep-1'"):
        db.add_label("ep-1", "segment", "idle", author="ana", start=10, end=21)
    with pytest.raises(ValueError, match="start/end: expected both"):
        db.add_label("ep-1", "segment", "idle", author="ana", start=10)
    with pytest.raises(ValueError, match=r"end: expected a frame index > start \(5\)"):
        db.add_label("ep-1", "segment", "idle", author="ana", start=5, end=5)
    with pytest.raises(ValueError, match="start: expected a frame index >= 0"):
        db.add_label("ep-1", "segment", "idle", author="ana", start=-1, end=3)
    with pytest.raises(ValueError, match="'ep-open' is still recording"):
        db.add_label("ep-open", "segment", "idle", author="ana", start=0, end=1)
    with pytest.raises(ValueError, match="segment_index: episode 'ep-1' has no segment 7"):
        db.add_label("ep-1", "segment", "idle", author="ana", segment_index=7)
    with pytest.raises(ValueError, match="key: expected a non-empty label key"):
        db.add_label("ep-1", " ", "x", author="ana")
    with pytest.raises(ValueError, match="author: expected a non-empty name"):
        db.add_label("ep-1", "quality", "x", author="")
    with pytest.raises(ValueError, match=r"source: expected one of human\|auto, got 'robot'"):
        db.add_label("ep-1", "quality", "x", author="ana", source="robot")
    assert len(db.labels()) == before  # nothing written


def test_bulk_labels_are_one_transaction(db: MetadataDB) -> None:
    ids = db.add_labels(["ep-0", "ep-1", "ep-2", "ep-1"], "quality", "good", author="ana")
    assert len(ids) == 3 and len(set(ids)) == 3  # a repeated id is labelled once
    assert db.current_labels(["ep-0", "ep-1", "ep-2"]) == {
        e: {"quality": "good"} for e in ("ep-0", "ep-1", "ep-2")
    }
    before = db.labels()
    with pytest.raises(KeyError, match="no episode 'nope' in the metadata DB"):
        db.add_labels(["ep-0", "nope", "ep-2"], "quality", "bad", author="ana")
    # a span outside one of them: none of them is labelled
    with pytest.raises(ValueError, match="still recording"):
        db.add_labels(["ep-0", "ep-open"], "segment", "idle", author="ana", start=0, end=3)
    with pytest.raises(ValueError, match="episode_ids: expected at least one"):
        db.add_labels([], "quality", "bad", author="ana")
    assert db.labels() == before


def test_outcome_label_overrides_the_recorded_outcome(db: MetadataDB) -> None:
    rec = db.episode("ep-2")
    assert rec is not None and (rec.outcome, rec.success) == ("failure", False)
    lid = db.add_label("ep-2", "outcome", "success", author="ana")
    labels = db.current_labels(["ep-2"])["ep-2"]
    assert effective_outcome(rec.outcome, rec.success, labels) == ("success", True)
    db.undo_label(lid, author="ana")
    assert effective_outcome(rec.outcome, rec.success, db.current_labels(["ep-2"])["ep-2"]) == (
        "failure",
        False,
    )
    assert effective_outcome(None, None, {"outcome": "failure"}) == ("failure", False)


def test_label_to_dict_is_the_api_shape() -> None:
    lb = Label(1, "e", None, "segment", "idle", "ana", time.time(), start=0, end=3, note="n")
    d = lb.to_dict()
    assert {
        "id",
        "episode_id",
        "key",
        "value",
        "start",
        "end",
        "note",
        "author",
        "source",
        "created_at",
        "undoes",
    } <= set(d)
    assert lb.is_span and not lb.is_undo


# ---------------------------------------------------------------------------- the schema file
def test_the_default_schema_file() -> None:
    schema = LabelSchema.load()
    assert DEFAULT_SCHEMA_PATH.name == "labels.toml" and schema.source.endswith("fleet/labels.toml")
    assert [k.key for k in schema.episode][:2] == ["outcome", "failure"]
    assert schema.get("note") is not None and schema.get("note").free_text  # type: ignore[union-attr]
    (seg,) = schema.span
    assert seg.values == ("progress", "idle", "failure-inducing", "recovery")
    d = schema.to_dict()
    assert d["span"][0]["digits"] == {"1": "progress", "2": "idle", "3": "failure-inducing", "4": "recovery"}
    assert d["episode"][0] == {
        "key": "outcome",
        "values": ["success", "failure"],
        "free_text": False,
        "shortcut": "o",
        "description": schema.episode[0].description,
    }


def test_validate_names_the_field_and_the_allowed_values() -> None:
    schema = LabelSchema.default()
    schema.validate("outcome", "success")
    schema.validate("segment", "idle", (3, 9))
    schema.validate("note", "gripper slipped at the handle")
    with pytest.raises(
        ValueError, match=r"key: unknown episode label key 'colour'; expected one of outcome, failure"
    ):
        schema.validate("colour", "red")
    with pytest.raises(ValueError, match=r"value: expected one of success, failure for 'outcome', got 'meh'"):
        schema.validate("outcome", "meh")
    with pytest.raises(ValueError, match=r"start/end: 'segment' is a span label; expected a frame span"):
        schema.validate("segment", "idle")
    with pytest.raises(ValueError, match=r"start/end: 'outcome' is an episode label; expected no span"):
        schema.validate("outcome", "success", (0, 3))
    with pytest.raises(ValueError, match=r"start/end: expected frames 0 <= start < end"):
        schema.validate("segment", "idle", (5, 2))
    with pytest.raises(ValueError, match=r"value: expected non-empty text for 'note'"):
        schema.validate("note", "  ")
    with pytest.raises(
        ValueError, match=r"value: expected one of progress, idle, failure-inducing, recovery"
    ):
        schema.validate("segment", "napping", (0, 1))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[episode]]\nkey = 'a'\n", r"episode\[0\]: episode key 'a': values: expected a non-empty list"),
        ("[[episode]]\nkey = ''\nvalues = ['x']\n", r"episode\[0\]: key: expected a non-empty label key"),
        ("[[episode]]\nkey = 'a'\nvalues = ['x', 'x']\n", r"values: expected no duplicates"),
        (
            "[[episode]]\nkey = 'a'\nvalues = ['x']\nshortcut = '1'\n",
            r"shortcut: '1' is taken by the episode page",
        ),
        ("[[episode]]\nkey = 'a'\nvalues = ['x']\nshortcut = 'ab'\n", r"shortcut: expected one character"),
        (
            "[[episode]]\nkey = 'a'\nvalues = ['x']\nshortcut = 'q'\n[[episode]]\nkey = 'b'\nvalues = ['y']\n"
            "shortcut = 'q'\n",
            r"shortcut 'q' is already 'a'",
        ),
        ("[[episode]]\nkey = 'a'\nvalues = ['x']\n[[episode]]\nkey = 'a'\nvalues = ['y']\n", "listed twice"),
        ("[[episode]]\nkey = 'a'\nvalues = ['x']\ncolour = 1\n", r"unknown fields \['colour'\]"),
        ("[[tags]]\nkey = 'a'\n", r"unknown tables \['tags'\]"),
        ("[[episode]\n", "not valid TOML"),
    ],
)
def test_a_bad_schema_file_names_the_file_and_field(tmp_path: Path, text: str, message: str) -> None:
    p = tmp_path / "labels.toml"
    p.write_text(text)
    with pytest.raises(ValueError, match=message) as e:
        LabelSchema.load(p)
    assert str(p) in str(e.value)


def test_a_missing_schema_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"labels: cannot read the label schema .*nope\.toml"):
        LabelSchema.load(tmp_path / "nope.toml")


def test_concurrent_labellers_keep_one_current_value(db: MetadataDB) -> None:
    """Two labellers relabel the same episodes at once (bulk, in opposite orders) and undo some: every
    key ends with exactly one event in force, the latest not undone (row locks on PostgreSQL, BEGIN
    IMMEDIATE on SQLite)."""
    import threading

    from sqlalchemy import func, select
    from sqlalchemy.orm import Session

    from fleet.db import LabelRow

    ids = ["ep-0", "ep-1", "ep-2"]
    errors: list[BaseException] = []

    def work(name: str, order: list[str]) -> None:
        try:
            other = MetadataDB(db.url)
            for i in range(15):
                (first, *_rest) = other.add_labels(order, "quality", f"{name}-{i}", author=name)
                if i % 4 == 0:
                    other.undo_label(first, author=name)
            other.close()
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [
        threading.Thread(target=work, args=("ana", ids)),
        threading.Thread(target=work, args=("bob", ids[::-1])),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    with Session(db.engine) as s:
        per_ep = dict(
            list(
                s.execute(
                    select(LabelRow.episode_id, func.count())
                    .where(LabelRow.current.is_(True))
                    .group_by(LabelRow.episode_id)
                ).tuples()
            )
        )
    assert per_ep == {e: 1 for e in ids}
    current = db.current_labels(ids)
    for e in ids:
        live = [lb for lb in db.labels(e, key="quality") if not lb.is_undo and lb.undone_by is None]
        assert current[e] == {"quality": live[-1].value}  # the latest event not undone
