"""What the off-policy RL trainers (FQL, QAM) share to run on a LeRobot SmolVLA / π0 / π0.5 base through the
flow-policy contract (docs/training.md, RL on LeRobot VLAs).

* :func:`copy_sharing`: the trained copy of the base shares the modules neither copy trains (the VLM),
  so a frozen VLM is held once in memory, not once per copy;
* :class:`LeRobotCriticInputs`: what a chunked critic reads from a LeRobot VLA: the pooled VLM output of
  the frozen base's prefix (:meth:`~policies.lerobot_flow.LeRobotFlowPolicy.features`) and the executed
  steps' robot dims of the normalised chunk, unclipped (LeRobot's normalisation is not bounded);
* :func:`check_feature_mode`: a critic on a LeRobot VLA reads those features, never FlowVLA's state
  normaliser.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from policies.lerobot_flow import LeRobotFlowPolicy

Tensor = torch.Tensor

__all__ = ["LeRobotCriticInputs", "check_feature_mode", "copy_sharing"]


def copy_sharing(policy: LeRobotFlowPolicy, shared: Sequence[nn.Module]) -> LeRobotFlowPolicy:
    """A deep copy of ``policy`` in which the ``shared`` modules (e.g. its
    :attr:`~policies.lerobot_flow.LeRobotFlowPolicy.vlm`) are the original's own objects: the same
    parameters, the same storage. Whatever trains a shared module trains it in both policies, so share
    only modules that neither copy trains."""
    return copy.deepcopy(policy, memo={id(m): m for m in shared})


def check_feature_mode(mode: str) -> None:
    """Refuse ``feature_mode='state'`` for a LeRobot base, naming what its critic reads instead."""
    if mode == "state":
        raise ValueError(
            "feature_mode: 'state' reads FlowVLA's state normaliser; a LeRobot VLA's critic reads its "
            "VLM prefix features: use 'trunk' (or 'auto')"
        )


class LeRobotCriticInputs:
    """What a chunked critic reads from a LeRobot VLA; mixed in before a learner that defines
    ``executed`` (:class:`vla_rl.train.qam_math.ChunkCriticInputs`) and holds the frozen ``base``."""

    base: LeRobotFlowPolicy
    executed: Callable[[Tensor], Tensor]
    """The learner's: ``[B, H, D]`` -> the executed steps' robot dims ``[B, n_exec, A]``."""

    @torch.no_grad()
    def features(self, obs: Mapping[str, Any]) -> Tensor:
        """``[B, F]``: the frozen base's pooled VLM output for the observations."""
        return self.base.features(self.base.encode_prefix(obs))

    def dataset_chunk(self, actions: Tensor) -> Tensor:
        """Env-unit ``[B, H, A]`` -> the normalised executed steps' robot dims ``[B, n_exec, A]``."""
        return self.executed(self.base.normalize_actions(actions.float()))
