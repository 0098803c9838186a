"""The trainers' side of the flow-policy contract (:mod:`policies.flow_policy`): one code path for our FlowVLA
and LeRobot's SmolVLA / π0 / π0.5.

SFT from a base, AWR / RECAP and awr-pi hold a :class:`~policies.flow_policy.FlowPolicy` and do these
things with it, here once:

* **load the base** (:func:`load_base`): our checkpoint or a LeRobot folder, as a
  :class:`~policies.loading.FlowCheckpoint`; a LeRobot type that is not a flow VLA is refused naming the
  algorithm (``"awr needs a flow-matching policy; act is not one — use sft"``);
* **choose what trains** (:func:`trainable_parameters`): the config's ``trainable`` knob, by default
  ``full`` for FlowVLA (what every trainer always trained) and ``expert`` for a LeRobot VLA on a CPU (on a
  GPU, what the folder's own config says: ``train_expert_only``); ``lora`` with the config's ``lora_*``
  settings (the adapters are merged into the weights when the policy is saved);
* **feed it** (:class:`PolicyInputs`): dataset / buffer batches (LeRobot's key names) become the contract's
  observation batches, each sample with its own instruction (text; FlowVLA also gets the frozen
  embeddings, computed once per distinct instruction, as before);
* **value inputs** (:func:`value_features`): FlowVLA's as before (normalised state for state-only policies,
  the pooled trunk otherwise), a LeRobot VLA's ``features(prefix)`` (the VLM output, pooled);
* **weighted flow matching** (:func:`weighted_flow_loss`): ``mean_b w_b loss_b`` of the per-sample loss;
* **save** (:func:`save_trained`): the policy in its own format with a lineage naming the algorithm and
  the parent (our checkpoint, or a LeRobot folder with our sidecar).

For FlowVLA every one of these computes exactly what the trainers computed before the contract.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from policies.flow_policy import FlowPolicy, FlowPolicyError, FlowVLAFlowPolicy, TrainableParts
from policies.lerobot_flow import LeRobotFlowPolicy
from policies.loading import FlowCheckpoint, load_flow_checkpoint
from vla_rl.hub.checkpoint import Lineage
from vla_rl.train.base import TrainerConfig
from vla_rl.train.common import batch_to_policy_inputs, instruction_table, observation_features

Tensor = torch.Tensor
ACTION_KEYS = ("action", "action_is_pad")

__all__ = [
    "PolicyInputs",
    "as_policy",
    "default_trainable",
    "load_base",
    "save_trained",
    "trainable_copy",
    "trainable_parameters",
    "trained_module",
    "value_features",
    "weighted_flow_loss",
]


def load_base(cfg: TrainerConfig, device: torch.device) -> FlowCheckpoint:
    """``cfg.base`` as a flow policy on ``device``, in eval mode; a LeRobot folder that is not a flow VLA
    raises :class:`~policies.flow_policy.FlowPolicyError` naming ``cfg.algorithm``."""
    if cfg.base is None:
        raise ValueError(f"base: {cfg.algorithm} needs a base checkpoint (a folder or hub://org/name@rev)")
    base = load_flow_checkpoint(cfg.base, algorithm=cfg.algorithm, device=str(device))
    base.policy.train(False)
    return base


def default_trainable(policy: FlowPolicy) -> TrainableParts:
    """``full`` for FlowVLA (what its trainers always trained); for a LeRobot VLA ``expert`` on a CPU,
    elsewhere what its config's ``train_expert_only`` says."""
    if not isinstance(policy, LeRobotFlowPolicy):
        return "full"
    if policy.device.type == "cpu":
        return "expert"
    return "expert" if policy.policy.config.train_expert_only else "full"


def trainable_parameters(cfg: TrainerConfig, policy: FlowPolicy) -> list[nn.Parameter]:
    """Set what trains from ``cfg.trainable`` (None: :func:`default_trainable`) and return those parameters,
    for the optimiser; a refused choice raises a ValueError naming the field."""
    parts = cfg.trainable or default_trainable(policy)
    try:
        params = policy.set_trainable(parts, cfg.lora_settings())
    except FlowPolicyError as e:
        raise ValueError(f"{e} ({cfg.algorithm})") from None
    if not params:
        raise ValueError(f"trainable: {parts!r} leaves nothing to train in this {type(policy).__name__}")
    return params


