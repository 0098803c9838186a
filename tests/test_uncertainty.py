"""The uncertainty CUSUM and its split-conformal calibration (fleet/uncertainty.py, docs/algorithms.md §6a)
against an independent computation in raw score units; the simulated operator's alarm built from it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fleet.uncertainty import calibrate_cusum, conformal_threshold, cusum_path, min_calibration_episodes
from sim.operator import OperatorRules, first_alarm


def reference_cusum(scores: list[float], mu0: float, sigma: float, k_sigma: float) -> list[float]:
    """docs/algorithms.md §6a in raw score units: S_t = max(0, S_{t-1} + x_t - mu0 - k), k = k_sigma * sigma."""
    out, s = [], 0.0
    for x in scores:
        if x != x:  # NaN: not available
            out.append(s / sigma)
            continue
        s = max(0.0, s + x - mu0 - k_sigma * sigma)
        out.append(s / sigma)  # in sigma units, as OperatorRules.uncertainty_h
    return out


def test_uncertainty_cusum_and_calibration_match_an_independent_computation() -> None:
    rng = np.random.default_rng(0)
    scores = list(rng.gamma(2.0, 0.5, 40))
    scores[7] = float("nan")
    np.testing.assert_allclose(cusum_path(scores, 1.1, 0.7, 0.25), reference_cusum(scores, 1.1, 0.7, 0.25))
    # split conformal over M = 50 successful episodes at alpha = 0.1: the 46th smallest peak
    episodes = [list(rng.gamma(2.0, 0.5, int(rng.integers(5, 30)))) for _ in range(50)]
    cal = calibrate_cusum(episodes, alpha=0.1, k=0.25)
    pooled = np.concatenate(episodes)
    assert cal["uncertainty_mean"] == pytest.approx(pooled.mean())
    assert cal["uncertainty_std"] == pytest.approx(pooled.std())
    peaks = sorted(max(reference_cusum(e, pooled.mean(), pooled.std(), 0.25)) for e in episodes)
    assert cal["uncertainty_h"] == pytest.approx(peaks[45]) and cal["uncertainty_k"] == 0.25
    assert conformal_threshold(peaks[::-1], 0.1) == pytest.approx(peaks[45])  # order does not matter
    rules = OperatorRules(**cal)
    alarmed = [first_alarm(e, rules) is not None for e in episodes]
    assert sum(alarmed) == sum(p > peaks[45] for p in peaks) <= 5  # at most alpha of them, by construction
    with pytest.raises(ValueError, match=r"5 scored episodes .*\(need at least 9\)"):
        calibrate_cusum(episodes[:5], alpha=0.1)
    with pytest.raises(ValueError, match="uncertainty_std"):
        OperatorRules(uncertainty_std=0.0)
    assert first_alarm(scores, OperatorRules()) is None  # off by default


def test_min_calibration_episodes_is_the_first_m_with_a_conformal_rank() -> None:
    for alpha in (0.5, 0.3, 0.2, 0.1, 0.05, 0.01):
        m = min_calibration_episodes(alpha)
        assert math.ceil((m + 1) * (1 - alpha)) <= m  # a rank exists with m episodes ...
        assert m == 1 or math.ceil(m * (1 - alpha)) > m - 1  # ... and not with one fewer
        conformal_threshold([0.0] * m, alpha)
        with pytest.raises(ValueError, match="conformal"):
            conformal_threshold([0.0] * (m - 1), alpha)
    assert min_calibration_episodes(0.1) == 9
    with pytest.raises(ValueError, match=r"alpha: expected a value in \(0, 1\)"):
        min_calibration_episodes(1.0)
