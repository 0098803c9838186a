"""`vla-rl up --operator-mode requests`: the loop's fleet runs the requests mode (robots ask in the help
queue, simulated operators claim there) with the reaction time and spot checks given; the default is
today's omniscient operator; the fleet child's saved config carries the rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.fleet_runner import FleetConfig
from vla_rl.core import configs
from vla_rl.up import loop
from vla_rl.up.config import UpConfig
from vla_rl.up.workdir import Ports


def _fleet(cfg: UpConfig, tmp_path: Path) -> FleetConfig:
    run = loop._Run(
        cfg, None, None, tmp_path, tmp_path / "store", "p", "sqlite://", Ports(1, 2, 3, 4), {}, "p"
    )  # type: ignore[arg-type]
    return run.fleet(1, 2)


def test_the_loops_fleet_answers_the_help_queue_in_requests_mode(tmp_path: Path) -> None:
    assert _fleet(UpConfig(workdir=tmp_path), tmp_path).rules.mode == "omniscient"  # the default
    cfg = UpConfig(
        workdir=tmp_path, operator_mode="requests", operators=2, reaction_s=0.25, spot_check_prob=0.01
    )
    fleet = _fleet(cfg, tmp_path)
    rules = fleet.rules
    assert (rules.mode, rules.failure_alarm, rules.reaction_s, rules.spot_check_prob) == (
        "requests",
        True,
        0.25,
        0.01,
    )
    assert fleet.operators == 2
    saved = configs.save(fleet, tmp_path / "fleet.json")  # what the fleet child reads
    again = FleetConfig(**configs.load(FleetConfig, saved))
    assert again.rules == rules
    assert "2 simulated operators answer the help queue" in loop._fleet_line(cfg)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"operator_mode": "psychic"}, "operator_mode"),
        ({"operator_mode": "requests", "reaction_s": -1.0}, "reaction_s"),
        ({"operator_mode": "requests", "spot_check_prob": 2.0}, "spot_check_prob"),
    ],
)
def test_the_operator_flags_are_validated_naming_the_field(tmp_path: Path, kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        UpConfig(workdir=tmp_path, **kwargs)
