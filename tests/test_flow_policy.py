"""The flow-policy contract (policies/flow_policy.py) on our FlowVLA: the adapter delegates without changing a
number, the generic Euler sampler equals FlowVLA's own, which parameters train, save / load.

LeRobot's SmolVLA / π0 / π0.5 behind the same contract: tests/test_flow_policy_lerobot.py.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch
from tolerances import RECOMPUTED_ATOL, RECOMPUTED_RTOL
from vla_rl_client.spec import RobotSpec

from policies.flow_policy import (
    EXPERT_MODULES,
    FlowPolicy,
    FlowPolicyError,
    FlowVLAFlowPolicy,
    euler_sample_prefix,
    masked_mean_per_sample,
)
from policies.flow_vla import FlowVLAConfig, FlowVLAPolicy
from policies.loading import load_flow_policy
from vla_rl.hub.checkpoint import Lineage, read_info

B = 3


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_policy(seed: int = 0, **kw) -> FlowVLAFlowPolicy:
    cfg = FlowVLAConfig(
        **{
            "state_dim": 3,
            "action_dim": 2,
            "chunk_len": 4,
            "n_exec": 2,
            "d_model": 32,
            "n_layers": 1,
            "expert_n_layers": 2,
            "n_heads": 4,
            "instruction_encoder": "none",
            "noise_head_hidden": (16,),
            "normalization_stats": {
                "action": {"min": [-2.0, -1.0], "max": [2.0, 3.0]},
                "state": {"mean": [0.0, 0.0, 0.0], "std": [1.0, 1.0, 1.0]},
            },
            **kw,
        }
    )
    torch.manual_seed(seed)
    spec = RobotSpec(name="toy/Reach-v0", state_dim=3, action_dim=2, control_hz=10.0, instruction="reach")
    return FlowVLAFlowPolicy(FlowVLAPolicy(cfg), spec)


def batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"state": torch.randn(B, 3, generator=g), "action": torch.rand(B, 4, 2, generator=g) * 4 - 2}


def noise(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=RECOMPUTED_ATOL, rtol=RECOMPUTED_RTOL)


def test_flowvla_adapter_is_a_flow_policy_with_flowvla_shapes() -> None:
    fp = tiny_policy()
    assert isinstance(fp, FlowPolicy)
    assert (fp.chunk_len, fp.n_exec, fp.action_dim, fp.event_shape) == (4, 2, 2, (4, 2))
    assert fp.num_inference_steps == fp.model.config.num_inference_steps
    assert torch.equal(fp.logprob_mask(), fp.model.logprob_mask())


def test_per_sample_loss_is_what_flow_matching_loss_averages_and_weights() -> None:
    fp, b = tiny_policy(), batch()
    x0, t = noise(1, B, 4, 2), torch.tensor([0.1, 0.5, 0.9])
    per = fp.loss(b, noise=x0, time=t)
    assert per.shape == (B,) and bool((per > 0).all())
    close(per.mean(), fp.model.flow_matching_loss(b, noise=x0, time=t)[0])
    w = torch.tensor([0.5, 2.0, 0.0])
    close((w * per).mean(), fp.model.flow_matching_loss(b, noise=x0, time=t, weights=w)[0])
    pad = torch.tensor([[False, False, True, True], [False] * 4, [False, False, False, True]])
    padded = fp.loss({**b, "action_is_pad": pad}, noise=x0, time=t)
    close(padded.mean(), fp.model.flow_matching_loss({**b, "action_is_pad": pad}, noise=x0, time=t)[0])
    assert not torch.allclose(padded, per)  # padded steps do not count


def test_masked_mean_per_sample_ignores_padded_steps() -> None:
    err = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    pad = torch.tensor([[False, True, True], [False, False, False]])
    out = masked_mean_per_sample(err, pad)
    close(out, torch.stack([err[0, 0].mean(), err[1].mean()]))
    close(masked_mean_per_sample(err, None), err.mean((1, 2)))


def test_generic_euler_sampler_equals_flowvla_sample() -> None:
    fp = tiny_policy()
    obs = {"state": batch()["state"]}
    x0 = noise(2, B, 2, 4, 2)

    def generic(num_steps: int, noise: torch.Tensor | None):
        kw = {"num_samples": 2, "noise": noise, "generator": None, "return_iterates": True}
        return euler_sample_prefix(fp, fp.encode_prefix(obs), num_steps=num_steps, **kw)

    own = fp.sample(obs, num_samples=2, noise=x0, num_steps=5, return_iterates=True)
    out = generic(5, x0)
    assert out.actions.shape == (B, 2, 4, 2) and out.iterates.shape == (B, 2, 6, 4, 2)
    close(out.actions, own.actions)
    close(out.iterates, own.iterates)
    close(fp.sample(obs, noise=x0[:, :1]).actions, fp.model.sample(obs, noise=x0[:, :1]).actions)
    with pytest.raises(ValueError, match="num_steps"):
        generic(1001, None)


def test_velocity_features_and_normalisation_delegate_to_the_model() -> None:
    fp = tiny_policy()
    obs = {"state": batch()["state"]}
    prefix = fp.encode_prefix(obs)
    x, t = noise(3, B, 4, 2), torch.tensor([0.0, 0.3, 0.7])
    close(fp.velocity(prefix, x, t), fp.model.velocity(prefix, x, t))
    close(fp.features(prefix), prefix.tokens.mean(1))
    assert fp.features(prefix).shape == (B, 32)
    a = batch()["action"]
    close(fp.unnormalize_actions(fp.normalize_actions(a)), a)
    close(fp.normalize_actions(a), fp.model.normalizer.normalize_action(a))
    env = fp.predict_action_chunk(obs, noise=x)
    close(env, fp.model.predict_action_chunk(obs, noise=x))
    assert env.shape == (B, 4, 2)


def test_set_trainable_expert_full_and_refused_parts() -> None:
    fp = tiny_policy()
    every = {n for n, _ in fp.model.named_parameters()}
    expert = fp.set_trainable("expert")
    names = {n for n, p in fp.model.named_parameters() if p.requires_grad}
    assert names and all(n.startswith(EXPERT_MODULES) for n in names)
    assert len(expert) == len(names) and any(n.startswith("trunk.") for n in every - names)
    loss = fp.loss(batch(), noise=noise(1, B, 4, 2), time=torch.full((B,), 0.5))
    loss.mean().backward()
    assert fp.model.expert.action_out.weight.grad is not None and fp.model.trunk[0].norm1.weight.grad is None
    full = fp.set_trainable("full")
    assert len(full) == len(list(fp.model.parameters()))
    with (
        mock.patch("importlib.util.find_spec", return_value=None),
        pytest.raises(FlowPolicyError, match="'lora' needs the peft package, which is not installed here"),
    ):
        fp.set_trainable("lora")  # LoRA itself: tests/test_lora.py
    with pytest.raises(FlowPolicyError, match=r"trainable: expected one of \['expert', 'full', 'lora'\]"):
        fp.set_trainable("head")  # type: ignore[arg-type]


def test_full_keeps_a_frozen_image_backbone_frozen() -> None:
    from vla_rl_client.spec import CameraSpec

    fp = tiny_policy(
        cameras=(CameraSpec("top", 32, 32),), image_encoder="resnet18", freeze_image_encoder=True
    )
    frozen = {n for n, p in fp.model.named_parameters() if not p.requires_grad}
    assert frozen
    fp.set_trainable("expert")
    fp.set_trainable("full")
    assert {n for n, p in fp.model.named_parameters() if not p.requires_grad} == frozen


def test_save_writes_our_checkpoint_and_load_flow_policy_reads_it_back(tmp_path: Path) -> None:
    fp = tiny_policy(seed=4)
    lineage = Lineage(algorithm="awr", parent_revision="hub://org/base@abc", round=2)
    fp.save(tmp_path / "ckpt", lineage=lineage, metrics={"train_steps": 7})
    info = read_info(tmp_path / "ckpt")
    assert (
        info.policy_type == "flow_vla"
        and info.lineage.algorithm == "awr"
        and info.metrics["train_steps"] == 7
    )
    back = load_flow_policy(tmp_path / "ckpt", device="cpu")
    assert isinstance(back, FlowVLAFlowPolicy) and back.spec == fp.spec
    obs, x0 = {"state": batch()["state"]}, noise(5, B, 4, 2)
    close(back.predict_action_chunk(obs, noise=x0), fp.predict_action_chunk(obs, noise=x0))
    back.save(tmp_path / "again")  # lineage defaults to the base checkpoint's
    assert read_info(tmp_path / "again").lineage.parent_revision == "hub://org/base@abc"
