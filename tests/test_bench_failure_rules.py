"""bench/failure_rules.py's alarm-rule statistics on hand-made score paths (no policy, no simulator)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.failure_rules import by_phase, evaluate_rule, k_of_m, logit_cusum, time_only
from bench.uncertainty import Episode


def _episode(seed: int, success: bool, scores: list[float], every: int = 5, max_steps: int = 50) -> Episode:
    """An episode whose decision t carries ``scores[t // every]`` as its (fake) predictor score."""
    steps = [i * every for i in range(len(scores))]
    ep = Episode(seed, max_steps, [], [], {t: 0.0 for t in steps}, success, len(scores) * every)
    ep.chunk_features = {t: np.array([s], np.float32) for t, s in zip(steps, scores, strict=True)}
    return ep


def _scorer(ep: Episode) -> tuple[np.ndarray, np.ndarray]:
    st = np.array(sorted(ep.chunk_features))
    return st, np.array([float(ep.chunk_features[t][0]) for t in st])


def test_k_of_m_needs_k_high_scores_in_the_window() -> None:
    ep = _episode(0, False, [0.9, 0.1, 0.8, 0.7, 0.2])
    st, q = k_of_m(_scorer, 2, 2)(ep)
    assert st.tolist() == [0, 5, 10, 15, 20]
    assert q.tolist() == pytest.approx([0.0, 0.1, 0.1, 0.7, 0.2])  # one spike alone never passes


def test_logit_cusum_accumulates_a_run_of_high_scores_only() -> None:
    calm = [_episode(i, True, [0.1, 0.2, 0.1, 0.2]) for i in range(4)]
    rule = logit_cusum(_scorer, calm, k=0.5)
    _, rising = rule(_episode(9, False, [0.1, 0.6, 0.8, 0.9]))
    _, calm_path = rule(calm[0])
    assert np.all(np.diff(rising[1:]) > 0) and rising[-1] > 5 * max(calm_path.max(), 0.1)


def test_phase_standardises_by_the_step_of_the_episode() -> None:
    fit_ok = [_episode(i, True, [0.1, 0.5 + 0.01 * i]) for i in range(5)]
    _, z = by_phase(_scorer, fit_ok)(_episode(9, False, [0.5, 0.5]))
    assert z[0] > 10 and z[1] < 0  # 0.5 is high at the start, ordinary (low) later


def test_time_only_fires_once_at_the_last_decision_a_lead_before_the_limit() -> None:
    rule = time_only(lead_steps=20)
    _, long_ep = rule(_episode(0, False, [0.0] * 10))  # runs to the limit (50)
    _, short_ep = rule(_episode(1, True, [0.0] * 5))  # ended at 25
    assert long_ep.tolist() == [0, 0, 0, 0, 0, 0, 1, 0, 0, 0] and short_ep.max() == 0


def test_evaluate_rule_calibrates_on_successes_and_reports_first_alarms() -> None:
    calib_ok = [_episode(i, True, [0.1 + 0.01 * i, 0.2]) for i in range(20)]
    evals = [_episode(100, False, [0.1, 0.9, 0.9]), _episode(101, True, [0.1, 0.2])]
    r = evaluate_rule(_scorer, calib_ok, evals, alpha=0.1)
    assert r["threshold"] == pytest.approx(
        0.28, abs=1e-6
    )  # the 19th of 20 peaks (conformal rank) and r["alarms"] == [5, None]
