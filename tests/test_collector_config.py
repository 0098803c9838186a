"""CollectorConfig: every knob of the collector typed and validated once, saved and read back as JSON
without secrets, and the same flags on ``vla-rl collect``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fleet.collector import CollectorConfig
from fleet.collector.config import MB
from vla_rl.cli.common import parse
from vla_rl.cli.services import _collect_args

# Every field away from its default, so a field that does not round-trip shows.
NON_DEFAULT = {
    "store": "/data/fleet/store",
    "db": "postgresql://db/vla_rl",
    "wal_dir": "/var/lib/collector/wal",
    "host": "0.0.0.0",
    "port": 50999,
    "fsync": True,
    "metrics_port": 9171,
    "metrics_host": "10.0.0.2",
    "metrics_robot_labels": False,
    "robots": "arm-1,arm-2",
    "chunk_len": 64,
    "camera_zstd_level": 3,
    "camera_codec": "jpeg:85,wrist=lossless",
    "max_batch_frames": 32,
    "max_pending_mb": 512.5,
    "store_writers": 2,
    "store_writer_nice": 0,
    "max_open_episodes_per_robot": 4,
    "episode_idle_timeout_s": 60.0,
    "max_open_logs": 64,
    "max_camera_pixels": 640 * 480,
    "max_value_abs": 1000.0,
    "max_buffered_mb": 256.0,
    "drain_timeout_s": 2.5,
    "max_message_mb": 16.0,
    "max_streams": 32,
    "idle_flush_s": 1.5,
    "store_retry_max_s": 10.0,
    "lease_ttl_s": 12.0,
}


def test_every_field_round_trips_through_json() -> None:
    assert set(NON_DEFAULT) == {f.name for f in dataclasses.fields(CollectorConfig)}, "a new field: add it"
    cfg = CollectorConfig.from_dict(NON_DEFAULT)
    for f in dataclasses.fields(CollectorConfig):
        assert getattr(cfg, f.name) != f.default, f"{f.name} is still its default: the test proves nothing"
    saved = json.loads(json.dumps(cfg.to_dict()))
    assert saved == NON_DEFAULT
    again = CollectorConfig.from_dict(saved)
    assert again == cfg
    assert isinstance(again.store, Path) and isinstance(again.wal_dir, Path)
    assert again.allowed_robots == frozenset({"arm-1", "arm-2"})
    assert again.max_pending_bytes == round(512.5 * MB) and again.max_message_bytes == 16 * MB


def test_defaults_round_trip_and_an_object_store_keeps_its_url() -> None:
    cfg = CollectorConfig(store=Path("runs/store"))
    assert CollectorConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert cfg.allowed_robots is None and cfg.max_buffered_bytes == 1024 * MB
    s3 = CollectorConfig(store="s3://bucket/fleet", db="postgresql://db/x", wal_dir="wal")  # type: ignore[arg-type]
    assert s3.store_location == "s3://bucket/fleet" and s3.to_dict()["store"] == "s3://bucket/fleet"
    assert CollectorConfig.from_dict(s3.to_dict()) == s3


def test_unknown_and_missing_keys_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['chunk_length', 'tokn'\]"):
        CollectorConfig.from_dict({"store": "s", "chunk_length": 8, "tokn": "x"})
    with pytest.raises(ValueError, match=r"^store: required"):
        CollectorConfig.from_dict({"port": 1})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"port": 70000}, r"^port: expected 0\.\.65535"),
        ({"metrics_port": -1}, r"^metrics_port: expected 0\.\.65535"),
        ({"port": "50071"}, r"^port: expected int, got str"),
        ({"fsync": 1}, r"^fsync: expected bool, got int"),
        ({"chunk_len": True}, r"^chunk_len: expected int, got bool"),
        ({"chunk_len": 0}, r"^chunk_len: expected at least 1"),
        ({"store_writers": -1}, r"^store_writers: expected at least 0"),
        ({"store_writer_nice": 20}, r"^store_writer_nice: expected 0\.\.19"),
        ({"episode_idle_timeout_s": float("nan")}, r"^episode_idle_timeout_s: expected at least"),
        ({"drain_timeout_s": float("inf")}, r"^drain_timeout_s: expected at least 0"),
        ({"max_pending_mb": 0}, r"^max_pending_mb: expected a positive size in MiB"),
        ({"camera_zstd_level": 23}, r"^camera_zstd_level: expected"),
        ({"camera_codec": "png"}, r"^camera_codec: expected lossless, jpeg or jpeg:QUALITY, got 'png'"),
        ({"robots": "arm-1,no spaces"}, r"^robots: expected comma-separated robot ids"),
        ({"host": ""}, r"^host: expected a bind address"),
        ({"store": "s3://bucket/p", "db": "postgresql://db/x"}, r"^wal_dir: .*--wal-dir"),
        ({"store": "s3://bucket/p", "wal_dir": "wal"}, r"^db: .*--db"),
    ],
)
def test_a_bad_value_names_its_field(values: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CollectorConfig(**{"store": Path("s"), **values})


def test_the_collect_command_parses_the_same_flags_and_saves_no_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLA_RL_COLLECTOR_TOKEN", "from-the-environment")
    cls = _collect_args()
    argv = ["--store", str(tmp_path / "s"), "--port", "0", "--robots", "a,b", "--max-pending-mb", "8"]
    argv += ["--no-metrics-robot-labels", "--camera-codec", "jpeg:90", "--token-file", str(tmp_path / "t")]
    a = parse(cls, argv, "vla-rl collect", "")
    assert isinstance(a, CollectorConfig) and a.token == "from-the-environment"
    assert a.token_file == tmp_path / "t"
    saved = a.to_dict()
    assert set(saved) == {f.name for f in dataclasses.fields(CollectorConfig)}  # no token, no token files
    assert "from-the-environment" not in json.dumps(saved)
    cfg = CollectorConfig.from_dict(saved)
    assert (cfg.port, cfg.robots, cfg.max_pending_mb, cfg.metrics_robot_labels, cfg.camera_codec) == (
        0,
        "a,b",
        8.0,
        False,
        "jpeg:90",
    )
    assert type(cfg) is CollectorConfig and not hasattr(cfg, "token")


def test_a_bad_flag_is_one_line_naming_it_and_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from vla_rl.cli import main

    for flags, want in (
        (["--store-writer-nice", "20"], "--store-writer-nice: expected 0..19"),
        (["--robots", "arm-1,-bad"], "--robots: expected comma-separated robot ids"),
        (["--max-pending-mb", "0"], "--max-pending-mb: expected a positive size in MiB"),
    ):
        assert main(["collect", "--store", str(tmp_path / "s"), "--port", "0", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: collect: ") and err.count("\n") == 1 and want in err, err
        assert not (tmp_path / "s").exists()
