"""QAM on LeRobot's flow VLAs (vla_rl/train/qam_lerobot.py's LeRobotQAMLearner), on the tiny SmolVLA / π0
configurations of test_ppo_lerobot (no download, the same connection guard):

* the learner's adjoint-matching loss equals an independent computation from the contract's velocities
  on the same noise (a hand-written SDE, terminal adjoint, lean adjoint and regression);
* with ``trainable`` ``expert`` the fine policy shares the base's frozen prefix encoder (the same
  parameters, the same storage) and one update encodes each observation batch once; ``full`` gives the
  fine policy a VLM of its own;
* a few QAM updates on kinematic camera demos ship a LeRobot folder (our lineage beside it) that LeRobot's
  own ``from_pretrained`` loads and that acts as ours, with the expert moved and the VLM as it was;
* online (qam-o2o) the fine policy acts in the simulator and re-anchors;
* what QAM does not do on a LeRobot base is refused naming the field.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import test_fql_lerobot
import torch
from lerobot_offline import from_pretrained, lerobot_actions
from test_ppo_lerobot import (  # noqa: F401  (module fixtures: no network, one thread)
    SPEC,
    TASK,
    _offline,
    _one_torch_thread,
    rows,
)
from tolerances import RECOMPUTED_ATOL, RECOMPUTED_RTOL

from policies.lerobot_flow import LINEAGE_FILE, LeRobotFlowPolicy
from vla_rl.hub.registry import pull
from vla_rl.train.algorithms import make_config, train
from vla_rl.train.qam_config import QAMConfig
from vla_rl.train.qam_lerobot import LeRobotQAMLearner

K = 3
folders = test_fql_lerobot.folders  # module fixtures: the tiny SmolVLA / π0 folders and camera demos
store = test_fql_lerobot.store


def qam_cfg(tmp_path: Path, **kw: Any) -> QAMConfig:
    values: dict[str, Any] = dict(
        base="unused", store=tmp_path, out=tmp_path, task=TASK, offline_steps=4, batch_size=3,
        critic_mc_steps=1, critic_warmup=2, flow_steps=K, members=3, critic_hidden=(32, 32), threads=1,
        progress=False,
    )  # fmt: skip
    return QAMConfig(**{**values, **kw})


def observations(b: int = 3, seed: int = 0) -> dict[str, Any]:
    obs = rows(b, seed)
    return {
        "state": torch.as_tensor(np.stack([r["state"] for r in obs])),
        "cameras": {"top_camera": torch.as_tensor(np.stack([r["cameras"]["top_camera"] for r in obs]))},
        "instruction": [SPEC.instruction] * b,
    }


def batch(b: int = 3) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    return {
        **observations(b),
        "action": torch.as_tensor(rng.normal(size=(b, 4, 4)), dtype=torch.float32),
        "action_is_pad": torch.zeros(b, 4, dtype=torch.bool),
        "reward_n": torch.tensor([-0.1, -0.2, 0.0]),
        "bootstrap": torch.tensor([1.0, 1.0, 0.0]),
        "mc_return": torch.tensor([-0.5, -1.0, 0.0]),
        "valid": torch.ones(b),
    }


def learner_for(folder: Path, tmp_path: Path, **kw: Any) -> LeRobotQAMLearner:
    learner = LeRobotQAMLearner(LeRobotFlowPolicy.load(folder), qam_cfg(tmp_path, **kw))
    return learner.train(False)  # no dropout: the same velocities as the independent computation


def _vlm_and_state_proj(policy: LeRobotFlowPolicy) -> list[torch.nn.Parameter]:
    return [p for m in policy.prefix_modules() for p in m.parameters()]


# ---------------------------------------------------------------------------- the adjoint step
def independent_am_loss(
    learner: LeRobotQAMLearner, obs: dict[str, Any], x0: torch.Tensor, eps: torch.Tensor
) -> torch.Tensor:
    """L_AM of docs/algorithms.md §2 from the contract's velocities, step by step: the fine policy's
    memoryless SDE (last step the base's), ã_K = −λ ∇ mean_m Q̄_m on the executed robot dims, the lean
    adjoint back through the base's drift, the regression on every grid point."""
    fine, base, lam = learner.fine, learner.base, learner.cfg.inv_temp
    n, a_dim, h = learner.n_exec, learner.action_dim, 1.0 / K
    with torch.no_grad():
        prefix = base.encode_prefix(obs)
        feats = base.features(prefix)
    sigma = [math.sqrt(2.0 * (1.0 - i * h + h) / (i * h + h)) for i in range(K)]
    xs, x = [x0], x0
    with torch.no_grad():
        for i in range(K - 1):
            x = (
                x
                + h * (2.0 * fine.velocity(prefix, x, i * h) - x / (i * h + h))
                + math.sqrt(h) * sigma[i] * eps[:, i]
            )
            xs.append(x)
        x_k = x + h * base.velocity(prefix, x, (K - 1) * h)
    a = x_k.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(learner.critic_target(feats, a[:, :n, :a_dim]).mean(0).sum(), a)
    adjoint = [torch.zeros_like(x0)] * K + [-lam * grad]
    for i in reversed(range(K)):
        xi = xs[i].clone().requires_grad_(True)
        (vjp,) = torch.autograd.grad(base.velocity(prefix, xi, i * h + h), xi, grad_outputs=adjoint[i + 1])
        adjoint[i] = adjoint[i + 1] + h * (2.0 * vjp - adjoint[i + 1] / (i * h + h))
    loss = torch.zeros(x0.shape[0])
    for i in range(K):
        with torch.no_grad():
            v_base = base.velocity(prefix, xs[i], i * h)
        residual = (2.0 / sigma[i]) * (fine.velocity(prefix, xs[i], i * h) - v_base) + sigma[i] * adjoint[i]
        loss = loss + residual.square().flatten(1).sum(1)
    return loss.mean()


@pytest.mark.parametrize("ptype", ["smolvla", "pi0"])
def test_qam_adjoint_loss_on_a_lerobot_vla_equals_an_independent_computation(
    folders: dict[str, Path], ptype: str, tmp_path: Path
) -> None:
    learner = learner_for(folders[ptype], tmp_path)
    assert learner.event == (4, 6) and learner.action_dim == 4  # padded to max_action_dim 6
    with torch.no_grad():  # the fine policy differs from the base, so v_θ − v̄_β is not zero
        for p in learner.actor_parameters():
            p.add_(0.05 * torch.randn_like(p))
    data, nxt = batch(), observations(seed=2)
    a_next = torch.zeros(3, 4, 6)  # given: no noise drawn for the TD target before the adjoint's
    torch.manual_seed(0)
    out = learner.losses(data, nxt, train_actor=True, next_chunk=a_next)
    torch.manual_seed(0)
    x0, eps = torch.randn(3, 4, 6), torch.randn(3, K - 1, 4, 6)
    expected = independent_am_loss(learner, data, x0, eps)
    assert float(expected.detach()) > 0
    torch.testing.assert_close(out["loss_am"], expected, atol=RECOMPUTED_ATOL, rtol=1e-3)
    out["loss_am"].backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in learner.actor_parameters())
    assert all(p.grad is None for p in _vlm_and_state_proj(learner.base))


