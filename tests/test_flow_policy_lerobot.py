"""LeRobot's SmolVLA, π0 and π0.5 behind the flow-policy contract (policies/lerobot_flow.py), against
LeRobot's own code on the same noise and time: the velocity through our cached prefix == its
``denoise_step`` at every step of its ``sample_actions``; our K-step sample == ``sample_actions(noise=...)``;
our per-sample loss == ``forward(reduction="none")``; a saved folder loads in LeRobot's own
``from_pretrained`` and acts as ours. The policies are tiny configurations of the published architectures
built here (policies/lerobot_tiny.py): no download, and a guard refuses any connection off this machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from lerobot_offline import from_pretrained, lerobot_actions, offline, one_torch_thread
from tiny_vlas import SPEC, STATS
from tolerances import RECOMPUTED_ATOL, RECOMPUTED_RTOL

from policies.flow_policy import FlowPolicy, FlowPolicyError
from policies.lerobot_adapter import save_random_policy
from policies.lerobot_flow import FLOW_TYPES, LINEAGE_FILE, LeRobotFlowPolicy
from policies.lerobot_local import LOCAL_VLM_DIR, PI_SIZES_FILE
from policies.lerobot_tiny import save_tiny_policy
from policies.loading import load_flow_policy
from vla_rl.hub.checkpoint import Lineage

TINY = {
    "chunk_size": 6,
    "n_action_steps": 3,
    "max_state_dim": 8,
    "max_action_dim": 8,
    "tokenizer_max_length": 32,
}
B = 3


@pytest.fixture(autouse=True, scope="module")
def _offline() -> Iterator[None]:
    """Nothing here may reach the internet, building the folders included (module scope: set up before
    them)."""
    with offline():
        yield


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_vlas")
    out = {}
    for ptype in FLOW_TYPES:
        out[ptype] = save_tiny_policy(
            root / ptype, ptype, SPEC, words=["pick up the block"], stats=STATS, seed=1, **TINY
        )
    return out


@pytest.fixture(scope="module")
def policies(folders: dict[str, Path]) -> dict[str, LeRobotFlowPolicy]:
    return {ptype: LeRobotFlowPolicy.load(folder) for ptype, folder in folders.items()}


def observations(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "state": torch.randn(B, 3, generator=g),
        "cameras": {"top": torch.randint(0, 256, (B, 48, 48, 3), generator=g, dtype=torch.uint8)},
        "instruction": ["push the red cube", "pick up the block", "push the red cube"],
    }


def noise(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=RECOMPUTED_ATOL, rtol=RECOMPUTED_RTOL)


def lerobot_inputs(fp: LeRobotFlowPolicy, batch: dict[str, Any]) -> list[Any]:
    """``sample_actions`` / ``model.forward``'s leading arguments as LeRobot's policy prepares them."""
    images, img_masks, tokens, masks, state = fp._pieces(fp._inputs(batch))
    return [images, img_masks, tokens, masks] + ([] if state is None else [state])


# ---------------------------------------------------------------------------- tiny folders
def test_tiny_folders_are_small_lerobot_policies_built_offline(
    folders: dict[str, Path], policies: dict[str, LeRobotFlowPolicy]
) -> None:
    for ptype, folder in folders.items():
        names = {p.name for p in folder.iterdir()}
        assert {
            "config.json",
            "model.safetensors",
            "policy_preprocessor.json",
            "policy_postprocessor.json",
        } <= names
        assert (folder / LOCAL_VLM_DIR / "tokenizer.json").is_file()
        assert (PI_SIZES_FILE in names) == (ptype != "smolvla")
        fp = policies[ptype]
        assert isinstance(fp, FlowPolicy)
        assert sum(p.numel() for p in fp.parameters()) < 1_000_000
        assert (fp.chunk_len, fp.n_exec, fp.action_dim, fp.event_shape) == (6, 3, 2, (6, 8))
        mask = fp.logprob_mask()
        assert mask.shape == (6, 8) and int(mask.sum()) == 3 * 2 and bool(mask[:3, :2].all())


# ---------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize("ptype", FLOW_TYPES)
def test_velocity_through_our_prefix_equals_lerobot_denoise_step(
    ptype: str, policies: dict[str, LeRobotFlowPolicy]
) -> None:
    """At every step of LeRobot's own ``sample_actions``: ``v(x, t) == -denoise_step(x, 1 - t)``."""
    fp = policies[ptype]
    m, obs = fp.policy.model, observations()
    calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    real = m.denoise_step

    def spy(**kw: Any) -> torch.Tensor:
        u = real(**kw)
        calls.append((kw["x_t"].clone(), kw["timestep"].clone(), u.clone()))
        return u

    with mock.patch.object(m, "denoise_step", spy):
        m.sample_actions(*lerobot_inputs(fp, obs), noise=noise(1, B, *fp.event_shape))
    assert len(calls) == fp.num_inference_steps
    prefix = fp.encode_prefix(obs)
    with torch.no_grad():
        for x, s, u in calls:
            close(fp.velocity(prefix, x, 1.0 - s), -u)


