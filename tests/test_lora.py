"""LoRA adapters (``trainable = "lora"``, policies/lora.py) on our FlowVLA and on LeRobot's SmolVLA / π0 / π0.5.

What breaks when the piece does: only the adapters (and FlowVLA's new heads) require grad and change after
a step, the base weights do not; the adapters start as a no-op; a saved checkpoint / folder is the plain
model with ``W + (alpha / rank) B A`` in each adapted layer and every other tensor the base's, it loads in
our loader and in LeRobot's own ``from_pretrained`` and acts as the adapted policy did; its lineage says it
was trained with LoRA; bad settings are refused naming the field.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lerobot_offline import from_pretrained, lerobot_actions, offline, one_torch_thread
from safetensors.torch import load_file
from test_flow_policy import batch as flow_batch
from test_flow_policy import tiny_policy
from test_flow_policy_lerobot import TINY, B, observations
from tiny_vlas import SPEC, STATS
from tolerances import RECOMPUTED_ATOL, RECOMPUTED_RTOL
from torch import nn

from policies.flow_policy import FlowPolicyError
from policies.lerobot_flow import FLOW_TYPES, LINEAGE_FILE, LeRobotFlowPolicy
from policies.lerobot_sidecar import read_sidecar
from policies.lerobot_tiny import save_tiny_policy
from policies.loading import load_flow_policy
from policies.lora import LoraSettings, add_lora, lora_state, merged_state_dict
from vla_rl.hub.checkpoint import Lineage, load_checkpoint

SETTINGS = LoraSettings(rank=4, alpha=8.0)


@pytest.fixture(autouse=True, scope="module")
def _offline() -> Iterator[None]:
    with offline(), one_torch_thread():
        yield


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_vlas")
    return {
        t: save_tiny_policy(root / t, t, SPEC, words=["push"], stats=STATS, seed=3, **TINY)
        for t in FLOW_TYPES
    }


def _train_steps(policy: Any, params: list[nn.Parameter], batch: dict[str, Any], steps: int = 3) -> None:
    """A few Adam steps on the mean flow loss (fixed noise / time)."""
    opt = torch.optim.Adam(params, lr=1e-2)
    g = torch.Generator().manual_seed(5)
    policy.train()
    for _ in range(steps):
        noise = torch.randn(B, *policy.event_shape, generator=g)
        loss = policy.loss(batch, noise=noise, time=torch.full((B,), 0.4)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    policy.eval()


def _only_adapters_changed(
    before: dict[str, torch.Tensor], model: nn.Module, heads: tuple[str, ...] = ()
) -> None:
    """Every adapter's B in the action expert moved (B starts at zero), no base weight did. (The VLM's
    last layer adapts only its keys / values usefully: its queries, output and MLP reach no action.)"""
    after = model.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all(".lora_" in k or k.startswith(heads) for k in moved), sorted(moved)[:5]
    expert = [k for k in before if ".lora_B." in k and re.search(r"(^|\.)(lm_|gemma_)?expert\.", k)]
    assert expert and all(k in moved for k in expert), sorted(set(expert) - moved)[:5]


def _check_merged(saved: dict[str, torch.Tensor], base: dict[str, torch.Tensor], model: nn.Module) -> None:
    """``saved`` = ``base`` with ``W + scaling B A`` in every adapted layer (the plain model's keys)."""
    state = lora_state(model)
    assert state is not None
    assert set(saved) == set(base)
    adapted = {f"{name}.weight" for name in state.layers}
    for name in state.layers:
        layer = model.get_submodule(name)
        delta = SETTINGS.scaling * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
        torch.testing.assert_close(saved[f"{name}.weight"].float(), base[f"{name}.weight"].float() + delta)
    for key in set(base) - adapted:
        assert torch.equal(saved[key], base[key]), key


# ---------------------------------------------------------------------------- settings
def test_settings_are_refused_naming_the_field(tmp_path: Path) -> None:
    for kw, match in [
        ({"rank": 0}, "lora_rank: expected an integer in 1..4096, got 0"),
        ({"rank": 2.5}, "lora_rank: expected an integer"),
        ({"alpha": 0.0}, r"lora_alpha: expected a finite number > 0, got 0.0"),
        ({"dropout": 1.0}, r"lora_dropout: expected a probability in \[0, 1\), got 1.0"),
        ({"targets": "("}, "lora_targets: not a valid regular expression"),
        ({"targets": " "}, "lora_targets: expected a regular expression over module names"),
    ]:
        with pytest.raises(ValueError, match=match):
            LoraSettings(**kw)
    from vla_rl.train.awr import AWRConfig

    common = {"store": tmp_path, "base": str(tmp_path), "out": tmp_path / "o"}
    with pytest.raises(ValueError, match="lora_dropout: expected a probability"):
        AWRConfig(**common, trainable="lora", lora_dropout=-0.1)
    with pytest.raises(
        ValueError, match="lora_rank: set only with trainable 'lora' \\(got trainable 'expert'\\)"
    ):
        AWRConfig(**common, trainable="expert", lora_rank=8)
    with pytest.raises(
        ValueError, match="lora_targets: set only with trainable 'lora' \\(got trainable None\\)"
    ):
        AWRConfig(**common, lora_targets="expert.*")
    cfg = AWRConfig(**common, trainable="lora", lora_rank=8, lora_alpha=16, lora_targets=r"expert\..*")
    assert cfg.lora_settings() == LoraSettings(8, 16.0, 0.0, r"expert\..*")
    assert AWRConfig(**common, trainable="full").lora_settings() is None


def test_merged_state_dict_adds_the_scaled_delta_and_leaves_the_model_as_it_is() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    base = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(7, 5)
    y0 = model(x)
    _, params = add_lora(model, SETTINGS, default_targets=r"0|2")
    torch.testing.assert_close(model(x), y0)  # B = 0: the adapters start as a no-op
    with torch.no_grad():
        for p in params:
            p.normal_()
    plain = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    merged = merged_state_dict(model)
    _check_merged(merged, base, model)
    plain.load_state_dict(merged)
    torch.testing.assert_close(plain(x), model(x), atol=1e-5, rtol=1e-5)
    assert any(".lora_A." in k for k in model.state_dict())  # the model keeps its adapters
    with pytest.raises(ValueError, match="lora: this policy already carries LoRA adapters"):
        add_lora(model, LoraSettings(rank=2), default_targets=r"0|2")
    with pytest.raises(ValueError, match="lora_targets: 'nothing' matches no linear layer of this mlp"):
        add_lora(nn.Sequential(nn.Linear(2, 2)), SETTINGS, default_targets="nothing", what="mlp")


# ---------------------------------------------------------------------------- FlowVLA
def test_flow_vla_trains_only_adapters_and_saves_a_plain_merged_checkpoint(tmp_path: Path) -> None:
    fp = tiny_policy()
    base = {k: v.clone() for k, v in fp.model.state_dict().items()}
    params = fp.set_trainable("lora", SETTINGS)
    names = {n for n, p in fp.model.named_parameters() if p.requires_grad}
    assert names and all(".lora_" in n or n.startswith("noise_head.") for n in names)
    assert len(params) == len(names) and any(n.startswith("noise_head.") for n in names)
    assert any(n.startswith("trunk.") for n in names) and any(n.startswith("expert.blocks.") for n in names)
    before = {k: v.clone() for k, v in fp.model.state_dict().items()}
    _train_steps(fp, params, flow_batch())
    _only_adapters_changed(before, fp.model, heads=("noise_head.",))
    with pytest.raises(FlowPolicyError, match="trainable: 'full' on a policy that carries LoRA adapters"):
        fp.set_trainable("full")
    out = fp.save(tmp_path / "ckpt", lineage=Lineage("awr", round=2))
    info, saved = load_checkpoint(out)
    _check_merged(
        {k: v for k, v in saved.items() if not k.startswith("noise_head.")},
        {k: v for k, v in base.items() if not k.startswith("noise_head.")},
        fp.model,
    )
    assert info.lineage.algorithm == "awr" and info.lineage.lora is not None
    assert (
        info.lineage.lora["rank"] == 4 and info.lineage.lora["alpha"] == 8.0 and info.lineage.lora["merged"]
    )
    again = load_flow_policy(out, device="cpu")
    obs = {"state": flow_batch(1)["state"]}
    x0 = torch.randn(B, 4, 2, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(
            again.predict_action_chunk(obs, noise=x0),
            fp.predict_action_chunk(obs, noise=x0),
            atol=RECOMPUTED_ATOL,
            rtol=RECOMPUTED_RTOL,
        )


def test_targets_that_match_nothing_are_refused_naming_the_field() -> None:
    msg = "lora_targets: 'vision.*' matches no linear layer of this flow_vla (e.g. state_encoder.0"
    with pytest.raises(FlowPolicyError, match=re.escape(msg)):
        tiny_policy().set_trainable("lora", LoraSettings(targets="vision.*"))


# ---------------------------------------------------------------------------- LeRobot
@pytest.mark.parametrize("ptype", FLOW_TYPES)
def test_lerobot_vla_trains_only_adapters_and_saves_a_merged_lerobot_folder(
    ptype: str, folders: dict[str, Path], tmp_path: Path
) -> None:
    fp = LeRobotFlowPolicy.load(folders[ptype])
    obs = observations(1)
    x0 = torch.randn(B, *fp.event_shape, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        start = fp.predict_action_chunk(obs, noise=x0)
    params = fp.set_trainable("lora", SETTINGS)
    state = lora_state(fp.policy)
    assert state is not None
    assert any(".lm_expert." in n or ".gemma_expert." in n for n in state.layers)
    assert any(".text_model." in n or ".language_model." in n for n in state.layers)
    assert not any("vision" in n for n in state.layers)
    names = {n for n, p in fp.policy.named_parameters() if p.requires_grad}
    assert names and all(".lora_" in n for n in names) and len(params) == len(names)
    cfg = fp.policy.config
    assert not cfg.train_expert_only and cfg.freeze_vision_encoder  # adapters in the VLM, none in vision
    with torch.no_grad():
        torch.testing.assert_close(fp.predict_action_chunk(obs, noise=x0), start)  # B = 0 at first
    before = {k: v.clone() for k, v in fp.policy.state_dict().items()}
    _train_steps(fp, params, {**observations(0), "action": torch.randn(B, 6, 2)})
    _only_adapters_changed(before, fp.policy)

    out = fp.save(tmp_path / "round1", lineage=Lineage(algorithm="sft", round=1))
    _check_merged(
        load_file(out / "model.safetensors"), load_file(folders[ptype] / "model.safetensors"), fp.policy
    )
    lineage = read_sidecar(out).lineage
    assert lineage is not None and lineage.algorithm == "sft"
    assert lineage.lora is not None and (lineage.lora["rank"], lineage.lora["layers"]) == (
        4,
        len(state.layers),
    )
    theirs = from_pretrained(out)
    assert type(theirs).name == ptype and not theirs.config.train_expert_only
    with torch.no_grad():
        ours = fp.predict_action_chunk(obs, noise=x0)
    assert not torch.allclose(ours, start, atol=1e-4)
    close = {"atol": RECOMPUTED_ATOL, "rtol": RECOMPUTED_RTOL}
    torch.testing.assert_close(lerobot_actions(theirs, out, obs, x0, fp.camera_keys), ours, **close)
    again = load_flow_policy(out, device="cpu")
    assert isinstance(again, LeRobotFlowPolicy) and lora_state(again.policy) is None
    with torch.no_grad():
        torch.testing.assert_close(again.predict_action_chunk(obs, noise=x0), ours, **close)
    assert (out / LINEAGE_FILE).is_file()


# ---------------------------------------------------------------------------- PPO's actor
def test_ppo_actor_under_lora_trains_the_adapters_and_its_noise_head(folders: dict[str, Path]) -> None:
    """Flow-Noise / Flow-SDE PPO with ``trainable lora``: the actor's optimiser gets the adapters and the
    noise head (FlowVLA's inside the model, a LeRobot VLA's beside it), nothing else."""
    from policies.flow_rl import stochastic_policy

    flow = stochastic_policy(tiny_policy(), "reach")
    params = flow.actor_parameters("lora", SETTINGS)
    names = {n for n, p in flow.policy.model.named_parameters() if p.requires_grad}
    assert any(n.startswith("noise_head.") for n in names) and any(".lora_" in n for n in names)
    assert all(".lora_" in n or n.startswith("noise_head.") for n in names) and len(params) == len(names)

    lerobot = stochastic_policy(LeRobotFlowPolicy.load(folders["smolvla"]), "push the red cube")
    params = lerobot.actor_parameters("lora", SETTINGS)
    head = list(lerobot.noise_head.parameters())
    assert head and all(any(p is h for p in params) for h in head)
    adapters = [p for n, p in lerobot.policy.policy.named_parameters() if p.requires_grad]
    assert adapters and len(params) == len(adapters) + len(head)
    assert all(".lora_" in n for n, p in lerobot.policy.policy.named_parameters() if p.requires_grad)
