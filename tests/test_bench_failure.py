"""bench/failure.py's rows, fit, threshold and early-flag statistics on hand-made episodes (no training of
a policy, no simulator; a few seconds)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.failure import (
    CALIB_SEED,
    EVAL_SEED,
    TRAIN_SEED,
    early_stats,
    episode_from_json,
    episode_json,
    fit_predictor,
    predictor_first_alarm,
    rollout_sets,
    training_rows,
)
from bench.uncertainty import Episode

HZ = 10.0


def _episode(seed: int, success: bool, length: int = 20, rng: np.random.Generator | None = None) -> Episode:
    """Decisions every 2 steps; a failing episode's feature 0 climbs towards its end, a successful
    one's stays at 0 (plus noise)."""
    rng = rng or np.random.default_rng(seed)
    steps = range(0, length, 2)
    level = (lambda t: t / length) if not success else (lambda t: 0.0)
    feats = {t: np.array([level(t) + 0.02 * rng.normal(), rng.normal()], np.float32) for t in steps}
    ep = Episode(seed, length, [], [], {t: 0.5 for t in steps}, success, length)
    ep.chunk_features = feats
    return ep


def test_rows_label_the_window_before_a_failed_ending() -> None:
    x, y = training_rows([_episode(0, False), _episode(1, True)], horizon_steps=5, hz=HZ, use_time=True)
    assert x.shape == (20, 4) and x[:10, 3].tolist() == pytest.approx([t / HZ for t in range(0, 20, 2)])
    # failing: decisions at 16, 18 are within 5 steps of the end (20); 0..14 are left out; success: all 0
    assert y.tolist() == [-1] * 8 + [1, 1] + [0] * 10


def test_early_stats_count_the_lead_and_false_alarms() -> None:
    eps = [_episode(0, False), _episode(1, False), _episode(2, True), _episode(3, True)]
    d = early_stats(eps, [4, 15, None, 6], lead_steps=10, hz=HZ)
    assert (d["flagged_early"], d["failures"], d["flagged_any"]) == (1, 2, 2)
    assert (d["false_alarms"], d["successes"]) == (1, 2) and d["lead_s_median"] == pytest.approx(1.05)
    lo, hi = d["flag_early_ci95"]
    assert lo < 0.5 < hi


def test_the_fitted_predictor_flags_the_separable_failures_within_alpha() -> None:
    rng = np.random.default_rng(0)
    train = [_episode(i, i % 2 == 0, rng=rng) for i in range(40)]
    calib = [_episode(100 + i, i % 2 == 0, rng=rng) for i in range(40)]
    args = argparse.Namespace(horizon_s=1.0, hidden=[16], steps=300, lr=1e-2, alpha=0.1)
    head, h, losses = fit_predictor(args, train, calib, HZ, use_time=False, dim=2)
    assert 0 < h < 1 and losses[-1] < losses[0]
    evals = [_episode(200 + i, i % 2 == 0, rng=rng) for i in range(40)]
    alarms = [predictor_first_alarm(head, e, h, HZ, use_time=False) for e in evals]
    d = early_stats(evals, alarms, lead_steps=2, hz=HZ)
    assert d["flag_early_rate"] == 1.0 and d["false_alarm_rate"] <= 0.2


def test_the_rollout_cache_round_trips() -> None:
    ep = _episode(0, False)
    ep.privileged = [{"tcp_pos": np.array([0.1, 0.2, 0.3]), "gripper_closed": np.array(1.0)}]
    ep.dense = [0.5]
    back = episode_from_json(json.loads(json.dumps(episode_json(ep))))
    assert (back.seed, back.success, back.length, back.max_steps) == (0, False, 20, 20)
    assert back.chunk_scores == ep.chunk_scores and back.dense == [0.5]
    np.testing.assert_allclose(back.privileged[0]["tcp_pos"], [0.1, 0.2, 0.3])
    for t, f in ep.chunk_features.items():
        np.testing.assert_allclose(back.chunk_features[t], f, atol=1e-7)