@pytest.mark.parametrize("ptype", FLOW_TYPES)
def test_k_step_sample_equals_lerobot_sample_actions(
    ptype: str, policies: dict[str, LeRobotFlowPolicy]
) -> None:
    fp, obs = policies[ptype], observations(2)
    x0 = noise(3, B, *fp.event_shape)
    with torch.no_grad():
        ours = fp.sample(obs, noise=x0[:, None])
        theirs = fp.policy.model.sample_actions(*lerobot_inputs(fp, obs), noise=x0.clone())
    assert ours.actions.shape == (B, 1, 6, 8)
    close(ours.actions[:, 0], theirs)
    # env units: LeRobot's predict_action_chunk + its post-processor
    env = fp.predict_action_chunk(obs, noise=x0)
    close(env, fp.postprocessor(fp.policy.predict_action_chunk(fp._inputs(obs), noise=x0.clone())))
    assert env.shape == (B, 6, 2)


@pytest.mark.parametrize("ptype", FLOW_TYPES)
def test_sampling_rows_are_independent_and_samples_share_one_prefix(
    ptype: str, policies: dict[str, LeRobotFlowPolicy]
) -> None:
    fp, obs = policies[ptype], observations(4)
    x0 = noise(5, B, 2, *fp.event_shape)
    with torch.no_grad():
        batched = fp.sample(obs, num_samples=2, noise=x0, num_steps=3, return_iterates=True)
        one = {
            "state": obs["state"][1:2],
            "cameras": {"top": obs["cameras"]["top"][1:2]},
            "instruction": obs["instruction"][1],
        }
        alone = fp.sample(one, num_samples=2, noise=x0[1:2], num_steps=3)
    assert batched.iterates.shape == (B, 2, 4, 6, 8)
    close(batched.actions[1:2], alone.actions)
    close(batched.iterates[:, :, -1], batched.actions)


@pytest.mark.parametrize("ptype", FLOW_TYPES)
def test_per_sample_loss_equals_lerobot_forward_reduction_none(
    ptype: str, policies: dict[str, LeRobotFlowPolicy]
) -> None:
    fp = policies[ptype]
    g = torch.Generator().manual_seed(6)
    batch = {**observations(6), "action": torch.randn(B, 6, 2, generator=g) * 2}
    x0, t = noise(7, B, *fp.event_shape), torch.tensor([0.05, 0.5, 0.95])  # our time: 0 noise
    ours = fp.loss(batch, noise=x0, time=t)
    lb, m = fp._inputs(batch), fp.policy.model
    if ptype == "smolvla":
        theirs, _ = fp.policy.forward(lb, noise=x0.clone(), time=1.0 - t, reduction="none")
    else:  # π0's forward draws its own noise and time: hand it ours
        with (
            mock.patch.object(m, "sample_noise", lambda shape, device: x0.clone()),
            mock.patch.object(m, "sample_time", lambda bsize, device: 1.0 - t),
        ):
            theirs, _ = fp.policy.forward(lb, reduction="none")
    assert ours.shape == (B,)
    close(ours, theirs)
    # padded steps never count (LeRobot's π0 / π0.5 count them; SmolVLA does not): LeRobot's elementwise
    # errors averaged over the valid steps only
    pad = torch.zeros(B, 6, dtype=torch.bool)
    pad[0, 4:] = True
    padded = fp.loss({**batch, "action_is_pad": pad}, noise=x0, time=t)
    actions = fp.policy.prepare_action(lb)
    err = m.forward(*lerobot_inputs(fp, batch), actions, x0.clone(), 1.0 - t)[..., :2]
    close(padded, torch.stack([err[0, :4].mean(), err[1].mean(), err[2].mean()]))
    if ptype == "smolvla":
        theirs_pad, _ = fp.policy.forward(
            fp._inputs({**batch, "action_is_pad": pad}), noise=x0.clone(), time=1.0 - t, reduction="none"
        )
        close(padded, theirs_pad)


