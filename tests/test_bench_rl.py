"""bench/rl.py's knob merging and its training cache (no training, no simulator; seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.rl import check_cached_knobs, knobs, preset_knobs
from vla_rl.train.algorithms import make_config
from vla_rl.train.presets import get_preset


def test_a_preset_in_the_bench_runs_on_the_benchs_env_step_budget() -> None:
    """The preset's env_steps (a round's 50,000) must not silently replace --env-steps, which the JSON
    reports as the budget; the other knobs come from the preset, and explicit overrides win over both."""
    preset = get_preset("pickcube-awr-pi-shaped").values
    assert preset["env_steps"] == 50_000
    knobs = preset_knobs("pickcube-awr-pi-shaped", {"advantage_lambda": 0.7})
    assert "env_steps" not in knobs
    assert (
        knobs["advantage_lambda"] == 0.7 and knobs["reward"] == "shaped" and knobs["beta"] == preset["beta"]
    )
    assert preset_knobs("pickcube-awr-pi-shaped", {"env_steps": 30_000})["env_steps"] == 30_000


def test_a_cached_training_result_is_reused_only_with_the_same_knobs(tmp_path: Path) -> None:
    """A cached run of other knobs (here: a smaller budget) is refused with the knob named, never
    reported under the new settings; the same knobs, or a result cached before knobs were recorded, pass."""
    values = {"base": "b", "store": tmp_path / "s", "out": tmp_path / "o", "progress": False}
    cfg = make_config("awr-pi", **values, env_steps=25_000)
    cache = tmp_path / "awr-pi.train.json"
    check_cached_knobs(cache, {"config": knobs(cfg)}, cfg)
    check_cached_knobs(cache, {"checkpoint": "c"}, cfg)
    shown = make_config("awr-pi", **{**values, "progress": True}, env_steps=25_000)
    check_cached_knobs(cache, {"config": knobs(cfg)}, shown)  # the progress display is not a knob
    old = {"config": knobs(make_config("awr-pi", **values, env_steps=15_000))}
    with pytest.raises(
        SystemExit,
        match=r"awr-pi\.train\.json: cached training used other knobs \(env_steps 15000 -> 25000\)",
    ):
        check_cached_knobs(cache, old, cfg)
    # a knob added to the config since (here: hindsight_weight) matches at its default, not otherwise
    before = {"config": {k: v for k, v in knobs(cfg).items() if k != "hindsight_weight"}}
    check_cached_knobs(cache, before, cfg)
    with pytest.raises(SystemExit, match=r"other knobs \(hindsight_weight 0\.0 -> 2\.0\)"):
        check_cached_knobs(
            cache, before, make_config("awr-pi", **values, env_steps=25_000, hindsight_weight=2.0)
        )
