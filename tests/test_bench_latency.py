"""bench/latency.py's pieces: which RTC rows a policy can run (and why not), the RTC proposer's request,
an RTC cell on a tiny checkpoint in the kinematic world, the rtc_max_delay training stage, the table,
the plot and merging result files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_server import make_checkpoint

import sim
from bench.common import write_results
from bench.latency import (
    RTCProposer,
    merge,
    method_label,
    plot,
    rtc_unavailable,
    run_cell,
    summary,
    train_checkpoint,
    trained_rtc_delay,
)
from bench.sft import SETTINGS
from fleet.store import EpisodeStore
from policies.loading import load_policy
from sim.latency import RequestContext

TINY = {"task": "kinematic/Reach-v0", "obs": "state"}


class Plain:
    def predict_chunks(self, obs: dict[str, Any], seed: int) -> np.ndarray:
        return np.zeros((len(obs["state"]), 4, 2), np.float32)


class WithRTC:
    def __init__(self, rtc_max_delay: int = 0) -> None:
        self.rtc_max_delay = rtc_max_delay
        self.calls: list[tuple[int, list[Any] | None]] = []

    def predict_chunks(self, obs: dict[str, Any], seed: int, rtc: list[Any] | None = None) -> np.ndarray:
        self.calls.append((seed, rtc))
        return np.zeros((len(obs["state"]), 4, 2), np.float32)


def test_rtc_rows_run_only_where_the_policy_takes_rtc_and_its_checkpoint_fits_the_row() -> None:
    assert "takes no rtc" in (rtc_unavailable("rtc-guided", Plain()) or "")
    assert rtc_unavailable("rtc-guided", WithRTC()) is None
    assert "no checkpoint trained with RTC" in (rtc_unavailable("rtc-trained", WithRTC()) or "")
    assert rtc_unavailable("rtc-trained", WithRTC(rtc_max_delay=3)) is None
    assert "trained with RTC (rtc_max_delay 3)" in (rtc_unavailable("rtc-guided", WithRTC(3)) or "")
    row = run_cell("push-state", Plain(), "rtc-trained", 100, episodes=1, num_envs=1)
    assert row["available"] is False and row["reason"].startswith("not available in this build")


def test_rtc_proposer_sends_each_robots_delay_and_queued_actions() -> None:
    policy = WithRTC()
    queued = np.ones((2, 2), np.float32)
    ctx = [RequestContext(4, 2, queued), RequestContext(0, 3, np.zeros((0, 2), np.float32))]
    chunks = RTCProposer(policy, seed=7)([0, 1], {"state": np.zeros((2, 3))}, ctx)
    assert chunks.shape == (2, 4, 2)
    seed, rtc = policy.calls[0]
    assert seed == 7000 and rtc is not None and rtc[0] == (2, queued) and rtc[1] is None


def test_an_rtc_row_continues_the_queued_actions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A guided-RTC cell on a tiny checkpoint in the kinematic world: it runs, and the first ``delay``
    actions of its chunks are closer to the robot's queued actions than the same request's plain chunk."""
    with sim.make_env(TINY["task"]) as env:
        spec = env.spec
    policy = load_policy(make_checkpoint(tmp_path / "ckpt", 0, spec), device="cpu")
    predict = policy.predict_chunks
    seen: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []

    def recording(obs: dict[str, Any], seed: int, rtc: list[Any] | None = None) -> np.ndarray:
        chunks = predict(obs, seed, rtc)
        plain = predict(obs, seed)
        for r, c, p in zip(rtc or [], chunks, plain, strict=False):
            if r is not None and r[0] and len(r[1]) >= r[0]:
                seen.append((r[0], r[1], c, p))
        return chunks

    policy.predict_chunks = recording  # type: ignore[method-assign]
    monkeypatch.setitem(SETTINGS, "tiny", TINY)
    row = run_cell("tiny", policy, "rtc-guided", 100, episodes=2, num_envs=2)
    assert row["available"] is True and row["episodes"] == 2 and row["requests_per_episode"] > 1
    assert seen and all(d == 2 for d, *_ in seen)  # 100 ms at 20 Hz
    rtc_err = np.mean([np.abs(c[:d] - q[:d]).mean() for d, q, c, _ in seen])
    plain_err = np.mean([np.abs(p[:d] - q[:d]).mean() for d, q, _, p in seen])
    assert rtc_err < 0.5 * plain_err


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


