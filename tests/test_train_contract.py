"""The trainer contract, the algorithm table and named presets, and the CLI generated from them.

One path for every algorithm: ``make_config`` / ``preset_config`` -> a TrainerConfig -> ``train`` -> a
TrainResult; ``vla-rl train NAME`` and ``vla-rl round start --algo NAME`` parse the same config dataclass.
The CLI tests replace the (slow) training call with a recorder, so they check parsing, presets and
overrides exactly, in-process.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import pytest

import vla_rl.rounds
import vla_rl.train.algorithms
from vla_rl.cli import main
from vla_rl.rounds import RoundConfig
from vla_rl.train.algorithms import ALGORITHMS, make_config
from vla_rl.train.base import TrainerConfig, TrainResult
from vla_rl.train.presets import PRESETS, get_preset, preset_config


def _required(tmp_path: Path) -> dict[str, Any]:
    return {"base": str(tmp_path / "base"), "store": tmp_path / "store", "out": tmp_path / "out"}


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_algorithm_takes_the_common_config_and_returns_the_common_result(
    name: str, tmp_path: Path
) -> None:
    alg = ALGORITHMS[name]
    cls = alg.config_class()
    assert issubclass(cls, TrainerConfig)
    cfg = make_config(name, **_required(tmp_path))
    assert cfg.algorithm == name  # the lineage / round name follows from the config
    common = {f.name for f in dataclasses.fields(TrainerConfig)}
    assert common <= {f.name for f in dataclasses.fields(cls)}
    ret = typing.get_type_hints(vla_rl.train.algorithms._load(alg.train_path))["return"]
    assert issubclass(ret, TrainResult), f"{alg.train_path} returns {ret}"


def test_common_fields_are_checked_once_for_all(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="device: expected one of"):
        make_config("qam", **_required(tmp_path), device="tpu")
    with pytest.raises(ValueError, match=r"threads: expected 0\.\.1024"):
        make_config("awr", **_required(tmp_path), threads=-1)
    with pytest.raises(ValueError, match="base: AWRConfig needs a base checkpoint"):
        make_config("awr", store=tmp_path, out=tmp_path)
    with pytest.raises(ValueError, match="store: QAMConfig needs an episode store"):
        make_config("qam", base="b", out=tmp_path, store=None)
    assert make_config("flow-noise", base="b", out=tmp_path).store is None  # PPO reads no store
    assert make_config("sft", store=tmp_path, out=tmp_path).base is None  # SFT trains from scratch
    assert make_config("qam", **_required(tmp_path), device="cuda:1").device == "cuda:1"


def test_presets_are_valid_configs_of_their_algorithm(tmp_path: Path) -> None:
    assert PRESETS, "no presets"
    for name, p in PRESETS.items():
        assert p.algorithm in ALGORITHMS, name
        cfg = preset_config(name, **_required(tmp_path))
        assert cfg.algorithm == p.algorithm
        for k, v in p.values.items():
            got = getattr(cfg, k)
            assert got == (tuple(v) if isinstance(got, tuple) else v), (name, k)
    # the recipe behind the kinematic benchmark's +35 (docs/benchmarks.md), by name
    pi = preset_config("kinematic-qam-pi", **_required(tmp_path), seed=2)
    assert (pi.utd, pi.actor_every, pi.next_action_cache, pi.reanchor_every) == (1.0, 20, 2000, 10_000)
    assert (pi.inv_temp, pi.env_steps, pi.members, pi.critic_hidden, pi.seed) == (
        20.0,
        40_000,
        5,
        (256, 256),
        2,
    )
    assert preset_config("kinematic-qam-pi", **_required(tmp_path), inv_temp=5.0).inv_temp == 5.0
    with pytest.raises(ValueError, match="preset: expected one of"):
        get_preset("no-such-recipe")


# ---------------------------------------------------------------------------- the CLI path
@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Any]:
    """Record what the CLI would train (or run as a round) instead of training."""
    calls: list[Any] = []

    def fake_train(cfg: TrainerConfig) -> TrainResult:
        calls.append(cfg)
        return TrainResult(checkpoint=tmp_path / "ckpt", seconds=1.0, metrics={"eval_success": 0.5})

    def fake_round(cfg: RoundConfig) -> Any:
        calls.append(cfg)
        raise vla_rl.rounds.RoundError("recorded")

    monkeypatch.setattr(vla_rl.train.algorithms, "train", fake_train)
    monkeypatch.setattr(vla_rl.rounds, "start_round", fake_round)
    (tmp_path / "base").mkdir()
    return calls


def _args(tmp_path: Path) -> list[str]:
    return [
        "--base",
        str(tmp_path / "base"),
        "--store",
        str(tmp_path / "store"),
        "--out",
        str(tmp_path / "o"),
    ]


def test_train_command_is_the_config_with_a_preset_and_overrides(
    recorded: list[Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "train",
        "qam",
        "--preset",
        "kinematic-qam-pi",
        *_args(tmp_path),
        "--inv-temp",
        "7",
        "--no-progress",
    ]
    assert main(argv) == 0
    (cfg,) = recorded
    assert type(cfg).__name__ == "QAMConfig" and cfg.inv_temp == 7.0 and not cfg.progress
    assert (cfg.utd, cfg.actor_every, cfg.critic_hidden) == (1.0, 20, (256, 256))  # from the preset
    assert cfg.base == str(tmp_path / "base") and cfg.out == tmp_path / "o"
    assert "eval success 50%" in capsys.readouterr().out
    # critic_hidden takes several values; tuples stay tuples
    assert main(["train", "qam", *_args(tmp_path), "--critic-hidden", "32", "16"]) == 0
    assert recorded[-1].critic_hidden == (32, 16) and recorded[-1].inv_temp == 10.0  # no preset: defaults


def test_train_command_refuses_what_its_name_fixes_and_foreign_presets(
    recorded: list[Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(["train", "flow-noise", "--base", str(tmp_path / "base"), "--out", "o", "--method", "sde"]) == 2
    )
    assert "--method: the flow-noise command fixes it to noise" in capsys.readouterr().err
    assert main(["train", "sft", "--preset", "kinematic-qam-pi", "--store", "s", "--out", "o"]) == 2
    assert "is a recipe for qam, not sft" in capsys.readouterr().err
    assert main(["train", "qam", *_args(tmp_path), "--inv-temp", "-1"]) == 2  # __post_init__, via tyro
    assert "inv_temp" in capsys.readouterr().err
    assert main(["train", "qam", *_args(tmp_path), "--no-such-knob", "1"]) == 2
    assert "--no-such-knob" in capsys.readouterr().err
    assert main(["train", "nope"]) == 2 and "no command 'train nope'" in capsys.readouterr().err
    assert not recorded


def test_round_start_takes_the_same_flags_plus_the_rounds(
    recorded: list[Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["round", "start", "--preset", "kinematic-qam-pi", *_args(tmp_path), "--inv-temp", "12"]
    assert (
        main([*argv, "--margin", "0.05", "--no-push", "--eval-episodes", "7"]) == 2
    )  # the fake round raises
    assert "recorded" in capsys.readouterr().err
    (rc,) = recorded
    assert isinstance(rc, RoundConfig) and rc.algo == "qam" and rc.preset == "kinematic-qam-pi"
    assert (rc.margin, rc.push, rc.eval_episodes) == (0.05, False, 7)
    assert rc.train.inv_temp == 12.0 and rc.train.actor_every == 20
    assert main(["round", "start", "--algo", "recap", *_args(tmp_path), "--no-push", "--beta", "0.5"]) == 2
    assert recorded[-1].train.variant == "recap" and recorded[-1].train.beta == 0.5
    assert main(["round", "start", *_args(tmp_path)]) == 2
    assert "--algo: expected one of" in capsys.readouterr().err
    assert main(["round", "start", "--help"]) == 0
    assert "kinematic-qam-pi" in capsys.readouterr().out  # the presets are listed
