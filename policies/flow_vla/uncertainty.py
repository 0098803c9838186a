"""Free per-decision uncertainty scores from the denoising path (docs/algorithms.md §6a, `fm-geometry`).

For the linear interpolant the velocity is ``(E[x1 | x_t] - x) / (1 - t)``: if the posterior over
the clean chunk has collapsed, paths are straight at constant speed and the Euler iterates have zero
acceleration. Curvature therefore measures posterior spread (second-order Tweedie) at no extra cost:
only the K + 1 iterates of the ODE sample that is executed anyway are needed.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def _executed_path(iterates: Tensor, n_exec: int | None, dim_scale: Tensor | None) -> Tensor:
    """``[..., K + 1, H, A] -> [..., K + 1, n_exec * A]``, per-dim standardised when ``dim_scale`` given."""
    x = iterates[..., :n_exec, :] if n_exec is not None else iterates
    if dim_scale is not None:
        x = x / dim_scale.to(x)
    return x.flatten(-2)


def accel_score(
    iterates: Tensor,
    n_exec: int | None = None,
    prefix_steps: int | None = None,
    dim_scale: Tensor | None = None,
    eps: float = 1e-8,
) -> Tensor:
    """``accel_p = p * sum_{t=1}^{p-1} ||v_t - v_{t-1}|| / sum_{t=0}^{p-1} ||v_t||`` with ``v_t = x_{t+1} - x_t``.

    ``iterates``: ``[..., K + 1, H, A]`` Euler iterates x_0..x_K of one decision (our time: x_0 is noise).
    Only the executed window (first ``n_exec`` actions) is scored. ``prefix_steps`` p defaults to
    round(K / 2) (the reference's best prefix is 0.4-0.5 K: the last steps mostly add discretisation
    noise). ``dim_scale`` ``[A]``: the run-pooled (winsorised) per-dim std used to standardise dims.
    Returns ``[...]``; 0 for a straight constant-speed path.
    """
    x = _executed_path(iterates, n_exec, dim_scale)
    v = x[..., 1:, :] - x[..., :-1, :]  # [..., K, D]; constant dt cancels in the ratio
    k = v.shape[-2]
    p = max(2, round(k / 2)) if prefix_steps is None else prefix_steps
    if not 2 <= p <= k:
        raise ValueError(f"prefix_steps must be in [2, K={k}], got {p}")
    v = v[..., :p, :]
    num = (v[..., 1:, :] - v[..., :-1, :]).norm(dim=-1).sum(-1)
    den = v.norm(dim=-1).sum(-1)
    return p * num / (den + eps)


def straightness(iterates: Tensor, n_exec: int | None = None, eps: float = 1e-8) -> Tensor:
    """``||x_K - x_0|| / sum_t ||x_{t+1} - x_t||`` in (0, 1]; saturates near 1 (a weaker sibling of accel)."""
    x = _executed_path(iterates, n_exec, None)
    path = (x[..., 1:, :] - x[..., :-1, :]).norm(dim=-1).sum(-1)
    return (x[..., -1, :] - x[..., 0, :]).norm(dim=-1) / (path + eps)
