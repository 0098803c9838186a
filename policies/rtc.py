"""Real-time chunking (RTC): a new chunk that agrees with the actions a robot is still executing.

A robot executing chunk after chunk asks for the next one while the current one still runs; the reply
comes ``d`` control steps later (the inference delay), so the new chunk's first ``d`` actions are never
executed: the robot runs the previous chunk's queued actions meanwhile. Switching to the new chunk at
step ``d`` jumps unless the new chunk continues what the robot did. RTC (Black, Galliker, Levine 2025,
"Real-Time Execution of Action Chunking Flow Policies") treats the next chunk as inpainting: the flow
sampler is guided so the chunk's first ``d`` actions match the queued ones (weight 1), the overlap after
them is pulled towards them with a decaying weight, and the rest is free.

**Guided sampling (training-free)**, in our time convention (t = 0 noise, t = 1 data;
:mod:`policies.flow_vla.conventions`). With ``Y`` ``[H, D]`` the queued actions in the model's normalised
space (zero past their length), ``W`` ``[H]`` the prefix weights (:func:`prefix_weights`) and the
velocity ``v = v(x_t, t)``, each Euler step uses

* ``x̂1 = x_t + (1 - t) v``, the one-step estimate of the final chunk (paper eq. 3);
* ``g = W ⊙ (Y - x̂1)``, the weighted inpainting error (eq. 2's ``(Y - x̂1)ᵀ diag(W)``);
* ``β(t) = min(β_max, (1 - t) / (t r_t²))`` with ``r_t² = (1 - t)² / (t² + (1 - t)²)`` (eq. 4's guidance
  weight, clipped at ``max_guidance_weight``, and at the number of steps K: :func:`step_cap`; ``β_max``
  at t = 0);
* ``v_guided = v + β(t) g``.

The paper multiplies ``g`` by the Jacobian ``∂x̂1 / ∂x_t`` (a vector-Jacobian product through the
model); LeRobot 0.6.1's ``RTCProcessor`` takes the velocity out of the autograd graph, which makes that
Jacobian the identity, and so does this module: no backward pass, so guidance runs under
``torch.inference_mode`` and compiled graphs, at the cost of one extra elementwise step. The numbers
are LeRobot's (``tests/test_rtc.py`` checks them against its ``RTCProcessor``).

**Per sample**: every row of a batch has its own delay and queued actions, and a row without RTC
(weights all zero) gets exactly the plain sampler's velocity, so robots with and without RTC share one
batch.

**Trained RTC** (a checkpoint trained with ``rtc_max_delay``): the executed prefix is not guided but
given, clean, at flow time 1 (per-action times); see :func:`inpaint_sample`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

import numpy as np
import torch

from policies.flow_vla.conventions import VelocityFn
from policies.flow_vla.sampling import SampleResult, euler_sample, per_action_time, prefix_mask

Tensor = torch.Tensor
RTCSchedule = Literal["zeros", "ones", "linear", "exp"]
RTC_SCHEDULES: tuple[str, ...] = get_args(RTCSchedule)
DEFAULT_MAX_GUIDANCE_WEIGHT = 10.0  # LeRobot's RTCConfig default
PerActionVelocityFn = Callable[[Tensor, Tensor], Tensor]
"""``fn(x [N, H, D], t [N, H]) -> v [N, H, D]``: a velocity that takes one flow time per action."""


@dataclass(frozen=True)
class RTCSettings:
    """How guided RTC weighs the queued actions (LeRobot's ``RTCConfig`` names).

    ``execution_horizon``: where the prefix weights reach 0 (LeRobot's ``execution_horizon``; the paper's
    ``H - s``), capped at the queued actions' length; None = every queued action. ``max_guidance_weight``:
    the paper's β (LeRobot's default 10). ``schedule``: the weights between the delay and the horizon
    (``linear`` as LeRobot; ``exp`` as the paper; ``ones`` / ``zeros`` for ablations).
    """

    execution_horizon: int | None = None
    max_guidance_weight: float = DEFAULT_MAX_GUIDANCE_WEIGHT
    schedule: RTCSchedule = "linear"

    def __post_init__(self) -> None:
        h = self.execution_horizon
        if h is not None and (isinstance(h, bool) or not isinstance(h, int) or h < 1):
            raise ValueError(f"execution_horizon: expected an integer >= 1 or None, got {h!r}")
        w = self.max_guidance_weight
        if isinstance(w, bool) or not isinstance(w, int | float) or not (0 < w < math.inf):
            raise ValueError(f"max_guidance_weight: expected a finite number > 0, got {w!r}")
        if self.schedule not in RTC_SCHEDULES:
            raise ValueError(f"schedule: expected one of {list(RTC_SCHEDULES)}, got {self.schedule!r}")


def prefix_weights(delay: int, horizon: int, chunk_len: int, schedule: RTCSchedule = "linear") -> Tensor:
    """``W`` ``[chunk_len]``: 1 on the first ``delay`` actions (executed while the chunk is computed),
    decaying to 0 at ``horizon`` (``linear``: ``linspace(1, 0)`` without its ends; ``exp``: that times
    ``expm1(w) / (e - 1)``), 0 from ``horizon`` on. LeRobot's ``RTCProcessor.get_prefix_weights``."""
    start = min(delay, horizon)
    w = torch.zeros(chunk_len)
    if schedule == "zeros":
        w[:start] = 1.0
        return w
    if schedule == "ones":
        w[:horizon] = 1.0
        return w
    end = min(horizon, chunk_len)
    if end > start:
        ramp = torch.linspace(1.0, 0.0, end - start + 2)[1:-1]
        if schedule == "exp":
            ramp = ramp * torch.expm1(ramp) / (math.e - 1)
        w[start:end] = ramp
    w[: min(start, chunk_len)] = 1.0
    return w


