"""What a round's promotion gate needs around its statistics (:mod:`vla_rl.gate_stats`): per-seed outcomes
kept in a form the DB and a checkpoint's ``config.json`` can hold, the gate's sentence, and the success a
round *reports*, measured on seeds the gate never saw.

Why a separate report: the gate's number is the one the promotion was decided on. Among candidates,
those promoted are the ones whose gate seeds happened to go well, so the gate's success of a promoted
candidate is biased upward (a selection effect). The report evaluates the promoted checkpoint again on
its own seed range (:data:`vla_rl.core.seeds.REPORT`), disjoint from the gate's, so the number a round
reports is an unbiased estimate of the checkpoint's success.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vla_rl.evaluation import EpisodeResult, evaluate
from vla_rl.gate_stats import PairedTest

__all__ = [
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
