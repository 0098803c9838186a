"""Transformer building blocks shared by the prefix trunk and the action expert.

Written out (rather than ``nn.TransformerEncoderLayer``) because the action expert's attention must
take the prefix's keys/values from a cache: each expert layer attends jointly to [prefix, action]
tokens like π0's blockwise-causal mask, while the prefix keys/values are projected ONCE per
observation and reused for all K denoising steps.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

Tensor = torch.Tensor


def sincos_time_embedding(t: Tensor, dim: int, min_period: float, max_period: float) -> Tensor:
    """π0's sin-cos embedding of a scalar time per row: ``t [N] -> [N, dim]`` (dim even).

    Periods are geometrically spaced in [min_period, max_period]; with min 4e-3 it resolves t to
    well below one Euler step.
    """
    half = dim // 2
    fraction = torch.linspace(0.0, 1.0, half, device=t.device, dtype=torch.float32)
    period = min_period * (max_period / min_period) ** fraction
    angle = t.float()[:, None] * (2 * math.pi / period)[None, :]
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=-1)


class MLP(nn.Sequential):
    """Linear -> act -> Linear (-> dropout)."""

    def __init__(
        self, d_in: int, d_hidden: int, d_out: int, act: type[nn.Module] = nn.GELU, dropout: float = 0.0
    ):
        super().__init__(nn.Linear(d_in, d_hidden), act(), nn.Linear(d_hidden, d_out), nn.Dropout(dropout))


class Attention(nn.Module):
    """Multi-head self-attention whose keys/values may be prefixed by cached ones.

    ``forward(x, prefix_kv)``: queries come from ``x`` only; keys/values are ``[prefix_kv; kv(x)]``.
    The prefix therefore never attends to ``x`` (π0's "prefix does not attend to the suffix").
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def split_heads(self, x: Tensor) -> Tensor:
        """``[N, L, D] -> [N, heads, L, D / heads]``."""
        n, length, d = x.shape
        return x.view(n, length, self.n_heads, d // self.n_heads).transpose(1, 2)

    def forward(self, x: Tensor, prefix_kv: tuple[Tensor, Tensor] | None = None) -> Tensor:
        q, k, v = (self.split_heads(z) for z in self.qkv(x).chunk(3, dim=-1))
        if prefix_kv is not None:
            k = torch.cat([prefix_kv[0], k], dim=2)
            v = torch.cat([prefix_kv[1], v], dim=2)
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        n, _, length, _ = o.shape
        return self.out(o.transpose(1, 2).reshape(n, length, -1))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(LN x [, prefix kv])`` then ``x + mlp(LN x)``."""

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: float, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_heads, dropout)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, int(d_model * mlp_ratio), d_model, dropout=dropout)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, prefix_kv: tuple[Tensor, Tensor] | None = None) -> Tensor:
        x = x + self.drop(self.attn(self.norm1(x), prefix_kv))
        return x + self.mlp(self.norm2(x))


class PrefixKV(nn.Module):
    """Projects prefix tokens to one expert layer's keys and values (computed once per observation)."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.norm = nn.LayerNorm(d_model)
        self.kv = nn.Linear(d_model, 2 * d_model)

    def forward(self, prefix: Tensor) -> tuple[Tensor, Tensor]:
        n, length, d = prefix.shape
        k, v = self.kv(self.norm(prefix)).chunk(2, dim=-1)
        shape = (n, length, self.n_heads, d // self.n_heads)
        return k.reshape(shape).transpose(1, 2).contiguous(), v.reshape(shape).transpose(1, 2).contiguous()
