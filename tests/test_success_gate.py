"""The success / progress estimator learned from the store's outcomes (vla_rl/train/success.py), the promote
gate it gives a task with no simulator (vla_rl/gate_success.py) and AWR's estimator weights: the head
learns a separable toy problem and reads the chunk, labels follow credit and the dashboard's outcome
labels, a store without outcomes is refused naming what is missing, the weights are the documented
formula, and import -> round -> gate runs end to end on imported real data."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from imported_base import imported_base
from vla_rl_client.spec import RobotSpec

from fleet.store import EpisodeStore
from vla_rl.train.success import (
    OutcomeRows,
    SuccessFitConfig,
    buffer_weights,
    check_outcomes,
    estimator_weights,
    fit_success_estimator,
    outcome_rows,
)


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """The small fits run on one thread (a shared machine's cores are contended)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


SPEC = RobotSpec(name="toy-arm", state_dim=2, action_dim=2, control_hz=10.0, instruction="reach")
H = 2


def toy_rows(n: int, seed: int, *, labels_from_action: bool = True) -> OutcomeRows:
    """``n`` rows of 2-d observations: the recorded chunk repeats ``obs`` (y = 1) or ``-obs`` (y = 0)
    when ``labels_from_action``; otherwise the chunk is always ``obs`` and y = 1[obs_0 > 0]. Progress:
    ``(obs_0 + 1) / 2`` on successful rows."""
    rng = np.random.default_rng(seed)
    obs = rng.uniform(-1, 1, (n, 2)).astype(np.float32)
    if labels_from_action:
        y = (rng.random(n) < 0.5).astype(np.int8)
        sign = np.where(y == 1, 1.0, -1.0)[:, None]
    else:
        y = (obs[:, 0] > 0).astype(np.int8)
        sign = np.ones((n, 1))
    chunk = np.repeat((obs * sign)[:, None, :], H, 1).astype(np.float32)
    progress = np.where(y == 1, (obs[:, 0] + 1) / 2, np.nan).astype(np.float32)
    return OutcomeRows(
        obs, chunk, y, progress, np.arange(n), np.zeros(n, np.int64), [f"e{i}" for i in range(n)]
    )


def test_the_head_learns_a_separable_toy_problem() -> None:
    cfg = SuccessFitConfig(horizon=H, hidden=(32, 32), steps=300, negatives=0.0, camera_grid=0)
    est, summary = fit_success_estimator(toy_rows(800, 0), cfg)
    assert summary["success_rows"] + summary["failure_rows"] == 800 and summary["wrong_action_rows"] == 0
    test = toy_rows(400, 1)
    good = np.repeat(test.obs[:, None, :], H, 1)
    p_good, p_bad = est.success(test.obs, good), est.success(test.obs, -good)
    assert (p_good > 0.5).mean() > 0.95 and (p_bad < 0.5).mean() > 0.95
    phi = est.progress(test.obs)
    assert np.abs(phi - (test.obs[:, 0] + 1) / 2).mean() < 0.1  # progress learned too
    with pytest.raises(ValueError, match="chunk: expected"):
        est.success(test.obs, good[:, :1])  # a chunk shorter than the estimator reads


def test_wrong_action_rows_make_the_head_read_the_chunk() -> None:
    """Success here is read off the observation (the recorded chunk copies it); without wrong-action rows
    the head need not read the chunk, with them a chunk unlike the recorded one scores clearly lower."""
    rows, test = toy_rows(800, 0, labels_from_action=False), toy_rows(400, 1, labels_from_action=False)
    win = test.obs[:, 0] > 0.2
    other = np.repeat(np.stack([-test.obs[:, 1], test.obs[:, 0]], 1)[:, None, :], H, 1)
    drop = {}
    for negatives in (0.0, 1.0):
        cfg = SuccessFitConfig(horizon=H, hidden=(32, 32), steps=300, negatives=negatives, camera_grid=0)
        est, _ = fit_success_estimator(rows, cfg)
        drop[negatives] = float(
            (est.success(test.obs, test.chunk) - est.success(test.obs, other))[win].mean()
        )
    assert drop[1.0] > max(0.5, drop[0.0] + 0.15), drop


def toy_store(root: Path) -> EpisodeStore:
    """Four 6-frame episodes: ``ok`` (autonomous, success), ``bad`` (autonomous, failure), ``takeover``
    (a human takes over at frame 3, outcome unknown) and ``teleop`` (all human, success)."""
    store = EpisodeStore(root, create=True)
    rng = np.random.default_rng(0)
    for eid, controller, outcome in [
        ("ok", [0] * 6, "success"),
        ("bad", [0] * 6, "timeout"),
        ("takeover", [0, 0, 0, 1, 1, 1], "unknown"),
        ("teleop", [1] * 6, "success"),
    ]:
        w = store.create_episode(SPEC, robot_id="r", task="toy", instruction="reach", episode_id=eid)
        w.begin_segment("autonomous", "policy")
        w.add_frames(
            {
                "state": rng.standard_normal((6, 2)).astype(np.float32),
                "action": rng.uniform(-1, 1, (6, 2)).astype(np.float32),
                "reward": np.zeros(6, np.float32),
                "terminated": np.zeros(6, bool),
                "truncated": np.zeros(6, bool),
                "controller": np.asarray(controller, np.uint8),
                "timestamp": np.arange(6, dtype=np.float64),
            }
        )
        w.close(outcome=outcome, success={"success": True, "timeout": False}.get(outcome))
    return store


def fake_db(labels: dict[str, dict[str, Any]] | None = None) -> Any:
    return SimpleNamespace(
        current_labels=lambda ids: {e: (labels or {}).get(e, {}) for e in ids},
        current_spans=lambda ids: {e: [] for e in ids},
    )


def test_outcome_rows_follow_credit_and_the_dashboards_outcome_labels(tmp_path: Path) -> None:
    store = toy_store(tmp_path / "s")
    ids = ["ok", "bad", "takeover", "teleop"]
    rows = outcome_rows(store, ids, fake_db(), horizon=H, camera_grid=0)
    y = {e: rows.y[rows.episode == i].tolist() for i, e in enumerate(rows.episode_ids)}
    assert y["ok"] == [1] * 6 and y["bad"] == [0] * 6
    # unknown outcome: the stretch before the takeover failed, the human frames say nothing
    assert y["takeover"] == [0, 0, 0] and y["teleop"] == [1] * 6  # a successful demonstration
    assert rows.known == {"success": 2, "failure": 1, "unknown": 1}
    np.testing.assert_allclose(rows.progress[rows.episode == 0], np.arange(6) / 5)
    assert np.isnan(rows.progress[rows.episode == 1]).all()
    ep = store.read_episode("ok")
    np.testing.assert_array_equal(rows.chunk[5], np.stack([ep.action[5], ep.action[5]]))  # padded
    # a dashboard outcome label overrides the recorded one
    relabelled = outcome_rows(
        store, ["bad"], fake_db({"bad": {"outcome": "success"}}), horizon=H, camera_grid=0
    )
    assert relabelled.y.tolist() == [1] * 6


def test_a_store_without_outcomes_is_refused_naming_what_is_missing(tmp_path: Path) -> None:
    store = toy_store(tmp_path / "s")
    rows = outcome_rows(store, ["ok", "teleop"], fake_db(), horizon=H, camera_grid=0)
    with pytest.raises(ValueError, match="no failing ones") as e:
        check_outcomes(rows)
    for needed in ("outcome labels", "2 episodes known to succeed", "label key 'outcome'", "action_mse"):
        assert needed in str(e.value)


def test_estimator_weights_are_the_documented_formula_and_change_the_loss(tmp_path: Path) -> None:
    raw = np.array([0.1, 0.3, 0.0, 1.6])  # mean 0.5
    np.testing.assert_allclose(estimator_weights(raw, w_max=2.5), [0.2, 0.6, 0.0, 2.5], rtol=1e-6)
    np.testing.assert_allclose(estimator_weights(np.zeros(3), w_max=2.0), [1, 1, 1])
    # on a buffer: success = P(success | o_t, recorded chunk) / mean; progress = gain of phi over H frames
    from vla_rl.train.transitions import TransitionBuffer

    store = toy_store(tmp_path / "s")
    ids = ["ok", "bad", "takeover", "teleop"]
    cfg = SuccessFitConfig(horizon=H, hidden=(16,), steps=50, camera_grid=0)
    est, _ = fit_success_estimator(outcome_rows(store, ids, fake_db(), horizon=H, camera_grid=0), cfg)
    buf = TransitionBuffer.from_store(store, ids, cameras=False)
    b = buf.batch(np.arange(len(buf)), horizon=H, n_step=H)
    w, raw = buffer_weights(est, buf, "success", w_max=20.0)
    p = est.success(b["observation.state"].numpy(), b["action"].numpy())
    np.testing.assert_allclose(raw, p, rtol=1e-6)
    np.testing.assert_allclose(w, p / p.mean(), rtol=1e-5)
    _, gain = buffer_weights(est, buf, "progress", w_max=20.0)
    phi_t, phi_h = est.progress(b["observation.state"].numpy()), est.progress(b["next.state"].numpy())
    np.testing.assert_allclose(gain, np.maximum(phi_h - phi_t, 0), rtol=1e-6, atol=1e-9)
    # AWR's loss is mean_b w_b loss_b: the weights move it off the unweighted mean
    from vla_rl.train.contract import weighted_flow_loss

    per_sample = torch.tensor([1.0, 2.0, 3.0, 4.0])
    policy = SimpleNamespace(loss=lambda batch, noise, time: per_sample)
    wt = torch.from_numpy(estimator_weights(np.array([0.0, 0.0, 1.0, 1.0]), w_max=20.0))
    loss, m = weighted_flow_loss(policy, {}, weights=wt)  # type: ignore[arg-type]
    assert float(loss) == pytest.approx((2 * 3.0 + 2 * 4.0) / 4) and float(m["mse"]) == pytest.approx(2.5)


def test_awr_weighting_is_validated() -> None:
    from vla_rl.train.awr import AWRConfig

    with pytest.raises(ValueError, match="weighting: expected one of"):
        AWRConfig(base="b", store=Path("s"), out=Path("o"), weighting="value")
    with pytest.raises(ValueError, match="weighting: 'success' weights AWR's samples"):
        AWRConfig(base="b", store=Path("s"), out=Path("o"), weighting="success", variant="recap")


class RulePolicy:
    """Predicts ``chunk = sign * state`` repeated (a stand-in for a candidate checkpoint)."""

    spec = SPEC
    chunk_len = H
    policy = None

    def __init__(self, sign: float) -> None:
        self.sign = sign

    def predict_chunks(self, obs: dict[str, Any], seed: int) -> np.ndarray:
        s = np.asarray(obs["state"], np.float32) * self.sign
        return np.repeat(s[:, None, :], H, 1)


def rule_store(root: Path, episodes: int = 24) -> EpisodeStore:
    """Episodes whose recorded actions follow the state (``a = s``: success) or oppose it (``a = -s``:
    failure), alternating."""
    store = EpisodeStore(root, create=True)
    rng = np.random.default_rng(3)
    for k in range(episodes):
        state = rng.uniform(-1, 1, (8, 2)).astype(np.float32)
        ok = k % 2 == 0
        w = store.create_episode(SPEC, robot_id="r", task="toy", instruction="reach", episode_id=f"e{k:02d}")
        w.begin_segment("autonomous", "policy")
        w.add_frames(
            {
                "state": state,
                "action": state if ok else -state,
                "reward": np.zeros(8, np.float32),
                "terminated": np.zeros(8, bool),
                "truncated": np.zeros(8, bool),
                "controller": np.zeros(8, np.uint8),
                "timestamp": np.arange(8, dtype=np.float64),
            }
        )
        w.close(outcome="success" if ok else "timeout", success=ok)
    return store


def test_the_success_gate_promotes_the_policy_that_acts_like_the_successes(tmp_path: Path) -> None:
    from vla_rl.gate_success import bootstrap_ci, fit_round_estimator, success_gate

    store = rule_store(tmp_path / "s")
    ids = store.episode_ids()
    train, held = ids[:16], ids[16:]
    estimator = fit_round_estimator(RulePolicy(1.0), store, train, fake_db())  # type: ignore[arg-type]
    kw: dict[str, Any] = dict(
        estimator=estimator, store=store, held_out=held, db=fake_db(), seed=0, task="toy"
    )
    good, bad = RulePolicy(1.0), RulePolicy(-1.0)
    up = success_gate(bad, good, margin=0.1, alpha=0.05, **kw)
    assert up.metric == "estimated_success" and up.promote and up.candidate > 0.8 > 0.2 > up.base
    assert up.test is not None and up.test.wins == len(held) and up.test.losses == 0
    assert up.candidate_ci95[0] <= up.candidate <= up.candidate_ci95[1] and up.delta_ci95[0] > 0.1
    assert up.why.startswith("estimated success") and "action MSE" in up.why
    m = up.round_metrics()
    assert (
        m["action_mse"] == pytest.approx(up.candidate_eval.action_mse)
        and m["gate_metric"] == "estimated_success"
    )
    assert m["estimated_success"] == up.candidate and m["estimator"]["episodes"] == 16
    down = success_gate(good, bad, margin=0.0, alpha=0.05, **kw)
    assert not down.promote and down.candidate < down.base
    same = success_gate(good, good, margin=0.0, alpha=0.05, **kw)
    assert not same.promote and same.candidate == pytest.approx(same.base)  # a copy of the base: no promotion
    lo, hi = bootstrap_ci([0.0, 1.0] * 50, seed=0)
    assert lo < 0.5 < hi and hi - lo < 0.3


def test_round_options_offline_gate_is_validated() -> None:
    from vla_rl.rounds import RoundOptions

    assert RoundOptions(push=False).offline_gate == "auto"
    with pytest.raises(ValueError, match="offline_gate: expected one of"):
        RoundOptions(push=False, offline_gate="mse")


# ---------------------------------------------------------------------- import -> round -> gate
@pytest.fixture(scope="module")
def labelled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """An imported LeRobot dataset (task "koch", no simulator, outcomes unknown) and an SFT base on it."""
    return imported_base(tmp_path_factory.mktemp("koch-outcomes"))


def _label_outcomes(store: Path, outcomes: dict[int, str]) -> None:
    """Dashboard outcome labels on the store's episodes (by position)."""
    from fleet import store_index

    s = EpisodeStore(store)
    db = store_index.store_db(s)
    assert db is not None
    ids = s.episode_ids()
    for i, value in outcomes.items():
        db.add_label(ids[i], "outcome", value, author="operator")


def test_a_round_on_imported_data_gates_on_estimated_success_end_to_end(
    labelled: tuple[Path, Path], tmp_path: Path
) -> None:
    from vla_rl.hub.checkpoint import read_info
    from vla_rl.rounds import RoundConfig, RoundError, start_round
    from vla_rl.train.algorithms import make_config

    store, base = labelled
    train = make_config("sft", base=str(base), store=store, out=tmp_path / "r", steps=10, batch_size=16)
    train.progress = False
    # no outcome labels: an explicit success gate is refused naming what is missing; auto gates on MSE
    with pytest.raises(
        RoundError, match=r"outcome labels: .*\(0 episodes known to succeed, 0 to fail, 3 of unknown"
    ):
        start_round(RoundConfig(train=train, push=False, offline_gate="success"))
    auto = start_round(RoundConfig(train=train, push=False, gate_alpha=1.0))
    assert auto.metrics["gate"]["reason"].startswith("offline action MSE")
    assert "not on estimated success" in auto.metrics["gate"]["reason"]

    _label_outcomes(store, {0: "success", 1: "failure", 2: "success"})  # the held-out one (3) unlabelled
    rec = start_round(RoundConfig(train=train, push=False, margin=0.0, gate_alpha=1.0))  # auto
    m = rec.metrics
    ids = EpisodeStore(store).episode_ids()
    assert rec.status == "succeeded" and m["eval"] == "offline" and m["gate_metric"] == "estimated_success"
    assert m["eval_episode_ids"] == ids[-1:] and m["estimator"]["outcomes"] == {
        "success": 2,
        "failure": 1,
        "unknown": 0,
    }
    assert 0 <= m["estimated_success"] <= 1 and 0 <= m["base_estimated_success"] <= 1
    lo, hi = m["estimated_success_ci95"]
    assert lo <= m["estimated_success"] <= hi
    assert m["action_mse"] > 0 and m["base_action_mse"] > 0  # still reported
    assert m["gate"]["reason"].startswith("estimated success")
    assert m["gate"]["passed"] is (m["estimated_success"] - m["base_estimated_success"] > 0.0)
    info = read_info(rec.checkpoint_ref)
    assert info.metrics["offline_estimated_success"] == pytest.approx(m["estimated_success"])
    from vla_rl.cli.training import _round_line

    line = _round_line(rec)  # `round list` shows the gate's estimate beside the action MSE
    assert "estimated success" in line and "action MSE" in line
    from vla_rl.dashboard.rounds import round_summary

    shown = round_summary(rec)  # ... and so does the dashboard's rounds page
    assert shown["estimated_success"] == m["estimated_success"] and shown["action_mse"] == m["action_mse"]
    assert shown["estimated_success_ci95"] == [lo, hi]

    # and AWR weighs the (teleoperated) frames by the estimator: RA-BC on real data
    awr = make_config(
        "awr", base=str(base), store=store, out=tmp_path / "awr", steps=5, batch_size=16, weighting="success"
    )
    awr.progress = False
    rec = start_round(RoundConfig(train=awr, push=False, gate_alpha=1.0))
    assert rec.status == "succeeded" and rec.metrics["train"]["estimator_success_rows"] > 0
    assert rec.metrics["train"]["weight_mean"] == pytest.approx(1.0, abs=0.05)


def test_camera_inputs_pool_the_policys_cameras_only(tmp_path: Path) -> None:
    """The observation's camera summary is a fixed colour grid of the cameras asked for (a policy's own):
    a camera the policy does not read adds no input."""
    from vla_rl_client.spec import CameraSpec

    from vla_rl.train.success import camera_summary

    spec = RobotSpec(
        name="cam-arm",
        state_dim=2,
        action_dim=2,
        control_hz=10.0,
        instruction="reach",
        cameras=(CameraSpec("top", 8, 8), CameraSpec("wrist", 8, 8)),
    )
    store = EpisodeStore(tmp_path / "s", create=True)
    top = np.zeros((4, 8, 8, 3), np.uint8)
    top[:, :4, :4, 0] = 255  # the top-left quarter of the red channel lit
    w = store.create_episode(spec, robot_id="r", task="toy", instruction="reach", episode_id="c")
    w.begin_segment("autonomous", "policy")
    frames = {
        "state": np.ones((4, 2), np.float32),
        "action": np.zeros((4, 2), np.float32),
        "reward": np.zeros(4, np.float32),
        "terminated": np.zeros(4, bool),
        "truncated": np.zeros(4, bool),
        "controller": np.zeros(4, np.uint8),
        "timestamp": np.arange(4, dtype=np.float64),
        "cameras": {"top": top, "wrist": np.full((4, 8, 8, 3), 9, np.uint8)},
    }
    w.add_frames(frames)
    w.close(outcome="success", success=True)
    both = outcome_rows(store, ["c"], fake_db(), horizon=H, camera_grid=2)
    only_top = outcome_rows(store, ["c"], fake_db(), horizon=H, camera_grid=2, cameras=["top"])
    assert both.obs.shape == (4, 2 + 2 * 2 * 2 * 3) and only_top.obs.shape == (4, 2 + 2 * 2 * 3)
    np.testing.assert_allclose(only_top.obs[0, 2:], camera_summary({"top": top[:1]}, 2, 1)[0])
    assert only_top.obs[0, 2] == pytest.approx(1.0) and only_top.obs[0, 3:].max() == pytest.approx(0.0)
