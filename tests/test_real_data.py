"""Real robot data in, a served policy out, with no simulator: a LeRobot dataset written by LeRobot's own
`LeRobotDataset` API -> `vla-rl store import-lerobot` -> `vla-rl train sft --push` -> `vla-rl serve`
-> a robot's request with an observation from the data (issue 17's four documented commands)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from test_lerobot_io import KOCH_TASKS, record_style_dataset

from fleet.store import EpisodeStore
from server.client import PolicyClient
from vla_rl.cli import main
from vla_rl.hub.registry import resolve
from vla_rl.hub.server import HubServer

TOKEN = "real-data-token"


def test_a_lerobot_dataset_becomes_a_served_versioned_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli_server: Callable[..., str]
) -> None:
    for k in ("HF_ENDPOINT", "HF_TOKEN", "VLA_RL_HUB", "VLA_RL_HUB_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # LeRobot writes the dataset locally
    dataset, store = tmp_path / "koch", tmp_path / "store"
    record_style_dataset(dataset)
    assert main(["store", "import-lerobot", str(dataset), str(store)]) == 0  # 1. import
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
        assert main(["--hub", hub.url, *train, "--push", "hub://fleet/koch", "--tag", "v1"]) == 0  # 2. + 3.
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
