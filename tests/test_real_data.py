"""Real robot data in, a served policy out, with no simulator: a LeRobot dataset written by LeRobot's own
`LeRobotDataset` API -> `vla-rl store import-lerobot` -> `vla-rl train sft` -> `vla-rl hub push` ->
`vla-rl serve` -> a robot's request with an observation from the data (issue 17's four commands, as
docs/training.md documents them); and post-training rounds of every algorithm on imported data."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from imported_base import PG_SLOW, imported_base, on_backend, on_postgresql
from test_lerobot_io import EPISODE_LEN, KOCH_TASKS, record_style_dataset
from vla_rl_client.policy_client import PolicyClient

from fleet.store import EpisodeStore
from vla_rl.cli import main
from vla_rl.hub.registry import resolve
from vla_rl.hub.server import HubServer

TOKEN = "real-data-token"


@pytest.mark.parametrize(
    "store_db_url", ["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)], indirect=True
)
def test_a_lerobot_dataset_becomes_a_served_versioned_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli_server: Callable[..., str], store_db_url: str | None
) -> None:
    for k in ("HF_ENDPOINT", "HF_TOKEN", "VLA_RL_HUB", "VLA_RL_HUB_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # LeRobot writes the dataset locally
    dataset, store = tmp_path / "koch", tmp_path / "store"
    record_style_dataset(dataset)
    db = ["--db", store_db_url] if store_db_url else []
    assert main(["store", "import-lerobot", str(dataset), str(store), *db]) == 0  # 1. import
    assert (store / "metadata.db").exists() is (store_db_url is None)
    episodes = [EpisodeStore(store).read_episode(e) for e in EpisodeStore(store).episode_ids()]
    assert {ep.meta.task for ep in episodes} == {"koch"}  # the robot type: no simulator task involved
    assert {ep.meta.instruction for ep in episodes} == set(KOCH_TASKS)

    hub = HubServer(tmp_path / "hub", token=TOKEN).start()
    try:
        monkeypatch.setenv("VLA_RL_HUB_TOKEN", TOKEN)
        out = tmp_path / "sft"
        train = [
            "train",
            "sft",
            "--store",
            str(store),
            "--out",
            str(out),
            "--steps",
            "30",
            "--batch-size",
            "16",
        ]
        train += ["--chunk-len", "4", "--n-exec", "2", "--d-model", "32", "--no-progress"]
        train += ["--db-url", store_db_url] if store_db_url else []
        assert main(["--hub", hub.url, *train]) == 0  # 2. train
        push = ["hub", "push", str(out / "checkpoints" / "last"), "--repo", "fleet/koch", "--tag", "v1"]
        assert main(["--hub", hub.url, *push]) == 0  # 3. push
        commit = resolve("hub://fleet/koch@v1")
        addr = cli_server("--checkpoint", "hub://fleet/koch@v1", env={"VLA_RL_HUB": hub.url})  # 4. serve
        client = PolicyClient(addr, timeout_s=60)
        ep = episodes[0]
        obs = {
            "state": ep.state[0],
            "cameras": {k: v[0] for k, v in ep.cameras.items()},
            "instruction": ep.meta.instruction,
        }
        r = client.act(obs, seed=3)
        assert r.commit == commit and r.actions.shape == (4, 3) and np.isfinite(r.actions).all()
        # the instruction reaches the policy: the same observation under the other task's words acts otherwise
        other = next(t for t in KOCH_TASKS if t != ep.meta.instruction)
        r2 = client.act({**obs, "instruction": other}, seed=3)
        assert not np.allclose(r.actions, r2.actions, atol=1e-4)
    finally:
        hub.stop()


# ---------------------------------------------------------------------- rounds of every algorithm
DAGGER = [8 <= i < 14 for i in range(EPISODE_LEN)]
"""LeRobot's DAgger recording: the policy drives, an operator takes over at frame 8 and hands back at 14."""