@pytest.mark.parametrize("ptype", ["smolvla", "pi0"])
def test_expert_fine_policy_shares_the_frozen_prefix_and_encodes_once(
    folders: dict[str, Path], ptype: str, tmp_path: Path
) -> None:
    learner = learner_for(folders[ptype], tmp_path)
    shared = _vlm_and_state_proj(learner.base)
    fine_prefix_params = _vlm_and_state_proj(learner.fine)
    assert shared and all(a is b for a, b in zip(shared, fine_prefix_params, strict=True))
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(shared, fine_prefix_params, strict=True))
    assert not any(p.requires_grad for p in shared)
    trained = {id(p) for p in learner.actor_parameters()}
    assert trained and not trained & {id(p) for p in shared}
    assert not any(p.requires_grad for p in learner.base.parameters())
    assert learner.fine.num_inference_steps == K
    calls: list[int] = []
    real = LeRobotFlowPolicy.encode_prefix

    def counted(self: LeRobotFlowPolicy, obs: Any) -> Any:
        calls.append(id(self))
        return real(self, obs)

    with mock.patch.object(LeRobotFlowPolicy, "encode_prefix", counted):
        out = learner.losses(batch(), observations(seed=2), train_actor=True)  # TD target sampled here
    assert math.isfinite(float(out["loss_am"].detach())) and math.isfinite(float(out["loss_q"].detach()))
    assert calls == [id(learner.base)] * 2  # the batch and the next observations, once each


def test_full_fine_policy_holds_its_own_vlm(folders: dict[str, Path], tmp_path: Path) -> None:
    learner = learner_for(folders["smolvla"], tmp_path, trainable="full")
    base_vlm = {id(p) for p in learner.base.vlm.parameters()}
    assert not base_vlm & {id(p) for p in learner.fine.vlm.parameters()}
    assert {id(p) for p in learner.fine.vlm.parameters()} <= {id(p) for p in learner.actor_parameters()}
    out = learner.losses(batch(), observations(seed=2), train_actor=True)
    out["loss_am"].backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in learner.fine.vlm.parameters())
    assert all(p.grad is None for p in learner.base.parameters())


# ---------------------------------------------------------------------------- a run
def _state(folder: Path) -> dict[str, torch.Tensor]:
    return LeRobotFlowPolicy.load(folder).policy.state_dict()