def test_each_rollout_set_is_cached_as_it_finishes_and_a_rerun_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run killed in the held-out set keeps the two sets it finished: a rerun with ``reuse`` rolls out
    only the missing one. Another policy (commit) or other seeds roll out again; without ``reuse``
    everything is rolled out; an earlier run's all-in-one ``rollouts.json`` is still read."""
    import bench.failure

    rolled: list[int] = []
    killed = [True]

    def fake_rollout(version: Any, task: str, seeds: list[int], group: int, features: bool) -> list[Episode]:
        rolled.append(seeds[0])
        if seeds[0] == EVAL_SEED and killed[0]:
            raise KeyboardInterrupt
        return [_episode(s, s % 2 == 0) for s in seeds]

    monkeypatch.setattr(bench.failure, "rollout", fake_rollout)
    args = argparse.Namespace(reuse=False, group=1, obs="state")
    a, b = argparse.Namespace(commit="local:a"), argparse.Namespace(commit="local:b")
    n = {"train_episodes": 3, "calib_episodes": 2, "episodes": 4}

    def run(version: Any, **counts: int) -> dict[str, list[Episode]]:
        rolled.clear()
        return rollout_sets(args, version, "kinematic/Reach-v0", {**n, **counts}, tmp_path)  # type: ignore[arg-type]

    with pytest.raises(KeyboardInterrupt):
        run(a)
    assert rolled == [TRAIN_SEED, CALIB_SEED, EVAL_SEED]
    killed[0], args.reuse = False, True
    sets = run(a)
    assert rolled == [EVAL_SEED]  # the train and calibration sets came from their caches
    assert [e.seed for e in sets["train"]] == [TRAIN_SEED + i for i in range(3)]
    assert [e.success for e in sets["calib"]] == [CALIB_SEED % 2 == 0, (CALIB_SEED + 1) % 2 == 0]
    assert len(sets["eval"]) == 4 and sets["train"][1].chunk_scores == _episode(1, False).chunk_scores
    run(a)
    assert rolled == []
    run(a, episodes=5)
    assert rolled == [EVAL_SEED]  # other seeds
    run(b)
    assert rolled == [TRAIN_SEED, CALIB_SEED, EVAL_SEED]  # another policy
    args.reuse = False
    run(b)
    assert rolled == [TRAIN_SEED, CALIB_SEED, EVAL_SEED]

    old = {k: [episode_json(_episode(i, True)) for i in range(2)] for k in ("train", "calib", "eval")}
    (tmp_path / "rollouts.json").write_text(json.dumps({"episodes": n, "sets": old}))
    args.reuse = True
    assert [e.seed for e in run(b)["eval"]] == [0, 1] and rolled == []
    run(b, episodes=5)
    assert rolled == [EVAL_SEED] and not (tmp_path / "rollouts.json").exists()


def test_an_empty_rollout_set_is_cached_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A set of 0 episodes (bench/operators' quick run asks for no calibration set) is rolled out as an
    empty list, cached under its first seed, and read back with ``reuse`` like any other set."""
    import bench.failure

    calls: list[tuple[int, ...]] = []

    def fake_rollout(version: Any, task: str, seeds: list[int], group: int, features: bool) -> list[Episode]:
        calls.append(tuple(seeds))
        return [_episode(s, True) for s in seeds]

    monkeypatch.setattr(bench.failure, "rollout", fake_rollout)
    args = argparse.Namespace(reuse=True, group=1, obs="state")
    n = {"train_episodes": 2, "calib_episodes": 0, "episodes": 1}
    version = argparse.Namespace(commit="local:a")
    sets = rollout_sets(args, version, "kinematic/Reach-v0", n, tmp_path)  # type: ignore[arg-type]
    assert sets["calib"] == [] and len(sets["train"]) == 2 and len(sets["eval"]) == 1
    assert json.loads((tmp_path / "rollouts_calib.json").read_text())["seeds"] == [CALIB_SEED, 0]
    calls.clear()
    again = rollout_sets(args, version, "kinematic/Reach-v0", n, tmp_path)  # type: ignore[arg-type]
    assert (
        calls == []
        and again["calib"] == []
        and [e.seed for e in again["train"]] == [TRAIN_SEED, TRAIN_SEED + 1]
    )
