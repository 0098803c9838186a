"""bench/operators.py end to end in its --quick mode (kinematic Reach: a small SFT base, its rollouts, the
CUSUM and the learned predictor, then 4 robots and 1 operator under every row; about a minute)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.operators import MODES, main, merge


def test_quick_bench_compares_the_operators(tmp_path: Path) -> None:
    out = tmp_path / "operators.json"
    r = main(["--quick", "--work", str(tmp_path / "work"), "--out", str(out), "--threads", "1"])
    assert list(r["modes"]) == list(MODES)
    s = r["settings"]
    assert (s["robots"], s["operators"], s["episodes_per_robot"]) == (4, 1, 3)
    for mode, m in r["modes"].items():
        assert m["episodes"] == 12, mode
        assert 0.0 <= m["operator_utilisation"] <= 1.0 and m["failures"] == 12 - m["successes"]
        assert m["failures_without_takeover"] <= m["failures"]
    assert r["modes"]["no operator"]["takeovers"] == 0
    assert set(r["modes"]["omniscient"]["reasons"]) <= {"stall", "drift"}
    for mode in ("accel alarm", "learned predictor"):
        m = r["modes"][mode]
        # no simulator state: every takeover answers a request (never a stall or a drift)
        assert set(m["reasons"]) <= {"uncertainty", "failure predictor", "spot check"}
        assert m["desk"]["answered"] == m["takeovers"] <= m["requests"]
        assert m["requests"] == m["takeovers"] + m["requests_unanswered"]
    assert set(r["modes"]["accel alarm"]["reasons"]) <= {"uncertainty"}
    assert 0.0 < r["signals"]["predictor_threshold"] < 1.0
    assert json.loads(out.read_text())["results"]["modes"].keys() == r["modes"].keys()

    # rows run separately merge into one table; another fleet's rows do not
    part = {**r, "modes": {"omniscient": r["modes"]["omniscient"]}}
    merge(part, [out])
    assert list(part["modes"]) == list(MODES) and part["modes"]["omniscient"] is r["modes"]["omniscient"]
    other = {**r, "settings": {**r["settings"], "robots": 12}, "modes": {}}
    with pytest.raises(SystemExit, match="robots"):
        merge(other, [out])

    # the requests rows through the product's help queue (a collector and its DB, simulated operators
    # claiming in lock-step) decide as the shared-memory desk did: same requests, takeovers, outcomes
    asks = ["--modes", "accel alarm", "learned predictor", "--reuse", "--desk", "queue"]
    q = main(["--quick", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "q.json"), *asks])
    assert q["settings"]["desk"] == "queue" and r["settings"]["desk"] == "memory"
    same = ("successes", "takeovers", "requests", "requests_unanswered", "failures_without_takeover")
    for mode in ("accel alarm", "learned predictor"):
        assert {k: q["modes"][mode][k] for k in same} == {k: r["modes"][mode][k] for k in same}, mode
        assert q["modes"][mode]["mean_wait_s"] == pytest.approx(r["modes"][mode]["mean_wait_s"], nan_ok=True)
        assert q["modes"][mode]["desk"] == pytest.approx(r["modes"][mode]["desk"], nan_ok=True), mode