def test_a_rerun_of_some_cells_merges_into_a_merged_file(tmp_path: Path) -> None:
    push = _rows()
    first = write_results("latency", {"args": {"n": 0}, "checkpoints": {}, "rows": push}, tmp_path / "0.json")
    merged = merge([first], tmp_path / "merged.json")
    rerun = {"setting": "push-state", "method": "rtc-guided", "latency_ms": 0.0, "available": True}
    rerun |= {"episodes": 10, "success_rate": 0.9, "ci95": [0.6, 1.0], "mean_jump": 0.05}
    rerun |= {"mean_max_jump": 0.1, "starved_per_episode": 0.0}
    new = rerun | {"latency_ms": 100}
    second = write_results(
        "latency", {"args": {"n": 1}, "checkpoints": {}, "rows": [rerun, new]}, tmp_path / "1.json"
    )
    doc = json.loads(merge([merged, second], tmp_path / "latency.json").read_text())["results"]
    assert doc["rows"] == json.loads(json.dumps([*push[:-1], rerun, new]))  # replaced in place, then added
    assert [m["args"] for m in doc["merged_from"]] == [{"n": 0}, {"n": 1}]


def test_the_rtc_trained_stage_reuses_the_demonstrations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(SETTINGS, "tiny", TINY | {"steps": 2, "batch_size": 4})
    trained = train_checkpoint("tiny", tmp_path, demos=2, noise=0.1, rtc_max_delay=2)
    plain = json.loads((tmp_path / "tiny" / "sft.json").read_text())
    assert trained["rtc_max_delay"] == 2 and plain["rtc_max_delay"] == 0
    assert trained["demo_frames"] == plain["demo_frames"]
    assert len(EpisodeStore(tmp_path / "tiny" / "store").episode_ids()) == 2  # recorded once
    assert trained_rtc_delay(load_policy(Path(trained["checkpoint"]), device="cpu")) == 2
    assert trained_rtc_delay(load_policy(Path(plain["checkpoint"]), device="cpu")) == 0


def test_a_mixed_delay_rtc_stage_is_its_own_stage_and_its_rows_their_own_cells(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rtc_zero_delay_prob`` names a stage of its own (a cached uniform one is never reused for it), is
    recorded beside ``rtc_max_delay``, and its rows keep cells of their own through a merge."""
    monkeypatch.setitem(SETTINGS, "tiny", TINY | {"steps": 2, "batch_size": 4})
    uniform = train_checkpoint("tiny", tmp_path, demos=2, noise=0.1, rtc_max_delay=2)
    mixed = train_checkpoint("tiny", tmp_path, demos=2, noise=0.1, rtc_max_delay=2, rtc_zero_delay_prob=0.5)
    assert (tmp_path / "tiny" / "sft-rtc-zero0.5.json").exists() and mixed["checkpoint"] != uniform[
        "checkpoint"
    ]
    assert (uniform["rtc_zero_delay_prob"], mixed["rtc_zero_delay_prob"]) == (None, 0.5)
    config = load_policy(Path(mixed["checkpoint"]), device="cpu").policy.config
    assert (config.rtc_max_delay, config.rtc_zero_delay_prob) == (2, 0.5)
    rtc = _rows()[0] | {"method": "rtc-trained"}
    rows = [rtc, rtc | {"rtc_zero_delay_prob": 0.5, "success_rate": 0.75}]
    assert method_label(rows[1]) == "rtc-trained (p0 0.5)" and "rtc-trained (p0 0.5)" in summary(rows)
    path = write_results("latency", {"args": {}, "checkpoints": {}, "rows": rows}, tmp_path / "0.json")
    merged = json.loads(merge([path], tmp_path / "latency.json").read_text())["results"]
    assert merged["rows"] == json.loads(json.dumps(rows))  # both kept: not the same cell