class PolicyInputs:
    """Dataset / transition-buffer batches (``observation.state``, ``observation.images.<cam>``, ``action``,
    ``action_is_pad``, ``instruction_index``) -> the policy's observation batches on ``device``, each
    sample with its own instruction from ``instructions`` (the data's distinct strings, in index order).
    FlowVLA gets its frozen instruction embeddings (one batched MiniLM call for the whole data) as before;
    every policy gets the texts (a LeRobot VLA tokenises them)."""

    def __init__(self, policy: FlowPolicy, data: Any, device: torch.device) -> None:
        self.device = device
        self.texts: list[str] = list(data.instructions)
        uses_embedding = isinstance(policy, FlowVLAFlowPolicy) and policy.model.config.uses_instruction
        self.embeddings = instruction_table(data, device) if uses_embedding else None

    def __call__(self, raw: Mapping[str, Tensor]) -> dict[str, Any]:
        out = batch_to_policy_inputs(raw, self.device, self.embeddings)
        out["instruction"] = [self.texts[i] for i in raw["instruction_index"].tolist()]
        return out


@torch.no_grad()
def value_features(policy: FlowPolicy, obs: Mapping[str, Any]) -> Tensor:
    """Value-head inputs ``[B, F]`` for a batch of observations; no gradient reaches the policy. FlowVLA:
    :func:`~vla_rl.train.common.observation_features` (normalised state when state-only, else the pooled
    trunk); any other flow policy: ``features(encode_prefix(obs))``, the pooled VLM output."""
    if isinstance(policy, FlowVLAFlowPolicy):
        return observation_features(policy.model, obs)
    observation = {k: v for k, v in obs.items() if k not in ACTION_KEYS}  # a prefix reads no actions
    return policy.features(policy.encode_prefix(observation)).float()


def weighted_flow_loss(
    policy: FlowPolicy,
    batch: Mapping[str, Any],
    *,
    weights: Tensor | None = None,
    noise: Tensor | None = None,
    time: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``mean_b w_b loss_b`` (``w`` = 1 without ``weights``) of the contract's per-sample flow-matching loss,
    with the detached ``loss`` and unweighted ``mse`` as metrics."""
    per_sample = policy.loss(batch, noise=noise, time=time)
    if weights is not None:
        loss = (weights.to(per_sample).reshape(per_sample.shape[0]) * per_sample).mean()
    else:
        loss = per_sample.mean()
    return loss, {"loss": loss.detach(), "mse": per_sample.mean().detach()}


def trained_module(policy: FlowPolicy) -> nn.Module:
    """The module a trainer updates, averages (EMA) and keeps in its train state: FlowVLA's model itself
    (so train states keep their keys), any other flow policy whole."""
    return policy.model if isinstance(policy, FlowVLAFlowPolicy) else policy  # type: ignore[return-value]


def trainable_copy(policy: FlowPolicy, *, num_inference_steps: int | None = None) -> FlowPolicy:
    """A copy of ``policy`` to train while the original stays as it is (the frozen base whose features
    the value reads): FlowVLA rebuilt from its config (:meth:`~policies.flow_policy.FlowVLAFlowPolicy.rebuilt`,
    as the trainers always built it, so the run's random draws are unchanged), any other policy deep-copied.
    ``num_inference_steps``: the copy's K (saved in its config, so it deploys with it; None keeps the
    original's)."""
    if isinstance(policy, FlowVLAFlowPolicy):
        k = {} if num_inference_steps is None else {"num_inference_steps": num_inference_steps}
        return policy.rebuilt(**k)
    out = copy.deepcopy(policy)
    if num_inference_steps is not None:
        out.set_num_inference_steps(num_inference_steps)  # type: ignore[attr-defined]
    return out


def as_policy(module: nn.Module, like: FlowPolicy) -> FlowPolicy:
    """``module`` (:func:`trained_module` of ``like``, or a copy of it such as the EMA's) as a flow policy."""
    if isinstance(like, FlowVLAFlowPolicy):
        return FlowVLAFlowPolicy(module, like.spec, like.base)  # type: ignore[arg-type]
    return module  # type: ignore[return-value]


def save_trained(
    policy: FlowPolicy,
    folder: Path,
    base: FlowCheckpoint,
    *,
    algorithm: str,
    data: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
    round_index: int | None = None,
) -> Path:
    """Save ``policy`` (trained from ``base``) in its own format: our checkpoint with the base's spec and
    normalisation, or a LeRobot folder with our sidecar; the lineage names ``algorithm``, the base's commit
    (or its ref) as parent, the round and the data."""
    lineage = Lineage(
        algorithm=algorithm,
        parent_revision=base.commit if base.commit else base.ref,
        round=round_index,
        data=dict(data or {}),
    )
    return policy.save(folder, lineage=lineage, metrics=dict(metrics or {}))
