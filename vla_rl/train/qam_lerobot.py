"""QAM on a LeRobot SmolVLA / π0 / π0.5 base (docs/algorithms.md §2; docs/training.md, RL on LeRobot VLAs).

:class:`LeRobotQAMLearner` is :class:`~vla_rl.train.qam_math.QAMLearner` with the policy-specific steps
done through the flow-policy contract (:class:`~policies.lerobot_flow.LeRobotFlowPolicy`): the same
losses, equations and update.

* **base** v_β: the loaded folder, frozen (the adjoint integrates backward through its velocities;
  ``train_base`` is refused);
* **fine** v_θ: a copy of the base whose action expert trains, deployed with K = ``flow_steps`` in its
  LeRobot config. What trains follows the ``trainable`` knob:

  - ``expert`` (default): the action expert and the action / time projections. The prefix encoder (the
    VLM and, for SmolVLA, the state projection: :meth:`~policies.lerobot_flow.LeRobotFlowPolicy.prefix_modules`)
    is frozen and *shared* with the base, not duplicated, so ONE prefix encode per batch serves the fine
    velocities, the base velocities and the critic's features. (SmolVLA's state projection therefore does
    not train here, where LeRobot's ``train_expert_only`` would train it.)
  - ``full`` / ``lora``: the fine policy holds its own copy of the VLM (the base's stays frozen), trained
    whole or through LoRA adapters (merged into the weights when saved); its prefix is encoded on its own,
    with gradients, the base's once more without (the critic reads the base's): two encodes a batch and
    a second VLM in memory;
* **critic**: the chunked Q ensemble on the base's pooled VLM output (``feature_mode`` ``trunk``; ``state``
  is refused) and the executed steps' robot dims of the normalised chunk, unclipped (LeRobot's
  normalisation is not bounded, so ``clip_actions`` does not apply).

Adjoint matching runs over the whole padded event ``[H, D]`` (the flow's state): the padded dims carry no
reward (the critic never reads them), so their target is the base's velocity plus what the lean adjoint
carries into them through the base's Jacobian.

Offline and online (qam-o2o) as on FlowVLA: the fine policy acts in the simulator from its camera with the
simulator's instruction text, LeRobot's un-normalised (unclipped) actions; evaluations (``eval_every``,
``final_eval_episodes``) score it as LeRobot deploys it; ``reanchor_every`` copies the fine policy's
weights into the base (not with ``lora``). Not implemented on a LeRobot base (refused naming the field):
``train_base``, ``next_action_cache``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from policies.flow_policy import FlowPolicyError
from policies.lerobot_flow import LeRobotFlowPolicy, LeRobotPrefix
from vla_rl.train.lerobot_rl import LeRobotCriticInputs, check_feature_mode, copy_sharing
from vla_rl.train.qam_config import QAMConfig
from vla_rl.train.qam_math import ObsEncoding, QAMLearner

Tensor = torch.Tensor

__all__ = ["LeRobotQAMLearner", "check_lerobot_qam"]


def check_lerobot_qam(cfg: QAMConfig) -> None:
    """Refuse the knobs QAM does not implement on a LeRobot base, naming the field."""
    if cfg.next_action_cache:
        raise ValueError(
            "next_action_cache: not implemented for a LeRobot base (its table is sampled from FlowVLA "
            f"inputs); expected 0, got {cfg.next_action_cache}"
        )
    if cfg.reanchor_every and cfg.trainable == "lora":
        raise ValueError(
            "reanchor_every: a LoRA fine policy cannot become the prior (its adapters are not the base's "
            f"weights); expected 0 with trainable 'lora', got {cfg.reanchor_every}"
        )
    if cfg.train_base:
        raise ValueError(
            "train_base: QAM keeps a LeRobot base frozen (the fine policy shares its VLM and the adjoint "
            "integrates through its velocities); expected False"
        )
    check_feature_mode(cfg.feature_mode)


class LeRobotQAMLearner(LeRobotCriticInputs, QAMLearner):
    """QAM's networks on a LeRobot flow VLA (see the module docstring): the frozen base, the fine copy
    sharing its frozen prefix encoder (``trainable`` ``expert``) or holding its own, the critic and
    its target."""

    base: LeRobotFlowPolicy  # type: ignore[assignment]
    fine: LeRobotFlowPolicy  # type: ignore[assignment]
    reads_instruction_text = True

    def __init__(
        self, base: LeRobotFlowPolicy, cfg: QAMConfig, value_support: tuple[float, float] = (-1.0, 0.0)
    ) -> None:
        nn.Module.__init__(self)
        check_lerobot_qam(cfg)
        self.cfg = cfg
        self.n_exec, self.horizon, self.action_dim = base.n_exec, base.chunk_len, base.action_dim
        self.event = base.event_shape
        self.clip, self.feature_mode, self.feature_net, self.base_target = False, "trunk", None, None
        parts = cfg.trainable or "expert"
        self.shares_prefix = parts == "expert"
        base.requires_grad_(False)
        self.base = base
        shared = base.prefix_modules() if self.shares_prefix else []
        self.fine = copy_sharing(base, shared)
        self.fine.set_num_inference_steps(cfg.flow_steps)  # deployed with the grid it was fine-tuned on
        try:
            self.fine.set_trainable(parts, cfg.lora_settings())
        except FlowPolicyError as e:
            raise ValueError(f"{e} (qam)") from None
        for module in shared:  # set_trainable may have freed SmolVLA's state projection: keep it frozen
            module.requires_grad_(False)
        self._actor_params = [p for p in self.fine.parameters() if p.requires_grad]
        if not self._actor_params:
            raise ValueError(f"trainable: {parts!r} leaves nothing of the fine policy to train")
        self.build_critic(base.feature_dim, value_support)

    def env_actions(self, chunk: Tensor) -> Tensor:
        """The post-processor's un-normalisation of the robot's dims, unclipped (as LeRobot serves)."""
        return self.base.unnormalize_actions(chunk)

    def actor_parameters(self) -> list[nn.Parameter]:
        """The fine policy's trainable parameters (``trainable``): never the shared prefix encoder."""
        return list(self._actor_params)

    def encode(self, obs: Mapping[str, Any]) -> ObsEncoding:
        """The base's prefix once (no gradient) for the critic's features and the base's velocities, and
        for the fine policy's when it shares the prefix encoder; else the fine policy's own encode."""
        base_prefix = functools.cache(lambda: _frozen_prefix(self.base, obs))
        fine_prefix = (
            base_prefix if self.shares_prefix else functools.cache(lambda: self.fine.encode_prefix(obs))
        )
        return ObsEncoding(lambda: self.base.features(base_prefix()), fine_prefix, base_prefix)

    def sampling_inputs(self, obs: Mapping[str, Any]) -> tuple[Any, Any, Any]:
        enc = self.encode(obs)
        return enc.base_prefix, enc.fine_prefix, lambda: enc.features

    def ode(self, policy: Any, obs_or_prefix: Any, noise: Tensor) -> Tensor:
        return policy.sample(obs_or_prefix, num_steps=self.cfg.flow_steps, noise=noise[:, None]).actions[:, 0]

    def grid_prefix(self, prefix: LeRobotPrefix, k: int) -> LeRobotPrefix:
        return prefix.repeat_interleave(k)


def _frozen_prefix(policy: LeRobotFlowPolicy, obs: Mapping[str, Any]) -> LeRobotPrefix:
    with torch.no_grad():
        return policy.encode_prefix(obs)