@pytest.mark.parametrize("ptype", FLOW_TYPES)
def test_features_and_normalisation_use_the_folder_processors(
    ptype: str, policies: dict[str, LeRobotFlowPolicy]
) -> None:
    fp, obs = policies[ptype], observations(8)
    prefix = fp.encode_prefix(obs)
    feats = fp.features(prefix)
    assert feats.shape == (B, prefix.hidden.shape[-1]) and bool(torch.isfinite(feats).all())
    a = torch.randn(B, 6, 2, generator=torch.Generator().manual_seed(9))
    x = fp.normalize_actions(a)
    assert x.shape == (B, 6, 8) and bool((x[..., 2:] == 0).all())
    close(x[..., :2], fp._inputs({**obs, "action": a})["action"])  # what the pre-processor feeds the loss
    close(fp.unnormalize_actions(x), a)


# ---------------------------------------------------------------------------- training knob
@pytest.mark.parametrize("ptype", FLOW_TYPES)
def test_expert_trains_with_the_vlm_frozen_and_full_trains_everything(
    ptype: str, folders: dict[str, Path]
) -> None:
    fp = LeRobotFlowPolicy.load(folders[ptype])
    m = fp.policy.model
    vlm = m.vlm_with_expert.vlm if ptype == "smolvla" else m.paligemma_with_expert.paligemma
    expert = m.vlm_with_expert.lm_expert if ptype == "smolvla" else m.paligemma_with_expert.gemma_expert
    params = fp.set_trainable("expert")
    assert not any(p.requires_grad for p in vlm.parameters())
    assert all(p.requires_grad for p in expert.parameters()) and m.action_out_proj.weight.requires_grad
    assert len(params) == sum(p.requires_grad for p in fp.parameters())
    assert fp.policy.config.train_expert_only and fp.policy.config.freeze_vision_encoder
    fp.train()
    assert not vlm.training  # LeRobot keeps a frozen VLM in eval mode
    batch = {**observations(), "action": torch.randn(B, 6, 2)}
    fp.loss(batch, noise=noise(1, B, 6, 8), time=torch.full((B,), 0.5)).mean().backward()
    assert m.action_out_proj.weight.grad is not None
    assert all(p.grad is None for p in vlm.parameters())
    full = fp.set_trainable("full")
    assert len(full) == len(list(fp.parameters())) and not fp.policy.config.train_expert_only
    with (
        mock.patch("importlib.util.find_spec", return_value=None),
        pytest.raises(FlowPolicyError, match="'lora' needs the peft package"),
    ):
        fp.set_trainable("lora")  # LoRA itself: tests/test_lora.py


# ---------------------------------------------------------------------------- save / load
@pytest.mark.parametrize("ptype", FLOW_TYPES)
def test_saved_folder_loads_in_lerobot_from_pretrained_and_acts_as_ours(
    ptype: str, folders: dict[str, Path], tmp_path: Path
) -> None:
    fp = LeRobotFlowPolicy.load(folders[ptype])
    params = fp.set_trainable("expert")
    opt = torch.optim.SGD(params, lr=0.1)  # one step, so the saved weights are not the base's
    fp.loss({**observations(), "action": torch.randn(B, 6, 2)}).mean().backward()
    opt.step()
    out = fp.save(tmp_path / "round1", lineage=Lineage(algorithm="awr", round=1), metrics={"train_steps": 1})
    assert (out / LINEAGE_FILE).is_file() and (out / LOCAL_VLM_DIR).is_dir()
    theirs = from_pretrained(out)
    assert type(theirs).name == ptype and theirs.config.train_expert_only
    obs, x0 = observations(10), noise(11, B, *fp.event_shape)
    actions = lerobot_actions(theirs, out, obs, x0, fp.camera_keys)
    close(fp.predict_action_chunk(obs, noise=x0), actions)
    again = load_flow_policy(out, algorithm="awr", device="cpu")
    assert isinstance(again, LeRobotFlowPolicy)
    close(again.predict_action_chunk(obs, noise=x0), actions)


def test_a_lerobot_policy_that_is_not_a_flow_vla_is_refused_naming_it(tmp_path: Path) -> None:
    folder = save_random_policy(tmp_path / "act", "act", SPEC, chunk_size=4, n_action_steps=4, dim_model=32)
    msg = "awr needs a flow-matching policy; act is not one — use sft"
    with pytest.raises(FlowPolicyError, match=msg):
        LeRobotFlowPolicy.load(folder, algorithm="awr")
    with pytest.raises(FlowPolicyError, match=msg):
        load_flow_policy(folder, algorithm="awr", device="cpu")
