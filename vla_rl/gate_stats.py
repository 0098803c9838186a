"""The promotion gate's statistics: one-sided tests that a candidate is better than its base, each with a
stated false-promotion rate ``alpha`` (the chance of promoting a candidate that is no better).

Paired outcomes (simulation, candidate and base on the same episode seeds). Of ``n`` seeds, ``b`` are won
by the candidate only and ``c`` by the base only (the *discordant* pairs; seeds both win or both lose say
nothing about which is better). Under H0 "the candidate is no better", a discordant seed is the
candidate's with probability at most 1/2, so the exact one-sided McNemar test is the binomial tail

    p = P(X >= b),  X ~ Binomial(b + c, 1/2) = sum_{i=b}^{b+c} C(b+c, i) / 2^(b+c)

and the gate promotes only when ``p <= alpha``. It is exact for any ``n`` (no normal approximation) and
uses the pairing: two 50-seed success rates of 58% and 52% overlap as intervals, but whether that is
noise depends on how many seeds changed hands (3 vs 0 is weaker evidence than it looks; 10 vs 7 is none).

Paired scores (offline, action MSE per held-out episode): the sign test is the same tail with ``b`` the
episodes where the candidate's error is lower, ``c`` where it is higher, ties dropped.

Unpaired outcomes (a canary: robots running the candidate and robots running ``prod`` meet different
episodes): Fisher's exact one-sided test. With ``s1`` successes of ``n1`` candidate episodes, ``s0`` of
``n0`` base episodes and ``s = s1 + s0``, under H0 (equal success rates) and the margins fixed, the
candidate's successes are hypergeometric:

    p = P(X >= s1) = sum_{k=s1}^{min(s, n1)} C(n1, k) C(n0, s - k) / C(n1 + n0, s)

Every tail is summed in log space (``lgamma``), so the tests stay exact to float precision and fast for
100,000 episodes. Pure functions, no simulator and no DB. The equations: docs/algorithms.md §8.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "PairedTest",
    "binomial_upper_tail",
    "fisher_one_sided",
    "hypergeometric_upper_tail",
    "mcnemar_one_sided",
    "paired_outcomes",
    "sign_test",
]


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def _log_sum_exp(terms: list[float]) -> float:
    top = max(terms)
    return top + math.log(math.fsum(math.exp(t - top) for t in terms))


def binomial_upper_tail(k: int, n: int, p: float = 0.5) -> float:
    """``P(X >= k)`` for ``X ~ Binomial(n, p)``: 1 for ``k <= 0``, 0 for ``k > n``."""
    if n < 0 or not 0.0 < p < 1.0:
        raise ValueError(f"binomial_upper_tail: expected n >= 0 and 0 < p < 1, got n={n}, p={p}")
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    lp, lq = math.log(p), math.log1p(-p)
    terms = [_log_comb(n, i) + i * lp + (n - i) * lq for i in range(k, n + 1)]
    return min(1.0, math.exp(_log_sum_exp(terms)))


def hypergeometric_upper_tail(k: int, n1: int, n0: int, s: int) -> float:
    """``P(X >= k)`` for ``X`` the successes among ``n1`` draws (without replacement) from ``n1 + n0``
    items of which ``s`` are successes."""
    if min(n1, n0, s) < 0 or s > n1 + n0:
        raise ValueError(
            f"hypergeometric_upper_tail: expected 0 <= s <= n1 + n0, got n1={n1}, n0={n0}, s={s}"
        )
    lo, hi = max(0, s - n0), min(s, n1)  # the support of X
    if k <= lo:
        return 1.0
    if k > hi:
        return 0.0
    total = _log_comb(n1 + n0, s)
    terms = [_log_comb(n1, i) + _log_comb(n0, s - i) - total for i in range(k, hi + 1)]
    return min(1.0, math.exp(_log_sum_exp(terms)))


@dataclass(frozen=True)
class PairedTest:
    """A one-sided paired test's counts and p-value: ``wins`` pairs favour the candidate, ``losses`` the
    base, ``ties`` neither (both succeeded / both failed, or equal errors); ``p_value`` of H0 "the
    candidate is no better"."""

    wins: int
    losses: int
    ties: int
    p_value: float

    @property
    def pairs(self) -> int:
        return self.wins + self.losses + self.ties

    def passes(self, alpha: float) -> bool:
        """Reject H0 at false-promotion rate ``alpha``."""
        return self.p_value <= alpha

    def describe(self) -> str:
        """E.g. ``candidate-only 7, base-only 1 of 50 paired (p 0.035)``."""
        return f"candidate-only {self.wins}, base-only {self.losses} of {self.pairs} paired (p {self.p_value:.3g})"


def mcnemar_one_sided(wins: int, losses: int, ties: int = 0) -> PairedTest:
    """Exact one-sided McNemar test from the discordant pair counts (module docstring): ``wins`` seeds the
    candidate alone succeeded on, ``losses`` the base alone; ``ties`` (concordant seeds) only reported."""
    if min(wins, losses, ties) < 0:
        raise ValueError(f"mcnemar_one_sided: expected counts >= 0, got {wins}, {losses}, {ties}")
    return PairedTest(wins, losses, ties, binomial_upper_tail(wins, wins + losses))


def paired_outcomes(candidate: Mapping[int, bool], base: Mapping[int, bool]) -> PairedTest:
    """McNemar's test over per-seed successes (seed -> success) of candidate and base; both must hold the
    same seeds (a pairing over different episodes would compare nothing)."""
    if set(candidate) != set(base):
        only = sorted(set(candidate) ^ set(base))[:5]
        raise ValueError(f"paired_outcomes: candidate and base must share their seeds; not shared: {only}")
    wins = sum(1 for s in candidate if candidate[s] and not base[s])
    losses = sum(1 for s in candidate if base[s] and not candidate[s])
    return mcnemar_one_sided(wins, losses, len(candidate) - wins - losses)


def sign_test(candidate: Mapping[str, float], base: Mapping[str, float]) -> PairedTest:
    """One-sided sign test that the candidate's per-episode error (episode -> error, lower is better) is
    below the base's on the same episodes; equal errors are ties and drop out."""
    if set(candidate) != set(base):
        only = sorted(set(candidate) ^ set(base))[:5]
        raise ValueError(f"sign_test: candidate and base must share their episodes; not shared: {only}")
    wins = sum(1 for e in candidate if candidate[e] < base[e])
    losses = sum(1 for e in candidate if candidate[e] > base[e])
    return PairedTest(wins, losses, len(candidate) - wins - losses, binomial_upper_tail(wins, wins + losses))


def fisher_one_sided(successes: int, episodes: int, base_successes: int, base_episodes: int) -> float:
    """Fisher's exact one-sided p-value that the candidate's success rate (``successes`` of ``episodes``)
    is above the base's (``base_successes`` of ``base_episodes``), episodes unpaired (module docstring)."""
    if not (0 <= successes <= episodes and 0 <= base_successes <= base_episodes):
        raise ValueError(
            f"fisher_one_sided: expected 0 <= successes <= episodes for both, got {successes}/{episodes} "
            f"and {base_successes}/{base_episodes}"
        )
    return hypergeometric_upper_tail(successes, episodes, base_episodes, successes + base_successes)
