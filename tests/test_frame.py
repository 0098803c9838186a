"""Frame: one recorded time step, the same type for the robot client and the store's writer; its digest
equals that of the frame the store holds."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from vla_rl_client.frame import FRAME_FIELDS, Frame
from vla_rl_client.spec import CameraSpec, RobotSpec, SpecError

from fleet.store import EpisodeStore

SPEC = RobotSpec("arm", 5, 3, 30.0, "push", cameras=(CameraSpec("front", 8, 8),))


def _frame(rng: np.random.Generator, i: int, **over: object) -> Frame:
    fields = {
        "cameras": {"front": rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)},
        "state": rng.standard_normal(5).astype(np.float32),
        "action": rng.uniform(-1, 1, 3).astype(np.float32),
        "proposed_action": rng.uniform(-1, 1, 3).astype(np.float32) if i % 2 else None,
        "reward": float(i),
        "terminated": i == 5,
        "controller": i % 2,
        "revision": f"rev-{i % 3}",
        "timestamp": 100.0 + i,
        "uncertainty": 0.25 * i if i % 3 else None,
        "failure": 0.125 * i if i % 2 else None,
    }
    return Frame(**{**fields, **over})  # type: ignore[arg-type]


def test_a_stored_frame_reads_back_as_the_frame_added(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    store = EpisodeStore(tmp_path / "s", create=True)
    frames = [_frame(rng, i) for i in range(6)]
    with store.create_episode(SPEC, robot_id="arm-1", task="t", chunk_len=4) as w:
        for f in frames[:3]:
            w.add(f)
        for f in frames[3:]:  # the keyword form is the same frame
            w.add_frame(**f.fields())
        w.close("success")
    ep = store.read_episode(w.episode_id)
    for i, f in enumerate(frames):
        got = ep.frame(i)
        assert got.digest() == f.digest()
        assert (got.revision, got.controller, got.terminated) == (f.revision, f.controller, f.terminated)
        if f.uncertainty is None:
            assert got.uncertainty is not None and np.isnan(got.uncertainty)
        else:
            assert got.uncertainty == pytest.approx(f.uncertainty)
        if f.failure is None:
            assert got.failure is not None and np.isnan(got.failure)
        else:
            assert got.failure == pytest.approx(f.failure)
    assert set(frames[0].fields()) == FRAME_FIELDS == {f.name for f in dataclasses.fields(Frame)}


def test_digest_sees_every_hashed_field_and_needs_controller_and_time() -> None:
    rng = np.random.default_rng(1)
    f = _frame(rng, 1)
    assert f.digest() == dataclasses.replace(f).digest()
    changed = {
        "state": f.state + 1,
        "action": f.action * 0,
        "proposed_action": None,
        "reward": 9.0,
        "terminated": True,
        "truncated": True,
        "controller": 2,
        "timestamp": 1.0,
        "cameras": {"front": np.zeros((8, 8, 3), np.uint8)},
    }
    for name, value in changed.items():
        assert dataclasses.replace(f, **{name: value}).digest() != f.digest(), name
    # no proposal and an all-NaN proposal are the same stored frame
    nan = dataclasses.replace(f, proposed_action=np.full(3, np.nan, np.float32))
    assert nan.digest() == dataclasses.replace(f, proposed_action=None).digest()
    for name in ("controller", "timestamp"):
        with pytest.raises(ValueError, match=f"^{name}: "):
            dataclasses.replace(f, **{name: None}).digest()


def test_a_bad_frame_is_refused_naming_the_field(tmp_path: Path) -> None:
    store = EpisodeStore(tmp_path / "s", create=True)
    rng = np.random.default_rng(2)
    with store.create_episode(SPEC, robot_id="arm-1", task="t") as w:
        with pytest.raises(SpecError, match="action"):
            w.add(_frame(rng, 0, action=np.zeros(4, np.float32)))
        assert w.num_frames == 0
        w.close("success")
