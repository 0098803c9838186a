"""Named training recipes: a setting that won a benchmark is a name, not a shell snippet.

    vla-rl train qam --preset kinematic-qam-pi --base B --store S --out O
    vla-rl round start --preset kinematic-qam-pi --base hub://org/arm@prod --store S

    from vla_rl.train.presets import preset_config
    cfg = preset_config("kinematic-qam-pi", base=..., store=..., out=..., seed=1)

A preset fixes an algorithm and some of its knobs; everything else keeps the config's default, and any
knob can still be overridden (command-line flags after ``--preset``, or keyword arguments). Where each
recipe was measured: docs/benchmarks.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vla_rl.train.algorithms import get_algorithm
from vla_rl.train.base import TrainerConfig

_MEASURED = "measured: docs/benchmarks.md, Against the published anchors"
"""Where a recipe's --help points for its numbers (a summary says what the recipe is, not what it scored)."""


@dataclass(frozen=True)
class Preset:
    name: str
    algorithm: str
    summary: str
    values: Mapping[str, Any]


# The kinematic test bed's small policy (d_model 64, H = 4, no instruction encoder: one task).
_KINEMATIC_SFT = {"chunk_len": 4, "n_exec": 2, "d_model": 64, "instruction_encoder": "none", "batch_size": 64}
# QAM on the kinematic test bed: a 5 x (2 x 256) critic ensemble on the state, steps-to-go reward,
# 1,000 Monte-Carlo then TD critic updates before the actor starts.
_KINEMATIC_QAM = {
    "reward": "steps_to_go",
    "flow_steps": 10,
    "members": 5,
    "critic_hidden": (256, 256),
    "batch_size": 128,
    "critic_mc_steps": 1000,
    "critic_warmup": 2000,
    "eval_every": 500,
    "eval_every_episodes": 50,
    "threads": 1,
}
_KINEMATIC_PPO = {"actor_lr": 3e-5, "rollout_steps": 200, "num_envs": 4, "env_steps": 40_000, "threads": 1}

# online AWR on PickCube state: 30 episodes per iteration on 2 robots, a short fresh value, 500 updates
_PICKCUBE_AWR_PI: dict[str, Any] = {
    "env_steps": 100_000,
    "episodes_per_iteration": 30,
    "num_envs": 2,
    "steps_per_iteration": 500,
    "value_steps": 300,
    "batch_size": 128,
    "lr": 1e-4,
    "beta": 0.3,
    "threads": 1,
}

# TD(λ) advantages on the shaped reward (success plus potential-based dense progress)
_SHAPED_ADVANTAGES: dict[str, Any] = {"reward": "shaped", "gamma": 0.99, "advantage_lambda": 0.9}
_PICKCUBE_AWR_PI_SHAPED: dict[str, Any] = {**_PICKCUBE_AWR_PI, **_SHAPED_ADVANTAGES, "env_steps": 50_000}

