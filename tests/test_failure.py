"""The failure / takeover predictor (policies/failure.py, vla_rl/train/failure.py): labels by hand, rows
from a hand-built store (takeovers, failed endings, dashboard labels), a head that learns a separable toy,
a conformal threshold with its stated false-alarm rate on new synthetic episodes, the artefact's
round trip, and a fit from a store on a real (tiny) flow policy that the server-side lookup accepts."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tiny_base import tiny_sft
from vla_rl_client.meta import Controller, SegmentKind
from vla_rl_client.spec import RobotSpec

from fleet.db import MetadataDB
from fleet.store import EpisodeStore
from policies.failure import (
    FAILURE_DIR,
    FailureHeadConfig,
    FailurePredictor,
    find_predictor,
    head_inputs,
)
from vla_rl.cli import main
from vla_rl.train import failure

P, H = int(Controller.POLICY), int(Controller.HUMAN)
SPEC = RobotSpec(name="toy", state_dim=2, action_dim=1, control_hz=10.0, instruction="do it")


def test_labels_by_hand() -> None:
    # a takeover at 4 (back at 6), then success: frames 2, 3 are within 2 steps of the takeover
    ctrl = np.array([P, P, P, P, H, H, P, P, P, P])
    y, event = failure.failure_labels(ctrl, success=True, horizon_steps=2)
    assert y.tolist() == [-1, -1, 1, 1, -1, -1, 0, 0, 0, 0]
    assert event.tolist() == [4, 4, 4, 4, -1, -1, -1, -1, -1, -1]
    # the same episode failed: its last stretch is a failing one, whose event is the end (10)
    y, event = failure.failure_labels(ctrl, success=False, horizon_steps=3)
    assert y.tolist() == [-1, 1, 1, 1, -1, -1, -1, 1, 1, 1]
    assert event.tolist()[6:] == [10, 10, 10, 10]
    # a failure-inducing span ending the stretch at 7 (a dashboard label): 6, 7 fail, 8, 9 succeed
    y, event = failure.failure_labels(ctrl, success=True, horizon_steps=1, failure_at=[7])
    assert y.tolist() == [-1, -1, -1, 1, -1, -1, -1, 1, 0, 0]
    assert event.tolist()[6:8] == [8, 8]
    # a clean success: every frame negative
    y, _ = failure.failure_labels(np.full(5, P), success=True, horizon_steps=2)
    assert y.tolist() == [0] * 5


def test_split_and_forward_fill() -> None:
    ids = [f"ep{i}" for i in range(20)]
    train, cal = failure.split_episodes(ids, 0.25, seed=0)
    assert len(cal) == 5 and sorted(train + cal) == sorted(ids)
    assert failure.split_episodes(ids, 0.25, seed=0) == (train, cal)
    assert failure.split_episodes(ids, 0.25, seed=1) != (train, cal)
    with pytest.raises(ValueError, match="at least 2"):
        failure.split_episodes(["a"], 0.5, seed=0)
    got = failure.forward_fill(np.array([np.nan, 1.0, np.nan, np.nan, 3.0, np.nan]))
    np.testing.assert_array_equal(np.isnan(got), [True, False, False, False, False, False])
    assert got[1:].tolist() == [1.0, 1.0, 1.0, 3.0, 3.0]


class StatePolicy:
    """A stand-in flow policy whose ``features(prefix)`` is the raw state (the rows' maths, no model)."""

    device = torch.device("cpu")

    def encode_prefix(self, obs: dict[str, Any]) -> torch.Tensor:
        return obs["state"]

    def features(self, prefix: torch.Tensor) -> torch.Tensor:
        return prefix


def _record(
    store: EpisodeStore,
    ctrl: list[int],
    success: bool,
    level: float,
    uncertainty: list[float] | None = None,
) -> str:
    w = store.create_episode(SPEC, robot_id="arm-1", task="toy", chunk_len=2)
    for i, c in enumerate(ctrl):
        if i and c != ctrl[i - 1]:
            kind = SegmentKind.INTERVENTION if c == H else SegmentKind.AUTONOMOUS
            w.begin_segment(kind, Controller(c))
        w.add_frame(
            cameras={},
            state=np.array([level, i], np.float32),
            action=np.zeros(1, np.float32),
            reward=0.0,
            terminated=success and i == len(ctrl) - 1,
            truncated=not success and i == len(ctrl) - 1,
            controller=Controller(c),
            revision="r",
            uncertainty=None if uncertainty is None else uncertainty[i],
        )
    return w.close(outcome="success" if success else "failure", success=success).episode_id


def test_rows_from_a_hand_built_store_with_labels(tmp_path: Path, db_url: str) -> None:
    db = MetadataDB(db_url)
    store = EpisodeStore(tmp_path / "store", create=True, db=db)
    ctrl = [P, P, P, P, H, H, P, P, P, P]
    unc = [0.5, np.nan, 0.7, np.nan, np.nan, np.nan, 0.2, np.nan, np.nan, np.nan]
    eid = _record(store, ctrl, success=True, level=1.0, uncertainty=unc)
    ep = store.read_episode(eid)
    rows = failure.episode_rows(StatePolicy(), ep, {}, [], horizon_s=0.2)  # 10 Hz: 2 steps
    assert rows.frames.tolist() == [0, 1, 2, 3, 6, 7, 8, 9]  # autonomous frames only
    assert rows.y.tolist() == [-1, -1, 1, 1, 0, 0, 0, 0]
    assert rows.event.tolist() == [4, 4, 4, 4, -1, -1, -1, -1]
    np.testing.assert_allclose(rows.time_s, np.array([0, 1, 2, 3, 6, 7, 8, 9]) / 10.0)
    np.testing.assert_allclose(rows.uncertainty, [0.5, 0.5, 0.7, 0.7, 0.2, 0.2, 0.2, 0.2])
    assert rows.features[:, 1].tolist() == [0, 1, 2, 3, 6, 7, 8, 9] and not rows.clean_success
    x = rows.inputs(use_time=True)
    assert x.shape == (8, 4) and x[4].tolist() == pytest.approx([1.0, 6.0, 0.2, 0.6])
    # the dashboard's labels: an outcome override makes the last stretch a failing one (event 10), a
    # failure-inducing span [6, 8) ends the stretch 6..7 as a failure
    db.add_label(eid, "outcome", "failure", author="ana")
    labels = db.current_labels([eid])[eid]
    rows = failure.episode_rows(StatePolicy(), ep, labels, [], horizon_s=0.2)
    assert rows.y.tolist() == [-1, -1, 1, 1, -1, -1, 1, 1]
    assert rows.event.tolist()[4:] == [10, 10, 10, 10]
    db.add_label(eid, "outcome", "success", author="ana")
    db.add_label(eid, "segment", "failure-inducing", author="ana", start=6, end=8)
    labels, spans = db.current_labels([eid])[eid], db.current_spans([eid])[eid]
    rows = failure.episode_rows(StatePolicy(), ep, labels, spans, horizon_s=0.1, stride=2)
    assert rows.frames.tolist() == [0, 2, 6, 8]
    assert rows.y.tolist() == [-1, -1, -1, 0]  # 7 (the span's last frame) is positive but not a row
    clean = failure.episode_rows(
        StatePolicy(), store.read_episode(_record(store, [P] * 4, True, 0.0)), {}, [], horizon_s=1
    )
    assert clean.clean_success and clean.y.tolist() == [0] * 4 and np.isnan(clean.uncertainty).all()


def test_the_head_learns_a_separable_toy() -> None:
    torch.manual_seed(0)
    x = torch.randn(600, 5)
    y = (x[:, 0] + 0.5 * x[:, 3] > 0.3).numpy().astype(np.int8)
    y[:50] = -1  # excluded rows are ignored
    cfg = FailureHeadConfig(feature_dim=4, hidden=(32,))
    head, losses = failure.fit_head(x, y, cfg, steps=400, batch_size=128, lr=1e-2, seed=0)
    with torch.no_grad():
        p = torch.sigmoid(head(x)).numpy()
    keep = y >= 0
    assert ((p[keep] > 0.5) == (y[keep] == 1)).mean() > 0.95
    assert np.mean(losses[-20:]) < 0.5 * np.mean(losses[:20])
    with pytest.raises(ValueError, match="both failure windows and successful stretches"):
        failure.fit_head(x, np.zeros(600, np.int8), cfg, steps=1, batch_size=8, lr=1e-3)


def test_conformal_threshold_gives_the_stated_false_alarm_rate() -> None:
    """Peak scores of successful episodes, i.i.d.: the threshold from M = 99 calibration episodes at
    alpha = 0.1 alarms on about alpha of new successful episodes (on average over calibrations:
    E[FA] = 1 - r / (M + 1) = 0.1 exactly for continuous scores)."""
    rng = np.random.default_rng(0)
    rates = []
    for _ in range(200):
        cal = rng.beta(2, 5, size=99)
        h = failure.calibrate_threshold(list(cal), alpha=0.1)
        new = rng.beta(2, 5, size=500)
        rates.append(float((new > h).mean()))
    assert np.mean(rates) == pytest.approx(0.1, abs=0.01)
    assert np.quantile(rates, 0.9) < 0.16  # a single calibration rarely strays far
    with pytest.raises(ValueError, match="needs at least 19"):
        failure.calibrate_threshold([0.1] * 10, alpha=0.05)
    assert failure.first_alarm(np.array([0.1, np.nan, 0.6, 0.9]), 0.5) == 2
    assert failure.first_alarm(np.array([0.1, 0.2]), 0.5) is None


def test_the_artefact_round_trips(tmp_path: Path) -> None:
    cfg = FailureHeadConfig(feature_dim=3, hidden=(8, 4), horizon_s=1.5)
    head, _ = failure.fit_head(
        torch.randn(64, 4), np.arange(64) % 2, cfg, steps=5, batch_size=16, lr=1e-3, seed=1
    )
    pred = FailurePredictor(head, threshold=0.7, alpha=0.05, lineage={"policy_commit": "abc"})
    pred.save(tmp_path / "f")
    back = FailurePredictor.load(tmp_path / "f")
    feats, unc = np.random.default_rng(0).normal(size=(5, 3)), np.array([0.1, np.nan, 0.3, 0.4, 0.5])
    np.testing.assert_allclose(back.score(feats, unc), pred.score(feats, unc), atol=1e-6)
    assert back.threshold == 0.7 and back.config == cfg and back.lineage == {"policy_commit": "abc"}
    assert back.alarms(np.array([0.69, 0.71, np.nan])).tolist() == [False, True, False]
    assert sorted(p.name for p in (tmp_path / "f").iterdir()) == ["failure.json", "failure.safetensors"]
    with pytest.raises(ValueError, match="takes no time in episode"):
        pred.score(feats, unc, np.zeros(5))
    with pytest.raises(ValueError, match="threshold: expected a probability"):
        FailurePredictor(head, threshold=1.5, alpha=0.05)
    with pytest.raises(ValueError, match="horizon_s: expected a positive"):
        FailureHeadConfig(feature_dim=3, horizon_s=0.0)
    assert head_inputs(np.zeros((2, 3)), np.ones(2), np.full(2, 4.0)).tolist() == [[0, 0, 0, 1, 4]] * 2


def _fleet_store(root: Path, spec: RobotSpec, n: int = 40) -> EpisodeStore:
    """``n`` episodes of 12 frames in ``spec``: failing ones drift to state +1 (a takeover or a failed
    ending), successful ones stay near -1; each chunk's uncertainty recorded on every other frame."""
    rng = np.random.default_rng(0)
    store = EpisodeStore(root, create=True)
    for i in range(n):
        fail, takeover = i % 2 == 0, i % 4 == 0
        ctrl = [P] * 8 + [H] * 4 if takeover else [P] * 12
        w = store.create_episode(spec, robot_id="arm-1", task=spec.name, chunk_len=4)
        for t in range(12):
            if t == 8 and takeover:
                w.begin_segment(SegmentKind.INTERVENTION, Controller.HUMAN, reason="stall")
            level = (t / 11.0 if fail else -1.0) + 0.05 * rng.normal()
            w.add_frame(
                cameras={},
                state=np.full(spec.state_dim, level, np.float32),
                action=np.zeros(spec.action_dim, np.float32),
                reward=0.0,
                terminated=not fail and t == 11,
                truncated=fail and t == 11,
                controller=Controller(ctrl[t]),
                revision="r",
                uncertainty=float(rng.uniform(0.2, 0.4)) if t % 2 == 0 else None,
            )
        w.close(outcome="failure" if fail else "success", success=not fail)
    return store


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, EpisodeStore]:
    """The tiny Reach SFT base (2 steps: its features are what matter, not its actions) and a hand-built
    fleet store of 40 episodes in its spec."""
    from tiny_base import demo_store

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("failure")
    demos = demo_store(root / "demos", "kinematic/Reach-v0", episodes=2, noise=0.3)
    ckpt = tiny_sft("kinematic/Reach-v0", demos.root, root / "sft", steps=2, batch_size=8)
    spec = demos.read_metadata(demos.episode_ids()[0]).spec
    return Path(ckpt), _fleet_store(root / "fleet", spec)