def guidance_weight(t: Tensor, max_guidance_weight: float) -> Tensor:
    """β(t) = min(β_max, (1 - t) / (t r_t²)) = min(β_max, (t² + (1 - t)²) / (t (1 - t))), our time
    (inf at t = 0 and t = 1, so β_max there)."""
    t = t.float()
    return (((1.0 - t) ** 2 + t**2) / (t * (1.0 - t))).clamp(max=max_guidance_weight)


@dataclass(frozen=True)
class RTCGuide:
    """What guides one batch: ``target`` ``[N, H, D]`` the queued actions in the model's space (zero past
    each row's length), ``weights`` ``[N, H]`` (all zero on rows without RTC), β_max."""

    target: Tensor
    weights: Tensor
    max_guidance_weight: float

    @property
    def active(self) -> Tensor:
        """``[N]`` bool: the rows RTC guides."""
        return (self.weights > 0).any(dim=1)

    @classmethod
    def build(
        cls,
        queued: Sequence[Tensor | None],
        delays: Sequence[int | None],
        event_shape: tuple[int, int],
        settings: RTCSettings,
        device: torch.device | str = "cpu",
    ) -> RTCGuide:
        """One guide for a batch: row i's ``queued[i]`` ``[n_i, D]`` (normalised, n_i >= 1) and
        ``delays[i]``, or None for a row without RTC."""
        h, d = event_shape
        target = torch.zeros(len(queued), h, d)
        weights = torch.zeros(len(queued), h)
        for i, (prev, delay) in enumerate(zip(queued, delays, strict=True)):
            if prev is None or delay is None:
                continue
            n = min(int(prev.shape[0]), h)
            horizon = min(settings.execution_horizon or n, n)
            target[i, :n] = prev[:n].detach().float().cpu()
            weights[i] = prefix_weights(delay, horizon, h, settings.schedule)
        return cls(target.to(device), weights.to(device), float(settings.max_guidance_weight))


def guided_velocity(velocity_fn: VelocityFn, guide: RTCGuide) -> VelocityFn:
    """``velocity_fn`` with RTC's guidance (module docstring); rows without RTC get ``velocity_fn``'s
    velocity unchanged (selected, not added to)."""
    active = guide.active[:, None, None]

    def v(x: Tensor, t: Tensor) -> Tensor:
        v0 = velocity_fn(x, t)
        tt = torch.as_tensor(t, device=x.device, dtype=torch.float32).expand(x.shape[0])
        x1_hat = x + (1.0 - tt)[:, None, None] * v0
        correction = guide.weights[:, :, None].to(x) * (guide.target.to(x) - x1_hat)
        beta = guidance_weight(tt, guide.max_guidance_weight).to(x)[:, None, None]
        return torch.where(active, v0 + beta * correction, v0)

    return v


def observation_velocity(policy: Any, obs: Mapping[str, Any]) -> VelocityFn:
    """``v(x, t)`` of a flow policy for a batch of observations, as its ``sample`` integrates it (one
    prefix pass; classifier-free guidance included where the policy guides itself, through its own
    ``observation_velocity``), for samplers of ours that wrap the velocity (RTC)."""
    own = getattr(policy, "observation_velocity", None)
    if own is not None:
        return own(obs)
    prefix = policy.encode_prefix(obs)
    return lambda x, t: policy.velocity(prefix, x, t)