# offline AWR on the fleet's rollouts + demos: sharp weights, 6,000 updates
_PICKCUBE_AWR_OFFLINE: dict[str, Any] = {"beta": 0.1, "steps": 6000}

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "kinematic-sft",
            "sft",
            "the deliberately weak base of the kinematic benchmark: a small policy, 1,000 steps",
            {**_KINEMATIC_SFT, "steps": 1000, "threads": 1},
        ),
        Preset(
            "kinematic-qam-offline",
            "qam",
            "QAM offline on demos + rollouts, λ = 10: 1,000 MC + 1,000 TD critic updates, then 1,000 with the actor",
            {**_KINEMATIC_QAM, "inv_temp": 10.0, "offline_steps": 3000},
        ),
        Preset(
            "kinematic-qam-pi",
            "qam",
            "QAM offline-to-online as policy iteration: 40k env steps at one critic update per env step "
            "(TD targets from a cached fine-policy snapshot), the actor every 20th update, re-anchored",
            {
                **_KINEMATIC_QAM,
                "inv_temp": 20.0,
                "offline_steps": 4000,
                "env_steps": 40_000,
                "utd": 1.0,
                "actor_every": 20,
                "next_action_cache": 2000,
                "num_envs": 2,
                "reanchor_every": 10_000,
                "eval_every": 2500,
            },
        ),
        Preset(
            "kinematic-flow-noise", "flow-noise", "Flow-Noise PPO, 4 robots, 40k env steps", _KINEMATIC_PPO
        ),
        Preset(
            "kinematic-flow-sde-all",
            "flow-sde",
            "Flow-SDE PPO with every denoising step stochastic (the exact joint), 4 robots, 40k env steps",
            {**_KINEMATIC_PPO, "sde_steps": "all"},
        ),
        Preset(
            "kinematic-awr-pi",
            "awr-pi",
            "online AWR policy iteration on the kinematic test bed: 20 episodes per iteration, 200 AWR updates, "
            "12,000 env steps (the slow learning check in tests/test_awr_pi.py runs 4,000)",
            {
                "env_steps": 12_000,
                "episodes_per_iteration": 20,
                "num_envs": 2,
                "steps_per_iteration": 200,
                "value_steps": 500,
                "batch_size": 64,
                "lr": 1e-4,
                "threads": 1,
            },
        ),
        Preset(
            "pickcube-awr-pi",
            "awr-pi",
            "online AWR policy iteration on PickCube state: 30 episodes per iteration on 2 robots, a fresh "
            "cross-fitted value (300 steps), 500 greedy AWR updates (β = 0.3, lr 1e-4 kept), up to 100,000 env steps",
            _PICKCUBE_AWR_PI,
        ),
        Preset(
            "pickcube-awr-pi-shaped",
            "awr-pi",
            "pickcube-awr-pi with TD(λ = 0.9) advantages on the shaped reward (success plus potential-based "
            f"dense progress, γ 0.99) over 50,000 env steps ({_MEASURED})",
            _PICKCUBE_AWR_PI_SHAPED,
        ),
        Preset(
            "pickcube-awr-pi-hindsight",
            "awr-pi",
            "pickcube-awr-pi-shaped plus one hindsight copy of each failed episode (the goal relabelled to where "
            f"the cube was brought, cloned at weight 4) over 25,000 env steps ({_MEASURED}). Goal-conditioned "
            "tasks only (train/hindsight.py)",
            {**_PICKCUBE_AWR_PI_SHAPED, "hindsight_weight": 4.0, "env_steps": 25_000},
        ),
        Preset(
            "pixels-awr-pi-privileged",
            "awr-pi",
            "pickcube-awr-pi-shaped for camera policies: the value reads the simulator's privileged state "
            "(training only; the policy sees pixels + proprioception), 500 updates of batch 64 an iteration, "
            f"9,000 env steps ({_MEASURED}). Simulated episodes recorded with their seed only "
            "(train/privileged.py)",
            {**_PICKCUBE_AWR_PI_SHAPED, "value_input": "privileged", "batch_size": 64, "env_steps": 9000},
        ),
        Preset(
            "pickcube-awr-offline",
            "awr",
            "offline AWR on the fleet's rollouts + demos, sharp weights (β 0.1) and 6,000 updates "
            f"({_MEASURED}); for goal-conditioned tasks see pickcube-awr-offline-hindsight",
            _PICKCUBE_AWR_OFFLINE,
        ),
        Preset(
            "pickcube-awr-offline-hindsight",
            "awr",
            "pickcube-awr-offline with the shaped TD(λ = 0.9) value and one hindsight copy of each failed "
            f"episode (the goal relabelled to where the cube was brought, cloned at weight 4; {_MEASURED}). "
            "Goal-conditioned tasks only (train/hindsight.py)",
            {**_PICKCUBE_AWR_OFFLINE, **_SHAPED_ADVANTAGES, "hindsight_weight": 4.0},
        ),
        Preset(
            "tiny-awr",
            "awr",
            "AWR at a smoke-test budget (20 value + 20 policy steps): `vla-rl up` in CI, not a recipe that learns",
            {"value_steps": 20, "steps": 20, "batch_size": 32, "warmup_steps": 5},
        ),
    )
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"preset: expected one of {', '.join(PRESETS)}, got {name!r}")
    return PRESETS[name]


def preset_config(name: str, **values: Any) -> TrainerConfig:
    """The preset's config with ``values`` (the run's base, store, out, ... and any overrides) on top."""
    p = get_preset(name)
    return get_algorithm(p.algorithm).make_config(**{**p.values, **values})
