"""The algorithm table: every trainer behind one name, one config class and one ``train`` call.

    from vla_rl.train.algorithms import ALGORITHMS, make_config, train
    cfg = make_config("qam", base="hub://org/arm@prod", store="runs/store", out="runs/qam", inv_temp=20)
    result = train(cfg)            # a TrainResult: checkpoint, seconds, metrics, curve, data
    train(cfg, on_progress=print)  # ... reporting {"stage", "step", "total_steps"} as it goes

Rounds, the CLI (``vla-rl train NAME``, ``vla-rl round start --algo NAME``), presets and benchmarks all go
through this table, so an algorithm is added in one place. Modules are imported on first use: listing
the table imports no torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from vla_rl.train.base import ProgressCallback, TrainerConfig, TrainResult, reporting_progress


@dataclass(frozen=True)
class Algorithm:
    name: str
    summary: str
    """One line for ``--help`` and the dashboard."""
    config_path: str
    """``module:ConfigClass`` (a TrainerConfig subclass)."""
    train_path: str
    """``module:train_function`` taking that config and returning a TrainResult."""
    fixed: Mapping[str, Any] = field(default_factory=dict)
    """Config fields this name implies (e.g. ``variant="recap"``); a caller may not set them otherwise."""

    def config_class(self) -> type[TrainerConfig]:
        return _load(self.config_path)

    def make_config(self, **values: Any) -> TrainerConfig:
        """The algorithm's config from ``values`` plus its fixed fields; unknown or clashing names raise
        a ValueError that lists what is allowed."""
        cls = self.config_class()
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"{unknown[0]}: not a {cls.__name__} field; expected one of {sorted(names)}")
        for k, v in self.fixed.items():
            if k in values and values[k] != v:
                raise ValueError(f"{k}: the {self.name} algorithm fixes it to {v!r}, got {values[k]!r}")
        return cls(**{**values, **self.fixed})

    def run(self, cfg: TrainerConfig) -> TrainResult:
        return _load(self.train_path)(cfg)


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


_PPO = ("vla_rl.train.ppo:PPOConfig", "vla_rl.train.ppo:train_ppo")
_AWR = ("vla_rl.train.awr:AWRConfig", "vla_rl.train.awr:train_awr")

ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm(
            "sft",
            "flow-matching behaviour cloning from scratch on the selected episodes",
            "vla_rl.train.sft:SFTConfig",
            "vla_rl.train.sft:train_sft",
        ),
        Algorithm(
            "awr", "advantage-weighted regression, human interventions as plain BC", *_AWR, {"variant": "awr"}
        ),
        Algorithm("recap", "advantage-conditioned policy (π0.6's RECAP)", *_AWR, {"variant": "recap"}),
        Algorithm(
            "awr-pi",
            "online AWR policy iteration: collect with the current policy, refit the value, AWR updates",
            "vla_rl.train.awr_pi:AWRPIConfig",
            "vla_rl.train.awr_pi:train_awr_pi",
        ),
        Algorithm(
            "qam",
            "Q-learning with adjoint matching: offline, then optionally online in simulation",
            "vla_rl.train.qam:QAMConfig",
            "vla_rl.train.qam:train_qam",
        ),
        Algorithm(
            "fql",
            "flow Q-learning: a one-step policy distilled from the BC flow against Q (offline)",
            "vla_rl.train.fql:FQLConfig",
            "vla_rl.train.fql:train_fql",
        ),
        Algorithm(
            "distill",
            "few-step head: distil the base's K-step sampler into a K = 1 or 2 student (--student-steps)",
            "vla_rl.train.fewstep:DistillConfig",
            "vla_rl.train.fewstep:train_distill",
        ),
        Algorithm("flow-noise", "π-RL Flow-Noise PPO, online in simulation", *_PPO, {"method": "noise"}),
        Algorithm("flow-sde", "π-RL Flow-SDE PPO, online in simulation", *_PPO, {"method": "sde"}),
    )
}


def get_algorithm(name: str) -> Algorithm:
    if name not in ALGORITHMS:
        raise ValueError(f"algo: expected one of {', '.join(ALGORITHMS)}, got {name!r}")
    return ALGORITHMS[name]


def make_config(name: str, **values: Any) -> TrainerConfig:
    return get_algorithm(name).make_config(**values)


def train(cfg: TrainerConfig, on_progress: ProgressCallback | None = None) -> TrainResult:
    """Run the trainer ``cfg`` belongs to; ``on_progress`` receives its step counts
    (:class:`vla_rl.train.base.StepProgress`) as it goes (None: whoever listens around the call)."""
    if on_progress is None:
        return get_algorithm(cfg.algorithm).run(cfg)
    with reporting_progress(on_progress):
        return get_algorithm(cfg.algorithm).run(cfg)