def rtc_sample(
    velocity_fn: VelocityFn, x0: Tensor, guide: RTCGuide, num_steps: int, *, return_iterates: bool = False
) -> SampleResult:
    """The Euler ODE of :func:`policies.flow_vla.sampling.euler_sample` on :func:`guided_velocity`, its
    guidance weight capped at :func:`step_cap` (``num_steps``)."""
    capped = replace(guide, max_guidance_weight=step_cap(guide.max_guidance_weight, num_steps))
    return euler_sample(guided_velocity(velocity_fn, capped), x0, num_steps, return_iterates=return_iterates)


def step_cap(max_guidance_weight: float, num_steps: int) -> float:
    """The guidance weight a K-step sampler uses: β_max, but at most K. One Euler step moves ``x̂1`` by
    ``β / K`` of its distance to the queued actions (identity Jacobian), so β > K overshoots them (a
    one-step policy with LeRobot's β = 10 would land 9 errors past them); at K >= β_max (LeRobot's
    defaults: K = 10, β = 10) nothing changes."""
    return float(min(max_guidance_weight, num_steps))


def sample_rtc(
    policy: Any,
    obs: Mapping[str, Any],
    x0: Tensor,
    requests: Sequence[tuple[int, np.ndarray] | None],
    settings: RTCSettings,
    num_steps: int | None = None,
) -> SampleResult:
    """One sample per observation of a flow policy (``policies.flow_policy.FlowPolicy``) from ``x0``
    ``[B, H, D]``, with real-time chunking on the rows whose request is ``(delay, queued)`` (queued:
    float32 [n, A] env-unit actions): the executed prefix given clean for a policy trained so
    (``rtc_max_delay``, :func:`inpaint_sample`), else guided (:func:`rtc_sample`); rows with None are
    sampled plainly. Iterates included (the server scores them)."""
    k = num_steps or policy.num_inference_steps
    h = policy.event_shape[0]
    queued = [None if r is None else normalized_queue(policy, r[1]) for r in requests]
    velocity = observation_velocity(policy, obs)
    x0 = x0.float()
    if getattr(policy, "rtc_max_delay", 0):
        given = torch.zeros_like(x0)
        delays = torch.zeros(len(requests), dtype=torch.long, device=x0.device)
        for i, (r, q) in enumerate(zip(requests, queued, strict=True)):
            if r is not None and q is not None:
                given[i, : len(q)], delays[i] = q, min(r[0], len(q), h)
        return inpaint_sample(velocity, x0, given, delays, k, return_iterates=True)
    delays = [None if r is None else r[0] for r in requests]
    guide = RTCGuide.build(queued, delays, policy.event_shape, settings, x0.device)
    return rtc_sample(velocity, x0, guide, k, return_iterates=True)


def normalized_queue(policy: Any, queued: np.ndarray) -> Tensor:
    """Queued env-unit actions [n, A] in the policy's normalised space [min(n, H), D] (normalised as a
    chunk: padded to H with the last action, the padding dropped)."""
    h = policy.event_shape[0]
    q = torch.from_numpy(np.array(queued[:h], np.float32)).to(policy.device)
    padded = torch.cat([q, q[-1:].expand(h - len(q), -1)])
    return policy.normalize_actions(padded[None])[0, : len(q)]


# ------------------------------------------------------------------------------------ trained RTC
def inpaint_sample(
    velocity_fn: PerActionVelocityFn,
    x0: Tensor,
    prefix: Tensor,
    delays: Tensor,
    num_steps: int,
    *,
    return_iterates: bool = False,
) -> SampleResult:
    """Trained RTC (a policy trained with per-action flow times, the executed prefix given clean): Euler
    from ``x0`` ``[N, H, D]`` where row i's first ``delays[i]`` actions are ``prefix[i]`` (normalised)
    at time 1 on every step and the rest denoise on the grid ``k / K``; the output's prefix is
    ``prefix`` exactly. ``delays`` 0 is the plain sampler on that row (up to the per-action time path)."""
    given = prefix_mask(delays.to(x0.device), x0.shape[1])[:, :, None]
    clean = prefix.to(x0)

    def v(x: Tensor, t: Tensor) -> Tensor:
        x = torch.where(given, clean, x)
        vel = velocity_fn(x, per_action_time(t.to(x), given[..., 0]))
        return torch.where(given, torch.zeros_like(vel), vel)

    return euler_sample(v, torch.where(given, clean, x0), num_steps, return_iterates=return_iterates)


__all__ = [
    "DEFAULT_MAX_GUIDANCE_WEIGHT",
    "RTC_SCHEDULES",
    "RTCGuide",
    "RTCSettings",
    "guidance_weight",
    "guided_velocity",
    "inpaint_sample",
    "observation_velocity",
    "per_action_time",
    "prefix_mask",
    "prefix_weights",
    "rtc_sample",
    "sample_rtc",
    "step_cap",
]
