"""FQL on LeRobot's flow VLAs (vla_rl/train/fql.py's LeRobotFQLLearner), on the tiny SmolVLA / π0
configurations of test_ppo_lerobot (no download, the same connection guard): FQL's losses count the robot's
dims only and train the expert, never the VLM (which the one-step policy shares with the base); a few FQL
updates on kinematic camera demos ship a LeRobot folder that deploys the one-step policy (K = 1) in
LeRobot's own config. QAM on LeRobot VLAs: tests/test_qam_lerobot.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_ppo_lerobot import (  # noqa: F401  (module fixtures: no network, one thread)
    SPEC,
    TASK,
    _offline,
    _one_torch_thread,
    rows,
    save_folders,
    unnamed_copy,
)

from fleet.store import EpisodeStore
from policies.lerobot_flow import LINEAGE_FILE, LeRobotFlowPolicy
from vla_rl.train.algorithms import make_config, train
from vla_rl.train.fql import FQLConfig, LeRobotFQLLearner


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return save_folders(tmp_path_factory.mktemp("fql_vlas"))


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sim.demos import record_demos

    root = tmp_path_factory.mktemp("fql_store")
    record_demos(
        EpisodeStore(root, create=True), TASK, episodes=3, noise=0.5, obs="rgb", image_size=32, progress=False
    )
    return root


def fql_cfg(tmp_path: Path, **kw: Any) -> FQLConfig:
    values: dict[str, Any] = dict(
        base="unused", store=tmp_path, out=tmp_path, task=TASK, steps=4, batch_size=3, critic_mc_steps=1,
        critic_warmup=2, flow_steps=3, critic_hidden=(32, 32), threads=1, progress=False,
    )  # fmt: skip
    return FQLConfig(**{**values, **kw})


def batch(b: int = 3) -> dict[str, Any]:
    obs = rows(b)
    rng = np.random.default_rng(1)
    return {
        "state": torch.as_tensor(np.stack([r["state"] for r in obs])),
        "cameras": {"top_camera": torch.as_tensor(np.stack([r["cameras"]["top_camera"] for r in obs]))},
        "instruction": [SPEC.instruction] * b,
        "action": torch.as_tensor(rng.normal(size=(b, 4, 4)), dtype=torch.float32),
        "action_is_pad": torch.zeros(b, 4, dtype=torch.bool),
        "mc_return": torch.tensor([-0.5, -1.0, 0.0]),
        "valid": torch.ones(b),
    }


@pytest.mark.parametrize("ptype", ["smolvla", "pi0"])
def test_fql_losses_count_robot_dims_and_train_only_the_expert(
    folders: dict[str, Path], ptype: str, tmp_path: Path
) -> None:
    learner = LeRobotFQLLearner(LeRobotFlowPolicy.load(folders[ptype]), fql_cfg(tmp_path, train_base=True))
    assert learner.event == (4, 6) and learner.action_dim == 4  # padded to max_action_dim 6
    assert learner.actor.num_inference_steps == 1 and learner.base.num_inference_steps != 1
    vlm = list(learner.base.vlm.parameters())
    assert vlm and all(a is b for a, b in zip(vlm, learner.actor.vlm.parameters(), strict=True))  # held once
    data = batch()
    torch.manual_seed(0)
    out = learner.losses(data, None, mc=True, use_q=True)
    torch.manual_seed(0)
    z = torch.randn(3, 4, 6)
    with torch.no_grad():
        mu = learner.one_step(data, z)
        ode = learner.base_ode(data, z)
        q = learner.critic(learner.features(data), learner.base.normalize_actions(data["action"])[:, :2, :4])
    torch.testing.assert_close(out["loss_distill"], (mu - ode)[..., :4].square().mean())
    torch.testing.assert_close(out["q_mean"], q.mean())
    (out["loss_q"] + out["loss_actor"] + out["loss_bc"]).backward()
    for name, module in (("actor", learner.actor), ("base", learner.base)):
        model = module.policy.model
        vlm = model.vlm_with_expert.vlm if ptype == "smolvla" else model.paligemma_with_expert.paligemma
        expert = (
            model.vlm_with_expert.lm_expert
            if ptype == "smolvla"
            else model.paligemma_with_expert.gemma_expert
        )
        assert all(p.grad is None for p in vlm.parameters()), name
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in expert.parameters()), name
    with pytest.raises(ValueError, match="feature_mode: 'state' reads FlowVLA's state normaliser"):
        LeRobotFQLLearner(LeRobotFlowPolicy.load(folders[ptype]), fql_cfg(tmp_path, feature_mode="state"))


def test_fql_ships_a_one_step_lerobot_folder(folders: dict[str, Path], store: Path, tmp_path: Path) -> None:
    cfg = make_config(
        "fql", base=str(folders["smolvla"]), store=str(store), out=str(tmp_path / "run"), task=TASK, steps=4,
        batch_size=8, critic_mc_steps=1, critic_warmup=2, flow_steps=3, critic_hidden=(32, 32),
        final_eval_episodes=2, threads=1, progress=False,
    )  # fmt: skip
    res = train(cfg)
    assert math.isfinite(res.metrics["loss_q_pi"]) and 0.0 <= res.metrics["eval_success"] <= 1.0
    out = res.checkpoint
    assert json.loads((out / "config.json").read_text())["type"] == "smolvla"
    lineage = json.loads((out / LINEAGE_FILE).read_text())["lineage"]
    assert lineage["algorithm"] == "fql" and lineage["data"]["task"] == TASK
    shipped, base = LeRobotFlowPolicy.load(out), LeRobotFlowPolicy.load(folders["smolvla"])
    assert shipped.num_inference_steps == 1  # deployed as μ(s, z) = z + v(s, z, 0) in LeRobot's own config
    moved = [
        n for (n, a), b in zip(shipped.state_dict().items(), base.state_dict().values(), strict=True)
        if not torch.equal(a, b)
    ]  # fmt: skip
    assert moved and all(".vlm." not in n for n in moved)
    obs = {**{k: np.stack([r[k] for r in rows(2)]) for k in ("state",)}, "instruction": SPEC.instruction}
    obs["cameras"] = {"top_camera": np.stack([r["cameras"]["top_camera"] for r in rows(2)])}
    z = torch.randn(2, 4, 6)
    with torch.no_grad():
        one_step = z + shipped.velocity(shipped.encode_prefix(obs), z, 0.0)
        torch.testing.assert_close(
            shipped.predict_action_chunk(obs, noise=z), shipped.unnormalize_actions(one_step)
        )


def test_fql_needs_a_task_for_a_lerobot_folder(folders: dict[str, Path], store: Path, tmp_path: Path) -> None:
    unnamed = unnamed_copy(folders["smolvla"], tmp_path)  # from elsewhere: no sidecar naming its task
    cfg = make_config("fql", base=str(unnamed), store=str(store), out=str(tmp_path / "o"))
    with pytest.raises(
        ValueError, match=r"task: .* is a LeRobot smolvla folder that names no task .*; say which \(--task\)"
    ):
        train(cfg)