@pytest.fixture(scope="module")
def teleop(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """What `lerobot-record` writes: teleoperated demonstrations only (every frame human)."""
    return imported_base(tmp_path_factory.mktemp("teleop"))


@pytest.fixture(scope="module")
def dagger(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A DAgger recording (an ``intervention`` column): autonomous stretches around each takeover."""
    return imported_base(tmp_path_factory.mktemp("dagger"), DAGGER)


@pytest.fixture(scope="module")
def teleop_pg(
    teleop: tuple[Path, Path], pg: Any, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path, str]:
    return on_postgresql(teleop, pg, tmp_path_factory.mktemp("teleop-pg"))


@pytest.fixture(scope="module")
def dagger_pg(
    dagger: tuple[Path, Path], pg: Any, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path, str]:
    return on_postgresql(dagger, pg, tmp_path_factory.mktemp("dagger-pg"))


@pytest.fixture(params=PG_SLOW)
def dagger_db(request: pytest.FixtureRequest) -> tuple[Path, Path, str | None]:
    return on_backend(request, "dagger")


@pytest.fixture(params=["sqlite", "postgresql"])
def teleop_db(request: pytest.FixtureRequest) -> tuple[Path, Path, str | None]:
    return on_backend(request, "teleop")


def _check_offline_round(rec: Any, store: Path, algo: str) -> None:
    """An offline round on imported data: gated on the held-out action MSE, the held-out episode never
    trained on, the candidate a checkpoint of ``algo`` that the gate's numbers describe."""
    from vla_rl.hub.checkpoint import read_info

    m, ids = rec.metrics, EpisodeStore(store).episode_ids()
    assert rec.status == "succeeded" and rec.algo == algo and rec.task == "koch"
    assert m["eval"] == "offline" and m["success"] is None and m["eval_episode_ids"] == ids[-1:]
    assert m["held_out_excluded_from_training"] is True and rec.data["selection"]["exclude"] == ids[-1:]
    assert m["action_mse"] > 0 and m["base_action_mse"] > 0 and m["val_loss"] is not None
    assert m["gate"]["passed"] is (m["base_action_mse"] - m["action_mse"] > 0.0)
    assert m["gate"]["reason"].startswith("offline action MSE")
    info = read_info(rec.checkpoint_ref)
    assert info.lineage.algorithm == algo and info.lineage.round == rec.id
    assert info.metrics["offline_action_mse"] == pytest.approx(m["action_mse"])


def test_a_recap_round_on_an_imported_dagger_recording(dagger_db: Any, tmp_path: Path) -> None:
    from vla_rl.rounds import RoundConfig, start_round
    from vla_rl.train.algorithms import make_config

    store, base, db_url = dagger_db
    train = make_config(
        "recap", base=str(base), store=store, out=tmp_path, db_url=db_url, steps=10, value_steps=10
    )
    train.batch_size, train.progress = 16, False
    rec = start_round(RoundConfig(train=train, push=False, eval_episodes=50, margin=0.0, gate_alpha=1.0))
    _check_offline_round(rec, store, "recap")
    # 3 training episodes x 6 human frames (always positive); the autonomous ones scored by advantage
    assert rec.data["human_frames"] == 18 and 0.2 < rec.metrics["train"]["positive_frac"] < 0.4


def test_a_qam_round_on_imported_teleoperation_through_the_cli(
    teleop_db: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """QAM learns its critic from any frames, so it runs on pure teleoperation, offline only (the knobs
    that need a simulator are refused naming the field); `round list` shows the gate's metric."""
    from vla_rl.cli.common import open_db

    store, base, db_url = teleop_db
    argv = ["round", "start", "--algo", "qam", "--base", str(base), "--store", str(store), "--no-push"]
    argv += ["--db-url", db_url] if db_url else []
    argv += [
        "--out",
        str(tmp_path),
        "--no-progress",
        "--margin",
        "0",
        "--gate-alpha",
        "1",
        "--offline-steps",
        "6",
    ]
    argv += ["--critic-mc-steps", "0", "--critic-warmup", "2", "--batch-size", "8", "--members", "2"]
    argv += ["--critic-hidden", "16", "16", "--flow-steps", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rec = open_db(store, db_url).rounds(task="koch")[-1]
    _check_offline_round(rec, store, "qam")
    assert "gate: offline action MSE" in out and "action MSE" in out.splitlines()[-2]
    assert main(["round", "list", "--store", str(store), *(["--db", db_url] if db_url else [])]) == 0
    assert f"action MSE {rec.metrics['action_mse']:.4f}" in capsys.readouterr().out
    # online steps need a simulator: refused before training, naming the knob
    assert main([*argv, "--env-steps", "10"]) == 2
    assert "env_steps" in capsys.readouterr().err


@pytest.mark.parametrize("teleop_db", PG_SLOW, indirect=True)
def test_a_recap_round_refuses_pure_teleoperation_naming_the_reason(teleop_db: Any, tmp_path: Path) -> None:
    """RECAP (as AWR, tests/test_offline_eval.py) weighs the policy's own actions: a teleoperated-only
    recording has none, and the round says so (recorded as failed) and names what works on it, rather
    than training on nothing."""
    from vla_rl.cli.common import open_db
    from vla_rl.rounds import RoundConfig, start_round
    from vla_rl.train.algorithms import make_config

    store, base, db_url = teleop_db
    train = make_config(
        "recap", base=str(base), store=store, out=tmp_path, db_url=db_url, steps=5, value_steps=5
    )
    train.batch_size, train.progress = 16, False
    with pytest.raises(ValueError, match=r"no autonomous frames.*train sft"):
        start_round(RoundConfig(train=train, push=False, eval_episodes=50))
    last = open_db(store, db_url).rounds()[-1]
    assert last.status == "failed" and "no autonomous frames" in (last.error or "")


def test_train_commands_on_imported_data_need_no_task(
    dagger: tuple[Path, Path], teleop: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`vla-rl train recap` (the spec, cameras and task from the base and the store), then `vla-rl eval
    --store` on its checkpoint; `train awr` on teleoperation alone is one line and exit 2."""
    import json

    from vla_rl.hub.checkpoint import read_info

    store, base = dagger
    out = tmp_path / "recap"
    argv = ["train", "recap", "--base", str(base), "--store", str(store), "--out", str(out), "--no-progress"]
    assert main([*argv, "--steps", "5", "--value-steps", "5", "--batch-size", "16"]) == 0
    info = read_info(out / "checkpoint")
    assert info.lineage.algorithm == "recap" and info.lineage.data["episodes"] == 4
    assert info.model_config["advantage_conditioning"] is True
    res = tmp_path / "eval.json"
    ev = ["eval", "--checkpoint", str(out / "checkpoint"), "--store", str(store), "--episodes", "1"]
    assert main([*ev, "--out", str(res), "--no-progress"]) == 0
    assert json.loads(res.read_text())["tasks"] == ["koch"]
    capsys.readouterr()

    store, base = teleop
    argv = ["train", "awr", "--base", str(base), "--store", str(store), "--out", str(tmp_path / "awr")]
    assert main([*argv, "--steps", "5", "--value-steps", "5", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "no autonomous frames" in err[-1] and "train sft" in err[-1] and "Traceback" not in "".join(err)


def test_serve_on_a_taken_port_is_refused_before_loading_the_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 17's port error for `vla-rl serve` (the CLI error test covers collect and hub serve): the
    port is checked first, so an unreachable registry is never asked for the checkpoint."""
    import socket

    with socket.socket() as taken, socket.socket() as free:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        free.bind(("127.0.0.1", 0))
        port, nobody = taken.getsockname()[1], f"http://127.0.0.1:{free.getsockname()[1]}"
        argv = ["--hub", nobody, "serve", "--checkpoint", "hub://fleet/koch@v1", "--port", str(port)]
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and f"--port {port}" in err, err
    assert "already in use" in err and "Hub registry" not in err
