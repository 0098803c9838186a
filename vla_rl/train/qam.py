"""QAM: Q-learning with Adjoint Matching (Li & Levine, arXiv 2601.14234), offline and offline-to-online.

One algorithm, one file. Every equation follows ``ColinQiyangLi/qam`` ``agents/qam.py`` as transcribed
in ../shared/reference/algorithms.md section 2 (time convention: t = 0 noise, t = 1 data, as our
policies). Networks on a flow VLA (section 7 checklist):

* **base** v_β: the SFT checkpoint's velocity field. Frozen by default; with ``train_base`` it keeps
  training with the behaviour flow-matching loss L_BC and the adjoint uses its Polyak copy v̄_β (the
  reference's ``target_actor_slow``).
* **fine** v_θ: a trainable copy of the base, trained ONLY by adjoint matching; the deployed policy.
* **critic**: a chunked Q ensemble (:class:`policies.critics.ChunkQEnsemble`) on the *executed*
  sub-chunk a_{t:t+n} (n = ``n_exec`` of the H predicted actions, normalised and clipped), with a Polyak
  target Q̄, trained by n-step TD with a pessimistic ensemble target (mean − ρ·std) and γ^n.

The target policy is π*(a|s) ∝ π_β(a|s)·exp(λ·Q(s, a)), λ = ``inv_temp``. One update:

1. ``L_Q = mean_{m,B} valid·(Q_m(s, a) − y)²``, ``y = R_n + γ^n·bootstrap·(mean_m Q̄_m − ρ std_m Q̄_m)(s', a')``
   with a' ~ fine policy at s' = s_{t+n} (Euler ODE, clipped); with ``value="divl"`` instead
   ``y = R_n + γ^n·bootstrap·V_τ(s')``, V_τ the τ-quantile of a categorical value fitted to the target
   critic at the data's actions (LWD's DIVL, :mod:`vla_rl.train.divl`);
2. ``L_BC``: the base's flow-matching loss (only with ``train_base``);
3. adjoint matching: simulate the fine policy under the memoryless SDE (last step deterministic with
   the base), take the terminal adjoint ``ã_K = −λ ∇_a mean_m Q̄(s, clip(a))`` (zero on the actions
   that are not executed), integrate the *lean* adjoint backward through the base drift only
   (vector-Jacobian products, no backprop through the fine policy), and regress
   ``L_AM = mean_B Σ_i ||(2/σ_i)(v_θ − v̄_β)(x_i, t_i) + σ_i ã_i||²``, i.e.
   ``v_θ → v̄_β − (σ_i²/2)·ã_i``.

Offline: updates on a :class:`~vla_rl.train.transitions.TransitionBuffer` built from the episode store.
Offline-to-online: the same replay seeded with the offline data; the fine policy acts in a
:class:`sim.vector.VectorSimEnv` (each chunk's first ``n_exec`` actions, like deployment, driven by
:class:`sim.rollout.ChunkRollout`) and every finished episode is appended; ``utd`` updates per env step
until an env-step budget is spent. With ``next_action_cache`` (a' looked up from a periodically
re-sampled table), ``actor_every`` (critic-only updates in between) and ``reanchor_every`` (the fine
policy becomes the prior) this is approximate policy iteration at UTD 1 that a CPU can afford; on the
kinematic benchmark it is the recipe that clears +20.

Output folder::

    <out>/checkpoints/last/   the fine policy (lineage algorithm "qam"; loads with policies.loading)
    <out>/train_state.pt      models, optimisers, step, env steps, online episodes (resume)
    <out>/tb/                 TensorBoard (losses, Q statistics, rollout / eval success)
    <out>/curve.json          the learning curve (also returned in QAMResult)
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import logging
import math
import shutil
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

import numpy as np
import torch
from torch import nn
from vla_rl_client.meta import Controller
from vla_rl_client.spec import RobotSpec

from fleet.selection import Selection
from fleet.store import EpisodeStore
from policies.critics import ChunkQEnsemble, pessimistic, polyak_update
from policies.flow_vla import FlowVLAPolicy
from policies.flow_vla.modeling_flow_vla import PrefixCache
from policies.loading import LoadedPolicy, load_policy
from sim.ray_workers import check_ray_address
from sim.rollout import EpisodeRecord, StepRecord
from vla_rl.core.seeds import ONLINE
from vla_rl.train.base import StepProgress, TrainerConfig, TrainResult
from vla_rl.train.common import (
    TRAIN_STATE,
    RunClock,
    batch_to_policy_inputs,
    config_dict,
    instruction_table,
    load_train_state,
    sample_indices,
    save_derived_checkpoint,
    save_train_state,
    seed_step,
)
from vla_rl.train.distributed import (
    SINGLE,
    Dist,
    Shard,
    agree,
    all_reduce_grads,
    broadcast_module,
    broadcast_object,
    distributed,
    mean_scalars,
    summary_writer,
)
from vla_rl.train.divl import DIVLConfig, DIVLValue, divl_support, divl_td_target
from vla_rl.train.transitions import (
    REWARD_KINDS,
    RewardKind,
    TransitionBuffer,
    load_transitions,
    next_observation,
)

log = logging.getLogger(__name__)
Tensor = torch.Tensor
VelocityFn = Callable[[Tensor, float], Tensor]
FeatureMode = Literal["auto", "state", "trunk"]

__all__ = [
    "QAMConfig",
    "QAMResult",
    "adjoint_matching_loss",
    "am_velocity_target",
    "critic_td_target",
    "lean_adjoint",
    "memoryless_sigma",
    "replay_indices",
    "simulate_fine_sde",
    "terminal_adjoint",
    "train_qam",
]


# ============================================================================ pure pieces
def memoryless_sigma(num_steps: int, device: torch.device | None = None) -> Tensor:
    """QAM's memoryless noise ``σ_i = sqrt(2 (1 − t_i + h) / (t_i + h))``, ``t_i = i / K``, ``h = 1 / K``.

    ``[K]`` float32. The shift by h (in numerator and denominator) avoids the t = 0 singularity; it is
    not :class:`policies.flow_vla.sampling.SDESchedule`'s clamp, so QAM keeps its own formula.
    """
    if num_steps < 2:
        raise ValueError(f"flow_steps: expected >= 2, got {num_steps}")
    h = 1.0 / num_steps
    t = torch.arange(num_steps, dtype=torch.float32, device=device) * h
    return torch.sqrt(2.0 * (1.0 - t + h) / (t + h))


@torch.no_grad()
def simulate_fine_sde(
    fine_v: VelocityFn, base_v: VelocityFn, x0: Tensor, num_steps: int, step_noise: Tensor
) -> Tensor:
    """Iterates ``[B, K + 1, ...]`` of the fine policy under the memoryless SDE (no gradients).

    ``x_{i+1} = x_i + h [2 v_θ(x_i, t_i) − x_i / (t_i + h)] + sqrt(h) σ_i ε_i`` for i < K − 1, and a
    deterministic last step with the base, ``x_K = x_{K−1} + h v̄_β(x_{K−1}, t_{K−1})``.
    ``step_noise`` ``[B, K − 1, ...]`` holds the standard normals ε_i.
    """
    k, h = num_steps, 1.0 / num_steps
    if step_noise.shape != (x0.shape[0], k - 1, *x0.shape[1:]):
        raise ValueError(
            f"step_noise: expected {[x0.shape[0], k - 1, *x0.shape[1:]]}, got {list(step_noise.shape)}"
        )
    sigma = memoryless_sigma(k, x0.device).tolist()
    xs = [x0]
    x = x0
    for i in range(k - 1):
        t = i * h
        drift = 2.0 * fine_v(x, t) - x / (t + h)
        x = x + h * drift + math.sqrt(h) * sigma[i] * step_noise[:, i]
        xs.append(x)
    xs.append(x + h * base_v(x, (k - 1) * h))
    return torch.stack(xs, 1)


def terminal_adjoint(
    q_fn: Callable[[Tensor], Tensor],
    x_final: Tensor,
    n_exec: int,
    inv_temp: float,
    clip: bool = True,
    rho: float = 0.0,
) -> Tensor:
    """``ã_K = −λ ∇_a (mean_m − ρ·std_m) Q̄(s, clip(a))`` at the final iterate ``x_final`` ``[B, H, A]``.

    ``q_fn(chunk [B, n_exec, A]) -> [M, B]`` scores the executed sub-chunk only, so the gradient is
    zero on the H − n_exec actions that are never executed (and, through the clip, on elements outside
    [−1, 1]). Summing Q over the batch gives each row its own gradient.
    """
    with torch.enable_grad():
        a = x_final.detach().requires_grad_(True)
        exec_part = a[:, :n_exec]
        if clip:
            exec_part = exec_part.clamp(-1.0, 1.0)
        q = pessimistic(q_fn(exec_part), rho).sum() if rho else q_fn(exec_part).mean(0).sum()
        (grad,) = torch.autograd.grad(q, a)
    return -inv_temp * grad


def lean_adjoint(base_v: VelocityFn, iterates: Tensor, terminal: Tensor, num_steps: int) -> Tensor:
    """Lean adjoint ``[B, K + 1, ...]`` integrated backward through the base drift only.

    ``b(x, t) = 2 v̄_β(x, t + h) − x / (t + h)`` (the reference evaluates v̄_β at t_i + h) and
    ``ã_i = ã_{i+1} + h [∂b/∂x (x_i, t_i)]ᵀ ã_{i+1}`` for i = K − 1 .. 0, from ``ã_K = terminal``.
    Each step is one vector-Jacobian product through ``base_v`` w.r.t. x (parameters get no gradient).
    """
    k, h = num_steps, 1.0 / num_steps
    adj = [terminal.detach()]
    a = terminal.detach()
    for i in range(k - 1, -1, -1):
        t = i * h
        with torch.enable_grad():
            x = iterates[:, i].detach().requires_grad_(True)
            v = base_v(x, t + h)
            (vjp_v,) = torch.autograd.grad(v, x, grad_outputs=a)
        a = a + h * (2.0 * vjp_v - a / (t + h))
        adj.append(a.detach())
    return torch.stack(adj[::-1], 1)


def am_velocity_target(v_base: Tensor, adjoint: Tensor, sigma: Tensor) -> Tensor:
    """What adjoint matching regresses v_θ to: ``v̄_β − (σ_i² / 2) ã_i`` (``[B, K, ...]``, σ ``[K]``)."""
    s = sigma.view(1, -1, *([1] * (v_base.ndim - 2)))
    return v_base - 0.5 * s.square() * adjoint


def adjoint_matching_loss(v_fine: Tensor, v_base: Tensor, adjoint: Tensor, sigma: Tensor) -> Tensor:
    """``mean_B Σ_i Σ_dims ((2/σ_i)(v_θ − v̄_β) + σ_i ã_i)²`` over ``[B, K, ...]`` tensors, σ ``[K]``."""
    s = sigma.view(1, -1, *([1] * (v_fine.ndim - 2)))
    residual = (2.0 / s) * (v_fine - v_base) + s * adjoint
    return residual.square().flatten(1).sum(1).mean()


def critic_td_target(
    q_next: Tensor, reward_n: Tensor, bootstrap: Tensor, gamma: float, n_step: int, rho: float
) -> Tensor:
    """``y = R_n + γ^n · bootstrap · (mean_m Q̄ − ρ std_m Q̄)`` from target-ensemble values ``[M, B]``."""
    return reward_n + (gamma**n_step) * bootstrap * pessimistic(q_next, rho)


def critic_loss(q: Tensor, target: Tensor, valid: Tensor) -> Tensor:
    """``mean_{m,B} valid · (Q_m − y)²`` (the reference's plain mean, invalid rows count as zeros)."""
    return (valid[None] * (q - target[None]).square()).mean()


# ============================================================================ config
@dataclass(kw_only=True)
class QAMConfig(TrainerConfig):
    """Every knob of a QAM run (offline, then optionally online). Defaults follow the reference where it
    applies to a VLA; CPU-friendly budgets are named presets (:mod:`vla_rl.train.presets`)."""

    algorithm: ClassVar[str] = "qam"
    distributed: ClassVar[bool] = True

    store: Path = field()
    """Episode store holding the offline data (demos, earlier rollouts)."""

    # ---- RL problem
    reward: RewardKind = "steps_to_go"
    """Reward relabelling: 'steps_to_go' (−1/T per step; our form of OGBench's −1·[not success]),
    'sparse' (1 on success), 'dense' (the simulator's shaped reward) or 'shaped' (success plus
    potential-based shaping). How they compared: docs/experiment-log.md."""
    gamma: float = 0.99
    """Per-step discount; the chunked TD uses γ^n_exec."""

    # ---- QAM
    inv_temp: float = 10.0
    """λ: target π* ∝ π_β·exp(λ Q). Scales the terminal adjoint; the knob that matters most. With
    steps_to_go rewards Q lives in about [−2, 0] (OGBench's −1 per step gives [−100, 0]), so our λ
    reads ~50x stronger than the reference's 1–30. Too large a λ destroys the policy; the sweep is in
    docs/experiment-log.md."""
    rho: float = 0.5
    """Ensemble pessimism in the TD target: mean − ρ·std over members."""
    actor_rho: float = 0.0
    """Ensemble pessimism in the actor's objective (the terminal adjoint follows ∇(mean − ρ·std) Q̄):
    steers the fine policy away from actions the members disagree on. 0 = the reference (mean Q).
    See docs/experiment-log.md."""
    members: int = 10
    """Critic ensemble size M."""
    critic_hidden: tuple[int, ...] = (512, 512, 512, 512)
    """Critic MLP widths (reference 4×512 with LayerNorm)."""
    tau: float = 0.005
    """Polyak rate of the target critic (and of the target base with train_base)."""
    flow_steps: int = 10
    """K: denoising steps for the SDE simulation, the adjoint and TD-target sampling. The saved fine
    policy's num_inference_steps is set to K (it is trained on that grid). Fewer (5) is faster on CPU."""
    clip_actions: bool = True
    """Clip normalised actions to [−1, 1] before Q (min-max normalisation only: the data's range)."""
    train_base: bool = False
    """Keep training the behaviour flow with L_BC and use its Polyak copy as the adjoint's base (the
    reference). False freezes the SFT policy as the base (cheaper; the prior never drifts)."""
    value: Literal["policy", "divl"] = "policy"
    """The TD target's bootstrap: 'policy' = the target critic at the fine policy's next chunk (the
    reference); 'divl' = LWD's distributional implicit value V_τ(s') (a categorical value trained by
    cross-entropy on the target critic at the data's actions, read out at ``divl_quantile``;
    vla_rl/train/divl.py): in-sample, and no fine-policy sampling per TD target."""
    divl_quantile: float = 0.7
    """value="divl": τ of the read-out V_τ(s) = Quant_τ(p(Q̄(s, a_data) | s)); > 0.5 leans optimistic."""
    value_bins: int = 51
    """value="divl": atoms of the categorical value (spanning the data's return range, widened 10%)."""
    value_hidden: tuple[int, ...] = (256, 256)
    """value="divl": the value MLP's widths (LayerNorm, as the critic)."""
    feature_mode: FeatureMode = "auto"
    """Critic input: 'state' = normalised state; 'trunk' = the frozen base's mean-pooled trunk tokens
    (needed with cameras; they include the instruction); 'auto' = trunk when the policy has cameras or
    is language-conditioned on data with several instructions (a state critic cannot tell tasks apart),
    else state."""

    # ---- optimisation
    batch_size: int = 256
    critic_lr: float = 3e-4
    actor_lr: float = 3e-5
    """Fine-policy learning rate (lower than the reference's 3e-4: the fine policy starts pretrained)."""
    base_lr: float = 3e-5
    """Behaviour-flow learning rate (train_base only)."""
    grad_clip: float = 1.0
    """Global-norm clip, applied to each module's gradients separately so a large L_AM never shrinks
    the critic's step."""
    critic_warmup: int = 2000
    """Updates at the start during which only the critic learns: the actor follows ∇_a Q from its
    first update, so it must wait for a trained critic (see docs/experiment-log.md)."""
    critic_mc_steps: int = 1000
    """The first this-many updates regress Q(s, a_data) on the data's Monte-Carlo return instead of
    the TD target (the target critic follows exactly). TD with Polyak targets needs ~1/τ updates per
    chunk of horizon to propagate a sparse outcome, and a TD update samples the fine policy K times; an
    MC update is ~40x cheaper and starts Q at the behaviour policy's value. Counted in offline_steps
    and in critic_warmup (the actor never trains on an MC-only critic)."""

    actor_every: int = 1
    """After the warm-up, the actor (adjoint matching) trains on every this-many-th update and the
    others are critic-only (TD3's policy delay). 1 = every update (the reference). With ``utd`` 1
    online it keeps the actor's update count, and cost, where the CPU can afford it while the critic
    gets one update per env step."""
    next_action_cache: int = 0
    """> 0: sample the TD target's next chunks a' ~ fine(s') for every replay frame at once, refresh
    that table every this many updates (frames appended since are sampled when they arrive) and look
    a' up, instead of K Euler steps per batch (0, the reference). The critic then evaluates a snapshot of
    the fine policy at most this many updates old (approximate policy iteration), and a critic-only
    update no longer samples the fine policy, which is what makes a high online ``utd`` affordable
    without a GPU (measurements: docs/experiment-log.md)."""

    # ---- schedule
    offline_steps: int = 3000
    """Gradient updates on the offline data before going online (critic-only warm-up included)."""
    env_steps: int = 0
    """Online budget in environment steps (all envs together); 0 = offline only."""
    utd: float = 1.0
    """Gradient updates per environment step during the online phase."""
    offline_fraction: float | None = None
    """Online phase: the share of each batch drawn from the offline data (the rest from online episodes),
    RLPD's symmetric sampling at 0.5. None = uniform over the whole replay (the reference's default,
    ``balanced_sampling = False``): after a few thousand env steps almost every sample is on-policy."""
    start_online_after: int = 0
    """Online env steps collected before online updates start (reference: 5000)."""
    reanchor_every: int = 0
    """Online phase: make the fine policy the prior (copy it into the base, and the base's target) at
    the first online update and again every this many online updates; 0 = keep the SFT prior (the
    reference). Why: adjoint matching regresses v_θ to v̄_β − (σ²/2)·ã, so once on-policy TD flattens
    ∇_a Q the fine policy slides back to the base and loses its offline gain. Re-anchored, the target
    is π_fine·exp(λQ): a trust-region policy iteration around what was learned (measurements:
    docs/experiment-log.md). The reference instead trains the behaviour flow on the replay (``train_base``).
    Online updates are counted from ``offline_steps``."""
    num_envs: int = 2
    """Simulator processes for online rollouts."""
    ray: str | None = None
    """Run the online rollouts' simulators (and evaluations) as Ray actors: 'auto' (this machine's Ray
    cluster, or a local head on 127.0.0.1) or a cluster address host:port; None = local processes. The
    same seeds give the same rollouts; a dead actor is replaced and its episode re-run (docs/sim.md)."""
    online_seed: int = ONLINE
    """First episode seed of online rollouts; every evaluation range stays below it (:mod:`vla_rl.core.seeds`)."""
    max_episode_steps: int | None = None
    """Online episode length limit; None = the task's."""

    # ---- bookkeeping
    eval_every: int = 0
    """Evaluate the fine policy every this many updates (0 = only if final_eval_episodes)."""
    eval_every_episodes: int = 10
    """Episodes of each periodic evaluation (``eval_every``)."""
    final_eval_episodes: int = 0
    """Episodes of a final evaluation recorded in the metrics (0 = none)."""
    checkpoint_every: int = 1000
    resume: bool = True
    """Continue from <out>/train_state.pt when it exists (exact in the offline phase)."""
    init_from: Path | None = None
    """Start from another QAM run's output folder (its train_state.pt): critic, fine policy, prior,
    optimisers, step and env-step counters and online episodes, as if resuming it into ``out`` (budgets
    are totals, so offline_steps = the source's step goes straight online). Ignored once ``out`` has a
    train state of its own (a preempted run resumes from that). Use it to go online from a checked
    offline run, or with ``init_reset_actor`` to re-extract."""
    init_reset_actor: bool = False
    """With init_from: restart the fine policy (and the prior) from ``base`` next to the loaded critic,
    with a fresh actor optimiser ("re-extraction"; see docs/experiment-log.md)."""
    stop_at: int | None = None
    """Stop after this many updates, as a preempted job would (tests of resume)."""
    max_seconds: float | None = None
    """Wall-clock budget: stop updating (offline or online) once this many seconds have passed and
    finish normally (save, final evaluation). For time-boxed jobs; the metrics say how many updates ran."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.init_from is not None:
            self.init_from = Path(self.init_from)
        if self.init_reset_actor and self.init_from is None:
            raise ValueError("init_reset_actor: needs init_from (the run whose critic to keep)")
        self.critic_hidden = tuple(int(h) for h in self.critic_hidden)
        self.value_hidden = tuple(int(h) for h in self.value_hidden)
        if self.value not in ("policy", "divl"):
            raise ValueError(f"value: expected policy or divl, got {self.value!r}")
        DIVLConfig(quantile=self.divl_quantile, bins=self.value_bins)  # validates divl_quantile, value_bins
        if self.value == "divl" and self.next_action_cache:
            raise ValueError(
                "next_action_cache: value='divl' bootstraps from V(s') and samples no next action; set it to 0"
            )
        self.ray = check_ray_address(self.ray)
        for name in (
            "members",
            "flow_steps",
            "batch_size",
            "checkpoint_every",
            "num_envs",
            "actor_every",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)}")
        if self.flow_steps < 2:
            raise ValueError(
                f"flow_steps: expected >= 2 (the last step is the base's), got {self.flow_steps}"
            )
        for name in (
            "offline_steps",
            "env_steps",
            "start_online_after",
            "eval_every",
            "critic_warmup",
            "critic_mc_steps",
            "reanchor_every",
            "next_action_cache",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected >= 0, got {getattr(self, name)}")
        if self.offline_steps == 0 and self.env_steps == 0:
            raise ValueError("offline_steps/env_steps: at least one must be > 0")
        if self.env_steps == 0 and max(self.critic_warmup, self.critic_mc_steps) >= self.offline_steps:
            raise ValueError(
                f"critic_warmup: the actor would never train (critic-only updates "
                f"{max(self.critic_warmup, self.critic_mc_steps)} >= offline_steps {self.offline_steps} "
                "and env_steps 0); raise offline_steps or lower critic_warmup/critic_mc_steps"
            )
        if self.reward not in REWARD_KINDS:
            raise ValueError(f"reward: expected one of {list(REWARD_KINDS)}, got {self.reward!r}")
        if not 0.0 < self.gamma <= 1.0:
            raise ValueError(f"gamma: expected in (0, 1], got {self.gamma}")
        if self.inv_temp < 0:
            raise ValueError(f"inv_temp: expected >= 0, got {self.inv_temp}")
        for name in ("rho", "actor_rho"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected >= 0, got {getattr(self, name)}")
        if not 0.0 < self.tau <= 1.0:
            raise ValueError(f"tau: expected in (0, 1], got {self.tau}")
        if self.utd <= 0:
            raise ValueError(f"utd: expected > 0, got {self.utd}")
        if self.offline_fraction is not None and not 0.0 <= self.offline_fraction <= 1.0:
            raise ValueError(f"offline_fraction: expected in [0, 1] or None, got {self.offline_fraction}")
        for name in ("critic_lr", "actor_lr", "base_lr", "grad_clip"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected > 0, got {getattr(self, name)}")
        if self.feature_mode not in get_args(FeatureMode):
            raise ValueError(f"feature_mode: expected auto|state|trunk, got {self.feature_mode!r}")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise ValueError(f"max_seconds: expected > 0 or None, got {self.max_seconds}")
        if self.eval_every_episodes < 1 or self.final_eval_episodes < 0:
            raise ValueError("eval_every_episodes: expected >= 1 and final_eval_episodes >= 0")

    def collection_seeds(self) -> range:
        """A superset of the online episode seeds: robot i's j-th episode is ``online_seed + i + j N``
        and every episode takes at least one env step."""
        return range(self.online_seed, self.online_seed + self.env_steps + self.num_envs)


@dataclass(kw_only=True)
class QAMResult(TrainResult):
    steps: int
    """Gradient updates in all (offline + online)."""
    env_steps: int


# ============================================================================ the learner
class ChunkCriticInputs:
    """What a chunked critic reads, shared by :class:`QAMLearner` and ``fql.FQLLearner``: needs ``base``
    (its normaliser), ``feature_net`` (the frozen trunk, or None: the state), ``clip`` and ``n_exec``."""

    base: FlowVLAPolicy
    feature_net: FlowVLAPolicy | None
    clip: bool
    n_exec: int

    def clip_norm(self, a: Tensor) -> Tensor:
        return a.clamp(-1.0, 1.0) if self.clip else a

    @torch.no_grad()
    def features(self, obs: Mapping[str, Any]) -> Tensor:
        if self.feature_net is not None:
            return self.feature_net.encode_prefix(obs).pooled()
        return self.base.normalizer.normalize_state(obs["state"].float())

    def dataset_chunk(self, actions: Tensor) -> Tensor:
        """Env-unit ``[B, H, A]`` -> the normalised, clipped executed part ``[B, n_exec, A]``."""
        return self.clip_norm(self.base.normalizer.normalize_action(actions.float()))[:, : self.n_exec]


class QAMLearner(ChunkCriticInputs, nn.Module):
    """Base (behaviour) flow, its target, the fine flow, the critic ensemble and its target."""

    def __init__(
        self,
        base: FlowVLAPolicy,
        cfg: QAMConfig,
        value_support: tuple[float, float] = (-1.0, 0.0),
        instructions: int = 1,
    ) -> None:
        """``value_support``: the DIVL value's atom range (``value="divl"``; see :func:`divl_support`);
        ``instructions``: how many distinct instructions the data holds (``feature_mode="auto"``)."""
        super().__init__()
        pc = base.config
        self.cfg = cfg
        self.n_exec, self.horizon, self.action_dim = pc.n_exec, pc.chunk_len, pc.action_dim
        self.clip = cfg.clip_actions and pc.action_norm == "min_max"
        mode = cfg.feature_mode
        if mode == "auto":
            mode = "trunk" if pc.cameras or (pc.uses_instruction and instructions > 1) else "state"
        if mode == "state" and pc.state_dim == 0:
            raise ValueError("feature_mode: 'state' needs a policy with a state input; use 'trunk'")
        self.feature_mode = mode
        self.base = base
        self.base.requires_grad_(cfg.train_base)
        # The adjoint's base: a Polyak copy when the base trains, else the frozen base itself.
        self.base_target = copy.deepcopy(base).requires_grad_(False) if cfg.train_base else None
        # The critic's feature net: a frozen snapshot of the pretrained trunk (features never drift).
        self.feature_net = copy.deepcopy(base).requires_grad_(False) if mode == "trunk" else None
        self.fine = copy.deepcopy(base).requires_grad_(True)
        self.fine.config.num_inference_steps = cfg.flow_steps
        feature_dim = pc.state_dim if mode == "state" else pc.d_model
        self.critic = ChunkQEnsemble(
            feature_dim, self.n_exec * self.action_dim, cfg.members, cfg.critic_hidden
        )
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        self.value_head: DIVLValue | None = None
        if cfg.value == "divl":
            divl = DIVLConfig(quantile=cfg.divl_quantile, bins=cfg.value_bins)
            self.value_head = DIVLValue(feature_dim, divl, *value_support, cfg.value_hidden)

    @property
    def adjoint_base(self) -> FlowVLAPolicy:
        return self.base_target if self.base_target is not None else self.base

    @torch.no_grad()
    def reanchor(self) -> None:
        """The fine policy becomes the prior: copy its weights into the base (and the base's target)."""
        fine = self.fine.state_dict()
        self.base.load_state_dict(fine)
        if self.base_target is not None:
            self.base_target.load_state_dict(fine)

    @torch.no_grad()
    def sample_fine(self, obs_or_prefix: Mapping[str, Any] | PrefixCache, noise: Tensor) -> Tensor:
        """Normalised, clipped chunks ``[B, H, A]`` from the fine policy (Euler ODE, K steps)."""
        s = self.fine.sample(obs_or_prefix, method="ode", num_steps=self.cfg.flow_steps, noise=noise[:, None])
        return self.clip_norm(s.actions[:, 0])

    @torch.no_grad()
    def q_gain(self, obs: Mapping[str, Any], shard: Shard | None = None) -> Tensor:
        """Diagnostic: mean Q̄(s, fine chunk) − Q̄(s, base chunk), both ODE samples from the same noise.
        Positive means adjoint matching moved the fine policy uphill on the critic. ``shard``: the
        rank's rows of a global batch (noise drawn for all of it; None = one process, ``obs`` is all)."""
        shard = shard or Shard(SINGLE, obs["state"].shape[0])
        noise = shard.randn(self.horizon, self.action_dim, device=obs["state"].device)
        base = self.adjoint_base.sample(
            obs, method="ode", num_steps=self.cfg.flow_steps, noise=noise[:, None]
        )
        a_base = self.clip_norm(base.actions[:, 0])
        a_fine = self.sample_fine(obs, noise)
        feats = self.features(obs)
        q_fine = self.critic_target(feats, a_fine[:, : self.n_exec]).mean(0)
        q_base = self.critic_target(feats, a_base[:, : self.n_exec]).mean(0)
        return (q_fine - q_base).mean()

    # ------------------------------------------------------------------ losses
    def value_loss(self, feats: Tensor, chunk: Tensor, valid: Tensor) -> dict[str, Tensor]:
        """DIVL (LWD Eq. 12): cross-entropy of V's distribution to ``mean_m Q̄_m(s, a_data)``, valid rows
        (empty without a value head)."""
        if self.value_head is None:
            return {}
        with torch.no_grad():
            q_data = self.critic_target(feats, chunk).mean(0)
        return {"loss_v": self.value_head.loss(feats, q_data, valid)}

    def mc_losses(self, batch: Mapping[str, Any]) -> dict[str, Tensor]:
        """Critic warm start: ``mean_{m,B} valid·(Q_m(s, a_data) − G_MC)²`` (and the DIVL value's loss)."""
        feats, chunk = self.features(batch), self.dataset_chunk(batch["action"])
        q = self.critic(feats, chunk)
        y = batch["mc_return"]
        return {
            "loss_q": critic_loss(q, y, batch["valid"]),
            "q_mean": q.mean().detach(),
            "target_mean": y.mean().detach(),
            **self.value_loss(feats, chunk, batch["valid"]),
        }

    def losses(
        self,
        batch: Mapping[str, Any],
        next_obs: Mapping[str, Any],
        train_actor: bool,
        next_chunk: Tensor | None = None,
        shard: Shard | None = None,
    ) -> dict[str, Tensor]:
        """All losses of one update. ``next_chunk``: the TD target's a' at ``next_obs`` (normalised,
        clipped, ``[B, H, A]``) when the caller has it (``next_action_cache``); else sampled here.
        ``shard``: under torchrun, which rows of the global batch ``batch`` holds (every noise tensor is
        drawn for the global batch and sliced, as :mod:`vla_rl.train.distributed` explains); None = one
        process, ``batch`` is the whole batch."""
        cfg, k = self.cfg, self.cfg.flow_steps
        b = batch["state"].shape[0]
        shard = shard or Shard(SINGLE, b)
        event = (self.horizon, self.action_dim)
        out: dict[str, Tensor] = {}

        # ---- critic: chunked n-step TD with a pessimistic target ensemble
        feats = self.features(batch)
        with torch.no_grad():
            if self.value_head is not None:  # DIVL: in-sample, no next action
                v_next = self.value_head(self.features(next_obs))
                y = divl_td_target(v_next, batch["reward_n"], batch["bootstrap"], cfg.gamma, self.n_exec)
            else:
                a_next = next_chunk
                if a_next is None:
                    a_next = self.sample_fine(next_obs, shard.randn(*event, device=feats.device))
                q_next = self.critic_target(self.features(next_obs), a_next[:, : self.n_exec])
                y = critic_td_target(
                    q_next, batch["reward_n"], batch["bootstrap"], cfg.gamma, self.n_exec, cfg.rho
                )
        chunk = self.dataset_chunk(batch["action"])
        q = self.critic(feats, chunk)
        out.update(self.value_loss(feats, chunk, batch["valid"]))
        out["loss_q"] = critic_loss(q, y, batch["valid"])
        out["q_mean"] = q.mean().detach()
        out["target_mean"] = y.mean().detach()

        # ---- behaviour flow (only when the base keeps training)
        if cfg.train_base:
            bc_noise = shard.randn(*event, device=feats.device)
            bc_time = shard.take(self.base.sample_time(shard.global_batch))
            out["loss_bc"], _ = self.base.flow_matching_loss(batch, noise=bc_noise, time=bc_time)

        # ---- adjoint matching for the fine policy
        if train_actor:
            fine_prefix = self.fine.encode_prefix(batch)
            with torch.no_grad():
                base_prefix = self.adjoint_base.encode_prefix(batch)

            def fine_v(x: Tensor, t: float) -> Tensor:
                return self.fine.velocity(fine_prefix, x, t)

            def base_v(x: Tensor, t: float) -> Tensor:
                return self.adjoint_base.velocity(base_prefix, x, t)

            x0 = shard.randn(*event, device=feats.device)
            eps = shard.randn(k - 1, *event, device=feats.device)
            iterates = simulate_fine_sde(fine_v, base_v, x0, k, eps)

            def q_fn(chunk: Tensor) -> Tensor:
                return self.critic_target(feats, chunk)

            adj_k = terminal_adjoint(
                q_fn, iterates[:, -1], self.n_exec, cfg.inv_temp, self.clip, cfg.actor_rho
            )
            adj = lean_adjoint(base_v, iterates, adj_k, k)[:, :k]
            xs = iterates[:, :k].reshape(b * k, *event)
            ts = (torch.arange(k, device=xs.device, dtype=xs.dtype) / k).repeat(b)
            with torch.no_grad():
                v_base = self.adjoint_base.velocity(base_prefix, xs, ts).reshape(b, k, *event)
            v_fine = self.fine.velocity(fine_prefix, xs, ts).reshape(b, k, *event)
            sigma = memoryless_sigma(k, xs.device)
            out["loss_am"] = adjoint_matching_loss(v_fine, v_base, adj, sigma)
            out["adjoint_norm"] = adj_k.flatten(1).norm(dim=1).mean().detach()
            out["final_action_abs"] = iterates[:, -1, : self.n_exec].abs().mean().detach()
        return out


# ============================================================================ online rollouts
class _Rollouts:
    """Fine-policy episodes in a VectorSimEnv (:class:`sim.rollout.ChunkRollout`, ``n_exec`` actions per
    chunk), appended to the replay buffer and to ``episodes`` as they finish."""

    def __init__(
        self,
        learner: QAMLearner,
        spec: RobotSpec,
        cfg: QAMConfig,
        instruction_emb: Tensor | None,
        buffer: TransitionBuffer,
        episodes: list[dict[str, np.ndarray]],
    ) -> None:
        from sim.rollout import ChunkRollout
        from sim.vector import VectorSimEnv

        self.learner, self.cfg, self.spec = learner, cfg, spec
        self.buffer, self.episodes = buffer, episodes
        self.env = VectorSimEnv(
            spec.name,
            num_envs=cfg.num_envs,
            seed=cfg.online_seed,
            obs="rgb" if spec.cameras else "state",  # type: ignore[arg-type]
            image_size=spec.cameras[0].height if spec.cameras else 128,
            max_episode_steps=cfg.max_episode_steps,
            ray=cfg.ray,
        )
        self.instruction_emb = instruction_emb
        self.frames: list[dict[str, list[Any]]] = [self._empty() for _ in range(cfg.num_envs)]
        self.gen = torch.Generator().manual_seed(cfg.seed * 7919 + 17)
        self.successes: deque[bool] = deque(maxlen=20)
        self.rollout = ChunkRollout(
            self.env,
            self._propose,
            learner.n_exec,
            reward_key="dense_reward",
            on_step=self._record_step,
            on_episode=self._episode_ended,
        )

    @staticmethod
    def _empty() -> dict[str, list[Any]]:
        return {"state": [], "action": [], "reward": [], "terminated": [], "cameras": []}

    @torch.no_grad()
    def _propose(self, robots: list[int], obs: Mapping[str, Any]) -> np.ndarray:
        """Env-unit chunks ``[len(robots), H, A]`` from the fine policy (ODE, noise from ``self.gen``)."""
        lr, device = self.learner, self.learner.base.device
        inputs = {
            "state": torch.as_tensor(obs["state"], device=device),
            "cameras": {k: torch.as_tensor(v, device=device) for k, v in obs["cameras"].items()},
        }
        if self.instruction_emb is not None:
            inputs["instruction_embedding"] = self.instruction_emb.expand(len(robots), -1)
        noise = torch.randn(len(robots), lr.horizon, lr.action_dim, generator=self.gen).to(device)
        lr.fine.eval()
        chunks = lr.base.normalizer.unnormalize_action(lr.sample_fine(inputs, noise)).cpu().numpy()
        lr.fine.train()
        return chunks

    def _record_step(self, step: StepRecord) -> None:
        for i, f in enumerate(self.frames):
            f["state"].append(step.obs["state"][i])
            f["action"].append(step.actions[i])
            if self.spec.cameras:
                f["cameras"].append({k: v[i] for k, v in step.obs["cameras"].items()})
            f["reward"].append(float(step.info["dense_reward"][i]))
            f["terminated"].append(bool(step.terminated[i]))

    def _episode_ended(self, end: EpisodeRecord) -> None:
        f = self.frames[end.robot]
        ep = {
            "state": np.stack(f["state"]).astype(np.float32),
            "action": np.stack(f["action"]).astype(np.float32),
            "reward": np.asarray(f["reward"], np.float32),
            "terminated": np.asarray(f["terminated"], bool),
            "controller": np.full(len(f["state"]), int(Controller.POLICY), np.int64),
            "success": np.asarray(end.success),
        }
        for name in self.spec.camera_names if f["cameras"] else ():
            ep[f"camera.{name}"] = np.stack([c[name] for c in f["cameras"]])
        _add_episode(self.buffer, ep)
        self.episodes.append(ep)
        self.successes.append(end.success)
        self.frames[end.robot] = self._empty()

    def step(self) -> None:
        """One vector step of every robot."""
        self.rollout.step()

    def close(self) -> None:
        self.env.close()


class _NextActionCache:
    """The fine policy's chunk at every replay frame, for the TD target (``next_action_cache``).

    The table is re-sampled on a fixed grid of updates (``step // refresh``); frames appended since are
    sampled when they are first looked up. A resumed run re-samples at its resume step (not saved).
    """

    def __init__(
        self,
        learner: QAMLearner,
        buffer: TransitionBuffer,
        cfg: QAMConfig,
        instructions: Tensor | None,
        device: torch.device,
    ) -> None:
        self.learner, self.buffer, self.device = learner, buffer, device
        self.refresh, self.seed = cfg.next_action_cache, cfg.seed
        self.instructions = instructions  # embeddings of buffer.instructions (each row its own)
        self.table: Tensor | None = None
        self.epoch = -1

    def lookup(self, rows: Tensor, step: int) -> Tensor:
        """Normalised, clipped chunks ``[B, H, A]`` at buffer ``rows``."""
        n = len(self.buffer)
        if self.table is None or step // self.refresh != self.epoch:
            self.epoch = step // self.refresh
            self.table = self._sample(0, n)
        elif len(self.table) < n:
            self.table = torch.cat([self.table, self._sample(len(self.table), n)])
        return self.table[rows.to(self.table.device)]

    @torch.no_grad()
    def _sample(self, lo: int, hi: int, chunk: int = 1024) -> Tensor:
        lr = self.learner
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch * 7919 + lo)
        parts = []
        for start in range(lo, hi, chunk):
            rows = np.arange(start, min(start + chunk, hi))
            obs = batch_to_policy_inputs(
                self.buffer.batch(rows, lr.horizon, lr.n_exec), self.device, self.instructions
            )
            noise = torch.randn(len(rows), lr.horizon, lr.action_dim, generator=gen).to(self.device)
            parts.append(lr.sample_fine(obs, noise))
        return torch.cat(parts)  # lookup only samples non-empty ranges


def replay_indices(n: int, offline_frames: int, cfg: QAMConfig, step: int) -> np.ndarray:
    """Batch indices into a replay whose first ``offline_frames`` frames are the offline data: uniform,
    or ``cfg.offline_fraction`` of them from the offline part once online frames exist."""
    if cfg.offline_fraction is None or n <= offline_frames or offline_frames == 0:
        return sample_indices(n, cfg.batch_size, cfg.seed, step)
    rng = np.random.default_rng([cfg.seed, step])
    k = round(cfg.offline_fraction * cfg.batch_size)
    return np.concatenate(
        [rng.integers(0, offline_frames, size=k), rng.integers(offline_frames, n, size=cfg.batch_size - k)]
    )


def _adapt_init_state(
    st: dict[str, Any], learner: QAMLearner, opt_base: torch.optim.Optimizer | None, *, reset_actor: bool
) -> None:
    """Fit another run's train state to this learner, in place: with ``reset_actor`` the fine policy and
    the prior restart from this run's base (fresh actor optimiser); a prior's Polyak copy and optimiser
    the source did not train (``train_base`` off there, on here) start from its prior."""
    weights, base = st["learner"], learner.base.state_dict()
    if reset_actor:
        for k, v in base.items():
            weights["base." + k] = v.detach().clone()
            weights["fine." + k] = v.detach().clone()
        st["opt_actor"] = {"state": {}, "param_groups": st["opt_actor"]["param_groups"]}
    if learner.base_target is not None:
        for k in base:
            if reset_actor or "base_target." + k not in weights:
                weights["base_target." + k] = weights["base." + k].clone()
    else:
        for k in [k for k in weights if k.startswith("base_target.")]:
            del weights[k]
    if opt_base is not None and (reset_actor or not st.get("opt_base")):
        st["opt_base"] = opt_base.state_dict()


def _add_episode(buffer: TransitionBuffer, ep: Mapping[str, np.ndarray]) -> None:
    cams = {k[len("camera.") :]: v for k, v in ep.items() if k.startswith("camera.")}
    buffer.add_episode(
        state=ep["state"],
        action=ep["action"],
        reward=ep["reward"],
        terminated=ep["terminated"],
        controller=ep["controller"],
        success=bool(ep["success"]),
        cameras=cams or None,
    )


class _EvalView:
    """The fine policy as a ChunkPolicy for :func:`vla_rl.evaluation.evaluate` (K = flow_steps)."""

    def __init__(self, learner: QAMLearner, loaded: LoadedPolicy) -> None:
        self._lp = LoadedPolicy(
            policy=learner.fine, info=loaded.info, path=loaded.path, commit="training", ref=loaded.ref
        )
        self._lp.num_steps = learner.cfg.flow_steps
        self.spec, self.chunk_len = loaded.spec, learner.horizon

    def predict_chunks(self, obs: dict[str, Any], seed: int) -> np.ndarray:
        was = self._lp.policy.training
        self._lp.policy.eval()
        try:
            return self._lp.predict_chunks(obs, seed)
        finally:
            self._lp.policy.train(was)


# ============================================================================ training
def _check_sim_needs(cfg: QAMConfig, task: str) -> None:
    """Online steps and success evaluations need a simulator: on a task without one (real robot data,
    e.g. a LeRobot import) QAM trains offline only, and says which knob asked for more."""
    from vla_rl.evaluation_offline import is_sim_task

    if is_sim_task(task):
        return
    for name in ("env_steps", "eval_every", "final_eval_episodes"):
        if getattr(cfg, name):
            raise ValueError(
                f"{name}: {task!r} is not a simulator task, so QAM trains offline only; expected 0, got "
                f"{getattr(cfg, name)} (a round evaluates real data offline: vla-rl eval --store)"
            )


class _QAMRun:
    """One QAM run: the offline data, the learner and its optimisers, the counters and the logs.

    Built (and restored from a train state) by the constructor; :meth:`offline_phase`,
    :meth:`online_phase` and :meth:`finish` are the run, :meth:`update` one gradient step,
    :meth:`save` a checkpoint plus the train state.
    """

    def __init__(self, cfg: QAMConfig, dist: Dist, device: torch.device) -> None:
        self.dist = dist
        dist.check_batch(cfg.batch_size)
        self.shard = Shard(dist, cfg.batch_size)
        if not dist.is_main:
            cfg = dataclasses.replace(cfg, progress=False)  # one set of progress bars: rank 0's
        self.cfg = cfg
        self.clock = RunClock()  # the whole run's wall time, across resumes
        self.device = device
        torch.set_num_threads(dist.threads(cfg.threads))
        self.loaded = loaded = load_policy(cfg.base, device=str(device))
        base = loaded.policy
        self.spec = spec = loaded.spec
        self.task = task = cfg.task or spec.name
        if task != spec.name:
            raise ValueError(f"task: the base checkpoint is for {spec.name!r}, got {task!r}")
        _check_sim_needs(cfg, task)
        self._load_data()
        self.learner = learner = self._build_learner(base)
        cfg.out.mkdir(parents=True, exist_ok=True)
        self.state_path = cfg.out / TRAIN_STATE
        self.step, self.env_steps = 0, 0
        self.curve: list[dict[str, Any]] = []
        self.online_episodes: list[dict[str, np.ndarray]] = []
        self._restore()
        broadcast_module(learner, dist)  # every rank starts from rank 0's weights
        self.synced_episodes = len(self.online_episodes)

        self.writer = summary_writer(dist, str(cfg.out / "tb"), purge_step=self.step)
        self.writer.add_text("config", f"```\n{config_dict(cfg)}\n```", self.step)
        log.info(
            "qam start",
            extra={
                "task": task,
                "base": cfg.base,
                "episodes": len(self.episode_ids),
                "frames": self.offline_frames,
                "feature_mode": learner.feature_mode,
                "device": str(device),
                "offline_steps": cfg.offline_steps,
                "env_steps": cfg.env_steps,
                "processes": dist.world,
            },
        )
        self.params = {
            "critic": list(learner.critic.parameters()),
            "value": list(learner.value_head.parameters()) if learner.value_head is not None else [],
            "actor": list(learner.fine.parameters()),
            "base": list(learner.base.parameters()) if cfg.train_base else [],
        }
        self.last_metrics: dict[str, float] = {}
        self.next_cache = (
            _NextActionCache(learner, self.buffer, cfg, self.instructions, device)
            if cfg.next_action_cache
            else None
        )
        self.bar: StepProgress | None = None
        self.stop_at = cfg.stop_at if cfg.stop_at is not None else math.inf
        self.deadline = math.inf

    # ------------------------------------------------------------------ build
    def _load_data(self) -> None:
        """The offline replay: the store's episodes chosen by ``cfg.data``."""
        cfg = self.cfg
        self.store = store = EpisodeStore(cfg.store)
        self.selection = Selection.parse(cfg.data, task=self.task)
        # as AWR: the configured DB, else the store's own; its labels (outcome overrides, span labels) and
        # rounds table reach the replay through load_transitions
        from fleet.db import MetadataDB

        db = MetadataDB(cfg.db_url) if cfg.db_url else None
        self.buffer = load_transitions(
            store, self.selection, db=db, reward=cfg.reward, gamma=cfg.gamma, cameras=bool(self.spec.cameras)
        )
        self.episode_ids = list(self.buffer.episode_ids)
        self.offline_frames = len(self.buffer)

    def _build_learner(self, base: FlowVLAPolicy) -> QAMLearner:
        """The learner (seeded), its optimisers and the embeddings of the replay's instructions."""
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        support = divl_support(torch.from_numpy(self.buffer.array("mc_return")), DIVLConfig().support_margin)
        learner = QAMLearner(base, cfg, support, instructions=len(self.buffer.instructions)).to(self.device)
        learner.base.eval()  # no dropout / augmentation noise in the prior (train_base re-enables train mode)
        if cfg.train_base:
            learner.base.train()
        critic_params = itertools.chain(
            learner.critic.parameters(), learner.value_head.parameters() if learner.value_head else ()
        )
        self.opt_critic = torch.optim.Adam(critic_params, lr=cfg.critic_lr)
        self.opt_actor = torch.optim.Adam(learner.fine.parameters(), lr=cfg.actor_lr)
        self.opt_base = (
            torch.optim.Adam(learner.base.parameters(), lr=cfg.base_lr) if cfg.train_base else None
        )
        # each replay frame is conditioned on its own instruction (its episode's, as SFT); online episodes
        # on the simulator's, the spec's: registered first so the table covers them too
        sim_code = self.buffer.instruction_code(self.spec.instruction)
        self.instructions: Tensor | None = None
        self.instruction_emb: Tensor | None = None
        if base.config.uses_instruction:
            self.instructions = instruction_table(self.buffer, self.device)
            self.instruction_emb = self.instructions[sim_code : sim_code + 1]
        return learner

    def _restore(self) -> None:
        """Continue from ``out``'s train state (resume) or another run's (``init_from``), if any."""
        cfg = self.cfg
        start_from = self.state_path if cfg.resume and self.state_path.exists() else None
        if start_from is None and cfg.init_from is not None:
            start_from = cfg.init_from / TRAIN_STATE
            if not start_from.is_file():
                raise FileNotFoundError(
                    f"init_from: no {TRAIN_STATE} in {cfg.init_from}; expected the out folder of a QAM run"
                )
        if start_from is None:
            return
        st = load_train_state(start_from)
        fresh = start_from != self.state_path
        if fresh:
            _adapt_init_state(st, self.learner, self.opt_base, reset_actor=cfg.init_reset_actor)
        try:
            self.learner.load_state_dict(st["learner"])
        except RuntimeError as e:
            raise ValueError(
                f"init_from: {start_from} does not fit this configuration (members, critic_hidden, "
                f"feature_mode and the base's architecture must match the source run): {e}"
            ) from e
        self.opt_critic.load_state_dict(st["opt_critic"])
        self.opt_actor.load_state_dict(st["opt_actor"])
        if self.opt_base is not None:
            self.opt_base.load_state_dict(st["opt_base"])
        self.step, self.env_steps = int(st["step"]), int(st["env_steps"])
        if not fresh:
            self.clock.resume(st)
        self.curve = json.loads(st["curve"])
        for ep in st["online_episodes"]:
            ep_np = {k: v.numpy() for k, v in ep.items()}
            _add_episode(self.buffer, ep_np)
            self.online_episodes.append(ep_np)
        log.info(
            "initialised from another run" if fresh else "resumed",
            extra={"step": self.step, "env_steps": self.env_steps, "from": str(start_from)},
        )

    # ------------------------------------------------------------------ checkpoints and evaluation
    def save(self, final: bool = False) -> None:
        """``checkpoints/step_NNNNNN`` (copied to ``last``), the train state and curve.json (rank 0)."""
        if not self.dist.is_main:
            return
        cfg, step, env_steps = self.cfg, self.step, self.env_steps
        ckpt = cfg.out / "checkpoints" / f"step_{step:06d}"
        save_derived_checkpoint(
            ckpt,
            self.learner.fine,
            self.loaded.info,
            algorithm="qam",
            parent_revision=self.loaded.commit,
            round_index=cfg.round_index,
            data={
                "store": str(cfg.store),
                "task": self.task,
                "selection": self.selection.to_dict(),
                "offline_episodes": len(self.episode_ids),
                "offline_frames": self.offline_frames,
                "online_episodes": len(self.online_episodes),
                "env_steps": env_steps,
                "reward": cfg.reward,
            },
            metrics={"train_steps": step, "env_steps": env_steps, "inv_temp": cfg.inv_temp},
        )
        last = cfg.out / "checkpoints" / "last"
        shutil.rmtree(last, ignore_errors=True)
        shutil.copytree(ckpt, last)
        save_train_state(
            self.state_path,
            learner=self.learner.state_dict(),
            opt_critic=self.opt_critic.state_dict(),
            opt_actor=self.opt_actor.state_dict(),
            opt_base=self.opt_base.state_dict() if self.opt_base is not None else {},
            step=step,
            env_steps=env_steps,
            seconds=self.clock.seconds,
            curve=json.dumps(self.curve),
            online_episodes=[
                {k: torch.from_numpy(np.asarray(v)) for k, v in ep.items()} for ep in self.online_episodes
            ],
        )
        (cfg.out / "curve.json").write_text(json.dumps(self.curve, indent=1))
        if final:
            log.info("checkpoint", extra={"step": step, "env_steps": env_steps, "path": str(ckpt)})

    def evaluate_fine(self, episodes: int) -> float:
        """Success rate of the fine policy on ``episodes`` held-out episodes."""
        from vla_rl.evaluation import evaluate

        res = evaluate(
            _EvalView(self.learner, self.loaded),
            self.task,
            episodes=episodes,
            num_envs=self.cfg.num_envs,
            progress=False,
            ray=self.cfg.ray,
        )
        return res.success_rate

    # ------------------------------------------------------------------ one update
    def _batch(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """This step's replay batch: the raw rows and the policy inputs (with the TD extras)."""
        cfg, lr = self.cfg, self.learner
        rows = self.shard.take(replay_indices(len(self.buffer), self.offline_frames, cfg, self.step))
        raw = self.buffer.batch(rows, horizon=lr.horizon, n_step=lr.n_exec)
        batch = batch_to_policy_inputs(raw, self.device, self.instructions)
        for key in ("reward_n", "bootstrap", "valid", "mc_return"):
            batch[key] = raw[key].to(self.device)
        return raw, batch

    def _losses(
        self, raw: dict[str, Any], batch: dict[str, Any], mc: bool, train_actor: bool
    ) -> dict[str, Tensor]:
        if mc:
            return self.learner.mc_losses(batch)
        # the TD target needs the observation n steps on; the MC warm start does not
        nxt = batch_to_policy_inputs(
            {**next_observation(raw), "action": raw["action"], "action_is_pad": raw["action_is_pad"]},
            self.device,
            self.instructions,
        )
        a_next = self.next_cache.lookup(raw["next_index"], self.step) if self.next_cache is not None else None
        return self.learner.losses(batch, nxt, train_actor, a_next, self.shard)

    def _apply(self, out: dict[str, Tensor], mc: bool, train_actor: bool) -> dict[str, float]:
        """One backward pass and optimiser steps (gradients clipped per module), then the Polyak
        targets; returns the gradient norms."""
        cfg, lr = self.cfg, self.learner
        total = out["loss_q"] + out.get("loss_v", 0.0) + out.get("loss_bc", 0.0) + out.get("loss_am", 0.0)
        for opt in (self.opt_critic, self.opt_actor, self.opt_base):
            if opt is not None:
                opt.zero_grad(set_to_none=True)
        total.backward()
        all_reduce_grads(itertools.chain(*self.params.values()), self.dist)
        norms = {}
        for name, ps in self.params.items():
            if ps:
                norms[f"grad_norm_{name}"] = float(torch.nn.utils.clip_grad_norm_(ps, cfg.grad_clip))
        self.opt_critic.step()
        if train_actor:
            self.opt_actor.step()
        if self.opt_base is not None:
            self.opt_base.step()
            assert lr.base_target is not None
            polyak_update(lr.base_target, lr.base, cfg.tau)
        polyak_update(lr.critic_target, lr.critic, 1.0 if mc else cfg.tau)
        return norms

    def update(self, phase: str, rollouts: _Rollouts | None) -> None:
        """One gradient update (MC warm start, critic-only or full), its log row and checkpoint."""
        cfg, step = self.cfg, self.step
        seed_step(cfg.seed, step)
        raw, batch = self._batch()
        mc = step < cfg.critic_mc_steps
        warmup = max(cfg.critic_warmup, cfg.critic_mc_steps)
        train_actor = step >= warmup and (step - warmup) % cfg.actor_every == 0
        if phase == "online" and cfg.reanchor_every and (step - cfg.offline_steps) % cfg.reanchor_every == 0:
            self.learner.reanchor()
            log.info("re-anchored: the fine policy is the prior now", extra={"step": step})
        out = self._losses(raw, batch, mc, train_actor)
        norms = self._apply(out, mc, train_actor)
        self.step += 1
        self.last_metrics = mean_scalars({k: float(v.detach()) for k, v in out.items()} | norms, self.dist)
        self._log(phase, rollouts, batch, warmup)
        if self.step % cfg.checkpoint_every == 0:
            self.save()

    def _log(self, phase: str, rollouts: _Rollouts | None, batch: dict[str, Any], warmup: int) -> None:
        """Every ``log_every`` updates a curve row (and TensorBoard); evaluations every ``eval_every``."""
        cfg, step, metrics = self.cfg, self.step, self.last_metrics
        if step % cfg.log_every == 0:
            if step > warmup:
                q_gain = float(self.learner.q_gain(batch, self.shard))
                metrics["q_gain"] = mean_scalars({"q_gain": q_gain}, self.dist)["q_gain"]
            row: dict[str, Any] = {"step": step, "env_steps": self.env_steps, "phase": phase, **metrics}
            if rollouts is not None and rollouts.successes:
                row["rollout_success"] = float(np.mean(rollouts.successes))
            if cfg.eval_every and step % cfg.eval_every == 0 and self.dist.is_main:
                row["eval_success"] = self.evaluate_fine(cfg.eval_every_episodes)
            for k, v in row.items():
                if isinstance(v, float):
                    self.writer.add_scalar(f"{phase}/{k}", v, step)
            self.curve.append(row)
            assert self.bar is not None
            self.bar.set_postfix(
                q=f"{metrics['loss_q']:.3g}",
                am=f"{metrics.get('loss_am', float('nan')):.3g}",
                **({"succ": f"{row['rollout_success']:.0%}"} if "rollout_success" in row else {}),
            )
        elif cfg.eval_every and step % cfg.eval_every == 0 and self.dist.is_main:
            self.curve.append(
                {
                    "step": step,
                    "env_steps": self.env_steps,
                    "phase": phase,
                    "eval_success": self.evaluate_fine(cfg.eval_every_episodes),
                }
            )

    # ------------------------------------------------------------------ processes
    def in_time(self) -> bool:
        """Within ``max_seconds``? Rank 0's clock decides for every rank (one broadcast per update, only
        with a budget), so all leave their loops at the same update."""
        if self.cfg.max_seconds is None:
            return True
        return agree(time.perf_counter() < self.deadline, self.dist)

    def sync_episodes(self) -> None:
        """Under torchrun: the online episodes rank 0 finished since the last call join every other
        rank's replay, in the same order (so all ranks sample the same replay)."""
        if not self.dist.enabled:
            return
        new = broadcast_object(
            self.online_episodes[self.synced_episodes :] if self.dist.is_main else None, self.dist
        )
        if not self.dist.is_main:
            for ep in new:
                _add_episode(self.buffer, ep)
                self.online_episodes.append(ep)
        self.synced_episodes = len(self.online_episodes)

    # ------------------------------------------------------------------ phases
    def offline_phase(self) -> bool:
        """Updates on the replay up to ``offline_steps`` (or the stop / time limit); True when stopped
        at ``stop_at`` (preempted: the caller saves and returns)."""
        cfg = self.cfg
        self.bar = StepProgress(
            cfg.offline_steps,
            initial=min(self.step, cfg.offline_steps),
            stage="offline",
            desc="qam offline",
            show=cfg.progress,
        )
        self.learner.fine.train()
        self.deadline = self.clock.t0 + (cfg.max_seconds if cfg.max_seconds is not None else math.inf)
        while self.step < min(cfg.offline_steps, self.stop_at) and self.in_time():
            self.update("offline", None)
            self.bar.update(1)
        self.bar.close()
        return self.step >= self.stop_at

    def online_phase(self) -> None:
        """Fine-policy rollouts until ``env_steps``, with ``utd`` updates per env step (after
        ``start_online_after``); saves the offline result first when it is fresh."""
        cfg = self.cfg
        if not (cfg.env_steps > self.env_steps and self.in_time()):
            return
        if cfg.offline_steps and self.step == cfg.offline_steps and self.env_steps == 0:
            self.save()  # the offline result survives a failure online (the final save covers the other cases)
        # under torchrun rank 0 collects and every rank learns: its finished episodes reach the others'
        # replay after each vector step (sync_episodes), before any update samples the replay
        rollouts = (
            _Rollouts(self.learner, self.spec, cfg, self.instruction_emb, self.buffer, self.online_episodes)
            if self.dist.is_main
            else None
        )
        self.bar = StepProgress(
            cfg.env_steps,
            initial=self.env_steps,
            stage="online",
            desc="qam online",
            unit="env step",
            show=cfg.progress,
        )
        due = 0.0
        try:
            while self.env_steps < cfg.env_steps and self.step < self.stop_at and self.in_time():
                if rollouts is not None:
                    rollouts.step()
                self.sync_episodes()
                self.env_steps += cfg.num_envs
                self.bar.update(cfg.num_envs)
                if self.env_steps > cfg.start_online_after:
                    due += cfg.utd * cfg.num_envs
                    while due >= 1.0:
                        self.update("online", rollouts)
                        due -= 1.0
        finally:
            if rollouts is not None:
                rollouts.close()
            self.bar.close()

    def finish(self) -> QAMResult:
        """The final save, metrics (and final evaluation) and the result."""
        cfg, step, env_steps = self.cfg, self.step, self.env_steps
        self.save(final=True)
        metrics: dict[str, Any] = dict(self.last_metrics)
        metrics.update(
            updates=step,
            timed_out=(step < cfg.offline_steps or env_steps < cfg.env_steps) and step < self.stop_at,
            offline_frames=self.offline_frames,
            online_episodes=len(self.online_episodes),
            online_success=float(np.mean([bool(e["success"]) for e in self.online_episodes]))
            if self.online_episodes
            else None,
        )
        if cfg.final_eval_episodes and self.dist.is_main:
            metrics["eval_success"] = self.evaluate_fine(cfg.final_eval_episodes)
        self.writer.close()
        seconds = self.clock.seconds
        if self.dist.is_main:
            (cfg.out / "curve.json").write_text(json.dumps(self.curve, indent=1))
        return QAMResult(
            checkpoint=cfg.out / "checkpoints" / "last",
            seconds=seconds,
            steps=step,
            env_steps=env_steps,
            curve=self.curve,
            metrics=metrics,
            data={"selection": self.selection.to_dict(), "env_steps": env_steps},
        )


def train_qam(cfg: QAMConfig) -> QAMResult:
    """Run (or resume) QAM: ``offline_steps`` updates on the store's data, then ``env_steps`` online.

    Under torchrun every process learns on its share of each global batch (see
    :mod:`vla_rl.train.distributed`); rank 0 collects the online episodes and writes checkpoints, the
    train state, the curve and the logs."""
    with distributed(cfg.device) as (dist, device):
        return _train_qam(cfg, dist, device)


def _train_qam(cfg: QAMConfig, dist: Dist, device: torch.device) -> QAMResult:
    run = _QAMRun(cfg, dist, device)
    if run.offline_phase():  # preempted: keep everything needed to resume
        run.save()
        return QAMResult(
            checkpoint=cfg.out / "checkpoints" / "last",
            seconds=run.clock.seconds,
            steps=run.step,
            env_steps=run.env_steps,
            curve=run.curve,
            data={"selection": run.selection.to_dict(), "env_steps": run.env_steps},
        )
    run.online_phase()
    return run.finish()
