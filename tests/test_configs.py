"""Service configs as files (vla_rl/core/configs.py) and `--config FILE` on the service commands: a config
round-trips through JSON, secrets never go in, a bad file is one line naming the file and the key."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from vla_rl.core import configs
from vla_rl.core.configs import SECRET


@dataclass
class Inner:
    rate: float = 1.0
    names: tuple[str, ...] = ("a",)


@dataclass
class Service:
    store: Path
    port: int = 1
    mode: Literal["fast", "safe"] = "safe"
    wal: Path | None = None
    inner: Inner = field(default_factory=Inner)
    pair: tuple[int, float] = (1, 2.0)
    token: str | None = field(default=None, metadata=SECRET)

    def __post_init__(self) -> None:
        if self.port < 0:
            raise ValueError(f"port: expected >= 0, got {self.port}")


def test_round_trip_through_a_file_leaves_secrets_out(tmp_path: Path) -> None:
    cfg = Service(Path("/data/s"), 5, "fast", Path("w"), Inner(0.5, ("x", "y")), (3, 4.5), token="hunter2")
    path = configs.save(cfg, tmp_path / "c" / "service.json")
    text = path.read_text()
    assert "hunter2" not in text and "token" not in json.loads(text)
    back = configs.from_dict(Service, json.loads(text))
    assert back == Service(Path("/data/s"), 5, "fast", Path("w"), Inner(0.5, ("x", "y")), (3, 4.5))
    assert (
        isinstance(back.store, Path)
        and isinstance(back.inner.names, tuple)
        and isinstance(back.pair[1], float)
    )
    assert configs.load(Service, path) == configs.values(Service, json.loads(text))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"store": "s", "prot": 2},
            "c.json: unknown key(s) ['prot']; Service has ['inner', 'mode', 'pair', ",
        ),
        ({"store": "s", "token": "t"}, "c.json: token is a secret and is never read from a config file"),
        ({"store": 3}, "c.json: store: expected a path (string), got 3"),
        ({"store": "s", "port": "80"}, "c.json: port: expected an integer, got '80'"),
        ({"store": "s", "port": True}, "c.json: port: expected an integer, got True"),
        ({"store": "s", "mode": "slow"}, "c.json: mode: expected fast or safe, got 'slow'"),
        ({"store": "s", "inner": {"rate": "x"}}, "c.json: inner: rate: expected a number, got 'x'"),
        ({"store": "s", "inner": {"names": ["a", 2]}}, "c.json: inner: names[1]: expected a string, got 2"),
        ({"store": "s", "pair": [1]}, "c.json: pair: expected a list of 2 values, got 1"),
        ({"store": "s", "wal": 5}, "c.json: wal: expected a path (string), got 5"),
        (["store"], "c.json: expected a JSON object of Service's fields, got list"),
    ],
)
def test_a_bad_value_is_named(data: Any, message: str) -> None:
    with pytest.raises(ValueError) as e:
        configs.values(Service, data, "c.json")
    assert str(e.value).startswith(message), str(e.value)


def test_the_config_validates_itself_and_files_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="port: expected >= 0, got -1"):
        configs.from_dict(Service, {"store": "s", "port": -1})
    with pytest.raises(ValueError, match="no such config file"):
        configs.load(Service, tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"bad.json: not JSON \(.* at line 1 column 2\)"):
        configs.load(Service, tmp_path / "bad.json")


def test_hub_serve_reads_its_config_file_and_flags_win(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vla_rl.cli import main
    from vla_rl.hub import server
    from vla_rl.hub.config import HubConfig
    from vla_rl.hub.limits import Limits

    got: list[HubConfig] = []
    monkeypatch.setattr(server, "serve", lambda config, **kw: got.append(config))
    monkeypatch.setenv("VLA_RL_HUB_TOKEN", "from-env")
    written = HubConfig(data=tmp_path / "hub", port=0, limits=Limits(max_json_bytes=777), token="not-saved")
    path = configs.save(written, tmp_path / "hub.json")
    assert "not-saved" not in path.read_text()
    assert main(["hub", "serve", "--config", str(path), "--max-commit-bytes", "4242"]) == 0
    [cfg] = got
    assert cfg.data == tmp_path / "hub" and cfg.port == 0
    assert cfg.limits == Limits(max_json_bytes=777, max_commit_bytes=4242)  # the file's, then the flag's
    assert cfg.resolved_token() == "from-env"  # secrets come from the environment, never the file


def test_a_bad_config_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vla_rl.cli import main

    path = tmp_path / "hub.json"
    path.write_text(json.dumps({"port": 0, "tokn": "x"}))
    assert main(["hub", "serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith(f"error: --config {path}: unknown key(s) ['tokn']; HubConfig has ") and "\n" not in err
    )
    path.write_text(json.dumps({"port": 0, "token": "x"}))
    assert main(["hub", "serve", "--config", str(path)]) == 2
    assert "token is a secret" in capsys.readouterr().err


# ------------------------------------------------------------------------- knob bounds (issue 45 item 4)
HOSTILE = [
    ({"batch_size": 10**12}, "batch_size: expected 1..1_048_576"),
    ({"steps": 10**15}, "steps: expected 0..1_000_000_000"),
    ({"threads": 100_000}, "threads: expected 0..1024"),
    ({"lr": float("inf")}, "lr: expected a finite number"),
    ({"lr": float("nan")}, "lr: expected a finite number"),
    ({"steps": 1.5}, "steps: expected an integer"),
    ({"steps": True}, "steps: expected an integer"),
    ({"seed": -1}, "seed: expected 0..2_147_483_647"),
    ({"device": "cuda:99"}, "device: expected one of"),
    ({"value_steps": 10**30}, "value_steps: expected 0..1_000_000_000"),
]


@pytest.mark.parametrize(
    ("knob", "message"), HOSTILE, ids=[next(iter(k)) + "-" + str(i) for i, (k, _) in enumerate(HOSTILE)]
)
def test_every_algorithm_refuses_hostile_knobs_naming_them(knob: dict[str, Any], message: str) -> None:
    """The trainer configs bound their own knobs, so the CLI, the dashboard's API and the round queue (which
    all build them) refuse the same values the same way, before anything allocates or trains."""
    from vla_rl.train.algorithms import ALGORITHMS, make_config

    for name, algo in ALGORITHMS.items():
        fields = {f.name for f in dataclasses.fields(algo.config_class())}
        if not set(knob) <= fields:
            continue
        with pytest.raises(ValueError) as e:
            make_config(name, base="hub://org/arm@prod", store=Path("s"), out=Path("o"), **knob)
        # the shared check's message, or the algorithm's own (run first) for the same field
        field = next(iter(knob))
        assert str(e.value).startswith(message) or str(e.value).startswith(f"{field}: expected"), (
            name,
            str(e.value),
        )


def test_defaults_presets_and_rounds_stay_valid_and_round_options_are_bounded() -> None:
    from vla_rl.rounds import RoundConfig
    from vla_rl.train.algorithms import ALGORITHMS, make_config
    from vla_rl.train.presets import PRESETS, preset_config

    common = {"base": "hub://org/arm@prod", "store": Path("s"), "out": Path("o")}
    for name in ALGORITHMS:
        make_config(name, **common)
    for name in PRESETS:
        preset_config(name, **common)
    train = make_config("awr", **common)
    for bad, message in [
        ({"eval_envs": 100_000}, "eval_envs: expected 1..256"),
        ({"eval_episodes": 0}, "eval_episodes: expected 1..100_000"),
        ({"repo": "../../x"}, "repo: expected org/name"),
        ({"promote_ref": "../x"}, "promote_ref: invalid revision"),
        ({"promote_ref": "main"}, "promote_ref: expected a tag or branch other than main"),
        ({"margin": float("inf")}, "margin: expected a finite number"),
    ]:
        with pytest.raises(ValueError) as e:
            RoundConfig(train=train, **bad)
        assert str(e.value).startswith(message), str(e.value)
