"""Time and velocity conventions, and the converters at the boundaries.

This package uses ONE convention everywhere (the π0 paper's, QAM's, FQL's, ReinFlow's):

* ``t = 0`` is noise, ``t = 1`` is data;
* interpolant ``x_t = (1 - t) * x0 + t * x1`` with ``x0 ~ N(0, I)`` noise and ``x1`` the action chunk;
* the network predicts the velocity ``v(x_t, t) ≈ x1 - x0`` (noise -> data);
* Euler integration runs ``t: 0 -> 1`` with ``x += v / K``.

The openpi code and RLinf's π-RL use the opposite one (``s = 1`` noise, ``s = 0`` data,
``x_s = s * eps + (1 - s) * a``, ``u = eps - a``, integrate ``s: 1 -> 0``). Mixing the two is the most
likely source of silent bugs (docs/algorithms.md §0), so anything that comes from or goes to openpi-style
code passes through the functions below and nowhere else:

* ``s = to_openpi_time(t) = 1 - t`` and ``t = from_openpi_time(s) = 1 - s``;
* ``v_ours(x, t) = -u_openpi(x, 1 - t)`` (:func:`velocity_from_openpi`) and its inverse
  (:func:`velocity_to_openpi`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Tensor = torch.Tensor
VelocityFn = Callable[[Tensor, Tensor], Tensor]
"""``fn(x, t) -> v`` with ``x`` of shape ``[N, *event]`` and ``t`` of shape ``[N]``."""


def to_openpi_time[T: (float, Tensor)](t: T) -> T:
    """Our time (0 = noise) to openpi time (1 = noise)."""
    return 1.0 - t


def from_openpi_time[T: (float, Tensor)](s: T) -> T:
    """openpi time (1 = noise) to our time (0 = noise)."""
    return 1.0 - s


def velocity_from_openpi(u_openpi: VelocityFn) -> VelocityFn:
    """Wrap an openpi-convention velocity ``u(x, s)`` (data -> noise) as ours: ``v(x, t) = -u(x, 1 - t)``."""

    def v(x: Tensor, t: Tensor) -> Tensor:
        return -u_openpi(x, to_openpi_time(t))

    return v


def velocity_to_openpi(v_ours: VelocityFn) -> VelocityFn:
    """Wrap our velocity ``v(x, t)`` as an openpi-convention one: ``u(x, s) = -v(x, 1 - s)``."""

    def u(x: Tensor, s: Tensor) -> Tensor:
        return -v_ours(x, from_openpi_time(s))

    return u
