"""Flow-Noise / Flow-SDE PPO on LeRobot's flow VLAs (policies/flow_rl.py, vla_rl/train/ppo*.py), on tiny
configurations of SmolVLA and π0 built here (policies/lerobot_tiny.py; no download, the connection guard
of test_flow_policy_lerobot applies): the log-prob a rollout records is the chain log-prob PPO re-scores,
and both are the Gaussian densities of the executed robot dims only (never the padding); an update moves
the action expert and the noise head, never the frozen VLM; train_ppo runs a couple of iterations on the
kinematic test bed with a camera and ships a LeRobot folder (FQL and QAM: test_fql_lerobot.py).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_flow_policy_lerobot import _offline, _one_torch_thread  # noqa: F401  (module fixtures: no network)
from tolerances import RECOMPUTED_ATOL, RECOMPUTED_RTOL
from vla_rl_client.spec import CameraSpec, RobotSpec

from policies.flow_rl import NOISE_HEAD_FILE, LeRobotStochastic, stochastic_policy
from policies.flow_vla import SDESchedule
from policies.flow_vla.sampling import sde_kernel
from policies.lerobot_adapter import save_random_policy
from policies.lerobot_flow import LINEAGE_FILE, LeRobotFlowPolicy
from policies.lerobot_tiny import save_tiny_policy
from vla_rl.train.ppo import PPOConfig, _actor_params, _load_base, _update, train_ppo
from vla_rl.train.ppo_math import score_chain, stored_chain
from vla_rl.train.ppo_rollout import Sampler, ValueFn, stack_obs

TASK = "kinematic/Reach-v0"
INSTRUCTION = "move the gripper to the goal and close it there"
SPEC = RobotSpec(  # the kinematic task in rgb mode: gripper xyz + closed, one top-down camera
    name=TASK, state_dim=4, action_dim=4, control_hz=10.0, instruction=INSTRUCTION,
    cameras=(CameraSpec("top_camera", 32, 32),),
)  # fmt: skip
TINY = {
    "chunk_size": 4,
    "n_action_steps": 2,
    "max_state_dim": 8,
    "max_action_dim": 6,
    "tokenizer_max_length": 16,
}
"""H = 4 (2 executed), actions padded from 4 to 6 dims: the padding is there to be ignored."""
K = 3
TYPES = ("smolvla", "pi0")


def save_folders(root: Path) -> dict[str, Path]:
    """A tiny SmolVLA and π0 for :data:`SPEC` under ``root``."""
    return {t: save_tiny_policy(root / t, t, SPEC, seed=1, **TINY) for t in TYPES}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return save_folders(tmp_path_factory.mktemp("ppo_vlas"))


def unnamed_copy(folder: Path, root: Path) -> Path:
    """``folder`` as a LeRobot folder from elsewhere: a copy without our sidecar, so it names no task."""
    out = shutil.copytree(folder, root / f"unnamed-{folder.name}")
    (out / LINEAGE_FILE).unlink()
    return out


def rl_policy(folder: Path) -> LeRobotStochastic:
    policy = LeRobotFlowPolicy.load(folder)
    policy.set_num_inference_steps(K)
    rl = stochastic_policy(policy, INSTRUCTION)
    assert isinstance(rl, LeRobotStochastic)
    return rl


def rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "state": rng.normal(size=4).astype(np.float32),
            "cameras": {"top_camera": rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)},
        }
        for _ in range(n)
    ]


def ppo_cfg(tmp_path: Path, method: str, **kw: Any) -> PPOConfig:
    return PPOConfig(base="unused", out=tmp_path, task=TASK, method=method, num_steps=K, seed=3, **kw)


def gaussian_log_prob(
    x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Σ over the masked elements of log N(x; mean, std²), per row ``[N]``."""
    lp = -0.5 * ((x - mean) / std) ** 2 - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return (lp * mask).sum((1, 2))


