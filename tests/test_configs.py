"""Service configs as files (vla_rl/core/configs.py) and `--config FILE` on the service commands: a config
round-trips through JSON, secrets never go in, a bad file is one line naming the file and the key."""

from __future__ import annotations

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
        ({"store": "s", "mode": "slow"}, "c.json: mode: expected one of ['fast', 'safe'], got 'slow'"),
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
