"""Few-step distillation (vla_rl/train/fewstep.py) on a LeRobot flow VLA, through the flow-policy contract, on
the tiny SmolVLA of test_ppo_lerobot (no download, the same connection guard)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from test_ppo_lerobot import (  # noqa: F401  (module fixtures: no network, one thread)
    TASK,
    _offline,
    _one_torch_thread,
    save_folders,
)

from fleet.store import EpisodeStore
from policies.lerobot_flow import LINEAGE_FILE, LeRobotFlowPolicy
from sim.demos import record_demos
from vla_rl.train.algorithms import make_config, train


def test_distill_ships_a_lerobot_folder_with_the_students_k(tmp_path: Path) -> None:
    """Through the contract on a tiny SmolVLA (no download): the folder saved is LeRobot's own, its config's
    ``num_steps`` the student's K, its lineage "distill"; only the action expert moved."""
    folder = save_folders(tmp_path / "vlas")["smolvla"]
    record_demos(
        EpisodeStore(tmp_path / "store", create=True), TASK, episodes=2, noise=0.5, obs="rgb",
        image_size=32, progress=False,
    )  # fmt: skip
    parent = LeRobotFlowPolicy.load(folder)
    assert parent.num_inference_steps > 1
    cfg = make_config(
        "distill", base=str(folder), store=str(tmp_path / "store"), out=str(tmp_path / "run"), task=TASK,
        student_steps=1, steps=3, warmup_steps=1, batch_size=4, threads=1, progress=False,
    )  # fmt: skip
    res = train(cfg)
    out = res.checkpoint
    config = json.loads((out / "config.json").read_text())
    assert config["type"] == "smolvla" and config["num_steps"] == 1
    lineage = json.loads((out / LINEAGE_FILE).read_text())["lineage"]
    assert (
        lineage["algorithm"] == "distill" and lineage["data"]["teacher_steps"] == parent.num_inference_steps
    )
    shipped = LeRobotFlowPolicy.load(out)
    assert shipped.num_inference_steps == 1
    moved = [
        n for (n, a), b in zip(shipped.state_dict().items(), parent.state_dict().values(), strict=True)
        if not torch.equal(a, b)
    ]  # fmt: skip
    assert moved and all(".vlm." not in n for n in moved)
