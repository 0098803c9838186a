"""bench/uncertainty.py's replay and statistics on hand-made episodes (no training, no simulator; ~1 s)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
from vla_rl_client.spec import CameraSpec, RobotSpec

from bench.uncertainty import (
    CAMERA_PRESETS,
    PRESETS,
    Episode,
    auroc,
    detector_stats,
    first_takeover,
    for_task,
    policy_obs,
    preset,
    rollout,
)
from sim.operator import OperatorRules

TASK = "kinematic/Reach-v0"


def _episode(seed: int, dense: list[float], scores: dict[int, float], success: bool) -> Episode:
    priv = {"tcp_pos": np.zeros(3), "goal_pos": np.full(3, 0.05), "gripper_closed": np.array(0.0)}
    return Episode(seed, 20, [priv] * len(dense), dense, scores, success, len(dense))


def test_replay_finds_each_rules_first_takeover_and_stats() -> None:
    flat = [0.5] * 12  # no progress after step 0: the stall rule (3 steps) fires at t = 3
    scores = {0: 1.0, 2: 1.0, 4: 3.0, 6: 3.0, 8: 3.0, 10: 1.0}  # z = 0, 0, 2, 2, 2 with mean 1, std 1
    failed = _episode(1, flat, scores, success=False)
    rising = [0.1 * t for t in range(6)]  # progress every step: never stalls
    ok = _episode(2, rising, {0: 1.0, 2: 1.0, 4: 1.0}, success=True)
    alarm = OperatorRules(stall_steps=0, drift_radius=0.0, uncertainty_mean=1.0, uncertainty_h=3.0)
    stall = OperatorRules(stall_steps=3, drift_radius=0.0)
    # CUSUM with k = 0.25: 0, 0, 1.75, 3.5 -> alarm on the chunk of step 6
    assert first_takeover(failed, TASK, alarm) == 6 and first_takeover(failed, TASK, stall) == 3
    assert first_takeover(ok, TASK, alarm) is None and first_takeover(ok, TASK, stall) is None
    d = detector_stats([failed, ok], [6, None])
    assert (d["flagged_failures"], d["failures"], d["false_alarms"], d["successes"]) == (1, 1, 0, 1)
    assert d["lead_steps_median"] == 12 - 6 and d["lead_fraction_mean"] == pytest.approx(0.5)
    assert auroc([2.0, 3.0], [1.0, 2.0]) == pytest.approx(0.875)


def test_a_task_table_is_read_for_the_observation_mode() -> None:
    state, camera = {"kinematic/Reach-v0": 1, "a": 2, "b": 3}, {"b": 30, "c": 40}
    assert [for_task(t, "state", state, camera) for t in ("a", "b", "c")] == [2, 3, 1]
    assert [for_task(t, "rgb", state, camera) for t in ("a", "b", "c", "d")] == [2, 30, 40, 1]
    assert preset("maniskill/PickCube-v1", "rgb") is CAMERA_PRESETS["maniskill/PickCube-v1"]
    assert preset("maniskill/PushCube-v1") is PRESETS["kinematic/Reach-v0"]


def _spec(*cameras: CameraSpec) -> RobotSpec:
    return RobotSpec("arm", state_dim=3, action_dim=2, control_hz=10, instruction="reach", cameras=cameras)


def test_a_policy_is_fed_each_camera_at_its_own_size_or_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rollout renders at the policy's camera size; a policy whose cameras differ in size (or are not
    square) is refused before any simulator starts: one render size would feed some camera wrongly."""
    import bench.uncertainty

    assert policy_obs(_spec()) == ("state", 128)
    assert policy_obs(_spec(CameraSpec("top", 32, 32), CameraSpec("wrist", 32, 32))) == ("rgb", 32)
    made: list[tuple[str, int]] = []
    monkeypatch.setattr(
        bench.uncertainty, "make_env", lambda task, obs, image_size: made.append((obs, image_size))
    )
    for cams, sizes in (
        ((CameraSpec("top", 32, 32), CameraSpec("wrist", 64, 64)), "top 32x32, wrist 64x64"),
        ((CameraSpec("top", 64, 64), CameraSpec("wrist", 32, 32)), "top 64x64, wrist 32x32"),
        ((CameraSpec("top", 32, 48),), "top 32x48"),
    ):
        version = argparse.Namespace(spec=_spec(*cams))
        with pytest.raises(ValueError, match=f"cameras: the simulator renders .* takes {sizes}$"):
            rollout(version, TASK, [0], group=1)  # type: ignore[arg-type]
    assert made == []


def test_a_camera_policy_is_rolled_out_from_its_camera_frames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--obs rgb``: the demos and the base see the camera, the rollout feeds the policy each decision's
    frames, and a decision's features are the served model's ``features`` of that very observation; a
    rerun with ``reuse`` that finds the demos but no base trains on them without recording again."""
    from tiny_base import TINY_POLICY

    from bench.uncertainty import base_checkpoint, rollout, work_dir
    from policies.loading import load_policy
    from server.slots import ServedVersion
    from sim.registry import make_env

    args = argparse.Namespace(
        obs="rgb",
        image_size=32,
        reuse=False,
        threads=1,
        demos=2,
        noise=0.5,
        sft_steps=3,
        sft=TINY_POLICY,
        work=tmp_path,
    )
    assert work_dir(args, TASK).name == "kinematic_Reach-v0_rgb32"
    assert work_dir(argparse.Namespace(work=tmp_path), TASK).name == "kinematic_Reach-v0"
    version = ServedVersion(load_policy(base_checkpoint(args, TASK, tmp_path), device="cpu"))
    assert version.spec.camera_names == ("top_camera",) and version.spec.cameras[0].height == 32
    (ep,) = rollout(version, TASK, [7], group=1, features=True)
    assert ep.length >= 1 and sorted(ep.chunk_features) == sorted(ep.chunk_scores)
    assert all(np.isfinite(s) for s in ep.chunk_scores.values())
    with make_env(TASK, obs="rgb", image_size=32) as env:
        obs, _ = env.reset(seed=7)
    cams = {k: v[None] for k, v in obs["cameras"].items()}
    want = version.model.features(obs["state"][None], cams, [version.spec.instruction])  # type: ignore[attr-defined]
    np.testing.assert_allclose(ep.chunk_features[0], want[0], atol=1e-5)
    blind = version.model.features(
        obs["state"][None], {k: np.zeros_like(v) for k, v in cams.items()}, [version.spec.instruction]
    )  # type: ignore[attr-defined]
    assert not np.allclose(blind[0], want[0], atol=1e-5)  # the frames, not a blank, reached the policy

    import bench.uncertainty

    (tmp_path / "checkpoint.txt").unlink()
    args.reuse = True
    monkeypatch.setattr(bench.uncertainty, "record_demos", lambda *a, **k: pytest.fail("recorded again"))
    assert base_checkpoint(args, TASK, tmp_path).exists()