def test_fit_from_a_store_writes_an_artefact_the_server_finds(
    fleet: tuple[Path, EpisodeStore], tmp_path: Path
) -> None:
    base, store = fleet
    ckpt = tmp_path / "ckpt"
    shutil.copytree(base, ckpt)
    cfg = failure.FailureFitConfig(
        base=str(ckpt), store=store.root, horizon_s=0.3, steps=300, lr=1e-2, alpha=0.2, calib_fraction=0.5
    )
    summary = failure.train_failure(cfg)
    assert summary["episodes"] == 40 and summary["train_episodes"] + summary["calibration_episodes"] == 40
    assert summary["calibration_successes"] >= 5 and summary["positive_rows"] > 0
    # the held-out check counts alarms at least lead_s = 1 s (20 frames) before the event: none in
    # 12-frame episodes
    assert summary["heldout_flagged"] == 0 and summary["heldout_failing_episodes"] > 0
    folder = ckpt / FAILURE_DIR
    meta = json.loads((folder / "failure.json").read_text())
    assert meta["lineage"]["policy_ref"] == str(ckpt) and meta["lineage"]["summary"]["rows"] > 0
    assert len(meta["lineage"]["policy_weights_sha256"]) == 64
    pred, note = find_predictor(ckpt, feature_dim=32)
    assert pred is not None and note == "" and pred.threshold == pytest.approx(summary["threshold"])
    assert find_predictor(ckpt, feature_dim=16)[1].endswith("the policy gives 16")
    # a lead of 0 s: the separable toy's failing held-out episodes are all flagged
    zero = failure.train_failure(
        failure.FailureFitConfig(**{**cfg.__dict__, "lead_s": 0.0, "out": tmp_path / "lead0"})
    )
    assert zero["heldout_flagged"] == zero["heldout_failing_episodes"] > 0
    # other weights: the lookup refuses it, naming why
    (ckpt / "model.safetensors").write_bytes(b"not the weights")
    pred, note = find_predictor(ckpt, feature_dim=32)
    assert pred is None and "other policy weights" in note


def test_the_cli_fits_and_says_what_is_wrong(
    fleet: tuple[Path, EpisodeStore], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base, store = fleet
    out = tmp_path / "pred"
    args = ["failure", "fit", "--base", str(base), "--store", str(store.root), "--out", str(out)]
    assert main([*args, "--steps", "20", "--alpha", "0.2", "--calib-fraction", "0.5"]) == 0
    assert "failure predictor on" in capsys.readouterr().out and (out / "failure.safetensors").is_file()
    assert main([*args, "--alpha", "0.05", "--steps", "5"]) == 2  # 12 held-out episodes: too few successes
    err = capsys.readouterr().err
    assert re.search(r"^error: calibration: \d+ held-out episodes succeeded without help", err)
    assert "needs at least 19" in err and "Traceback" not in err