@pytest.mark.parametrize("ptype", ["smolvla", "pi0"])
def test_qam_ships_a_lerobot_folder_that_lerobot_loads_and_acts_as_ours(
    folders: dict[str, Path], store: Path, ptype: str, tmp_path: Path
) -> None:
    evals = {"final_eval_episodes": 2} if ptype == "smolvla" else {}
    cfg = make_config(
        "qam", base=str(folders[ptype]), store=str(store), out=str(tmp_path / "run"), task=TASK,
        offline_steps=4, batch_size=8, critic_mc_steps=1, critic_warmup=2, flow_steps=K, members=3,
        critic_hidden=(32, 32), actor_lr=1e-3, threads=1, progress=False, **evals,
    )  # fmt: skip
    res = train(cfg)
    assert res.steps == 4 and math.isfinite(res.metrics["loss_am"]) and math.isfinite(res.metrics["loss_q"])
    if evals:
        assert 0.0 <= res.metrics["eval_success"] <= 1.0
    out = res.checkpoint
    assert json.loads((out / "config.json").read_text())["type"] == ptype
    record = json.loads((out / LINEAGE_FILE).read_text())
    assert record["lineage"]["algorithm"] == "qam" and record["lineage"]["data"]["task"] == TASK
    assert record["lineage"]["parent_revision"] == pull(str(folders[ptype])).commit
    shipped = LeRobotFlowPolicy.load(out)
    assert shipped.num_inference_steps == K  # deployed on the grid it was fine-tuned on
    before, after = _state(folders[ptype]), shipped.policy.state_dict()
    moved = [n for n in before if not torch.equal(before[n], after[n])]
    prefix = (".vlm.", "state_proj") if ptype == "smolvla" else (".paligemma.",)
    assert moved and not [n for n in moved if any(p in n for p in prefix)], moved
    assert [n for n in before if any(p in n for p in prefix)]  # the names do match the VLM's weights

    frames = rows(2, seed=5)
    obs = {
        "state": np.stack([r["state"] for r in frames]),
        "cameras": {"top_camera": np.stack([r["cameras"]["top_camera"] for r in frames])},
        "instruction": [SPEC.instruction] * 2,
    }
    x0 = torch.randn(2, *shipped.event_shape, generator=torch.Generator().manual_seed(1))
    theirs = lerobot_actions(from_pretrained(out), out, obs, x0, shipped.camera_keys)
    with torch.no_grad():
        ours = shipped.predict_action_chunk(obs, noise=x0)
    torch.testing.assert_close(ours, theirs, atol=RECOMPUTED_ATOL, rtol=RECOMPUTED_RTOL)


def test_qam_online_on_a_lerobot_vla_acts_from_the_camera_and_reanchors(
    folders: dict[str, Path], store: Path, tmp_path: Path
) -> None:
    """qam-o2o: the fine SmolVLA acts in the simulator (its camera, the instruction text), finished
    episodes join the replay, the re-anchored prior is the fine policy (its VLM still the shared one)."""
    cfg = make_config(
        "qam", base=str(folders["smolvla"]), store=str(store), out=str(tmp_path / "run"), task=TASK,
        offline_steps=2, env_steps=6, num_envs=1, max_episode_steps=3, batch_size=4, critic_mc_steps=1,
        critic_warmup=1, flow_steps=K, members=2, critic_hidden=(32, 32), reanchor_every=2, eval_every=4,
        eval_every_episodes=1, threads=1, progress=False,
    )  # fmt: skip
    res = train(cfg)
    assert res.env_steps == 6 and res.steps == 8 and res.metrics["online_episodes"] == 2
    assert 0.0 <= res.metrics["online_success"] <= 1.0
    assert [row for row in res.curve if "eval_success" in row]
    assert json.loads((res.checkpoint / LINEAGE_FILE).read_text())["lineage"]["data"]["online_episodes"] == 2

    learner = learner_for(folders["smolvla"], tmp_path)
    with torch.no_grad():
        for p in learner.actor_parameters():
            p.add_(0.05)
    learner.reanchor()
    fine, base = learner.fine.state_dict(), learner.base.state_dict()
    assert all(torch.equal(fine[k], base[k]) for k in fine)
    assert all(
        a is b for a, b in zip(learner.base.vlm.parameters(), learner.fine.vlm.parameters(), strict=True)
    )
    assert not any(p.requires_grad for p in learner.base.parameters())


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"next_action_cache": 2}, "next_action_cache: not implemented for a LeRobot base"),
        ({"reanchor_every": 2, "trainable": "lora"}, "reanchor_every: a LoRA fine policy cannot become"),
        ({"train_base": True}, "train_base: QAM keeps a LeRobot base frozen"),
        ({"feature_mode": "state"}, "feature_mode: 'state' reads FlowVLA's state normaliser"),
    ],
)
def test_qam_refuses_what_it_does_not_do_on_a_lerobot_base(
    folders: dict[str, Path], store: Path, tmp_path: Path, knobs: dict[str, Any], message: str
) -> None:
    cfg = make_config(
        "qam", base=str(folders["smolvla"]), store=str(store), out=str(tmp_path / "o"), task=TASK, **knobs
    )
    with pytest.raises(ValueError, match=message):
        train(cfg)
