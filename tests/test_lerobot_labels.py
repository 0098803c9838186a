"""`store export-lerobot` carries the current labels (meta/vla_rl_labels.parquet and the sidecar), and
an outcome label overrides next.success; read back with pyarrow and LeRobot. SQLite and PostgreSQL."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub.constants  # noqa: F401  (read HF_HUB_OFFLINE before the fixture sets it)
import numpy as np
import pytest
from vla_rl_client.meta import Controller, SegmentKind
from vla_rl_client.spec import RobotSpec

from fleet.db import MetadataDB
from fleet.lerobot import LABEL_COLUMNS, LABELS_PATH, SIDECAR_PATH, export_lerobot, read_exported_labels
from fleet.store import EpisodeStore

SPEC = RobotSpec(name="toy", state_dim=2, action_dim=1, control_hz=10.0, instruction="do it")


@pytest.fixture(autouse=True)
def offline_hf(tmp_path: Path) -> Iterator[None]:
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _record(store: EpisodeStore, success: bool) -> str:
    w = store.create_episode(SPEC, robot_id="arm-1", task="toy", chunk_len=2)
    for i in range(8):
        if i == 4:
            w.begin_segment(SegmentKind.INTERVENTION, Controller.HUMAN, reason="stall")
        w.add_frame(
            cameras={},
            state=np.full(2, i, np.float32),
            action=np.full(1, i / 10, np.float32),
            reward=0.0,
            terminated=success and i == 7,
            truncated=not success and i == 7,
            controller=Controller.HUMAN if i >= 4 else Controller.POLICY,
            revision="r",
        )
    return w.close(outcome="success" if success else "failure", success=success).episode_id


def test_export_carries_the_current_labels(tmp_path: Path, db_url: str) -> None:
    db = MetadataDB(db_url)
    store = EpisodeStore(tmp_path / "store", create=True, db=db)
    a, b, c = _record(store, True), _record(store, False), _record(store, True)
    db.add_label(a, "quality", "good", author="ana")
    gone = db.add_label(a, "quality", "bad", author="bob")
    db.undo_label(gone, author="bob")  # undone: a is good
    db.add_label(a, "segment", "idle", author="ana", start=1, end=3, note="waiting")
    db.add_label(b, "outcome", "success", author="ana")  # overrides the recorded failure
    db.add_label(c, "flagger", 0.5, author="auto-flags", source="auto")
    out = export_lerobot(store, tmp_path / "ds", "fleet/toy", use_videos=False)  # the store's own DB

    rows = read_exported_labels(out)
    assert set(rows[0]) == set(LABEL_COLUMNS)
    name = {a: "a", b: "b", c: "c"}
    got = sorted(
        (name[r["episode_id"]], r["key"], r["value"], r["start"], r["end"], r["author"], r["source"])
        for r in rows
    )
    assert got == [
        ("a", "quality", "good", None, None, "ana", "human"),
        ("a", "segment", "idle", 1, 3, "ana", "human"),
        ("b", "outcome", "success", None, None, "ana", "human"),
        ("c", "flagger", 0.5, None, None, "auto-flags", "auto"),
    ]
    assert all(r["created_at"] > 1.7e9 for r in rows)
    assert [r["note"] for r in rows if r["key"] == "segment"] == ["waiting"]
    sidecar = json.loads((out / SIDECAR_PATH).read_text())
    by = {e["episode_id"]: e for e in sidecar["episodes"]}
    assert all(r["episode_index"] == by[r["episode_id"]]["episode_index"] for r in rows)
    assert by[a]["labels"] == {"quality": "good"} and by[c]["labels"] == {"flagger": 0.5}
    assert (by[b]["outcome"], by[b]["success"]) == ("success", True)
    assert (by[b]["recorded_outcome"], by[b]["recorded_success"]) == ("failure", False)

    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    ds = LeRobotDataset("fleet/toy", root=out)
    success = np.array([bool(ds[i]["next.success"]) for i in range(len(ds))]).reshape(3, 8)
    assert success[:, -1].tolist() == [True, True, True]  # b counts as a success now (in any order)
    assert not success[:, :-1].any()

    # without a DB there are no labels to carry: no labels file
    bare = EpisodeStore(tmp_path / "store")
    out2 = export_lerobot(bare, tmp_path / "ds2", "fleet/toy", use_videos=False)
    assert not (out2 / LABELS_PATH).exists() and read_exported_labels(out2) == []
