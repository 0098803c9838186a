"""bench/uncertainty.py's replay and statistics on hand-made episodes (no training, no simulator; ~1 s)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.uncertainty import Episode, auroc, detector_stats, first_takeover
from sim.operator import OperatorRules

TASK = "kinematic/Reach-v0"


def _episode(seed: int, dense: list[float], scores: dict[int, float], success: bool) -> Episode:
    priv = {"tcp_pos": np.zeros(3), "goal_pos": np.full(3, 0.05), "gripper_closed": np.array(0.0)}
    return Episode(seed, 20, [priv] * len(dense), dense, scores, success, len(dense))


def test_replay_finds_each_rules_first_takeover_and_stats() -> None:
    flat = [0.5] * 12  # no progress after step 0: the stall rule (3 steps) fires at t = 3
    scores = {0: 1.0, 2: 1.0, 4: 3.0, 6: 3.0, 8: 3.0, 10: 1.0}  # z = 0, 0, 2, 2, 2 with mean 1, std 1
    failed = _episode(1, flat, scores, success=False)
    rising = [0.1 * t for t in range(6)]  # progress every step: never stalls
    ok = _episode(2, rising, {0: 1.0, 2: 1.0, 4: 1.0}, success=True)
    alarm = OperatorRules(stall_steps=0, drift_radius=0.0, uncertainty_mean=1.0, uncertainty_h=3.0)
    stall = OperatorRules(stall_steps=3, drift_radius=0.0)
    # CUSUM with k = 0.25: 0, 0, 1.75, 3.5 -> alarm on the chunk of step 6
    assert first_takeover(failed, TASK, alarm) == 6 and first_takeover(failed, TASK, stall) == 3
    assert first_takeover(ok, TASK, alarm) is None and first_takeover(ok, TASK, stall) is None
    d = detector_stats([failed, ok], [6, None])
    assert (d["flagged_failures"], d["failures"], d["false_alarms"], d["successes"]) == (1, 1, 0, 1)
    assert d["lead_steps_median"] == 12 - 6 and d["lead_fraction_mean"] == pytest.approx(0.5)
    assert auroc([2.0, 3.0], [1.0, 2.0]) == pytest.approx(0.875)
