"""State and action normalisation, stored as buffers so it travels inside ``model.safetensors``.

Both state and action use the same affine form ``y = (x - offset) / scale``:

* state: offset = mean, scale = std (proprioception is roughly Gaussian and unbounded);
* action, ``"min_max"`` (default): offset = (max + min) / 2, scale = (max - min) / 2, so the data range
  maps to [-1, 1] -- the range the robot-spec contract uses and the one N(0, I) flow noise covers;
* action, ``"mean_std"``: offset = mean, scale = std.

Scales are floored at ``MIN_SCALE`` so a constant dimension (a gripper that never moved in the data)
maps to 0 instead of dividing by zero. The trainer computes stats with
:func:`compute_normalization_stats` and stores them in the config too, so a checkpoint's config alone
rebuilds an identical normaliser.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

Tensor = torch.Tensor
MIN_SCALE = 1e-3


class Normalizer(nn.Module):
    """Affine normalisation of states and actions (buffers: ``state_offset/scale``, ``action_offset/scale``)."""

    state_offset: Tensor
    state_scale: Tensor
    action_offset: Tensor
    action_scale: Tensor

    def __init__(
        self,
        state_dim: int,
        action_dim: int,
        stats: Mapping[str, Mapping[str, Any]] | None = None,
        action_norm: str = "min_max",
    ) -> None:
        super().__init__()
        s_off, s_scale = torch.zeros(state_dim), torch.ones(state_dim)
        a_off, a_scale = torch.zeros(action_dim), torch.ones(action_dim)
        if stats is not None:
            if state_dim > 0 and "state" in stats:
                s_off = _vec(stats["state"]["mean"])
                s_scale = _vec(stats["state"]["std"])
            a = stats["action"]
            if action_norm == "min_max":
                lo, hi = _vec(a["min"]), _vec(a["max"])
                a_off, a_scale = (hi + lo) / 2, (hi - lo) / 2
            elif action_norm == "mean_std":
                a_off, a_scale = _vec(a["mean"]), _vec(a["std"])
            else:
                raise ValueError(f"action_norm must be 'min_max' or 'mean_std', got {action_norm!r}")
        self.register_buffer("state_offset", s_off)
        self.register_buffer("state_scale", s_scale.clamp_min(MIN_SCALE))
        self.register_buffer("action_offset", a_off)
        self.register_buffer("action_scale", a_scale.clamp_min(MIN_SCALE))

    def normalize_state(self, state: Tensor) -> Tensor:
        return (state - self.state_offset) / self.state_scale

    def normalize_action(self, action: Tensor) -> Tensor:
        return (action - self.action_offset) / self.action_scale

    def unnormalize_action(self, action: Tensor) -> Tensor:
        return action * self.action_scale + self.action_offset


def _vec(values: Any) -> Tensor:
    return torch.as_tensor(np.asarray(values, dtype=np.float32))


def compute_normalization_stats(state: Any, action: Any) -> dict[str, dict[str, list[float]]]:
    """Stats in the config's format from arrays ``state [N, S]`` and ``action [N, A]`` (or ``[N, H, A]``).

    Returns mean/std/min/max for both, so either action mode can be chosen later without recomputing.
    ``state=None`` (a policy without proprioception) leaves the state entry out. Pass only real (not
    padded) action rows.
    """
    out: dict[str, dict[str, list[float]]] = {}
    for name, x in (("state", state), ("action", action)):
        if x is None and name == "state":
            continue
        arr = np.asarray(x.detach().cpu() if isinstance(x, Tensor) else x, dtype=np.float64)
        arr = arr.reshape(-1, arr.shape[-1])
        if arr.shape[0] == 0:
            raise ValueError(f"{name}: no rows to compute statistics from")
        out[name] = {
            "mean": arr.mean(0).tolist(),
            "std": arr.std(0).tolist(),
            "min": arr.min(0).tolist(),
            "max": arr.max(0).tolist(),
        }
    return out
