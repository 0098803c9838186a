"""Samplers for flow-matching policies, written against plain velocity functions.

Time convention (see :mod:`.conventions`): t = 0 noise, t = 1 data, ``x_t = (1 - t) x0 + t x1``,
velocity ``v ≈ x1 - x0``. The grid is ``t_k = k / K`` for k = 0..K, ``dt = 1 / K``.

Every sampler is one loop over a Gaussian *step kernel*: a stochastic step k draws
``x_{k+1} ~ N(mean_k, std_k^2)``, a deterministic one takes the Euler ODE step ``x_k + dt v``. Steps
can be mixed per call (π-RL Flow-SDE makes one random step stochastic and the rest ODE; the SDE drift
without its noise would NOT keep the marginals, so deterministic steps always use the ODE drift).
That single form covers

* the Euler ODE: no stochastic steps;
* SDEs with the ODE's marginals (QAM's memoryless SDE, π-RL Flow-SDE): Euler–Maruyama with
  ``mean = x + dt [v + (σ²/2) score]``, ``std = sqrt(dt) σ``;
* Flow-Noise (π-RL / ReinFlow): ``mean = x + dt v``, ``std = σ_φ`` from a learned noise head,

and makes the chain's log-likelihood the sum of per-step Gaussian log-densities, which
:func:`chain_log_prob` can recompute for a stored chain under new parameters (PPO's ratio).

The score of the linear interpolant follows from the velocity: with ``ε̂ = E[x0 | x_t] = x - t v``,
``∇ log p_t(x) = -ε̂ / (1 - t) = (t v - x) / (1 - t)``. Adding ``(σ²/2)·score`` to the drift and
``σ dW`` noise leaves every marginal p_t unchanged (Fokker–Planck). For the memoryless schedule
``σ² = 2 (1 - t) / t`` the drift is ``2 v - x / t`` (QAM's form).

Randomness: pass ``noise`` (``[N, K, *event]`` per-step standard normals) for exact reproducibility
(the policy server relies on it), or a ``torch.Generator``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from .conventions import VelocityFn, to_openpi_time

Tensor = torch.Tensor
NoisyVelocityFn = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
"""``fn(x, t) -> (v, std)``: velocity and the learned per-element noise std of the step from t."""


class KernelStep(NamedTuple):
    """One step's transition: ``ode_mean`` if the step is deterministic, else ``N(mean, std²)``."""

    ode_mean: Tensor
    mean: Tensor
    std: Tensor | None


StepFn = Callable[[Tensor, Tensor, float], KernelStep]
"""``kernel(x_k, t_k, dt) -> KernelStep`` for ``x_{k+1}``."""

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
MAX_NUM_STEPS = 1000  # denoising steps a sample may ask for (bounds the work one call can demand)


