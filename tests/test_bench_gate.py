"""bench/gate.py's scoring of gate trials, on hand-made paired outcomes (the slow bench itself is not run)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.gate import trials


def test_trials_count_each_rules_promotions_per_block() -> None:
    # block 0: 3 vs 0 discordant (old rule promotes, p 1/8 does not); block 1: 6 vs 0 (both promote);
    # block 2: identical (neither); block 3: the candidate worse (neither)
    base = np.zeros(40, dtype=bool)
    cand = base.copy()
    cand[0:3] = True
    cand[10:16] = True
    base[30:35] = True
    r = trials(cand, base, n=10, alpha=0.05)
    assert r["old_rule"]["promoted"] == 2 and r["paired_test"]["promoted"] == 1
    assert r["old_rule"]["trials"] == 4 and r["old_rule"]["rate"] == pytest.approx(0.5)
    lo, hi = r["paired_test"]["ci95"]
    assert lo < 0.25 < hi
    assert r["candidate_success"] == pytest.approx(9 / 40) and r["base_success"] == pytest.approx(5 / 40)
    # the old rule's promoted blocks scored 30% and 60% at the gate against a true 22.5%
    assert r["old_rule_gate_success_when_promoted"] == pytest.approx(0.45)
    assert r["old_rule_optimism"] == pytest.approx(0.45 - 9 / 40)
