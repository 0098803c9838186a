"""The promote gate of a round whose task has no simulator, on a learned success estimate.

Action MSE against recorded episodes says how closely a candidate imitates the recording, not whether
it would succeed. Where the store holds outcomes (episode success, failed endings, takeovers, the
dashboard's outcome and span labels), the round fits a success estimator on its *training* episodes
(:mod:`vla_rl.train.success`: ``P(success | observation, chunk)`` on policy-independent inputs), then
lets base and candidate each predict their chunks on the same held-out recorded observations
(:func:`vla_rl.evaluation_offline.evaluate_offline`, which still measures action MSE on the way) and
scores every chunk. Per held-out episode the score is its frames' mean; the gate promotes iff

    mean_e s_new(e) - mean_e s_base(e) > margin   and   the one-sided sign test on the (s_new(e), s_base(e))
                                                      pairs rejects "no better" at ``gate_alpha``,

and reports both means and their difference with 95% percentile-bootstrap intervals over episodes.
Action MSE stays in the round's metrics (reported, not gated on).

``offline_gate`` (:class:`vla_rl.rounds.RoundOptions`) picks the mode: ``auto`` uses this gate when the
training episodes hold both successful and failing autonomous stretches and action MSE otherwise (saying
why); ``success`` refuses a round without them, naming what is missing; ``action_mse`` is the old gate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fleet.db import MetadataDB
from fleet.store import EpisodeStore
from vla_rl.evaluation_offline import evaluate_offline
from vla_rl.gate import OfflineGate, gate_sentence
from vla_rl.gate_stats import sign_test
from vla_rl.train.success import SuccessEstimator, SuccessFitConfig, fit_success_estimator, outcome_rows

__all__ = ["OFFLINE_GATES", "SuccessGate", "bootstrap_ci", "fit_round_estimator", "success_gate"]

OFFLINE_GATES = ("auto", "success", "action_mse")
"""``RoundOptions.offline_gate`` values (module docstring)."""
BOOTSTRAP_RESAMPLES = 2000


def bootstrap_ci(values: Sequence[float], seed: int, level: float = 0.95) -> tuple[float, float]:
    """Percentile-bootstrap interval of the mean of ``values`` (resampled with replacement, seeded)."""
    v = np.asarray(values, np.float64)
    if not len(v):
        raise ValueError("values: expected at least one to bootstrap")
    idx = np.random.default_rng(seed).integers(0, len(v), size=(BOOTSTRAP_RESAMPLES, len(v)))
    means = v[idx].mean(1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


@dataclass(frozen=True)
class SuccessGate(OfflineGate):
    """No simulator, outcomes in the store: ``candidate`` / ``base`` are the mean estimated success over
    the held-out episodes (``candidate_eval`` / ``base_eval`` keep the action MSE and the per-episode
    scores)."""

    candidate_ci95: tuple[float, float]
    base_ci95: tuple[float, float]
    delta_ci95: tuple[float, float]
    estimator: dict[str, Any]
    """How the estimator was fit (episodes, outcomes, rows, losses)."""

    def round_metrics(self) -> dict[str, Any]:
        return {
            **super().round_metrics(),
            "gate_metric": "estimated_success",
            "estimated_success": self.candidate,
            "estimated_success_ci95": list(self.candidate_ci95),
            "base_estimated_success": self.base,
            "base_estimated_success_ci95": list(self.base_ci95),
            "estimated_delta": self.candidate - self.base,
            "estimated_delta_ci95": list(self.delta_ci95),
            "estimator": self.estimator,
        }

    def checkpoint_metrics(self) -> dict[str, Any]:
        return {
            **super().checkpoint_metrics(),
            "offline_estimated_success": self.candidate,
            "offline_estimated_success_ci95": list(self.candidate_ci95),
            "base_offline_estimated_success": self.base,
        }


def fit_round_estimator(
    base: Any, store: EpisodeStore, episode_ids: Sequence[str], db: MetadataDB | None, seed: int = 0
) -> tuple[SuccessEstimator, dict[str, Any]]:
    """The estimator of a round: fit on ``episode_ids`` (its training episodes) with chunks of the base's
    length and, for a camera policy, a 4 x 4 summary of each camera (ValueError without outcomes)."""
    cfg = SuccessFitConfig(horizon=int(base.chunk_len), camera_grid=4 if base.spec.cameras else 0, seed=seed)
    cams = list(base.spec.camera_names)
    rows = outcome_rows(
        store, episode_ids, db, horizon=cfg.horizon, camera_grid=cfg.camera_grid, cameras=cams
    )
    return fit_success_estimator(rows, cfg)


def success_gate(
    base: Any,
    new: Any,
    *,
    estimator: tuple[SuccessEstimator, dict[str, Any]],
    store: EpisodeStore,
    held_out: Sequence[str],
    db: MetadataDB,
    margin: float,
    alpha: float,
    seed: int,
    task: str,
) -> SuccessGate:
    """Score base and candidate on the held-out episodes with the fitted ``estimator`` (module docstring)."""
    est, summary = estimator
    kw: dict[str, Any] = dict(seed=seed, labels=db.current_labels(held_out), chunk_score=est.chunk_scorer())
    base_ev = evaluate_offline(base, store, held_out, **kw)
    new_ev = evaluate_offline(new, store, held_out, **kw)
    assert base_ev.score is not None and new_ev.score is not None
    ids = sorted(new_ev.per_episode_score)
    s_new = np.array([new_ev.per_episode_score[e] for e in ids])
    s_base = np.array([base_ev.per_episode_score[e] for e in ids])
    delta = new_ev.score - base_ev.score
    # the sign test compares errors (lower is better): the negated scores
    test = sign_test(
        {e: -float(v) for e, v in zip(ids, s_new, strict=True)},
        {e: -float(v) for e, v in zip(ids, s_base, strict=True)},
    )
    ci_new, ci_base, ci_delta = (bootstrap_ci(v, seed) for v in (s_new, s_base, s_new - s_base))
    b_mse, n_mse = base_ev.action_mse, new_ev.action_mse
    why = (
        f"estimated success {new_ev.score:.1%} [{ci_new[0]:.1%}, {ci_new[1]:.1%}] vs base {base_ev.score:.1%} "
        f"on {len(ids)} held-out episodes (delta {delta:+.1%} [{ci_delta[0]:+.1%}, {ci_delta[1]:+.1%}], "
        f"needs > {margin:+.1%}; learned from {summary['episodes']} episodes' outcomes, no simulator for "
        f"{task}; action MSE {n_mse:.4f} vs {b_mse:.4f}, not gated on); {gate_sentence(test, alpha, 'episodes')}"
    )
    return SuccessGate(
        metric="estimated_success",
        candidate=new_ev.score,
        base=base_ev.score,
        margin=margin,
        promote=delta > margin and test.passes(alpha),
        why=why,
        alpha=alpha,
        test=test,
        candidate_eval=new_ev,
        base_eval=base_ev,
        relative_improvement=(b_mse - n_mse) / b_mse if b_mse > 0 else 0.0,
        eval_seed=seed,
        candidate_ci95=ci_new,
        base_ci95=ci_base,
        delta_ci95=ci_delta,
        estimator=summary,
    )