def time_grid(num_steps: int) -> list[float]:
    """``[k / K for k in 0..K]`` (our convention: 0 = noise). Python floats so hand loops match exactly."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    return [k / num_steps for k in range(num_steps + 1)]


def check_num_steps(k: object) -> None:
    """Refuse a denoising step count that is not an int in [1, :data:`MAX_NUM_STEPS`]."""
    if not isinstance(k, int) or not 1 <= k <= MAX_NUM_STEPS:
        raise ValueError(f"num_steps: expected an int in [1, {MAX_NUM_STEPS}], got {k!r}")


def initial_noise(
    shape: tuple[int, ...],
    noise: Tensor | None,
    generator: torch.Generator | None,
    device: torch.device,
    dtype: torch.dtype,
) -> Tensor:
    """The initial x0 of ``shape``: ``noise`` checked (shape, finite) and moved, or standard normals drawn
    from ``generator`` on its own device (a CPU generator serves a CUDA model)."""
    if noise is None:
        g_device = generator.device if generator is not None else device
        return torch.randn(shape, generator=generator, device=g_device, dtype=dtype).to(device)
    if tuple(noise.shape) != tuple(shape):
        raise ValueError(f"noise: expected shape {list(shape)}, got {list(noise.shape)}")
    if not bool(torch.isfinite(noise).all()):
        raise ValueError("noise: expected finite values, got NaN or inf")
    return noise.to(device, dtype)


# ---------------------------------------------------------------------- SDE schedules
@dataclass(frozen=True)
class SDESchedule:
    """Diffusion coefficient σ(t) of an SDE with the flow ODE's marginals.

    * ``"memoryless"``: QAM's ``σ_t = sqrt(2 (1 - t) / t)``; the final sample forgets x0.
    * ``"flow_sde"``: π-RL Flow-SDE's ``σ_s = a sqrt(s / (1 - s))`` in openpi time ``s = 1 - t``
      (``a = noise_level``, RLinf default 0.5; ``a = sqrt(2)`` is exactly memoryless). ``noise_level``
      is ignored by ``"memoryless"``.

    σ blows up at t = 0, so σ and the score coefficient are evaluated at ``max(t, t_min)``;
    ``t_min = None`` uses ``dt`` (QAM shifts by the step size ``h`` the same way). The score itself
    is finite at t = 0 (it is ``-x`` there) and uses the true t.
    """

    kind: Literal["memoryless", "flow_sde"] = "memoryless"
    noise_level: float = 0.5
    t_min: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("memoryless", "flow_sde"):
            raise ValueError(f"SDESchedule.kind must be 'memoryless' or 'flow_sde', got {self.kind!r}")
        if not self.noise_level > 0:
            raise ValueError(f"SDESchedule.noise_level must be > 0, got {self.noise_level}")
        if self.t_min is not None and not 0 < self.t_min < 1:
            raise ValueError(f"SDESchedule.t_min must be in (0, 1), got {self.t_min}")

    def clip(self, t: Tensor, dt: float) -> Tensor:
        t_min = self.t_min if self.t_min is not None else dt
        return t.clamp(t_min, 1.0 - 1e-6)

    def sigma(self, t: Tensor) -> Tensor:
        """σ at (already clipped) time t, our convention."""
        if self.kind == "memoryless":
            return torch.sqrt(2.0 * (1.0 - t) / t)
        s = to_openpi_time(t)
        return self.noise_level * torch.sqrt(s / (1.0 - s))

    def half_sigma_sq_over_one_minus_t(self, t: Tensor) -> Tensor:
        """``σ² / (2 (1 - t))``, the factor in front of ``(t v - x)`` in the drift, in closed form
        (σ² carries a ``(1 - t)`` factor for both schedules, so this stays finite at t -> 1)."""
        a_sq = 2.0 if self.kind == "memoryless" else self.noise_level**2
        return a_sq / (2.0 * t)


# ---------------------------------------------------------------------- step kernels
def _expand_t(t: float, x: Tensor) -> Tensor:
    return torch.full((x.shape[0],), t, device=x.device, dtype=x.dtype)


def ode_kernel(velocity_fn: VelocityFn) -> StepFn:
    """Deterministic Euler step ``x + dt v(x, t)``."""

    def step(x: Tensor, t: Tensor, dt: float) -> KernelStep:
        mean = x + dt * velocity_fn(x, t)
        return KernelStep(mean, mean, None)

    return step


def sde_kernel(velocity_fn: VelocityFn, schedule: SDESchedule) -> StepFn:
    """Euler–Maruyama step of the marginal-preserving SDE ``dx = [v + (σ²/2) score] dt + σ dW``."""

    def step(x: Tensor, t: Tensor, dt: float) -> KernelStep:
        v = velocity_fn(x, t)
        tc = schedule.clip(t, dt)
        shape = (-1,) + (1,) * (x.ndim - 1)
        coef = schedule.half_sigma_sq_over_one_minus_t(tc).view(shape)
        drift = v + coef * (t.view(shape) * v - x)
        std = math.sqrt(dt) * schedule.sigma(tc).view(shape)
        return KernelStep(x + dt * v, x + dt * drift, std.expand_as(x))

    return step


def noise_kernel(noisy_velocity_fn: NoisyVelocityFn) -> StepFn:
    """Flow-Noise step: ``N(x + dt v, σ_φ²)`` with σ_φ from the learned noise head (not scaled by dt)."""

    def step(x: Tensor, t: Tensor, dt: float) -> KernelStep:
        v, std = noisy_velocity_fn(x, t)
        mean = x + dt * v
        return KernelStep(mean, mean, std)

    return step


# ---------------------------------------------------------------------- chain
@dataclass
class SampleResult:
    """Output of a sampler over N chains.

    ``actions``: ``x_K`` ``[N, *event]``; ``iterates``: ``[N, K + 1, *event]`` (x_0 .. x_K) when asked
    for; ``log_prob``: ``[N]`` log-likelihood of the chain over the masked dims (stochastic samplers);
    ``stochastic``: ``[K]`` or ``[N, K]`` bool, the steps that drew noise.
    """

    actions: Tensor
    iterates: Tensor | None
    log_prob: Tensor | None
    stochastic: Tensor


def gaussian_log_density(x: Tensor, mean: Tensor, std: Tensor, mask: Tensor | None) -> Tensor:
    """Sum over event dims of ``log N(x; mean, std²)`` per row, restricted to ``mask`` (broadcast)."""
    lp = -((x - mean) / std).square() / 2 - torch.log(std) - LOG_SQRT_2PI
    if mask is not None:
        lp = lp * mask
    return lp.flatten(1).sum(1)


def _stochastic_mask(
    stochastic_steps: Sequence[int] | Tensor | None, n: int, k: int, device: torch.device
) -> Tensor:
    """Normalise "which steps draw noise" to a bool tensor ``[K]`` or ``[N, K]``."""
    if stochastic_steps is None:
        return torch.ones(k, dtype=torch.bool, device=device)
    m = torch.as_tensor(stochastic_steps, device=device)
    if m.dtype != torch.bool:  # indices
        idx = m.long().reshape(-1)
        if idx.numel() and (idx.min() < 0 or idx.max() >= k):
            raise ValueError(f"stochastic step indices must be in [0, {k}), got {idx.tolist()}")
        m = torch.zeros(k, dtype=torch.bool, device=device)
        m[idx] = True
    if m.shape not in ((k,), (n, k)):
        raise ValueError(f"stochastic mask must have shape [{k}] or [{n}, {k}], got {list(m.shape)}")
    return m


def run_chain(
    kernel: StepFn,
    x0: Tensor,
    num_steps: int,
    *,
    stochastic_steps: Sequence[int] | Tensor | None = None,
    noise: Tensor | None = None,
    generator: torch.Generator | None = None,
    logprob_mask: Tensor | None = None,
    include_initial: bool = False,
    return_iterates: bool = False,
) -> SampleResult:
    """Run K steps of ``kernel`` from ``x0`` (``[N, *event]``) and accumulate the chain log-likelihood.

    ``noise``: ``[N, K, *event]`` standard normals used at stochastic steps (else drawn from
    ``generator``). ``logprob_mask``: broadcastable to ``[*event]``, which dims count in the log-prob
    (the executed actions). ``include_initial`` adds ``log N(x0; 0, I)`` (the exact joint of the chain).
    """
    n, k_steps = x0.shape[0], num_steps
    ts = time_grid(k_steps)
    dt = 1.0 / k_steps
    if noise is not None and noise.shape != (n, k_steps, *x0.shape[1:]):
        raise ValueError(f"noise must have shape {[n, k_steps, *x0.shape[1:]]}, got {list(noise.shape)}")
    mask = _stochastic_mask(stochastic_steps, n, k_steps, x0.device)
    x = x0
    iterates = [x0] if return_iterates else None
    log_prob = None
    if include_initial:
        log_prob = gaussian_log_density(x0, torch.zeros_like(x0), torch.ones_like(x0), logprob_mask)
    for k in range(k_steps):
        ode_mean, mean, std = kernel(x, _expand_t(ts[k], x), dt)
        if std is None or (mask.ndim == 1 and not bool(mask[k])):
            x = ode_mean
        else:
            eps = noise[:, k] if noise is not None else _randn(x.shape, generator, x)
            row_flag = mask[:, k].to(x.dtype) if mask.ndim == 2 else None  # per-row stochastic steps
            if row_flag is None:
                x = mean + std * eps
            else:
                x = torch.where(row_flag.view((-1,) + (1,) * (x.ndim - 1)) > 0, mean + std * eps, ode_mean)
            lp = gaussian_log_density(x, mean, std, logprob_mask)
            if row_flag is not None:
                lp = lp * row_flag
            log_prob = lp if log_prob is None else log_prob + lp
        if iterates is not None:
            iterates.append(x)
    return SampleResult(
        actions=x,
        iterates=torch.stack(iterates, dim=1) if iterates is not None else None,
        log_prob=log_prob,
        stochastic=mask,
    )


def chain_log_prob(
    kernel: StepFn,
    iterates: Tensor,
    *,
    stochastic_steps: Sequence[int] | Tensor | None = None,
    logprob_mask: Tensor | None = None,
    include_initial: bool = False,
) -> Tensor:
    """Log-likelihood ``[N]`` of stored chains ``iterates [N, K + 1, *event]`` under ``kernel``'s
    current parameters: the same sum :func:`run_chain` accumulated, differentiable (PPO's ratio).

    All K kernel evaluations run as one batch of ``N * K`` rows.
    """
    n, kp1 = iterates.shape[:2]
    k_steps = kp1 - 1
    event = iterates.shape[2:]
    mask = _stochastic_mask(stochastic_steps, n, k_steps, iterates.device)
    x_prev = iterates[:, :-1].reshape(n * k_steps, *event)
    x_next = iterates[:, 1:].reshape(n * k_steps, *event)
    ts = torch.tensor(time_grid(k_steps)[:-1], device=iterates.device, dtype=iterates.dtype)
    t = ts.repeat(n)
    _, mean, std = kernel(x_prev, t, 1.0 / k_steps)
    total = torch.zeros(n, device=iterates.device, dtype=iterates.dtype)
    if include_initial:
        x0 = iterates[:, 0]
        total = total + gaussian_log_density(x0, torch.zeros_like(x0), torch.ones_like(x0), logprob_mask)
    if std is None:
        return total
    lp = gaussian_log_density(x_next, mean, std, logprob_mask).view(n, k_steps)
    flags = mask.to(lp.dtype).expand(n, k_steps)
    return total + (lp * flags).sum(1)


def _randn(shape: torch.Size, generator: torch.Generator | None, like: Tensor) -> Tensor:
    """Standard normals drawn on the generator's device (CPU generators work for CUDA models)."""
    device = generator.device if generator is not None else like.device
    return torch.randn(shape, generator=generator, device=device, dtype=like.dtype).to(like.device)


# ---------------------------------------------------------------------- per-action times
def prefix_mask(delays: Tensor, chunk_len: int) -> Tensor:
    """``[N, H]`` bool: True on each row's first ``delays[i]`` actions (the executed prefix)."""
    return torch.arange(chunk_len, device=delays.device)[None, :] < delays[:, None]


def sample_delays(
    max_delay: int, batch: int, device: torch.device | str, zero_delay_prob: float | None = None
) -> Tensor:
    """``[batch]`` training delays (``rtc_max_delay``, ``rtc_zero_delay_prob``): d ~ U{0..max_delay} when
    ``zero_delay_prob`` is None; else d = 0 with that probability, otherwise d ~ U{1..max_delay}. Action h
    is scored only in rows with d <= h, so the uniform draw scores action 0 (what a plain sampler and every
    episode's first chunk execute) in 1 / (max_delay + 1) of the rows; the mixture scores it in
    ``zero_delay_prob`` of them."""
    if zero_delay_prob is None:
        return torch.randint(0, max_delay + 1, (batch,), device=device)
    delays = torch.randint(1, max_delay + 1, (batch,), device=device)
    return delays.masked_fill(torch.rand(batch, device=device) < zero_delay_prob, 0)


def random_prefix(
    max_delay: int,
    batch: int,
    chunk_len: int,
    device: torch.device | str,
    zero_delay_prob: float | None = None,
) -> Tensor:
    """``[batch, chunk_len]`` bool: each row's first d actions (d from :func:`sample_delays`), the executed
    prefix a policy trained for real-time chunking takes given clean (``rtc_max_delay``)."""
    return prefix_mask(sample_delays(max_delay, batch, device, zero_delay_prob), chunk_len)


def per_action_time(t: Tensor, given: Tensor) -> Tensor:
    """``[N, H]`` flow times: 1 (clean data) on the ``given`` actions, the row's ``t`` ``[N]`` elsewhere."""
    return torch.where(given, torch.ones_like(given, dtype=t.dtype), t[:, None].expand(given.shape))


# ---------------------------------------------------------------------- public samplers
def euler_sample(
    velocity_fn: VelocityFn, x0: Tensor, num_steps: int, *, return_iterates: bool = False
) -> SampleResult:
    """Deterministic Euler ODE: ``x_{k+1} = x_k + v(x_k, k / K) / K`` from noise ``x0``."""
    return run_chain(
        ode_kernel(velocity_fn), x0, num_steps, stochastic_steps=(), return_iterates=return_iterates
    )


def sde_sample(
    velocity_fn: VelocityFn,
    x0: Tensor,
    num_steps: int,
    schedule: SDESchedule | None = None,
    *,
    stochastic_steps: Sequence[int] | Tensor | None = None,
    noise: Tensor | None = None,
    generator: torch.Generator | None = None,
    logprob_mask: Tensor | None = None,
    return_iterates: bool = False,
) -> SampleResult:
    """Euler–Maruyama on the marginal-preserving SDE (default: memoryless).

    ``stochastic_steps`` picks the steps that draw noise (π-RL Flow-SDE draws one index per call and
    keeps the rest ODE); the log-prob sums only those transitions.
    """
    return run_chain(
        sde_kernel(velocity_fn, schedule or SDESchedule()),
        x0,
        num_steps,
        stochastic_steps=stochastic_steps,
        noise=noise,
        generator=generator,
        logprob_mask=logprob_mask,
        return_iterates=return_iterates,
    )


def learnable_noise_sample(
    noisy_velocity_fn: NoisyVelocityFn,
    x0: Tensor,
    num_steps: int,
    *,
    noise: Tensor | None = None,
    generator: torch.Generator | None = None,
    logprob_mask: Tensor | None = None,
    include_initial: bool = True,
    return_iterates: bool = False,
) -> SampleResult:
    """Flow-Noise: every step ``x_{k+1} ~ N(x_k + v dt, σ_φ²)``; returns the exact chain log-likelihood."""
    return run_chain(
        noise_kernel(noisy_velocity_fn),
        x0,
        num_steps,
        noise=noise,
        generator=generator,
        logprob_mask=logprob_mask,
        include_initial=include_initial,
        return_iterates=return_iterates,
    )
