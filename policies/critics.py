"""Critics and value heads for post-training: chunked Q ensembles, expectile and distributional values.

All heads take a feature vector per observation (``[B, F]``): the normalised proprio state for a
standalone critic, or a policy's pooled trunk features (``PrefixCache.pooled()``) when images matter.
Q heads also take the flattened executed action chunk ``[B, n_exec * A]`` (Q-chunking: the chunk is the
RL action). See docs/algorithms.md §2 (QAM critic), §4a (AWR) and §4d (DIVL).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

Tensor = torch.Tensor

__all__ = [
    "CategoricalValue",
    "ChunkQEnsemble",
    "EnsembleLinear",
    "ValueMLP",
    "expectile_loss",
    "mlp",
    "pessimistic",
    "polyak_update",
]


def mlp(in_dim: int, hidden: Sequence[int], out_dim: int, layer_norm: bool = True) -> nn.Sequential:
    """Linear -> (LayerNorm) -> GELU blocks, then a linear output (QAM's critics use LayerNorm)."""
    layers: list[nn.Module] = []
    d = in_dim
    for h in hidden:
        layers += [nn.Linear(d, h), *([nn.LayerNorm(h)] if layer_norm else []), nn.GELU()]
        d = h
    layers.append(nn.Linear(d, out_dim))
    return nn.Sequential(*layers)


class EnsembleLinear(nn.Module):
    """M independent linear layers applied in one batched matmul: ``[M, B, in] -> [M, B, out]``."""

    def __init__(self, members: int, in_dim: int, out_dim: int) -> None:
        super().__init__()
        bound = 1.0 / math.sqrt(in_dim)  # PyTorch's default nn.Linear init, per member
        self.weight = nn.Parameter(torch.empty(members, in_dim, out_dim).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(members, 1, out_dim).uniform_(-bound, bound))

    def forward(self, x: Tensor) -> Tensor:
        return torch.baddbmm(self.bias, x, self.weight)


class ChunkQEnsemble(nn.Module):
    """``M`` chunked Q functions Q_m(s, a_{t:t+n}) (MLPs with LayerNorm), evaluated together.

    ``forward(features [B, F], chunk [B, n, A] or [B, n*A]) -> [M, B]``.
    """

    def __init__(
        self,
        feature_dim: int,
        chunk_dim: int,
        members: int = 10,
        hidden: Sequence[int] = (256, 256, 256),
        layer_norm: bool = True,
    ) -> None:
        super().__init__()
        if members < 1:
            raise ValueError(f"members: expected >= 1, got {members}")
        self.members, self.feature_dim, self.chunk_dim = members, feature_dim, chunk_dim
        dims = [feature_dim + chunk_dim, *hidden]
        self.layers = nn.ModuleList(EnsembleLinear(members, a, b) for a, b in itertools.pairwise(dims))
        self.norms = nn.ModuleList(nn.LayerNorm(h) if layer_norm else nn.Identity() for h in hidden)
        self.out = EnsembleLinear(members, dims[-1], 1)

    def forward(self, features: Tensor, chunk: Tensor) -> Tensor:
        b = features.shape[0]
        a = chunk.reshape(b, -1)
        if a.shape[1] != self.chunk_dim or features.shape[1] != self.feature_dim:
            raise ValueError(
                f"expected features [B, {self.feature_dim}] and chunk [B, {self.chunk_dim}], "
                f"got {list(features.shape)} and {list(a.shape)}"
            )
        x = torch.cat([features, a], -1).expand(self.members, b, -1)
        for layer, norm in zip(self.layers, self.norms, strict=True):
            x = F.gelu(norm(layer(x)))
        return self.out(x).squeeze(-1)


def pessimistic(q: Tensor, rho: float) -> Tensor:
    """Ensemble lower bound ``mean_m Q - rho * std_m Q`` over the leading member dim (``[M, B] -> [B]``)."""
    if q.shape[0] == 1:
        return q[0]
    return q.mean(0) - rho * q.std(0, unbiased=False)


@torch.no_grad()
def polyak_update(target: nn.Module, source: nn.Module, tau: float) -> None:
    """``target <- (1 - tau) * target + tau * source`` for parameters (buffers copied)."""
    for tp, sp in zip(target.parameters(), source.parameters(), strict=True):
        tp.lerp_(sp, tau)
    for tb, sb in zip(target.buffers(), source.buffers(), strict=True):
        tb.copy_(sb)


class ValueMLP(nn.Module):
    """Scalar state value ``V(s)`` ``[B, F] -> [B]`` (trained by MSE or :func:`expectile_loss`)."""

    def __init__(self, feature_dim: int, hidden: Sequence[int] = (256, 256), layer_norm: bool = True) -> None:
        super().__init__()
        self.net = mlp(feature_dim, hidden, 1, layer_norm)

    def forward(self, features: Tensor) -> Tensor:
        return self.net(features).squeeze(-1)


def expectile_loss(pred: Tensor, target: Tensor, tau: float) -> Tensor:
    """IQL's asymmetric L2: ``mean |tau - 1[target < pred]| * (target - pred)^2``; tau = 0.5 is MSE/2."""
    if not 0.0 < tau < 1.0:
        raise ValueError(f"tau: expected in (0, 1), got {tau}")
    diff = target - pred
    weight = torch.where(diff < 0, 1.0 - tau, tau)
    return (weight * diff.square()).mean()


class CategoricalValue(nn.Module):
    """Distributional value over ``bins`` atoms evenly spaced on ``[v_min, v_max]`` (C51 / RECAP / DIVL).

    Trained with :meth:`loss` (cross-entropy to the two-atom projection of scalar targets); read out
    with :meth:`mean` or :meth:`quantile` (DIVL bootstraps from an upper quantile).
    """

    def __init__(
        self,
        feature_dim: int,
        bins: int = 51,
        v_min: float = -1.0,
        v_max: float = 0.0,
        hidden: Sequence[int] = (256, 256),
        layer_norm: bool = True,
    ) -> None:
        super().__init__()
        if bins < 2:
            raise ValueError(f"bins: expected >= 2, got {bins}")
        if not v_min < v_max:
            raise ValueError(f"v_min/v_max: expected v_min < v_max, got {v_min} and {v_max}")
        self.bins, self.v_min, self.v_max = bins, v_min, v_max
        self.register_buffer("atoms", torch.linspace(v_min, v_max, bins), persistent=False)
        self.net = mlp(feature_dim, hidden, bins, layer_norm)

    def logits(self, features: Tensor) -> Tensor:
        return self.net(features)

    def project(self, target: Tensor) -> Tensor:
        """Scalar targets ``[B]`` -> probabilities ``[B, bins]`` on the two nearest atoms (mean-preserving)."""
        t = target.clamp(self.v_min, self.v_max)
        pos = (t - self.v_min) / (self.v_max - self.v_min) * (self.bins - 1)
        lo = pos.floor().long().clamp(0, self.bins - 1)
        hi = (lo + 1).clamp(max=self.bins - 1)
        w_hi = pos - lo.to(pos)
        probs = torch.zeros(*t.shape, self.bins, device=t.device, dtype=t.dtype)
        probs.scatter_add_(-1, lo[..., None], (1.0 - w_hi)[..., None])
        probs.scatter_add_(-1, hi[..., None], w_hi[..., None])
        return probs

    def loss(self, features: Tensor, target: Tensor, weight: Tensor | None = None) -> Tensor:
        ce = -(self.project(target) * F.log_softmax(self.logits(features), -1)).sum(-1)
        return (ce * weight).sum() / weight.sum().clamp_min(1e-8) if weight is not None else ce.mean()

    def mean(self, features: Tensor) -> Tensor:
        return (F.softmax(self.logits(features), -1) * self.atoms).sum(-1)

    def quantile(self, features: Tensor, tau: float) -> Tensor:
        """The ``tau``-quantile of the predicted distribution (the smallest atom whose CDF >= tau)."""
        if not 0.0 < tau <= 1.0:
            raise ValueError(f"tau: expected in (0, 1], got {tau}")
        cdf = F.softmax(self.logits(features), -1).cumsum(-1)
        idx = (cdf < tau).sum(-1).clamp(max=self.bins - 1)
        return self.atoms[idx]

    def forward(self, features: Tensor) -> Tensor:
        return self.mean(features)