# ----------------------------------------------------------------------------- log-probs
@pytest.mark.parametrize("ptype", TYPES)
@pytest.mark.parametrize("method", ["noise", "sde"])
def test_recorded_log_prob_is_the_chain_log_prob_over_robot_dims(
    folders: dict[str, Path], ptype: str, method: str, tmp_path: Path
) -> None:
    rl = rl_policy(folders[ptype])
    cfg = ppo_cfg(tmp_path, method)
    sampler = Sampler(cfg, rl, ValueFn(cfg, rl))
    batch = rows(3)
    with torch.no_grad():
        chunks, env_actions = sampler.act(batch)
    assert env_actions.shape == (3, 2, 4)  # n_exec steps, the robot's 4 dims (the padding never leaves)
    iterates = torch.as_tensor(np.stack([c.iterates for c in chunks]))
    stochastic = torch.as_tensor(np.stack([c.stochastic for c in chunks]))
    assert iterates.shape == (3, K + 1, 4, 6)
    schedule = SDESchedule("flow_sde", cfg.noise_level) if method == "sde" else None
    chain = stored_chain(iterates, stochastic, method, schedule, rl.n_exec)
    recorded = torch.tensor([c.logp for c in chunks])
    with torch.no_grad():
        prefix = rl.encode_prefix(stack_obs(batch))
        logp, entropy = score_chain(rl, prefix, chain)
    # the old policy re-scores its own chains to what the rollout recorded (PPO's first ratio is 1)
    torch.testing.assert_close(logp[:, 0], recorded, atol=RECOMPUTED_ATOL, rtol=RECOMPUTED_RTOL)
    assert (entropy is None) == (method == "sde")

    # ... and both are the Gaussian transition densities of the executed steps' robot dims only
    mask = rl.logprob_mask().float()
    assert int(mask.sum()) == 2 * 4 and not mask[:, 4:].any() and not mask[2:].any()
    expected = torch.zeros(3)
    sde = sde_kernel(lambda x, t: rl.velocity(prefix, x, t), schedule or SDESchedule())
    with torch.no_grad():
        if method == "noise":  # x0 ~ N(0, I), then N(x_k + dt v, σ_φ²) on every step
            expected += gaussian_log_prob(iterates[:, 0], torch.zeros(()), torch.ones(()), mask)
        for k in range(K):
            x, dt = iterates[:, k], 1.0 / K
            if method == "noise":
                v, std = rl.velocity_and_std(prefix, x, k / K)
                mean = x + dt * v
            else:  # Flow-SDE's marginal-preserving Euler–Maruyama step
                _, mean, std = sde(x, torch.full((3,), k / K), dt)
            row = gaussian_log_prob(iterates[:, k + 1], mean, std, mask)
            expected += torch.where(stochastic[:, k], row, torch.zeros(()))
    torch.testing.assert_close(recorded, expected, atol=1e-3, rtol=1e-4)


def test_padding_never_enters_the_log_prob_or_the_entropy(folders: dict[str, Path], tmp_path: Path) -> None:
    """The noise head's std on padded dims and unexecuted steps is free to be anything: scaling it
    changes neither the chain log-prob nor the entropy bonus."""
    rl = rl_policy(folders["smolvla"])
    cfg = ppo_cfg(tmp_path, "noise")
    with torch.no_grad():
        chunks, _ = Sampler(cfg, rl, ValueFn(cfg, rl)).act(rows(2))
        iterates = torch.as_tensor(np.stack([c.iterates for c in chunks]))
        stochastic = torch.as_tensor(np.stack([c.stochastic for c in chunks]))
        chain = stored_chain(iterates, stochastic, "noise", None, rl.n_exec)
        prefix = rl.encode_prefix(stack_obs(rows(2)))
        before = score_chain(rl, prefix, chain)
        mask = rl.logprob_mask()
        plain = rl.velocity_and_std

        def odd_padding(p: Any, x: torch.Tensor, t: Any) -> tuple[torch.Tensor, torch.Tensor]:
            v, std = plain(p, x, t)
            return v, torch.where(mask, std, 7.0 * std)

        rl.velocity_and_std = odd_padding  # type: ignore[method-assign]
        after = score_chain(rl, prefix, chain)
    torch.testing.assert_close(after[0], before[0])
    assert before[1] is not None and after[1] is not None
    torch.testing.assert_close(after[1], before[1])


# ----------------------------------------------------------------------------- what trains
@pytest.mark.parametrize("method", ["noise", "sde"])
def test_update_moves_the_expert_and_noise_head_not_the_vlm(
    folders: dict[str, Path], method: str, tmp_path: Path
) -> None:
    rl = rl_policy(folders["smolvla"])
    cfg = ppo_cfg(
        tmp_path, method, minibatch_size=4, update_epochs=1, critic_warmup_iterations=0, actor_lr=1e-3
    )
    value_fn = ValueFn(cfg, rl)
    assert value_fn.kind == "prefix"  # 'auto': RLinf's value head after the VLM prefix
    actor = _actor_params(rl, cfg)  # trainable None: the expert (on a CPU)
    model = rl.policy.policy.model
    vlm = model.vlm_with_expert.vlm
    expert = model.vlm_with_expert.lm_expert
    assert {id(p) for p in actor} >= {id(p) for p in expert.parameters()}
    assert {id(p) for p in actor} >= {id(p) for p in rl.noise_head.parameters()}
    assert not any(p.requires_grad for p in vlm.parameters())
    snap = {n: p.detach().clone() for n, p in rl.named_parameters()}
    with torch.no_grad():
        chunks, _ = Sampler(cfg, rl, value_fn).act(rows(4))
    adv = np.array([1.0, -1.0, 0.5, -0.5])
    ret = adv + np.array([c.value for c in chunks])
    actor_opt = torch.optim.AdamW(actor, lr=cfg.actor_lr)
    critic_opt = torch.optim.AdamW(value_fn.net.parameters(), lr=cfg.critic_lr)
    stats = _update(cfg, rl, value_fn, chunks, adv, ret, actor_opt, critic_opt, 0)
    assert math.isfinite(stats["policy_loss"]) and math.isfinite(stats["value_loss"])
    moved = {n for n, p in rl.named_parameters() if not torch.equal(p, snap[n])}
    assert any(n.startswith("policy.policy.model.vlm_with_expert.lm_expert.") for n in moved)
    assert not any(n.startswith("policy.policy.model.vlm_with_expert.vlm.") for n in moved)
    assert any(n.startswith("noise_head.") for n in moved) == (method == "noise")


