"""Episode-seed ranges (vla_rl/core/seeds.py): online training never collects from an evaluation's seeds."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from vla_rl.core.seeds import EVAL, ONLINE, SeedOverlapError, check_disjoint
from vla_rl.train.algorithms import make_config
from vla_rl.train.awr_pi import AWRPIConfig, iteration_seed
from vla_rl.train.presets import PRESETS, preset_config


def test_check_disjoint_names_the_run_and_both_ranges() -> None:
    check_disjoint(range(100, 200), {"a": range(200, 300), "b": range(0, 100)})  # touching is fine
    with pytest.raises(
        SeedOverlapError,
        match=r"eval seeds 100\.\.199 overlap the training episodes of "
        r"awr-pi \(seeds 150\.\.159\)",
    ):
        check_disjoint(range(100, 200), {"ok": range(0, 10), "awr-pi": range(150, 160)})
    assert issubclass(SeedOverlapError, ValueError)


@pytest.mark.parametrize(
    ("episodes", "robots", "env_steps"), [(30, 2, 100_000), (5, 3, 97), (1, 4, 10), (7, 7, 7)]
)
def test_awr_pi_collection_seeds_cover_the_worst_case(
    tmp_path: Path, episodes: int, robots: int, env_steps: int
) -> None:
    """Worst case: every episode lasts one step, so every iteration spends E steps and starts E + N - 1
    episodes (robot i's j-th at ``iteration_seed + i + j N``) until the budget is gone."""
    cfg = AWRPIConfig(
        base="b",
        store=tmp_path,
        out=tmp_path,
        episodes_per_iteration=episodes,
        num_envs=robots,
        env_steps=env_steps,
    )
    seeds, spent, k = set(), 0, 0
    while spent < env_steps:
        started = [i + j * robots for j in range(episodes + robots) for i in range(robots)]
        seeds |= {iteration_seed(cfg, k) + s for s in started if s < episodes + robots - 1}
        spent, k = spent + episodes, k + 1
    allowed = cfg.collection_seeds()
    assert min(seeds) == allowed.start == ONLINE and max(seeds) < allowed.stop
    assert len(allowed) <= (math.ceil(env_steps / episodes) + 1) * (episodes + robots)


def test_every_online_default_and_preset_trains_above_every_evaluation(tmp_path: Path) -> None:
    held_out = range(EVAL, ONLINE)  # evaluation 100000+, benchmark finals 200000+, probes 300000+
    common = {"base": "b", "out": tmp_path}
    configs = {
        "awr-pi": make_config("awr-pi", store=tmp_path, **common),
        "qam": make_config("qam", store=tmp_path, env_steps=100_000, **common),
        "flow-sde": make_config("flow-sde", task="kinematic/Reach-v0", env_steps=100_000, **common),
    }
    for name, p in PRESETS.items():
        values = {"task": "kinematic/Reach-v0"} if p.algorithm.startswith("flow-") else {"store": tmp_path}
        configs[name] = preset_config(name, **common, **values)
    online = {n: c.collection_seeds() for n, c in configs.items() if hasattr(c, "collection_seeds")}
    assert {"awr-pi", "qam", "flow-sde", "pickcube-awr-pi", "kinematic-flow-noise"} <= set(online)
    check_disjoint(held_out, online)
    for name, seeds in online.items():
        assert seeds.start >= ONLINE, name


def test_ppo_refuses_a_final_evaluation_on_its_own_training_episodes(tmp_path: Path) -> None:
    kw = {"base": "b", "out": tmp_path, "task": "kinematic/Reach-v0", "env_steps": 1000, "num_envs": 4}
    cfg = make_config("flow-sde", **kw, final_eval_episodes=50)  # evaluation 100000+, training 1000000+
    assert cfg.final_eval_seed == EVAL and cfg.collection_seeds() == range(ONLINE, ONLINE + 1004)
    with pytest.raises(SeedOverlapError, match="overlap the training episodes of ppo"):
        make_config("flow-sde", **kw, final_eval_episodes=50, final_eval_seed=ONLINE + 900)


def test_bench_rl_refuses_to_evaluate_on_the_demos_seeds(tmp_path: Path) -> None:
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "bench.rl", "--seeds", "1", "--eval-seed", "10005", "--work", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert r.returncode == 2, r.stderr
    assert "overlap the training episodes of demos (seeds 10000..10029)" in r.stderr
    assert "Traceback" not in r.stderr and not any(tmp_path.iterdir())  # refused before any work
