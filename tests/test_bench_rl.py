"""bench/rl.py's knob merging (no training, no simulator; instant)."""

from __future__ import annotations

from bench.rl import preset_knobs
from vla_rl.train.presets import get_preset


def test_a_preset_in_the_bench_runs_on_the_benchs_env_step_budget() -> None:
    """The preset's env_steps (a round's 100,000) must not silently replace --env-steps, which the JSON
    reports as the budget; the other knobs come from the preset, and explicit overrides win over both."""
    preset = get_preset("pickcube-awr-pi-shaped").values
    assert preset["env_steps"] == 100_000
    knobs = preset_knobs("pickcube-awr-pi-shaped", {"advantage_lambda": 0.7})
    assert "env_steps" not in knobs
    assert (
        knobs["advantage_lambda"] == 0.7 and knobs["reward"] == "shaped" and knobs["beta"] == preset["beta"]
    )
    assert preset_knobs("pickcube-awr-pi-shaped", {"env_steps": 30_000})["env_steps"] == 30_000
