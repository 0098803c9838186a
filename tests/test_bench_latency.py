"""bench/latency.py's pieces that need no simulator: which RTC rows this build can run (and why not),
the RTC proposer's request, the table and the plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import write_results
from bench.latency import RTCProposer, merge, plot, rtc_unavailable, run_cell, summary
from sim.latency import RequestContext


class Plain:
    def predict_chunks(self, obs: dict[str, Any], seed: int) -> np.ndarray:
        return np.zeros((len(obs["state"]), 4, 2), np.float32)


class WithRTC:
    rtc_trained = False

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[int], list[np.ndarray]]] = []

    def predict_chunks(
        self, obs: dict[str, Any], seed: int, inference_delay: Any = None, prev_chunk_left_over: Any = None
    ) -> np.ndarray:
        self.calls.append((seed, inference_delay, prev_chunk_left_over))
        return np.zeros((len(obs["state"]), 4, 2), np.float32)


def test_rtc_rows_run_only_where_the_policy_takes_rtc_inputs() -> None:
    assert "takes no inference_delay, prev_chunk_left_over" in (rtc_unavailable("rtc-guided", Plain()) or "")
    assert rtc_unavailable("rtc-guided", WithRTC()) is None
    assert "no checkpoint trained with RTC" in (rtc_unavailable("rtc-trained", WithRTC()) or "")
    row = run_cell("push-state", Plain(), "rtc-trained", 100, episodes=1, num_envs=1)
    assert row["available"] is False and row["reason"].startswith("not available in this build")


def test_rtc_proposer_sends_each_robots_delay_and_queued_actions() -> None:
    policy = WithRTC()
    queued = np.ones((2, 2), np.float32)
    ctx = [RequestContext(4, 2, queued), RequestContext(0, 3, np.zeros((0, 0), np.float32))]
    chunks = RTCProposer(policy, "guided", seed=7)([0, 1], {"state": np.zeros((2, 3))}, ctx)
    assert chunks.shape == (2, 4, 2)
    seed, delays, left = policy.calls[0]
    assert seed == 7000 and delays == [2, 3] and left[0] is queued


def _rows() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = [
        {
            "setting": "push-state",
            "method": m,
            "latency_ms": ms,
            "available": True,
            "episodes": 10,
            "success_rate": 0.5,
            "ci95": [0.2, 0.8],
            "mean_jump": 0.1,
            "mean_max_jump": float("nan"),
            "starved_per_episode": 1.0,
        }
        for m in ("latest_only", "weighted_average")
        for ms in (0, 100)
    ]
    rows.append(
        {
            "setting": "push-state",
            "method": "rtc-guided",
            "latency_ms": 0,
            "available": False,
            "reason": "why",
        }
    )
    return rows


def test_table_and_plot(tmp_path: Path) -> None:
    rows = _rows()
    text = summary(rows)
    assert "50% (20%-80%, n=10)" in text and "| why" in text and "| -" in text
    assert plot(rows, tmp_path / "latency.png").stat().st_size > 1000


def test_runs_of_separate_settings_merge_into_one_file(tmp_path: Path) -> None:
    push = _rows()
    pick = [dict(r, setting="pick-state") for r in _rows()]
    paths = [
        write_results("latency", {"args": {"n": i}, "checkpoints": {}, "rows": rows}, tmp_path / f"{i}.json")
        for i, rows in enumerate((push, pick))
    ]
    out = merge(paths, tmp_path / "latency.json")
    doc = json.loads(out.read_text())["results"]
    assert doc["rows"] == json.loads(json.dumps(push + pick)) and [m["args"] for m in doc["merged_from"]] == [
        {"n": 0},
        {"n": 1},
    ]
    assert (tmp_path / "latency.png").stat().st_size > 1000
