"""PPO's math: the equation-level pure functions, each tested against a hand computation
(``tests/test_ppo.py``): GAE over chunks, the clipped (dual-clip) policy loss, the clipped value loss,
GRPO's group advantages, per-chunk discounts, the adaptive-KL learning rate, and the scoring of a stored
denoising chain's log-likelihood under the current weights (what makes the PPO ratio exact).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from policies.flow_policy import Prefix
from policies.flow_rl import StochasticFlowPolicy
from policies.flow_vla import DenoisingChain, SDESchedule

Tensor = torch.Tensor
ArrayLike = np.ndarray | float

__all__ = [
    "adapt_lr",
    "chunk_discounts",
    "gae",
    "group_advantages",
    "ppo_policy_loss",
    "score_chain",
    "stored_chain",
    "value_loss",
]


# ============================================================================ pure functions
def gae(
    rewards: np.ndarray,
    values: np.ndarray,
    next_values: np.ndarray,
    terminated: np.ndarray,
    episode_end: np.ndarray,
    gamma: ArrayLike,
    lam: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation over one robot's consecutive transitions (time = axis 0).

    ``next_values[t]`` is the value to bootstrap transition t from: ``V(next obs)`` inside an episode,
    ``V(final_obs)`` after a truncation (anything after a termination, which is ignored).
    ``terminated[t]``: the episode ended in a terminal state (no bootstrap). ``episode_end[t]``: the
    episode ended (terminated or truncated), so advantages do not flow back across it. ``gamma``: a
    scalar or per-transition discounts (γ^steps for chunks). The last transition's advantage is its TD
    error (the rollout is cut there). Returns ``(advantages, returns = advantages + values)``.

        δ_t = r_t + γ_t (1 - term_t) V_next_t - V_t
        A_t = δ_t + γ_t λ (1 - end_t) A_{t+1}
    """
    r = np.asarray(rewards, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    nv = np.asarray(next_values, dtype=np.float64)
    term = np.asarray(terminated, dtype=np.float64)
    end = np.maximum(np.asarray(episode_end, dtype=np.float64), term)
    g = np.broadcast_to(np.asarray(gamma, dtype=np.float64), r.shape)
    if not r.shape == v.shape == nv.shape == term.shape == end.shape:
        raise ValueError(
            f"gae: shapes differ: rewards {r.shape}, values {v.shape}, next_values {nv.shape}, "
            f"terminated {term.shape}, episode_end {end.shape}"
        )
    delta = r + g * (1.0 - term) * nv - v
    adv = np.zeros_like(r)
    running = np.zeros_like(r[0]) if r.ndim else 0.0
    for t in range(r.shape[0] - 1, -1, -1):
        running = delta[t] + g[t] * lam * (1.0 - end[t]) * running
        adv[t] = running
    return adv, adv + v


def ppo_policy_loss(
    logp: Tensor, logp_old: Tensor, adv: Tensor, clip: float = 0.2, dual_clip: float = 3.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate (to minimise) with RLinf/verl's dual clip for negative advantages.

        r = exp(logp - logp_old);  L = max(-A r, -A clip(r, 1 - ε, 1 + ε))
        A < 0 and dual_clip c > 1:  L = min(L, -c A)   (a huge ratio on a bad action cannot blow up the loss)

    Returns the mean loss and detached metrics (ratio, clip fraction, approximate KL).
    """
    log_ratio = (logp - logp_old).clamp(-20.0, 20.0)  # exp() of a wild first step must not overflow
    ratio = torch.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - clip, 1.0 + clip)
    loss = torch.maximum(pg1, pg2)
    dual_clipped = torch.zeros_like(loss, dtype=torch.bool)
    if dual_clip:
        capped = torch.minimum(loss, -dual_clip * adv)
        dual_clipped = (adv < 0) & (capped < loss)
        loss = torch.where(adv < 0, capped, loss)
    with torch.no_grad():
        metrics = {
            "ratio": ratio.mean(),
            "clipfrac": ((ratio - 1.0).abs() > clip).float().mean(),
            "dual_clipfrac": dual_clipped.float().mean(),
            "approx_kl": ((ratio - 1.0) - log_ratio).mean(),  # k3 estimator of KL(old || new)
        }
    return loss.mean(), metrics


def adapt_lr(lr: float, kl: float, desired: float, bounds: tuple[float, float], factor: float = 1.5) -> float:
    """rsl_rl's adaptive learning-rate rule: ``lr / factor`` if ``kl > 2 desired``, ``lr * factor`` if
    ``kl < desired / 2``, else ``lr``; clamped to ``bounds``. A NaN KL (no actor update) keeps ``lr``."""
    if not math.isfinite(kl):
        return lr
    if kl > 2 * desired:
        lr = lr / factor
    elif kl < desired / 2:
        lr = lr * factor
    return min(max(lr, bounds[0]), bounds[1])


def value_loss(v: Tensor, v_old: Tensor, returns: Tensor, clip: float = 0.2) -> Tensor:
    """PPO's clipped value loss ``0.5 mean max((v - R)², (v_old + clip(v - v_old, ±c) - R)²)``; c = 0 is plain MSE."""
    unclipped = (v - returns).square()
    if not clip:
        return 0.5 * unclipped.mean()
    v_clipped = v_old + (v - v_old).clamp(-clip, clip)
    return 0.5 * torch.maximum(unclipped, (v_clipped - returns).square()).mean()


def group_advantages(returns: np.ndarray, groups: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """GRPO advantages: each trajectory's return standardised within its group (same task and initial
    state): ``(R_j - mean_g R) / (std_g R + eps)``. Groups whose returns are all equal get 0 (no signal).
    """
    r = np.asarray(returns, dtype=np.float64)
    g = np.asarray(groups)
    if r.shape != g.shape or r.ndim != 1:
        raise ValueError(f"group_advantages: returns {r.shape} and groups {g.shape} must be equal 1-d shapes")
    adv = np.zeros_like(r)
    for key in np.unique(g):
        idx = g == key
        adv[idx] = (r[idx] - r[idx].mean()) / (r[idx].std() + eps)
    return adv


def chunk_discounts(steps: np.ndarray, gamma: float, discount: str) -> np.ndarray:
    """Discount applied after a chunk of ``steps`` env steps: γ per chunk, or γ^steps."""
    steps = np.asarray(steps, dtype=np.float64)
    return np.full_like(steps, gamma) if discount == "chunk" else gamma**steps


# ============================================================================ chain scoring
def score_chain(
    policy: StochasticFlowPolicy, prefix: Prefix, chain: DenoisingChain
) -> tuple[Tensor, Tensor | None]:
    """``(log-prob [B, N], mean Gaussian entropy per element or None)`` of stored chains under the
    current parameters (:meth:`StochasticFlowPolicy.chain_log_prob`). Flow-Noise also keeps the learned
    stds for the entropy bonus, averaged over the log-prob's elements (executed steps, robot dims);
    Flow-SDE's std is fixed, so it has no entropy term."""
    if chain.method != "noise":
        return policy.chain_log_prob(prefix, chain), None
    stds: list[Tensor] = []
    lp = policy.chain_log_prob(prefix, chain, stds=stds)
    std = stds[0]  # [B * N * K, H, D], every step stochastic in Flow-Noise
    mask = policy.logprob_mask()
    ent = (0.5 * math.log(2 * math.pi * math.e) + torch.log(std)) * mask
    entropy = ent.sum() / (mask.sum() * std.shape[0])
    return lp, entropy


def stored_chain(
    iterates: Tensor, stochastic: Tensor, method: str, schedule: SDESchedule | None, n_exec: int
) -> DenoisingChain:
    """Rebuild the chain object of B stored transitions (``iterates [B, K + 1, H, A]``, ``stochastic
    [B, K]``) as one sample per observation, exactly as :meth:`StochasticFlowPolicy.sample` scored it."""
    return DenoisingChain(
        iterates=iterates[:, None],
        method=method,  # type: ignore[arg-type]
        stochastic=stochastic[:, None],
        schedule=schedule,
        include_initial=method == "noise",
        n_exec=n_exec,
    )
