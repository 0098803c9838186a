"""What a round's promotion gate needs around its statistics (:mod:`vla_rl.gate_stats`): per-seed outcomes
kept in a form the DB and a checkpoint's ``config.json`` can hold, the gate's sentence, and the success a
round *reports*, measured on seeds the gate never saw; and the gate's typed verdicts (:class:`GateResult`:
:class:`SimGate` in simulation, :class:`OfflineGate` on recorded episodes).

Why a separate report: the gate's number is the one the promotion was decided on. Among candidates,
those promoted are the ones whose gate seeds happened to go well, so the gate's success of a promoted
candidate is biased upward (a selection effect). The report evaluates the promoted checkpoint again on
its own seed range (:data:`vla_rl.core.seeds.REPORT`), disjoint from the gate's, so the number a round
reports is an unbiased estimate of the checkpoint's success.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from vla_rl.evaluation import EpisodeResult, evaluate
from vla_rl.evaluation_offline import OfflineEvalResult
from vla_rl.gate_stats import PairedTest

__all__ = [
    "GateResult",
    "OfflineGate",
    "SimGate",
    "check_report_seeds",
    "decode_outcomes",
    "encode_outcomes",
    "gate_sentence",
    "known_outcomes",
    "report_success",
]


def encode_outcomes(per_episode: Sequence[EpisodeResult], seed: int, episodes: int) -> str:
    """Per-seed successes of an evaluation on seeds ``seed .. seed + episodes - 1`` as text: ``'1'`` for a
    success, ``'0'`` for a failure, in seed order (50 seeds = 50 characters in the round's metrics)."""
    by_seed = {r.seed: r.success for r in per_episode}
    missing = [s for s in range(seed, seed + episodes) if s not in by_seed]
    if missing:
        raise ValueError(f"outcomes: the evaluation has no episode for seeds {missing[:5]}")
    return "".join("1" if by_seed[s] else "0" for s in range(seed, seed + episodes))


def decode_outcomes(text: str, seed: int) -> dict[int, bool]:
    """Seed -> success from :func:`encode_outcomes`'s text."""
    if set(text) - {"0", "1"}:
        raise ValueError(f"outcomes: expected a string of 0 and 1, got {text[:20]!r}")
    return {seed + i: c == "1" for i, c in enumerate(text)}


def known_outcomes(metrics: Mapping[str, Any], key: str, episodes: int) -> str | None:
    """``metrics[key]`` when it holds the outcomes of exactly ``episodes`` seeds (older rounds and
    checkpoints recorded only rates: then None, and the base is evaluated again)."""
    text = metrics.get(key)
    return text if isinstance(text, str) and len(text) == episodes and not set(text) - {"0", "1"} else None


PAIRED_TEST_NAMES = {"seeds": "McNemar", "episodes": "sign test"}
"""What a gate pairs -> the test it runs on them: simulator seeds' successes (McNemar), held-out episodes'
errors (sign test)."""


def gate_sentence(test: PairedTest, alpha: float, what: str) -> str:
    """The statistical half of the gate's ``why``: the discordant counts, the p-value and what it needed,
    e.g. ``paired on 50 seeds: candidate-only 7, base-only 1 (one-sided McNemar p 0.035, needs <= 0.05)``;
    ``what`` is a key of :data:`PAIRED_TEST_NAMES`."""
    if what not in PAIRED_TEST_NAMES:
        raise ValueError(f"what: expected one of {sorted(PAIRED_TEST_NAMES)}, got {what!r}")
    return (
        f"paired on {test.pairs} {what}: candidate-only {test.wins}, base-only {test.losses} "
        f"(one-sided {PAIRED_TEST_NAMES[what]} p {test.p_value:.3g}, needs <= {alpha:g})"
    )


def check_report_seeds(eval_seed: int, eval_episodes: int, report_seed: int, report_episodes: int) -> None:
    """The report's seeds must not meet the gate's (ValueError naming ``report_seed`` and both ranges)."""
    if report_episodes == 0:
        return
    lo, hi = max(eval_seed, report_seed), min(eval_seed + eval_episodes, report_seed + report_episodes)
    if lo < hi:
        raise ValueError(
            f"report_seed: the report's seeds {report_seed}..{report_seed + report_episodes - 1} overlap the "
            f"gate's {eval_seed}..{eval_seed + eval_episodes - 1}; the reported success must come from seeds "
            "the gate did not see"
        )


def report_success(
    policy: Any, task: str, *, episodes: int, seed: int, num_envs: int, progress: bool
) -> dict[str, Any]:
    """The promoted checkpoint's success on the report seeds ``seed .. seed + episodes - 1`` (never the
    gate's): the round metrics' ``reported_*`` keys."""
    ev = evaluate(policy, task, episodes=episodes, num_envs=num_envs, seed=seed, progress=progress)
    return {
        "reported_success": ev.success_rate,
        "reported_ci95": list(ev.ci95),
        "report_episodes": episodes,
        "report_seed": seed,
    }


@dataclass(frozen=True)
class GateResult:
    """The promotion gate's verdict on a candidate against its base: ``metric`` is ``success`` (the
    success rate on the same simulator seeds, higher is better; promote iff ``candidate - base >
    margin``) or ``action_mse`` (the normalised action MSE on the same held-out episodes, lower is
    better; promote iff ``base - candidate > margin * base``) or ``estimated_success`` (a learned
    success estimate of each policy's chunks on the same held-out episodes, higher is better; promote iff
    ``candidate - base > margin``, :mod:`vla_rl.gate_success`), and in every case the paired one-sided
    ``test`` (McNemar on the seeds, a sign test on the episodes: :mod:`vla_rl.gate_stats`) rejects "no
    better" at false-promotion rate ``alpha``."""

    metric: Literal["success", "action_mse", "estimated_success"]
    candidate: float
    base: float
    margin: float
    promote: bool
    why: str
    """One line: both scores, the difference, the paired test and what the gate needed."""
    alpha: float = field(default=1.0, kw_only=True)
    """The false-promotion rate the test was held to (1: no test)."""
    test: PairedTest | None = field(default=None, kw_only=True)
    """The paired test's counts and p-value (None: a verdict built without one)."""

    def test_metrics(self) -> dict[str, Any]:
        """The paired test as the round's DB metrics record it (empty without one)."""
        if self.test is None:
            return {}
        t = self.test
        return dict(gate_alpha=self.alpha, p_value=t.p_value, candidate_only=t.wins, base_only=t.losses)

    def round_metrics(self) -> dict[str, Any]:
        """The evaluation as the round's DB metrics record it."""
        raise NotImplementedError

    def checkpoint_metrics(self) -> dict[str, Any]:
        """The evaluation as the candidate's ``config.json`` metrics record it."""
        raise NotImplementedError


@dataclass(frozen=True)
class SimGate(GateResult):
    """Simulation: success rates with 95% intervals; the base's may be reused (``base_source``)."""

    candidate_ci95: tuple[float, float]
    base_ci95: Any
    base_source: str
    """``evaluated``, ``checkpoint`` or ``round N`` (see :func:`_known_base_score`)."""
    eval_episodes: int
    eval_seed: int
    candidate_outcomes: str | None = field(default=None, kw_only=True)
    """Per-seed successes of the candidate on the gate's seeds (:func:`vla_rl.gate.encode_outcomes`)."""
    base_outcomes: str | None = field(default=None, kw_only=True)

    def round_metrics(self) -> dict[str, Any]:
        outcomes = {"outcomes": self.candidate_outcomes, "base_outcomes": self.base_outcomes}
        return {
            **self.test_metrics(),
            **{k: v for k, v in outcomes.items() if v is not None},
            "base_success": self.base,
            "base_ci95": self.base_ci95,
            "base_eval_source": self.base_source,
            "success": self.candidate,
            "ci95": list(self.candidate_ci95),
            "delta": self.candidate - self.base,
            "eval_episodes": self.eval_episodes,
            "eval_seed": self.eval_seed,
        }

    def checkpoint_metrics(self) -> dict[str, Any]:
        outcomes = {} if self.candidate_outcomes is None else {"eval_outcomes": self.candidate_outcomes}
        return {
            "success_rate": self.candidate,
            "success_ci95": list(self.candidate_ci95),
            "eval_episodes": self.eval_episodes,
            "eval_seed": self.eval_seed,
            "base_success_rate": self.base,
            **outcomes,
        }


@dataclass(frozen=True)
class OfflineGate(GateResult):
    """No simulator: both evaluated offline on the same held-out episodes and frames."""

    candidate_eval: OfflineEvalResult
    base_eval: OfflineEvalResult
    relative_improvement: float
    """``(base - candidate) / base`` (0 when the base's error is 0)."""
    eval_seed: int

    def round_metrics(self) -> dict[str, Any]:
        new, base = self.candidate_eval, self.base_eval
        return {
            **self.test_metrics(),
            "eval": "offline",
            "success": None,
            "base_success": None,
            "action_mse": new.action_mse,
            "base_action_mse": base.action_mse,
            "action_mse_per_dim": new.per_dim,
            "base_action_mse_per_dim": base.per_dim,
            "action_mse_per_task": new.per_task,
            "action_mse_per_step": new.per_step,
            "val_loss": new.val_loss,
            "base_val_loss": base.val_loss,
            "relative_improvement": self.relative_improvement,
            "eval_episode_ids": new.episode_ids,
            "eval_frames": new.frames,
            "eval_seed": self.eval_seed,
        }

    def checkpoint_metrics(self) -> dict[str, Any]:
        return {
            "offline_action_mse": self.candidate_eval.action_mse,
            "offline_val_loss": self.candidate_eval.val_loss,
            "offline_eval_episode_ids": self.candidate_eval.episode_ids,
            "offline_eval_seed": self.eval_seed,
            "base_offline_action_mse": self.base_eval.action_mse,
        }
