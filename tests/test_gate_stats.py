"""The promotion gate's statistics (vla_rl/gate_stats.py) against independent computations: scipy's exact
binomial and Fisher tests, and a brute-force enumeration of every outcome."""

from __future__ import annotations

import itertools
import math

import pytest

from vla_rl.gate_stats import (
    binomial_upper_tail,
    fisher_one_sided,
    hypergeometric_upper_tail,
    mcnemar_one_sided,
    paired_outcomes,
    sign_test,
)

scipy_stats = pytest.importorskip("scipy.stats")


@pytest.mark.parametrize(("k", "n"), [(0, 0), (0, 5), (3, 5), (5, 5), (6, 5), (7, 10), (30, 50), (520, 1000)])
def test_binomial_tail_matches_scipy(k: int, n: int) -> None:
    want = scipy_stats.binomtest(k, n, 0.5, alternative="greater").pvalue if 0 < k <= n else float(k <= 0)
    assert binomial_upper_tail(k, n) == pytest.approx(want, rel=1e-9, abs=1e-15)


def test_binomial_tail_by_enumeration() -> None:
    """Every sequence of n fair coin flips counted: the tail is the share with at least k heads."""
    for n in range(0, 9):
        flips = list(itertools.product((0, 1), repeat=n))
        for k in range(0, n + 2):
            want = sum(1 for f in flips if sum(f) >= k) / len(flips)
            assert binomial_upper_tail(k, n) == pytest.approx(want, rel=1e-12)


def test_binomial_tail_other_p_and_large_n() -> None:
    assert binomial_upper_tail(3, 10, 0.2) == pytest.approx(scipy_stats.binom.sf(2, 10, 0.2), rel=1e-9)
    assert binomial_upper_tail(50_500, 100_000) == pytest.approx(
        scipy_stats.binom.sf(50_499, 100_000, 0.5), rel=1e-6
    )
    with pytest.raises(ValueError, match="0 < p < 1"):
        binomial_upper_tail(1, 3, 1.0)


@pytest.mark.parametrize(
    ("s1", "n1", "s0", "n0"),
    [(7, 10, 2, 10), (5, 10, 5, 10), (0, 4, 3, 4), (12, 20, 30, 60), (40, 40, 0, 40)],
)
def test_fisher_matches_scipy(s1: int, n1: int, s0: int, n0: int) -> None:
    want = scipy_stats.fisher_exact([[s1, n1 - s1], [s0, n0 - s0]], alternative="greater").pvalue
    assert fisher_one_sided(s1, n1, s0, n0) == pytest.approx(want, rel=1e-9)


def test_hypergeometric_tail_by_enumeration() -> None:
    """Every way to draw n1 of n1 + n0 items (s successes among them) counted."""
    n1, n0 = 4, 3
    for s in range(0, n1 + n0 + 1):
        items = [1] * s + [0] * (n1 + n0 - s)
        draws = list(itertools.combinations(range(n1 + n0), n1))
        for k in range(-1, n1 + 2):
            want = sum(1 for d in draws if sum(items[i] for i in d) >= k) / math.comb(n1 + n0, n1)
            assert hypergeometric_upper_tail(k, n1, n0, s) == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="s <= n1 \\+ n0"):
        hypergeometric_upper_tail(0, 2, 2, 5)
    with pytest.raises(ValueError, match="successes <= episodes"):
        fisher_one_sided(3, 2, 0, 2)


def test_mcnemar_uses_only_the_discordant_pairs() -> None:
    """58% vs 52% on 50 seeds: 29 vs 26 successes; with 3 seeds won by the candidate alone and none by the
    base, p = 1/8 (not significant at 0.05); 6 vs 0 gives 1/64."""
    cand = {s: s < 29 for s in range(50)}
    base = {s: s < 26 for s in range(50)}
    t = paired_outcomes(cand, base)
    assert (t.wins, t.losses, t.ties, t.pairs) == (3, 0, 47, 50)
    assert t.p_value == pytest.approx(1 / 8) and not t.passes(0.05) and t.passes(0.2)
    assert mcnemar_one_sided(6, 0).p_value == pytest.approx(1 / 64)
    assert mcnemar_one_sided(0, 0, ties=50).p_value == 1.0  # identical outcomes: no evidence at all
    assert "candidate-only 3, base-only 0 of 50 paired" in t.describe()
    with pytest.raises(ValueError, match="share their seeds"):
        paired_outcomes({1: True}, {2: True})
    with pytest.raises(ValueError, match="counts >= 0"):
        mcnemar_one_sided(-1, 0)


def test_sign_test_drops_ties() -> None:
    cand = {"a": 0.1, "b": 0.2, "c": 0.3, "d": 0.5}
    base = {"a": 0.2, "b": 0.3, "c": 0.3, "d": 0.4}
    t = sign_test(cand, base)
    assert (t.wins, t.losses, t.ties) == (2, 1, 1)
    assert t.p_value == pytest.approx(scipy_stats.binomtest(2, 3, 0.5, alternative="greater").pvalue)
    with pytest.raises(ValueError, match="share their episodes"):
        sign_test({"a": 1.0}, {"b": 1.0})