def test_noise_head_is_saved_beside_the_folder_and_picked_up_again(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    rl = rl_policy(folders["smolvla"])
    with torch.no_grad():
        for p in rl.noise_head.parameters():
            p.add_(0.3)
    rl.policy.save(tmp_path / "out")
    rl.save_noise_head(tmp_path / "out")
    again = rl_policy(tmp_path / "out")
    for (name, a), b in zip(
        rl.noise_head.state_dict().items(), again.noise_head.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(a, b, msg=name)
    assert again.noise_head_config == rl.noise_head_config


# ----------------------------------------------------------------------------- the trainer
@pytest.mark.parametrize(("ptype", "method"), [("smolvla", "noise"), ("smolvla", "sde"), ("pi0", "noise")])
def test_train_ppo_on_a_lerobot_folder_ships_a_lerobot_folder(
    folders: dict[str, Path], ptype: str, method: str, tmp_path: Path
) -> None:
    cfg = PPOConfig(
        base=str(folders[ptype]),
        out=tmp_path / "run",
        task=TASK,
        method=method,
        num_steps=K,
        num_envs=2,
        rollout_steps=4,
        env_steps=16,  # two iterations of 2 robots x 4 steps
        minibatch_size=4,
        update_epochs=1,
        critic_warmup_iterations=0,
        final_eval_episodes=2,
        threads=1,
        progress=False,
        seed=0,
    )
    res = train_ppo(cfg)
    assert [r["iteration"] for r in res.curve] == [0, 1]
    assert all(math.isfinite(r["policy_loss"]) and math.isfinite(r["value_loss"]) for r in res.curve)
    assert 0.0 <= res.metrics["eval_success"] <= 1.0
    out = res.checkpoint
    assert json.loads((out / "config.json").read_text())["type"] == ptype
    lineage = json.loads((out / LINEAGE_FILE).read_text())["lineage"]
    assert lineage["algorithm"] == f"flow-{method}" and lineage["parent_revision"].startswith("local:")
    assert (out / NOISE_HEAD_FILE).is_file() and (tmp_path / "run" / "critic.pt").is_file()
    shipped = LeRobotFlowPolicy.load(out)
    assert shipped.num_inference_steps == K  # the Euler grid the RL tuned, in LeRobot's own config
    base = LeRobotFlowPolicy.load(folders[ptype])
    moved = [
        n for (n, a), b in zip(shipped.state_dict().items(), base.state_dict().values(), strict=True)
        if not torch.equal(a, b)
    ]  # fmt: skip
    assert moved and all("vlm." not in n and "paligemma." not in n for n in moved)


def test_a_lerobot_base_whose_sidecar_names_its_task_needs_no_task(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    """A folder a round trained records its task (our sidecar's robot spec): PPO trains in it without
    --task, as SFT / AWR do, and refuses another task naming both."""
    folder = folders["smolvla"]  # save_tiny_policy records SPEC (task TASK) in the sidecar
    base = _load_base(PPOConfig(base=str(folder), out=tmp_path / "a", progress=False), torch.device("cpu"))
    assert base.task == TASK and base.loaded is None
    other = PPOConfig(base=str(folder), out=tmp_path / "b", task="maniskill/PushCube-v1", progress=False)
    with pytest.raises(
        ValueError, match="task: the base checkpoint is for 'kinematic/Reach-v0', not 'maniskill"
    ):
        _load_base(other, torch.device("cpu"))


def test_lerobot_bases_are_checked_before_training(folders: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"task: .* is a LeRobot smolvla folder that names no task .*; say which \(--task\)"
    ):
        train_ppo(
            PPOConfig(
                base=str(unnamed_copy(folders["smolvla"], tmp_path)), out=tmp_path / "a", progress=False
            )
        )
    act = save_random_policy(tmp_path / "act", "act", SPEC, chunk_size=4, n_action_steps=4, dim_model=32)
    with pytest.raises(
        ValueError, match="base: flow-sde needs a flow-matching policy; act is not one — use sft"
    ):
        train_ppo(PPOConfig(base=str(act), out=tmp_path / "b", task=TASK, method="sde", progress=False))
    rl = rl_policy(folders["smolvla"])
    with pytest.raises(ValueError, match="critic: 'state' reads FlowVLA's state normaliser"):
        ValueFn(ppo_cfg(tmp_path, "noise", critic="state"), rl)
