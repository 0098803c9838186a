"""PPO fine-tuning of a flow-matching VLA in simulation (π_RL Flow-Noise / Flow-SDE): one algorithm, one file.

The flow policy is made stochastic by injecting noise into its denoising chain, which gives an exact,
differentiable log-likelihood of the executed action sub-chunk (algorithms.md §3):

* ``method="noise"`` (Flow-Noise / ReinFlow): every one of the K Euler steps draws
  ``x_{k+1} ~ N(x_k + v dt, σ_φ²)`` with σ_φ from the policy's learnable, bounded noise head; the
  log-prob is the exact joint of the chain (initial normal included, a constant), and an entropy
  bonus on the Gaussian steps keeps σ_φ from collapsing.
* ``method="sde"`` (Flow-SDE): π-RL's marginal-preserving SDE ``σ = a sqrt(s / (1 - s))`` (openpi
  time, a = ``noise_level``) on ONE denoising step per policy call, drawn uniformly from the first
  K - 1 (RLinf's ``ignore_last``); every other step is the ODE. The log-prob is that one transition's.

The RL action is the executed sub-chunk (the policy's ``n_exec`` first actions, real dims only) and the
MDP step is one chunk: its reward is the sum of the env rewards over the steps executed. Each robot
keeps a queue of actions (:class:`sim.rollout.ChunkRollout`, as in evaluation); when an episode ends
inside a chunk the chunk is cut there and the robot asks for a fresh chunk for its new episode at once, so
chunks always start at episode step 0, 5, 10, ... and never straddle two episodes. Bootstrapping:
none after a termination (success), ``V(final_obs)`` after a truncation (time limit), ``V(next obs)``
otherwise. A chunk still running when an iteration ends carries over to the next one with its
recorded (behaviour) log-prob, so the PPO ratio stays an importance ratio.

PPO (RLinf's objective): ratio clip 0.2, dual clip 3.0 for negative advantages, clipped value loss,
GAE (γ, λ) = (0.99, 0.95) over chunks, advantages normalised over the batch, several epochs of
minibatches, AdamW with separate actor / critic learning rates and gradient clipping. The critic is a
separate small MLP (not saved in the policy checkpoint): on the normalised state (default; what learnt
best for the state-only model) or on the pooled, detached prefix tokens (π0.5-style, for camera models).

``advantage="grpo"`` replaces the critic by GRPO: each iteration replays the same initial states
``group_size`` times and every chunk gets its episode's success standardised within its group.

What is shipped: a derived checkpoint (``save_derived_checkpoint``; lineage algorithm ``flow-noise`` or
``flow-sde``, parent = the base's commit) whose config's ``num_inference_steps`` is the K used in RL,
because the fine-tuned velocity field is tuned for that Euler grid. Deployment runs the deterministic
ODE as usual (the injected noise is for exploration only).

Output folder::

    <out>/checkpoints/last/   the fine-tuned policy (plus iter_NNNN/ every ``checkpoint_every`` iterations)
    <out>/critic.pt           the critic's weights (safe to load with weights_only)
    <out>/curve.json          one row per iteration: env steps, rollout success, losses, KL, ...
    <out>/tb/                 TensorBoard logs

Runs are reproducible under ``seed`` (sim seeds, sampling generator and minibatch order are all derived
from it) but not resumable: a stopped run starts over.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

import numpy as np
import torch
from torch import nn

from policies.flow_vla import DenoisingChain, FlowVLAConfig, FlowVLAPolicy, PrefixCache, SDESchedule
from policies.flow_vla.sampling import chain_log_prob, noise_kernel
from policies.loading import LoadedPolicy, load_policy, pick_device
from sim.ray_workers import check_ray_address
from sim.rollout import ChunkRecord, ChunkRollout
from vla_rl.core.seeds import EVAL, ONLINE, check_disjoint
from vla_rl.train.base import StepProgress, TrainerConfig, TrainResult, check_optional_positive
from vla_rl.train.common import config_dict, save_derived_checkpoint

log = logging.getLogger(__name__)
Tensor = torch.Tensor
ArrayLike = np.ndarray | float

# Option sets: the Literal is the one spelling (tyro shows its choices); the tuple is derived from it.
Method = Literal["noise", "sde"]
Reward = Literal["sparse", "dense"]
CriticInput = Literal["state", "prefix"]
Discount = Literal["chunk", "step"]
LogprobReduction = Literal["sum", "mean"]
TrainScope = Literal["all", "expert"]
Advantage = Literal["gae", "grpo"]
SdeSteps = Literal["one", "all"]
METHODS, REWARDS, CRITICS, DISCOUNTS = (
    get_args(Method),
    get_args(Reward),
    get_args(CriticInput),
    get_args(Discount),
)
LOGPROB_REDUCTIONS, TRAIN_SCOPES = get_args(LogprobReduction), get_args(TrainScope)
ADVANTAGES, SDE_STEPS = get_args(Advantage), get_args(SdeSteps)


# ============================================================================ config
@dataclass(kw_only=True)
class PPOConfig(TrainerConfig):
    """Every knob of a PPO fine-tuning run. Defaults follow RLinf's π_RL where they apply; the batch,
    learning-rate and reward defaults are the ones tried on PickCube state (docs/experiment-log.md)."""

    needs_store: ClassVar[bool] = False

    base: str = field()  # type: ignore[assignment]
    """Checkpoint to start from: ``hub://org/name@rev`` or a local folder (a flow_vla SFT checkpoint)."""
    task: str | None = None
    """Simulated task to train in; None = the base checkpoint's robot spec name."""

    # ------------------------------------------------------------ noise injection
    method: Method = "noise"
    """'noise' (Flow-Noise: learnable σ on every denoising step, exact joint log-prob) or 'sde'
    (Flow-SDE: one stochastic SDE step per call, log-prob of that transition)."""
    num_steps: int = 4
    """K, denoising steps during RL (RLinf: 4 for π0, 5 for π0.5; 10 at SFT). Saved as the checkpoint's
    ``num_inference_steps``."""
    noise_level: float = 0.5
    """Flow-SDE a in σ = a sqrt(s / (1 - s)) (RLinf 0.5; sqrt(2) is the memoryless SDE). 'sde' only."""
    sde_steps: SdeSteps = "one"
    """Flow-SDE: 'one' (π-RL: one random SDE step per call, the log-prob of that transition only; the
    ODE steps after it also depend on the weights, which that log-prob ignores) or 'all' (every step
    SDE, the exact joint log-prob of the chain; how they compared: docs/experiment-log.md). 'sde' only."""
    noise_std_range: tuple[float, float] | None = None
    """Flow-Noise (min, max) bound of the learnable per-step std, in normalised action units; None keeps
    the base config's (RLinf default 0.08-0.16). 'noise' only."""
    entropy_coef: float = 0.005
    """Bonus on the mean per-element Gaussian entropy of the noise steps (RLinf 0.005). 'noise' only."""
    logprob_reduction: LogprobReduction = "sum"
    """'sum': exact chunk log-likelihood (sum over steps x executed actions x dims); 'mean': divided by
    the number of stochastic steps (RLinf's ``log_probs.mean`` over the chain, a per-step geometric-mean
    ratio that keeps PPO's ratio tame when K is large)."""

    # ------------------------------------------------------------ environment and MDP
    num_envs: int = 4
    """Parallel simulated robots (one process each)."""
    ray: str | None = None
    """Run the simulated robots (and the final evaluation) as Ray actors: 'auto' (this machine's Ray
    cluster, or a local head on 127.0.0.1) or a cluster address host:port; None = local processes. The
    same seeds give the same rollouts; a dead actor is replaced and its episode re-run (docs/sim.md)."""
    env_steps: int = 50_000
    """Budget: total env steps (summed over robots) to train for."""
    rollout_steps: int = 400
    """Vector-env steps per iteration: each iteration collects num_envs * rollout_steps env steps."""
    reward: Reward = "dense"
    """'sparse': 1 on success (episodes terminate on success). 'dense': the same success reward plus
    potential-based shaping with the sim's dense reward Φ in [0, 1] (Ng et al. 1999): a chunk from s to
    s' earns ``success + γ_chunk Φ(s') - Φ(s)`` (Φ = 0 at episode start and after termination). Shaping
    keeps the optimal policy and the return scale of 'sparse' (values stay in about [-1, 1], where the
    0.2 value clip makes sense) but credits progress chunk by chunk; summing the raw dense reward instead
    would pay a policy for hovering near the goal rather than finishing."""
    gamma: float = 0.99
    """Discount per chunk (``discount='chunk'``, RLinf) or per env step (``'step'``: γ^steps per chunk)."""
    discount: Discount = "chunk"
    """How γ applies to a chunk of executed actions (see ``gamma``)."""
    gae_lambda: float = 0.95
    max_episode_steps: int | None = None
    """Episode step limit; None = the task's."""
    env_seed: int = ONLINE
    """Seed of the first training episode; every evaluation range stays below it (:mod:`vla_rl.core.seeds`)."""

    # ------------------------------------------------------------ advantages
    advantage: Advantage = "gae"
    """'gae': GAE with the critic. 'grpo': no critic; each iteration replays the same initial states
    ``group_size`` times (robot i always gets seed ``s + i``), and every chunk of an episode gets the
    episode's success standardised within its group (RLinf GRPO; ``rollout_steps`` is then unused)."""
    group_size: int = 8
    """G, episodes per initial state in GRPO (RLinf 8)."""

    # ------------------------------------------------------------ PPO
    clip: float = 0.2
    """PPO ratio clip ε."""
    dual_clip: float = 3.0
    """Dual clip c (> 1) bounding the loss for negative advantages; 0 disables it."""
    value_clip: float = 0.2
    """Clip of the value prediction around its rollout value; 0 disables it."""
    update_epochs: int = 4
    minibatch_size: int = 160
    """Transitions (chunks) per gradient step."""
    actor_lr: float = 3e-6
    """Actor learning rate. Flow-Noise's exact chain log-prob moves the PPO ratio more than Flow-SDE's
    single transition at the same rate, so it wants a smaller one (try ~1e-6; docs/experiment-log.md)."""
    critic_lr: float = 3e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    """Max global grad norm, applied to the actor and to the critic separately."""
    target_kl: float | None = None
    """Stop the iteration's epochs early once the approximate KL exceeds this; None = never."""
    adaptive_kl: float | None = None
    """The adaptive schedule of rsl_rl / Isaac Lab's PPO on the actor's learning rate: after each
    iteration that updated the actor, the rate is multiplied by 1.5 when the iteration's mean approx-KL
    was under half of this, divided by 1.5 when over twice it, kept within ``adaptive_lr_bounds``
    (:func:`adapt_lr`); ``actor_lr`` is where it starts. None = a fixed ``actor_lr``. For a step size
    that would otherwise be too small to compound (PickCube: approx-KL 0.003-0.007 an iteration at 3e-6)
    or too large to be stable (1e-5 on small batches)."""
    adaptive_lr_bounds: tuple[float, float] = (1e-7, 1e-4)
    """(min, max) actor learning rate under ``adaptive_kl``."""
    critic_warmup_iterations: int = 2
    """Iterations that train only the critic (a fresh critic's advantages are noise)."""
    train_scope: TrainScope = "all"
    """'all' policy weights, or 'expert': only the action expert and noise head (RLinf freezes the VLM)."""

    # ------------------------------------------------------------ critic
    critic: CriticInput = "state"
    """'state': MLP on the normalised state (state-only models); 'prefix': MLP on the pooled prefix
    tokens (π0.5-style; sees the cameras)."""
    critic_hidden: tuple[int, ...] = (256, 256)
    critic_detach: bool = True
    """'prefix' critic: stop value gradients into the trunk (RLinf ``detach_critic_input``)."""

    # ------------------------------------------------------------ bookkeeping
    threads: int = 1
    """Torch CPU threads in the trainer (sim workers use 1 each)."""
    checkpoint_every: int = 0
    """Also save out/checkpoints/iter_NNNN every this many iterations; 0 = only the final one."""
    max_minutes: float | None = None
    """Wall-clock budget: no new iteration starts once this many minutes have passed since the start,
    and the policy as it is then is shipped (``metrics["env_steps"]`` says how far it got; a round on a
    deadline, or a benchmark on a borrowed machine). None = run until ``env_steps``."""
    final_eval_episodes: int = 0
    """Evaluate the final policy on this many held-out episodes (seeds from ``final_eval_seed``), stored in
    the checkpoint's metrics; 0 = skip."""
    final_eval_seed: int = EVAL

    def __post_init__(self) -> None:
        super().__post_init__()
        self.base = str(self.base)
        _choice(self, "method", METHODS)
        _choice(self, "reward", REWARDS)
        _choice(self, "critic", CRITICS)
        _choice(self, "discount", DISCOUNTS)
        _choice(self, "logprob_reduction", LOGPROB_REDUCTIONS)
        _choice(self, "train_scope", TRAIN_SCOPES)
        _choice(self, "advantage", ADVANTAGES)
        _choice(self, "sde_steps", SDE_STEPS)
        self.ray = check_ray_address(self.ray)
        for name in (
            "num_envs",
            "env_steps",
            "rollout_steps",
            "update_epochs",
            "minibatch_size",
            "threads",
            "group_size",
        ):
            _positive_int(self, name)
        _positive_int(self, "num_steps")
        if self.method == "sde" and self.num_steps < 2:
            raise ValueError("num_steps: Flow-SDE needs >= 2 (the last step is never the stochastic one)")
        for name in (
            "critic_warmup_iterations",
            "checkpoint_every",
            "final_eval_episodes",
            "env_seed",
            "seed",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}: expected an integer >= 0, got {v!r}")
        for name in _NUMBERS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name}: expected a finite number, got {v!r}")
        for name, lo, hi in (("gamma", 0.0, 1.0), ("gae_lambda", 0.0, 1.0)):
            v = getattr(self, name)
            if not lo <= v <= hi:
                raise ValueError(f"{name}: expected in [{lo}, {hi}], got {v}")
        for name in ("actor_lr", "critic_lr", "grad_clip", "noise_level"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected > 0, got {getattr(self, name)}")
        for name in ("weight_decay", "entropy_coef", "value_clip"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: expected >= 0, got {getattr(self, name)}")
        if not 0 < self.clip < 1:
            raise ValueError(f"clip: expected in (0, 1), got {self.clip}")
        if self.dual_clip != 0 and not self.dual_clip > 1:
            raise ValueError(f"dual_clip: expected > 1 (or 0 = off), got {self.dual_clip}")
        check_optional_positive(self, "max_minutes", "a positive number of minutes")
        check_optional_positive(self, "adaptive_kl", "a positive approx-KL per iteration")
        lo, hi = (float(x) for x in self.adaptive_lr_bounds)
        if not 0 < lo <= hi:
            raise ValueError(f"adaptive_lr_bounds: expected 0 < min <= max, got {self.adaptive_lr_bounds}")
        self.adaptive_lr_bounds = (lo, hi)
        if self.target_kl is not None and not self.target_kl > 0:
            raise ValueError(f"target_kl: expected > 0 or None, got {self.target_kl}")
        if self.noise_std_range is not None:
            lo, hi = (float(x) for x in self.noise_std_range)
            if not 0 < lo <= hi:
                raise ValueError(f"noise_std_range: expected 0 < min <= max, got {self.noise_std_range}")
            self.noise_std_range = (lo, hi)
        self.critic_hidden = tuple(int(h) for h in self.critic_hidden)
        if not self.critic_hidden or min(self.critic_hidden) < 1:
            raise ValueError(f"critic_hidden: expected positive widths, got {self.critic_hidden}")
        if self.max_episode_steps is not None and self.max_episode_steps < 1:
            raise ValueError(f"max_episode_steps: expected >= 1 or None, got {self.max_episode_steps}")
        if self.final_eval_episodes:
            evaluation = range(self.final_eval_seed, self.final_eval_seed + self.final_eval_episodes)
            check_disjoint(evaluation, {"ppo": self.collection_seeds()})

    def collection_seeds(self) -> range:
        """A superset of the training episode seeds: robot i's j-th episode is ``env_seed + i + j N``
        (GRPO: iteration k replays ``env_seed + k N + i``), and every episode takes at least one env step."""
        return range(self.env_seed, self.env_seed + self.env_steps + self.num_envs)

    @property
    def algorithm(self) -> str:
        """Lineage name of what this run ships."""
        return f"flow-{self.method}"


_NUMBERS = (
    "noise_level",
    "entropy_coef",
    "gamma",
    "gae_lambda",
    "clip",
    "dual_clip",
    "value_clip",
    "actor_lr",
    "critic_lr",
    "weight_decay",
    "grad_clip",
)


def _choice(cfg: Any, name: str, options: tuple[str, ...]) -> None:
    if getattr(cfg, name) not in options:
        raise ValueError(f"{name}: expected one of {list(options)}, got {getattr(cfg, name)!r}")


def _positive_int(cfg: Any, name: str) -> None:
    v = getattr(cfg, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}: expected a positive integer, got {v!r}")


@dataclass(kw_only=True)
class PPOResult(TrainResult):
    env_steps: int
    iterations: int
    episodes: int
    """Training episodes completed."""


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
    policy: FlowVLAPolicy, prefix: PrefixCache, chain: DenoisingChain
) -> tuple[Tensor, Tensor | None]:
    """``(log-prob [B, N], mean Gaussian entropy per element or None)`` of stored chains under the
    current parameters. Flow-Noise runs the same kernel as :meth:`FlowVLAPolicy.chain_log_prob` while
    keeping the learned stds for the entropy bonus; Flow-SDE's std is fixed, so it has no entropy term."""
    if chain.method != "noise":
        return policy.chain_log_prob(prefix, chain), None
    stds: list[Tensor] = []

    def velocity_and_std(x: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        v, hidden = policy.velocity(prefix, x, t, return_hidden=True)
        std = policy.noise_std(hidden)
        stds.append(std)
        return v, std

    b, n, kp1 = chain.iterates.shape[:3]
    iterates = chain.iterates.reshape(b * n, kp1, *chain.iterates.shape[3:])
    mask = policy.logprob_mask()
    lp = chain_log_prob(
        noise_kernel(velocity_and_std),
        iterates,
        stochastic_steps=chain.stochastic
        if chain.stochastic.ndim == 1
        else chain.stochastic.reshape(b * n, -1),
        logprob_mask=mask,
        include_initial=chain.include_initial,
    )
    std = stds[0]  # [B * N * K, H, A], every step stochastic in Flow-Noise
    ent = (0.5 * math.log(2 * math.pi * math.e) + torch.log(std)) * mask
    entropy = ent.sum() / (mask.sum() * std.shape[0])
    return lp.reshape(b, n), entropy


def stored_chain(
    iterates: Tensor, stochastic: Tensor, method: str, schedule: SDESchedule | None, n_exec: int
) -> DenoisingChain:
    """Rebuild the chain object of B stored transitions (``iterates [B, K + 1, H, A]``, ``stochastic
    [B, K]``) as one sample per observation, exactly as :meth:`FlowVLAPolicy.sample` scored it."""
    return DenoisingChain(
        iterates=iterates[:, None],
        method=method,  # type: ignore[arg-type]
        stochastic=stochastic[:, None],
        schedule=schedule,
        include_initial=method == "noise",
        n_exec=n_exec,
    )


# ============================================================================ critic
class Critic(nn.Module):
    """V(o): an MLP on the normalised state or on the pooled prefix tokens; the last layer starts at 0."""

    def __init__(self, d_in: int, hidden: tuple[int, ...]) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for h in hidden:
            layers += [nn.Linear(d_in, h), nn.LayerNorm(h), nn.SiLU()]
            d_in = h
        out = nn.Linear(d_in, 1)
        nn.init.zeros_(out.weight)
        nn.init.zeros_(out.bias)
        self.net = nn.Sequential(*layers, out)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x).squeeze(-1)


class ValueFn:
    """Binds the critic to its input: the normalised state, or the (detached) pooled prefix."""

    def __init__(self, cfg: PPOConfig, policy: FlowVLAPolicy) -> None:
        self.kind, self.detach, self.policy = cfg.critic, cfg.critic_detach, policy
        if cfg.critic == "state" and policy.config.state_dim == 0:
            raise ValueError("critic: 'state' needs a policy with a state input; use 'prefix'")
        d_in = policy.config.state_dim if cfg.critic == "state" else policy.config.d_model
        self.net = Critic(d_in, cfg.critic_hidden).to(policy.device)

    def __call__(self, obs: Mapping[str, Any], prefix: PrefixCache | None) -> Tensor:
        if self.kind == "state":
            state = torch.as_tensor(obs["state"], device=self.policy.device).float()
            return self.net(self.policy.normalizer.normalize_state(state))
        if prefix is None:
            prefix = self.policy.encode_prefix(obs)
        pooled = prefix.pooled()
        return self.net(pooled.detach() if self.detach else pooled)


# ============================================================================ rollout storage
@dataclass
class _Chunk:
    """One MDP step of one robot: the observation, the stored chain, and what executing it earned."""

    obs: dict[str, Any]  # {"state": [S], "cameras": {name: [h, w, 3]}}
    iterates: np.ndarray  # [K + 1, H, A] normalised
    stochastic: np.ndarray  # [K] bool
    logp: float
    value: float
    reward: float = 0.0
    steps: int = 0
    terminated: bool = False
    truncated: bool = False
    success: bool = False
    next_value: float | None = None
    potential: float = 0.0  # Φ(s) at the chunk's first observation ('dense' reward)


def _obs_row(obs: Mapping[str, Any], i: int) -> dict[str, Any]:
    return {
        "state": np.array(obs["state"][i]),
        "cameras": {k: np.array(v[i]) for k, v in obs["cameras"].items()},
    }


def _stack_obs(rows: list[dict[str, Any]], emb: Tensor | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "state": np.stack([r["state"] for r in rows]),
        "cameras": {k: np.stack([r["cameras"][k] for r in rows]) for k in rows[0]["cameras"]},
    }
    if emb is not None:
        out["instruction_embedding"] = emb.expand(len(rows), -1)
    return out


class _Sampler:
    """Draws noise-injected chunks for a batch of observations and records what PPO needs."""

    def __init__(self, cfg: PPOConfig, policy: FlowVLAPolicy, value_fn: ValueFn, emb: Tensor | None) -> None:
        self.cfg, self.policy, self.value_fn, self.emb = cfg, policy, value_fn, emb
        self.gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
        self.rng = np.random.default_rng([cfg.seed, 1])
        self.schedule = SDESchedule("flow_sde", cfg.noise_level) if cfg.method == "sde" else None

    @torch.no_grad()
    def act(self, rows: list[dict[str, Any]]) -> tuple[list[_Chunk], np.ndarray]:
        """Chunks for ``rows`` and the executed actions in env units ``[B, n_exec, A]``."""
        p, k = self.policy, self.cfg.num_steps
        obs = _stack_obs(rows, self.emb)
        prefix = p.encode_prefix(obs)
        steps = None
        if self.cfg.method == "sde" and self.cfg.sde_steps == "one":
            # one SDE step per call, same index for the batch, never the last (RLinf's ignore_last)
            steps = [int(self.rng.integers(0, k - 1))]
        s = p.sample(
            prefix,
            method=self.cfg.method,
            num_steps=k,
            generator=self.gen,
            schedule=self.schedule,
            stochastic_steps=steps,
        )
        assert s.chain is not None and s.log_prob is not None
        values = self.value_fn(obs, prefix).cpu().numpy()
        actions = s.actions[:, 0]
        if p.config.action_norm == "min_max":
            actions = actions.clamp(-1.0, 1.0)  # as predict_action_chunk: the stored chain stays unclipped
        env_actions = p.normalizer.unnormalize_action(actions)[:, : p.config.n_exec].cpu().numpy()
        stoch = s.chain.stochastic
        stoch = stoch.expand(len(rows), 1, k) if stoch.ndim == 1 else stoch
        chunks = [
            _Chunk(
                obs=row,
                iterates=s.chain.iterates[j, 0].cpu().numpy(),
                stochastic=stoch[j, 0].cpu().numpy().astype(bool),
                logp=float(s.log_prob[j, 0]),
                value=float(values[j]),
            )
            for j, row in enumerate(rows)
        ]
        return chunks, env_actions.astype(np.float32)

    @torch.no_grad()
    def values(self, rows: list[dict[str, Any]]) -> np.ndarray:
        return self.value_fn(_stack_obs(rows, self.emb), None).cpu().numpy()


class _Rollout:
    """PPO's view of a :class:`sim.rollout.ChunkRollout`: each chunk's stored chain, value and shaped
    reward, and its bootstrap value; completed chunks accumulate per robot, in time order."""

    def __init__(self, cfg: PPOConfig, env: Any, sampler: _Sampler, seed: int | None = None) -> None:
        self.cfg, self.sampler = cfg, sampler
        n = env.num_envs
        self.pending: list[_Chunk | None] = [None] * n
        self.waiting: list[_Chunk | None] = [None] * n  # completed, needs V(next obs) from the next chunk
        self.done: list[list[_Chunk]] = [[] for _ in range(n)]
        self.episodes: list[bool] = []  # success of each episode finished in this iteration
        self.potential = np.zeros(n)  # Φ of each robot's current observation (last dense reward)
        self.rollout = ChunkRollout(
            env,
            self._propose,
            sampler.policy.config.n_exec,
            seed=cfg.env_seed if seed is None else seed,
            reward_key="sparse_reward",
            on_chunks=self._finish,
        )

    def _propose(self, robots: list[int], obs: Mapping[str, Any]) -> np.ndarray:
        chunks, actions = self.sampler.act([_obs_row(obs, j) for j in range(len(robots))])
        for j, i in enumerate(robots):
            if self.waiting[i] is not None:
                self.waiting[i].next_value = chunks[j].value
                self.waiting[i] = None
            chunks[j].potential = float(self.potential[i])
            self.pending[i] = chunks[j]
        return actions

    def _finish(self, records: list[ChunkRecord]) -> None:
        """Chunks that ended in one vector step: rewards (shaped), ends, and what to bootstrap from."""
        truncated: list[ChunkRecord] = []
        for rec in records:
            i = rec.robot
            c = self.pending[i]
            assert c is not None
            c.reward, c.steps = rec.reward, rec.steps
            if self.cfg.reward == "dense":
                phi_next = 0.0 if rec.terminated else float(rec.info["dense_reward"])
                g = float(chunk_discounts(np.array([c.steps]), self.cfg.gamma, self.cfg.discount)[0])
                c.reward += g * phi_next - c.potential
            self.potential[i] = 0.0 if rec.episode_ended else float(rec.info["dense_reward"])
            if rec.episode_ended:
                c.terminated, c.truncated = rec.terminated, rec.truncated
                c.success = bool(rec.info["success"])
                self.episodes.append(c.success)
                if c.truncated and not c.terminated:
                    truncated.append(rec)
                else:
                    c.next_value = 0.0
            else:
                self.waiting[i] = c
            self.done[i].append(c)
            self.pending[i] = None
        if truncated:  # bootstrap from the observation the time limit cut off
            vals = self.sampler.values([_obs_row_single(rec.final_obs) for rec in truncated])
            for rec, v in zip(truncated, vals, strict=True):
                self.done[rec.robot][-1].next_value = float(v)

    def collect(self, steps: int) -> int:
        """Run ``steps`` vector steps; returns env steps taken. Chunks in flight carry over."""
        taken = self.rollout.run(steps)
        self.rollout.refill()  # every completed chunk now knows V(next obs)
        return taken

    def take(self) -> tuple[list[list[_Chunk]], list[bool]]:
        done, episodes = self.done, self.episodes
        self.done, self.episodes = [[] for _ in range(len(done))], []
        return done, episodes


def _obs_row_single(o: Mapping[str, Any]) -> dict[str, Any]:
    return {"state": np.asarray(o["state"]), "cameras": {k: np.asarray(v) for k, v in o["cameras"].items()}}


def collect_groups(
    cfg: PPOConfig, env: Any, sampler: _Sampler, seed: int
) -> tuple[list[_Chunk], np.ndarray, list[bool], int]:
    """GRPO rollouts: ``group_size`` rounds from the same initial states (``env.reset(seed)`` gives robot
    i seed ``seed + i`` every time); each round keeps each robot's first episode. Returns the chunks,
    their group-normalised advantages, the episodes' successes and the env steps spent (robots that
    finish early keep stepping until the slowest is done; those steps count but are not trained on)."""
    n = env.num_envs
    chunks: list[_Chunk] = []
    chunk_group: list[tuple[int, int]] = []  # (robot, round) of each kept chunk
    successes = np.zeros((cfg.group_size, n))
    steps = 0
    for rnd in range(cfg.group_size):
        rollout = _Rollout(cfg, env, sampler, seed=seed)
        first: list[list[_Chunk] | None] = [None] * n
        while any(f is None for f in first):
            steps += rollout.collect(1)
            for i in range(n):
                if first[i] is None:
                    ends = [j for j, c in enumerate(rollout.done[i]) if c.terminated or c.truncated]
                    if ends:
                        first[i] = rollout.done[i][: ends[0] + 1]
        for i, episode in enumerate(first):
            assert episode is not None
            successes[rnd, i] = float(episode[-1].success)
            chunks += episode
            chunk_group += [(i, rnd)] * len(episode)
    # group = robot (its initial state); one return per (round, robot) episode
    adv_ep = group_advantages(successes.reshape(-1), np.tile(np.arange(n), cfg.group_size)).reshape(
        cfg.group_size, n
    )
    adv = np.array([adv_ep[rnd, i] for i, rnd in chunk_group])
    return chunks, adv, [bool(x) for x in successes.reshape(-1)], steps


# ============================================================================ training
def _prepare_policy(cfg: PPOConfig, base: LoadedPolicy, device: torch.device) -> FlowVLAPolicy:
    """A trainable copy of the base policy with the RL-time config (K, noise bounds)."""
    d = dict(base.info.model_config)
    d["num_inference_steps"] = cfg.num_steps
    if cfg.noise_std_range is not None:
        d["noise_std_min"], d["noise_std_max"] = cfg.noise_std_range
    d.pop("type", None)
    model_cfg = FlowVLAConfig.from_dict(d)
    if model_cfg.dropout:
        raise ValueError("base: PPO needs dropout = 0 (a chain's log-prob must be a function of the weights)")
    policy = FlowVLAPolicy(model_cfg).to(device)
    policy.load_state_dict(base.policy.state_dict())
    return policy.eval()  # no dropout or augmentation anywhere: rollouts and updates see the same function


def _actor_params(policy: FlowVLAPolicy, scope: str) -> list[nn.Parameter]:
    params = []
    for name, p in policy.named_parameters():
        train = scope == "all" or name.startswith(("expert.", "noise_head."))
        p.requires_grad_(train)
        if train:
            params.append(p)
    return params


def _flatten(done: list[list[_Chunk]], cfg: PPOConfig) -> tuple[list[_Chunk], np.ndarray, np.ndarray]:
    """All completed chunks, their GAE advantages and returns (per robot, in time order)."""
    chunks: list[_Chunk] = []
    advs, rets = [], []
    for seq in done:
        if not seq:
            continue
        assert all(c.next_value is not None for c in seq)
        a, r = gae(
            np.array([c.reward for c in seq]),
            np.array([c.value for c in seq]),
            np.array([c.next_value for c in seq]),
            np.array([c.terminated for c in seq]),
            np.array([c.terminated or c.truncated for c in seq]),
            chunk_discounts(np.array([c.steps for c in seq]), cfg.gamma, cfg.discount),
            cfg.gae_lambda,
        )
        chunks += seq
        advs.append(a)
        rets.append(r)
    return chunks, np.concatenate(advs), np.concatenate(rets)


def train_ppo(cfg: PPOConfig) -> PPOResult:
    """Fine-tune ``cfg.base`` with PPO in simulation; see the module docstring.

    ``curve`` rows: ``iteration, env_steps`` (cumulative), ``episodes`` finished in the iteration and
    their ``rollout_success`` (noise-injected policy), ``chunks`` and their mean ``chunk_return``, the
    mean ``policy_loss, value_loss, entropy, approx_kl, clipfrac`` over minibatches, ``explained_var``
    of the rollout values, the Flow-Noise ``noise_std``, ``epochs_run`` and ``seconds``. Losses are NaN
    in critic warm-up iterations.
    """
    from sim.vector import VectorSimEnv

    t_start = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    device = pick_device(cfg.device)
    base = load_policy(cfg.base, device=str(device))
    task = cfg.task or base.spec.name
    policy = _prepare_policy(cfg, base, device)
    value_fn = ValueFn(cfg, policy)
    emb = None
    if policy.config.uses_instruction:  # one task, one instruction: embed it once
        from policies.flow_vla import embed_instructions

        emb = embed_instructions([base.spec.instruction]).to(device)
    actor_params = _actor_params(policy, cfg.train_scope)
    critic_params = list(value_fn.net.parameters())
    betas = (0.9, 0.95)
    actor_opt = torch.optim.AdamW(actor_params, lr=cfg.actor_lr, betas=betas, weight_decay=cfg.weight_decay)
    critic_opt = torch.optim.AdamW(
        critic_params, lr=cfg.critic_lr, betas=betas, weight_decay=cfg.weight_decay
    )

    cfg.out.mkdir(parents=True, exist_ok=True)
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(cfg.out / "tb"))
    writer.add_text("config", f"```\n{config_dict(cfg)}\n```", 0)
    spec = base.spec
    env = VectorSimEnv(
        task,
        num_envs=cfg.num_envs,
        seed=cfg.env_seed,
        obs="rgb" if spec.cameras else "state",
        image_size=spec.cameras[0].height if spec.cameras else 128,
        max_episode_steps=cfg.max_episode_steps,
        ray=cfg.ray,
    )
    if env.spec.state_dim != spec.state_dim or env.spec.camera_names != spec.camera_names:
        env.close()
        raise ValueError(
            f"task: {task} (state {env.spec.state_dim}, cameras {list(env.spec.camera_names)}) does not match "
            f"the base policy's spec {spec.name} (state {spec.state_dim}, cameras {list(spec.camera_names)})"
        )
    log.info(
        "ppo start",
        extra={
            "task": task,
            "base": cfg.base,
            "method": cfg.method,
            "K": cfg.num_steps,
            "num_envs": cfg.num_envs,
            "env_steps": cfg.env_steps,
            "params": policy.num_parameters(),
        },
    )
    sampler = _Sampler(cfg, policy, value_fn, emb)
    curve: list[dict[str, float]] = []
    env_steps = episodes_total = iteration = 0
    bar = StepProgress(
        cfg.env_steps, stage="online", desc=f"ppo {cfg.algorithm}", unit="env step", show=cfg.progress
    )
    try:
        rollout = _Rollout(cfg, env, sampler) if cfg.advantage == "gae" else None
        deadline = t_start + 60 * cfg.max_minutes if cfg.max_minutes else math.inf
        while env_steps < cfg.env_steps:
            t_iter = time.perf_counter()
            if t_iter >= deadline:
                log.info(
                    "ppo stopped at its time budget",
                    extra={"max_minutes": cfg.max_minutes, "env_steps": env_steps},
                )
                break
            if cfg.advantage == "grpo":
                seed = cfg.env_seed + iteration * cfg.num_envs  # fresh initial states every iteration
                chunks, adv, episodes, taken = collect_groups(cfg, env, sampler, seed)
                ret = np.zeros_like(adv)
            else:
                steps = min(cfg.rollout_steps, math.ceil((cfg.env_steps - env_steps) / cfg.num_envs))
                assert rollout is not None
                taken = rollout.collect(steps)
                done, episodes = rollout.take()
                chunks, adv, ret = _flatten(done, cfg)
            env_steps += taken
            episodes_total += len(episodes)
            lr_used = actor_opt.param_groups[0]["lr"]
            stats = _update(cfg, policy, value_fn, chunks, adv, ret, actor_opt, critic_opt, emb, iteration)
            if cfg.adaptive_kl is not None:
                lr_next = adapt_lr(lr_used, stats["approx_kl"], cfg.adaptive_kl, cfg.adaptive_lr_bounds)
                for g in actor_opt.param_groups:
                    g["lr"] = lr_next
            row = {
                "iteration": iteration,
                "env_steps": env_steps,
                "actor_lr": lr_used,
                "episodes": len(episodes),
                "rollout_success": float(np.mean(episodes)) if episodes else float("nan"),
                "chunk_return": float(np.mean([c.reward for c in chunks])) if chunks else float("nan"),
                "chunks": len(chunks),
                **stats,
                "seconds": time.perf_counter() - t_iter,
            }
            curve.append(row)
            for k, v in row.items():
                if k != "iteration" and isinstance(v, float) and math.isfinite(v):
                    writer.add_scalar(f"ppo/{k}", v, env_steps)
            log.info(
                "ppo iteration", extra={k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
            )
            bar.update(taken)
            bar.set_postfix(succ=f"{row['rollout_success']:.0%}", kl=f"{row['approx_kl']:.4f}")
            iteration += 1
            if cfg.checkpoint_every and iteration % cfg.checkpoint_every == 0:
                _save(
                    cfg, policy, base, cfg.out / "checkpoints" / f"iter_{iteration:04d}", env_steps, curve, {}
                )
    finally:
        bar.close()
        env.close()
        writer.close()

    metrics: dict[str, Any] = {
        "env_steps": env_steps,
        "iterations": iteration,
        "episodes": episodes_total,
        "stopped_by_time": env_steps < cfg.env_steps,
        "actor_lr_final": actor_opt.param_groups[0]["lr"],
    }
    tail = [r["rollout_success"] for r in curve[-3:] if math.isfinite(r["rollout_success"])]
    metrics["rollout_success_last3"] = float(np.mean(tail)) if tail else float("nan")
    if cfg.final_eval_episodes:
        from vla_rl.evaluation import evaluate

        lp = LoadedPolicy(policy=policy, info=base.info, path=cfg.out, commit="unsaved", ref=str(cfg.out))
        ev = evaluate(
            lp,
            task,
            episodes=cfg.final_eval_episodes,
            num_envs=cfg.num_envs,
            seed=cfg.final_eval_seed,
            progress=cfg.progress,
            ray=cfg.ray,
        )
        metrics.update(eval_success=ev.success_rate, eval_episodes=ev.episodes, eval_seed=cfg.final_eval_seed)
    ckpt = _save(cfg, policy, base, cfg.out / "checkpoints" / "last", env_steps, curve, metrics)
    torch.save(value_fn.net.state_dict(), cfg.out / "critic.pt")
    (cfg.out / "curve.json").write_text(json.dumps(curve, indent=1))
    seconds = time.perf_counter() - t_start
    metrics["seconds"] = seconds
    log.info(
        "ppo done", extra={"checkpoint": str(ckpt), **{k: v for k, v in metrics.items() if k != "seconds"}}
    )
    return PPOResult(
        checkpoint=ckpt,
        seconds=seconds,
        metrics=metrics,
        curve=curve,
        data={"env_steps": env_steps, "episodes": episodes_total},
        env_steps=env_steps,
        iterations=iteration,
        episodes=episodes_total,
    )


def _save(
    cfg: PPOConfig,
    policy: FlowVLAPolicy,
    base: LoadedPolicy,
    path: Path,
    env_steps: int,
    curve: list[dict[str, float]],
    metrics: Mapping[str, Any],
) -> Path:
    if path.exists():
        shutil.rmtree(path)
    save_derived_checkpoint(
        path,
        policy,
        base.info,
        algorithm=cfg.algorithm,
        parent_revision=base.commit,
        data={
            "base_ref": cfg.base,
            "task": cfg.task or base.spec.name,
            "env_steps": env_steps,
            "method": cfg.method,
            "num_steps": cfg.num_steps,
            "reward": cfg.reward,
            "num_envs": cfg.num_envs,
            "seed": cfg.seed,
        },
        metrics={**metrics, "env_steps": env_steps, "iterations": len(curve)},
        round_index=cfg.round_index,
    )
    return path


def _update(
    cfg: PPOConfig,
    policy: FlowVLAPolicy,
    value_fn: ValueFn,
    chunks: list[_Chunk],
    adv: np.ndarray,
    ret: np.ndarray,
    actor_opt: torch.optim.Optimizer,
    critic_opt: torch.optim.Optimizer,
    emb: Tensor | None,
    iteration: int,
) -> dict[str, float]:
    """PPO epochs over minibatches of this iteration's chunks; returns averaged diagnostics."""
    nan = float("nan")
    if not chunks:
        return dict.fromkeys(
            ("policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac", "explained_var", "noise_std"),
            nan,
        )
    device = policy.device
    m = len(chunks)
    iterates = torch.as_tensor(np.stack([c.iterates for c in chunks]), device=device)
    stochastic = torch.as_tensor(np.stack([c.stochastic for c in chunks]), device=device)
    logp_old = torch.as_tensor([c.logp for c in chunks], device=device, dtype=torch.float32)
    v_old = torch.as_tensor([c.value for c in chunks], device=device, dtype=torch.float32)
    returns = torch.as_tensor(ret, device=device, dtype=torch.float32)
    advantages = torch.as_tensor(adv, device=device, dtype=torch.float32)
    grpo = cfg.advantage == "grpo"
    if m > 1 and not grpo:  # GRPO advantages are already standardised within their groups
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    norm = 1.0
    if cfg.logprob_reduction == "mean":
        norm = float(cfg.num_steps + 1) if cfg.method == "noise" else 1.0
    train_actor = grpo or iteration >= cfg.critic_warmup_iterations
    schedule = SDESchedule("flow_sde", cfg.noise_level) if cfg.method == "sde" else None
    rng = np.random.default_rng([cfg.seed, 2, iteration])
    sums: dict[str, float] = {}
    count = 0
    stop = False
    for _epoch in range(cfg.update_epochs):
        perm = rng.permutation(m)
        for start in range(0, m, cfg.minibatch_size):
            mb = perm[start : start + cfg.minibatch_size]
            mb_t = torch.as_tensor(mb, device=device)
            obs = _stack_obs([chunks[i].obs for i in mb], emb)
            stats: dict[str, Tensor] = {}
            prefix = None
            loss = torch.zeros((), device=device)
            if train_actor:
                prefix = policy.encode_prefix(obs)
                chain = stored_chain(
                    iterates[mb_t], stochastic[mb_t], cfg.method, schedule, policy.config.n_exec
                )
                logp, entropy = score_chain(policy, prefix, chain)
                pl, stats = ppo_policy_loss(
                    logp[:, 0] / norm, logp_old[mb_t] / norm, advantages[mb_t], cfg.clip, cfg.dual_clip
                )
                loss = pl
                stats["policy_loss"] = pl.detach()
                if entropy is not None:
                    loss = loss - cfg.entropy_coef * entropy
                    stats["entropy"] = entropy.detach()
            if not grpo:  # GRPO has no critic
                if cfg.critic == "prefix" and (prefix is None or not cfg.critic_detach):
                    prefix = policy.encode_prefix(obs)
                v = value_fn(obs, prefix)
                vl = value_loss(v, v_old[mb_t], returns[mb_t], cfg.value_clip)
                stats["value_loss"] = vl.detach()
                loss = loss + vl
            actor_opt.zero_grad(set_to_none=True)
            critic_opt.zero_grad(set_to_none=True)
            # one backward: actor and critic own disjoint parameters (a prefix critic with
            # critic_detach=False also trains the trunk, on purpose)
            loss.backward()
            if train_actor:
                torch.nn.utils.clip_grad_norm_(_params(actor_opt), cfg.grad_clip)
                actor_opt.step()
            if not grpo:
                torch.nn.utils.clip_grad_norm_(_params(critic_opt), cfg.grad_clip)
                critic_opt.step()
            for k, val in stats.items():
                sums[k] = sums.get(k, 0.0) + float(val)
            count += 1
            if train_actor and cfg.target_kl is not None and float(stats["approx_kl"]) > cfg.target_kl:
                stop = True
                break
        if stop:
            break
    out = {
        k: sums.get(k, 0.0) / max(count, 1) if k in sums else nan
        for k in ("policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac")
    }
    var = float(returns.var()) if m > 1 else nan
    out["explained_var"] = (
        1.0 - float((returns - v_old).var()) / var if m > 1 and var > 0 and not grpo else nan
    )
    out["noise_std"] = (
        _mean_noise_std(policy, chunks[: cfg.minibatch_size], emb) if cfg.method == "noise" else nan
    )
    out["epochs_run"] = float(_epoch + 1)
    return out


def _params(opt: torch.optim.Optimizer) -> list[Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


@torch.no_grad()
def _mean_noise_std(policy: FlowVLAPolicy, chunks: list[_Chunk], emb: Tensor | None) -> float:
    """Mean learned std over the executed actions of a few stored chains (is exploration collapsing?)."""
    prefix = policy.encode_prefix(_stack_obs([c.obs for c in chunks], emb))
    x = torch.as_tensor(np.stack([c.iterates[0] for c in chunks]), device=policy.device)
    _, hidden = policy.velocity(prefix, x, 0.0, return_hidden=True)
    std = policy.noise_std(hidden)[:, : policy.config.n_exec]
    return float(std.mean())
