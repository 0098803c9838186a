"""ServerConfig (server/config.py): the policy server's knobs typed once. Each refusal names its field
(and, through the CLI, its flag on one line); to_dict / from_dict round-trip every field through JSON and
refuse unknown keys; `vla-rl serve` parses its flags into exactly this class."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from server.config import MESSAGE_SLACK_BYTES, ServerConfig
from server.policy_server import PolicyServer
from vla_rl.cli import main
from vla_rl.cli.common import CliError, build_config, parse_config


def test_defaults_and_derived_values() -> None:
    from vla_rl.hub.checkpoint import DEFAULT_MAX_FILE_BYTES

    c = ServerConfig(checkpoint="hub://fleet/push@prod")
    assert c.max_file_bytes == DEFAULT_MAX_FILE_BYTES  # the same bound as the checkpoint loader's own
    assert c.models() == {"default": "hub://fleet/push@prod"} and c.follow_map() == {}
    assert ServerConfig(checkpoint="a", follow="self", model_id="m").follow_map() == {"m": "a"}
    assert ServerConfig(checkpoint="a", follow="hub://x/y@prod").follow_map() == {"default": "hub://x/y@prod"}
    assert ServerConfig(checkpoint="a", max_file_mb=1.5).max_file_bytes == 3 * 512 * 1024


BAD: list[tuple[dict[str, Any], str]] = [
    ({"checkpoint": ""}, "checkpoint: expected a non-empty string"),
    ({"follow": ""}, "follow: expected a non-empty string"),
    ({"follow_interval": 0}, "follow_interval: expected a number > 0"),
    ({"port": -1}, "port: expected an integer >= 0"),
    ({"port": 70000}, "port: expected 0..65535"),
    ({"port": "50061"}, "port: expected an integer"),
    ({"max_batch": 0}, "max_batch: expected an integer >= 1"),
    ({"max_wait_us": -1}, "max_wait_us: expected an integer >= 0"),
    ({"max_queue": 0}, "max_queue: expected an integer >= 1"),
    ({"adaptive_wait": "yes"}, "adaptive_wait: expected true or false"),
    ({"lone_inline_ms": -1.0}, "lone_inline_ms: expected milliseconds >= 0"),
    ({"lone_inline_ms": float("inf")}, "lone_inline_ms: expected milliseconds >= 0"),
    ({"tls_cert": Path("/nonexistent/cert.pem")}, "tls_key: expected both tls_cert"),
    ({"tls_key": Path("/nonexistent/key.pem")}, "tls_cert: expected both tls_cert"),
    ({"model_id": ""}, "model_id: expected a non-empty string"),
    ({"token_file": "secret.txt"}, "token_file: expected a path"),
    (
        {"max_message_bytes": MESSAGE_SLACK_BYTES - 1},
        f"max_message_bytes: expected an integer >= {MESSAGE_SLACK_BYTES}",
    ),
    ({"max_concurrent_rpcs": 0}, "max_concurrent_rpcs: expected an integer >= 1"),
    ({"max_peer_queued": 0}, "max_peer_queued: expected an integer >= 1"),
    ({"stream_write_timeout": 0.0}, "stream_write_timeout: expected a number > 0"),
    ({"load_timeout": -1.0}, "load_timeout: expected a number > 0"),
    ({"max_file_mb": 0}, "max_file_mb: expected a number > 0"),
    ({"max_noise_abs": float("nan")}, "max_noise_abs: expected a number > 0"),
    ({"max_state_abs": True}, "max_state_abs: expected a number > 0"),
    ({"log_interval": 0}, "log_interval: expected a number > 0"),
    ({"drain": -1}, "drain: expected seconds >= 0"),
    ({"drain": float("inf")}, "drain: expected seconds >= 0"),
    ({"torch_threads": 0}, "torch_threads: expected an integer >= 1"),
    ({"compile": "yes"}, "compile: expected one of ['off', 'auto', 'on'], got 'yes'"),
]


@pytest.mark.parametrize(("values", "message"), BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_each_refusal_names_its_field(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as err:
        ServerConfig(**({"checkpoint": "x"} | values))
    assert str(err.value).startswith(message), err.value


def test_tls_files_must_exist(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("pem")
    with pytest.raises(ValueError, match=r"tls_key: expected a PEM file, got .*key\.pem: no such file"):
        ServerConfig(checkpoint="x", tls_cert=cert, tls_key=key)
    key.write_text("pem")
    assert ServerConfig(checkpoint="x", tls_cert=cert, tls_key=key).tls_key == key


def test_to_dict_from_dict_round_trip_every_field(tmp_path: Path) -> None:
    (tmp_path / "cert.pem").write_text("pem")
    (tmp_path / "key.pem").write_text("pem")
    c = ServerConfig(
        checkpoint="hub://fleet/push@prod",
        follow="self",
        follow_interval=2.5,
        host="0.0.0.0",
        port=50099,
        max_batch=4,
        max_wait_us=100,
        adaptive_wait=False,
        tls_cert=tmp_path / "cert.pem",
        tls_key=tmp_path / "key.pem",
        max_queue=9,
        model_id="arm",
        canary="hub://org/arm@canary",
        canary_model_id="arm-canary",
        token_file=tmp_path / "token",
        device="cpu",
        max_message_bytes=2 * 1024 * 1024,
        max_concurrent_rpcs=7,
        max_peer_queued=3,
        max_peer_in_flight=5,
        stream_write_timeout=1.5,
        load_timeout=30.0,
        max_file_mb=12.0,
        max_noise_abs=5.0,
        max_state_abs=100.0,
        log_interval=1.0,
        drain=0.0,
        cache_dir=tmp_path / "cache",
        torch_threads=2,
        compile="auto",
        rtc_execution_horizon=6,
        rtc_max_guidance_weight=5.0,
        lone_inline_ms=5.0,
    )
    defaults = ServerConfig(checkpoint="other")
    changed = {f.name for f in dataclasses.fields(c) if getattr(c, f.name) != getattr(defaults, f.name)}
    assert changed == {f.name for f in dataclasses.fields(c)}, "the round trip below covers every field"
    d = c.to_dict()
    assert d["tls_cert"] == str(tmp_path / "cert.pem") and d["cache_dir"] == str(tmp_path / "cache")
    back = ServerConfig.from_dict(json.loads(json.dumps(d)))
    assert back == c and isinstance(back.token_file, Path)
    assert ServerConfig.from_dict({"checkpoint": "x"}) == ServerConfig(checkpoint="x")  # the rest: defaults
    assert ServerConfig.from_dict(defaults.to_dict()) == defaults  # None paths stay None


def test_from_dict_refuses_unknown_keys_and_bad_values() -> None:
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['tokn', 'zzz'\]"):
        ServerConfig.from_dict({"checkpoint": "x", "tokn": "s3cret", "zzz": 1})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['token'\]"):  # secrets are never config fields
        ServerConfig.from_dict({"checkpoint": "x", "token": "s3cret"})
    with pytest.raises(ValueError, match="checkpoint: required"):
        ServerConfig.from_dict({"port": 1})
    with pytest.raises(ValueError, match="max_batch: expected an integer >= 1"):
        ServerConfig.from_dict({"checkpoint": "x", "max_batch": 0})
    with pytest.raises(ValueError, match="expected a JSON object"):
        ServerConfig.from_dict(["x"])  # type: ignore[arg-type]


def test_the_cli_parses_into_server_config(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = parse_config(ServerConfig, ["--checkpoint", "x"], "vla-rl serve")
    assert type(cfg) is ServerConfig and cfg == ServerConfig(checkpoint="x")
    argv = [
        "--checkpoint",
        "x",
        "--follow",
        "self",
        "--no-adaptive-wait",
        "--max-file-mb",
        "2",
        "--port",
        "0",
    ]
    cfg = parse_config(ServerConfig, argv, "vla-rl serve")
    assert (cfg.follow, cfg.adaptive_wait, cfg.max_file_mb, cfg.port) == ("self", False, 2.0, 0)
    with pytest.raises(CliError, match=r"^--max-queue: expected an integer >= 1, got 0$"):
        parse_config(ServerConfig, ["--checkpoint", "x", "--max-queue", "0"], "vla-rl serve")
    with pytest.raises(CliError, match=r"^checkpoint required$"):  # no field name: the message as it is
        build_config(_NoField, {})
    for flag, value in (("--max-peer-queued", "0"), ("--stream-write-timeout", "0"), ("--max-file-mb", "-1")):
        assert main(["serve", "--checkpoint", "x", flag, value]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {flag}: expected") and err.count("\n") == 1, err
    assert main(["serve", "--help"]) == 0
    help_text = capsys.readouterr().out
    for f in dataclasses.fields(ServerConfig):
        assert f"--{f.name.replace('_', '-')}" in help_text, f.name
    assert "--token " not in help_text and "--token-file" in help_text


@dataclasses.dataclass
class _NoField:
    def __post_init__(self) -> None:
        raise ValueError("checkpoint required")


def test_policy_server_takes_the_config_and_a_model_table() -> None:
    c = ServerConfig(checkpoint="a", follow="self")
    with pytest.raises(ValueError, match=r"follow: config\.follow"):
        PolicyServer(c, models={"m1": "a", "m2": "b"})
    with pytest.raises(ValueError, match="follow: a follow map goes with models"):
        PolicyServer(ServerConfig(checkpoint="a"), follow={"default": "a"})
    with pytest.raises(ValueError, match=r"not served: \['zz'\]"):
        PolicyServer(ServerConfig(checkpoint="a"), models={"m1": "a"}, follow={"zz": "a"})
