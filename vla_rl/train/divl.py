"""DIVL: distributional implicit value learning (LWD, arXiv 2605.00416; docs/algorithms.md §4d).

The value for AWR's advantages and QAM's TD targets, next to the mean of a categorical head
(``value="categorical"``) and IQL's expectile (``value="expectile"``). DIVL fits the whole distribution of
an *in-sample* target and reads out an upper quantile, the distributional analogue of IQL's expectile:

* **Loss** (LWD Eq. 12): ``L_V(ψ) = E_{(s, a) ~ D} [ −log p_ψ(y(s, a) | s) ]`` with p_ψ categorical over
  ``bins`` atoms z_0 < ... < z_{K−1} evenly spaced on ``[v_min, v_max]`` and the scalar target y projected
  onto its two nearest atoms (C51, mean-preserving): the cross-entropy ``−Σ_k proj(y)_k log p_ψ(z_k | s)``.
  y is the Monte-Carlo return G for AWR, the target critic at the data's action ``mean_m Q̄_m(s, a)`` for
  QAM (the value of *dataset* actions only: no out-of-distribution action is ever queried).
* **Read-out**: ``V_τ(s) = Quant_τ(p_ψ(· | s))``, the τ-quantile of the predicted distribution, each
  atom's mass spread over its bin (:func:`interpolated_quantile`; the step quantile of a 51-atom head
  moves in jumps of a whole bin). τ > 0.5 leans optimistic: an estimate of the best in-support
  action's value, as IQL's expectile.
* **Use**: AWR's advantage ``A = G − V_τ(s)``; QAM's TD target (LWD Eq. 15)
  ``y_Q = R_n + γ^n · bootstrap · V_τ(s_{t+n})`` (:func:`divl_td_target`) instead of the target critic at
  the fine policy's next action, which also saves sampling the fine policy for every TD target.

The network is :class:`policies.critics.CategoricalValue` (the projection and cross-entropy live there);
:class:`DIVLValue` only changes what it reads out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from policies.critics import CategoricalValue

Tensor = torch.Tensor

__all__ = ["DIVLConfig", "DIVLValue", "divl_support", "divl_td_target", "interpolated_quantile"]


@dataclass(frozen=True)
class DIVLConfig:
    """The knobs of a DIVL value (the trainers expose them as ``divl_quantile`` and ``value_bins``)."""

    quantile: float = 0.7
    """τ of the read-out V_τ(s) = Quant_τ(p_ψ(·|s)); 0.5 is the median, larger is more optimistic."""
    bins: int = 51
    """K atoms of the categorical distribution (C51's 51)."""
    support_margin: float = 0.1
    """The atoms span the targets' range widened by this fraction of it on each side (room for values
    that leave the offline data's range online; targets outside are clamped onto the end atoms)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.quantile < 1.0:
            raise ValueError(f"divl_quantile: expected in (0, 1), got {self.quantile}")
        if self.bins < 2:
            raise ValueError(f"value_bins: expected >= 2, got {self.bins}")
        if self.support_margin < 0:
            raise ValueError(f"support_margin: expected >= 0, got {self.support_margin}")


def divl_support(targets: Tensor, margin: float) -> tuple[float, float]:
    """``[lo − margin·span, hi + margin·span]`` of the targets (span = hi − lo; a constant target gets ±1)."""
    lo, hi = float(targets.min()), float(targets.max())
    if hi - lo < 1e-6:
        return lo - 1.0, hi + 1.0
    span = hi - lo
    return lo - margin * span, hi + margin * span


def interpolated_quantile(probs: Tensor, atoms: Tensor, tau: float) -> Tensor:
    """τ-quantile ``[B]`` of categoricals ``probs [B, K]`` on evenly spaced ``atoms [K]`` (spacing Δ), each
    atom's mass spread uniformly over its bin ``[z_k − Δ/2, z_k + Δ/2]`` (the histogram reading).

    With F_k = Σ_{j≤k} p_j and k the first atom with F_k ≥ τ: ``z_k − Δ/2 + (τ − F_{k−1}) / p_k · Δ``
    (F_{−1} = 0). A point mass at z_k has its median at z_k, and the two-atom projection of one scalar y
    has its median at y; the result is monotone in τ and moves continuously with the probabilities
    (the step quantile of a 51-atom head jumps by whole bins).
    """
    if not 0.0 < tau < 1.0:
        raise ValueError(f"tau: expected in (0, 1), got {tau}")
    delta = atoms[1] - atoms[0]
    cdf = probs.cumsum(-1)
    k = (cdf < tau).sum(-1).clamp(max=probs.shape[-1] - 1)  # first atom with F_k >= τ
    f_prev = (cdf - probs).gather(-1, k[..., None]).squeeze(-1)  # F_{k-1}
    p_k = probs.gather(-1, k[..., None]).squeeze(-1)
    frac = ((tau - f_prev) / p_k.clamp_min(1e-12)).clamp(0.0, 1.0)
    return atoms[k] - 0.5 * delta + frac * delta


def divl_td_target(v_next: Tensor, reward_n: Tensor, bootstrap: Tensor, gamma: float, n_step: int) -> Tensor:
    """LWD Eq. 15 for an n-step chunk: ``y = R_n + γ^n · bootstrap · V_τ(s_{t+n})`` (all ``[B]``)."""
    return reward_n + (gamma**n_step) * bootstrap * v_next


class DIVLValue(CategoricalValue):
    """A categorical value trained by :meth:`CategoricalValue.loss` (LWD Eq. 12) whose ``forward`` is the
    interpolated τ-quantile ``V_τ(s)`` instead of the mean."""

    def __init__(
        self,
        feature_dim: int,
        cfg: DIVLConfig,
        v_min: float,
        v_max: float,
        hidden: Sequence[int] = (256, 256),
        layer_norm: bool = True,
    ) -> None:
        super().__init__(feature_dim, cfg.bins, v_min, v_max, hidden, layer_norm)
        self.tau = cfg.quantile

    def probs(self, features: Tensor) -> Tensor:
        return F.softmax(self.logits(features), -1)

    def forward(self, features: Tensor) -> Tensor:
        return interpolated_quantile(self.probs(features), self.atoms, self.tau)
