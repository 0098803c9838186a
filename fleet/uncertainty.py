"""The online uncertainty detector over a policy's per-chunk scores (docs/algorithms.md §6a), as pure functions.

A one-sided CUSUM over per-chunk ``accel`` scores x (the policy server's ``uncertainty``), standardised
with reference statistics from held-out *successful* episodes::

    z_t = (x_t - mean) / std,   S_t = max(0, S_{t-1} + z_t - k),   alarm when S_t > h

(docs/algorithms.md §6a writes it in raw units, ``S_t = max(0, S_{t-1} + x_t - mu0 - k sigma)``: the same path
divided by sigma). ``h`` is split conformal on the calibration episodes' peak CUSUM: the r-th smallest of
M peaks, ``r = ceil((M + 1)(1 - alpha))`` (alpha = 0.1: the 46th of 50), so a new successful episode
alarms with probability at most alpha (exchangeability). Needs ``M >= 1 / alpha - 1`` episodes.

Used by the simulated operator (``sim.operator``: the alarm that makes it take over) and by the
``high_uncertainty`` auto-flag (``fleet.flags``: calibrated per checkpoint revision). Fleet is the lower
layer, so the functions live here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np


def cusum_step(s: float, score: float, mean: float, std: float, k: float) -> float:
    """One CUSUM update ``max(0, s + (score - mean) / std - k)``; a non-finite score leaves ``s``."""
    if not math.isfinite(score):
        return s
    return max(0.0, s + (score - mean) / std - k)


def cusum_path(scores: Iterable[float], mean: float, std: float, k: float) -> np.ndarray:
    """``S_1..S_n`` over one episode's per-chunk scores, from ``S_0 = 0``."""
    out, s = [], 0.0
    for x in scores:
        s = cusum_step(s, float(x), mean, std, k)
        out.append(s)
    return np.asarray(out, np.float64)


def min_calibration_episodes(alpha: float) -> int:
    """The fewest calibration episodes M with a conformal rank ``ceil((M + 1)(1 - alpha)) <= M``."""
    _check_alpha(alpha)
    m = max(1, math.ceil(1 / alpha - 1))
    while math.ceil((m + 1) * (1 - alpha)) > m:  # float rounding at the boundary
        m += 1
    return m


def conformal_threshold(peaks: Sequence[float], alpha: float) -> float:
    """The r-th smallest of the M ``peaks``, ``r = ceil((M + 1)(1 - alpha))`` (ValueError when r > M)."""
    _check_alpha(alpha)
    m = len(peaks)
    r = math.ceil((m + 1) * (1 - alpha))
    if m == 0 or r > m:
        raise ValueError(
            f"calibrate_cusum: {m} scored episodes cannot give a conformal threshold at alpha={alpha} "
            f"(need at least {min_calibration_episodes(alpha)})"
        )
    return float(np.sort(np.asarray(peaks, np.float64))[r - 1])


def scored_episodes(episodes: Iterable[Sequence[float]]) -> list[np.ndarray]:
    """Each episode's finite per-chunk scores (float64), episodes without any left out."""
    eps = [np.asarray(e, np.float64) for e in episodes]
    return [e[np.isfinite(e)] for e in eps if np.isfinite(e).any()]


def calibrate_cusum(
    episodes: Sequence[Sequence[float]], *, alpha: float = 0.1, k: float = 0.25
) -> dict[str, float]:
    """The CUSUM's reference from held-out *successful* episodes' per-chunk scores.

    ``uncertainty_mean`` / ``uncertainty_std``: mean and std of every calibration chunk's score (pooled);
    ``uncertainty_h``: :func:`conformal_threshold` of the M episodes' peak CUSUM (docs/algorithms.md §6a).
    Needs ``M >= min_calibration_episodes(alpha)`` scored episodes (ValueError naming the count).
    Use as ``OperatorRules(**calibrate_cusum(...), ...)``.
    """
    _check_alpha(alpha)
    eps = scored_episodes(episodes)
    if len(eps) < min_calibration_episodes(alpha):
        conformal_threshold([0.0] * len(eps), alpha)  # raises, naming the count
    pooled = np.concatenate(eps)
    mean, std = float(pooled.mean()), float(pooled.std())
    std = std if std > 0 else 1.0
    peaks = [float(cusum_path(e, mean, std, k).max()) for e in eps]
    h = conformal_threshold(peaks, alpha)
    return {
        "uncertainty_mean": mean,
        "uncertainty_std": std,
        "uncertainty_k": float(k),
        "uncertainty_h": max(h, 1e-6),  # 0 would mean "off"; a zero peak threshold alarms on any excess
    }


def _check_alpha(alpha: float) -> None:
    if not (isinstance(alpha, int | float) and 0 < alpha < 1):
        raise ValueError(f"alpha: expected a value in (0, 1), got {alpha!r}")
