"""QAM's math: the equation-documented pure pieces and the learner that assembles them into one update.

Every function here follows ``ColinQiyangLi/qam`` ``agents/qam.py`` (time convention: t = 0 noise,
t = 1 data, as our policies) and is tested against an independent computation (``tests/test_qam.py``):
the memoryless noise schedule, the fine policy's SDE simulation, the terminal and lean adjoints, the
adjoint-matching target and loss, and the critic's pessimistic n-step TD target. :class:`QAMLearner`
holds the networks (base, fine policy, critic ensemble and their targets) and computes all losses of
one update (:meth:`QAMLearner.losses`); the training loop is :mod:`vla_rl.train.qam`.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from policies.critics import ChunkQEnsemble, pessimistic
from policies.flow_vla import FlowVLAPolicy
from policies.flow_vla.modeling_flow_vla import PrefixCache
from vla_rl.train.distributed import SINGLE, Shard
from vla_rl.train.divl import DIVLConfig, DIVLValue, divl_td_target
from vla_rl.train.qam_config import QAMConfig

Tensor = torch.Tensor
VelocityFn = Callable[[Tensor, float], Tensor]

__all__ = [
    "ChunkCriticInputs",
    "ObsEncoding",
    "QAMLearner",
    "adjoint_matching_loss",
    "am_velocity_target",
    "critic_loss",
    "critic_td_target",
    "lean_adjoint",
    "memoryless_sigma",
    "simulate_fine_sde",
    "terminal_adjoint",
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


# ============================================================================ the learner
def _without_grad(fn: Callable[[Any], Any], arg: Any) -> Any:
    with torch.no_grad():
        return fn(arg)


class ChunkCriticInputs:
    """What a chunked critic reads, shared by :class:`QAMLearner` and ``fql.FQLLearner``: needs ``base``
    (its normaliser), ``feature_net`` (the frozen trunk, or None: the state), ``clip`` and ``n_exec``."""

    base: FlowVLAPolicy
    feature_net: FlowVLAPolicy | None
    clip: bool
    n_exec: int
    action_dim: int

    def clip_norm(self, a: Tensor) -> Tensor:
        return a.clamp(-1.0, 1.0) if self.clip else a

    def executed(self, chunk: Tensor) -> Tensor:
        """``[B, H, D]`` -> what the critic scores: the executed steps' robot dims ``[B, n_exec, A]``
        (D = A for FlowVLA; a LeRobot VLA pads its actions to D)."""
        return chunk[:, : self.n_exec, : self.action_dim]

    @torch.no_grad()
    def features(self, obs: Mapping[str, Any]) -> Tensor:
        if self.feature_net is not None:
            return self.feature_net.encode_prefix(obs).pooled()
        return self.base.normalizer.normalize_state(obs["state"].float())

    def dataset_chunk(self, actions: Tensor) -> Tensor:
        """Env-unit ``[B, H, A]`` -> the normalised, clipped executed part ``[B, n_exec, A]``."""
        return self.clip_norm(self.base.normalizer.normalize_action(actions.float()))[:, : self.n_exec]


class ObsEncoding:
    """One observation batch as an update reads it, each piece computed once, on first use (so a
    learner's calls keep their order): the critic's features, the fine policy's prefix (differentiable)
    and the adjoint base's (no gradient). A learner whose fine and base policies share their prefix
    encoder gives the same prefix for both: one encode."""

    def __init__(
        self, features: Callable[[], Tensor], fine_prefix: Callable[[], Any], base_prefix: Callable[[], Any]
    ) -> None:
        self._features, self._fine, self._base = features, fine_prefix, base_prefix

    @functools.cached_property
    def features(self) -> Tensor:
        return self._features()

    @functools.cached_property
    def fine_prefix(self) -> Any:
        return self._fine()

    @functools.cached_property
    def base_prefix(self) -> Any:
        return self._base()


class QAMLearner(ChunkCriticInputs, nn.Module):
    """Base (behaviour) flow, its target, the fine flow, the critic ensemble and its target.

    The policy-specific steps are methods a learner for another flow policy overrides
    (:class:`vla_rl.train.qam_lerobot.LeRobotQAMLearner`): :meth:`encode`, :meth:`ode`,
    :meth:`sampling_inputs`, :meth:`grid_prefix` and :meth:`actor_parameters`; the losses are the same."""

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
        self.event = (pc.chunk_len, pc.action_dim)
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
        self.build_critic(pc.state_dim if mode == "state" else pc.d_model, value_support)

    def build_critic(self, feature_dim: int, value_support: tuple[float, float]) -> None:
        """The critic ensemble on (features, executed sub-chunk), its Polyak target and the DIVL value."""
        cfg = self.cfg
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

    # ------------------------------------------------------------------ policy-specific steps
    reads_instruction_text = False
    """The policy tokenises its observations' ``instruction`` text (FlowVLA reads frozen embeddings)."""

    def env_actions(self, chunk: Tensor) -> Tensor:
        """Normalised chunks ``[B, H, D]`` -> env units ``[B, H, A]`` (what the robot executes)."""
        return self.base.normalizer.unnormalize_action(chunk)

    def actor_parameters(self) -> list[nn.Parameter]:
        """What the actor's optimiser updates: the whole fine policy."""
        return list(self.fine.parameters())

    def encode(self, obs: Mapping[str, Any]) -> ObsEncoding:
        """``obs`` for the critic (features) and the adjoint step (the fine and the base prefix)."""
        return ObsEncoding(
            lambda: self.features(obs),
            lambda: self.fine.encode_prefix(obs),
            lambda: _without_grad(self.adjoint_base.encode_prefix, obs),
        )

    def sampling_inputs(self, obs: Mapping[str, Any]) -> tuple[Any, Any, Callable[[], Tensor]]:
        """What :meth:`ode` samples the base and the fine policy from at ``obs``, and the critic's
        features (called after sampling): FlowVLA samples from the observations (an advantage-conditioned
        policy guides them, a prefix it would not)."""
        return obs, obs, lambda: self.features(obs)

    def ode(self, policy: Any, obs_or_prefix: Any, noise: Tensor) -> Tensor:
        """``policy``'s normalised chunks ``[B, H, D]`` from ``noise`` by its Euler ODE, K = ``flow_steps``."""
        s = policy.sample(obs_or_prefix, method="ode", num_steps=self.cfg.flow_steps, noise=noise[:, None])
        return s.actions[:, 0]

    def grid_prefix(self, prefix: Any, k: int) -> Any:
        """The prefix for velocities on ``[B·K]`` rows (row b·K + i is observation b): FlowVLA's velocity
        repeats a prefix itself."""
        return prefix

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
        return self.clip_norm(self.ode(self.fine, obs_or_prefix, noise))

    @torch.no_grad()
    def q_gain(self, obs: Mapping[str, Any], shard: Shard | None = None) -> Tensor:
        """Diagnostic: mean Q̄(s, fine chunk) − Q̄(s, base chunk), both ODE samples from the same noise.
        Positive means adjoint matching moved the fine policy uphill on the critic. ``shard``: the
        rank's rows of a global batch (noise drawn for all of it; None = one process, ``obs`` is all)."""
        shard = shard or Shard(SINGLE, obs["state"].shape[0])
        noise = shard.randn(*self.event, device=obs["state"].device)
        base_in, fine_in, features = self.sampling_inputs(obs)
        a_base = self.clip_norm(self.ode(self.adjoint_base, base_in, noise))
        a_fine = self.sample_fine(fine_in, noise)
        feats = features()
        q_fine = self.critic_target(feats, self.executed(a_fine)).mean(0)
        q_base = self.critic_target(feats, self.executed(a_base)).mean(0)
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
        cfg = self.cfg
        b = batch["state"].shape[0]
        shard = shard or Shard(SINGLE, b)
        event = self.event
        out: dict[str, Tensor] = {}

        # ---- critic: chunked n-step TD with a pessimistic target ensemble
        enc = self.encode(batch)
        feats = enc.features
        with torch.no_grad():
            if self.value_head is not None:  # DIVL: in-sample, no next action
                v_next = self.value_head(self.features(next_obs))
                y = divl_td_target(v_next, batch["reward_n"], batch["bootstrap"], cfg.gamma, self.n_exec)
            else:
                a_next = next_chunk
                _, fine_in, next_features = self.sampling_inputs(next_obs)
                if a_next is None:
                    a_next = self.sample_fine(fine_in, shard.randn(*event, device=feats.device))
                q_next = self.critic_target(next_features(), self.executed(a_next))
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
            out.update(self.adjoint_losses(enc, shard))
        return out

    def adjoint_losses(self, enc: ObsEncoding, shard: Shard) -> dict[str, Tensor]:
        """L_AM for the batch ``enc`` encodes (docs/algorithms.md §2): the fine policy's memoryless SDE,
        the terminal adjoint of the target critic at the final iterate, the lean adjoint back through the
        base, and the regression of v_θ on the K grid points; with its diagnostics."""
        cfg, k, event = self.cfg, self.cfg.flow_steps, self.event
        fine_prefix, base_prefix = enc.fine_prefix, enc.base_prefix
        feats = enc.features
        b = feats.shape[0]

        def fine_v(x: Tensor, t: float) -> Tensor:
            return self.fine.velocity(fine_prefix, x, t)

        def base_v(x: Tensor, t: float) -> Tensor:
            return self.adjoint_base.velocity(base_prefix, x, t)

        x0 = shard.randn(*event, device=feats.device)
        eps = shard.randn(k - 1, *event, device=feats.device)
        iterates = simulate_fine_sde(fine_v, base_v, x0, k, eps)

        def q_fn(chunk: Tensor) -> Tensor:
            return self.critic_target(feats, chunk[..., : self.action_dim])

        adj_k = terminal_adjoint(q_fn, iterates[:, -1], self.n_exec, cfg.inv_temp, self.clip, cfg.actor_rho)
        adj = lean_adjoint(base_v, iterates, adj_k, k)[:, :k]
        xs = iterates[:, :k].reshape(b * k, *event)
        ts = (torch.arange(k, device=xs.device, dtype=xs.dtype) / k).repeat(b)
        grid_base = self.grid_prefix(base_prefix, k)
        grid_fine = grid_base if fine_prefix is base_prefix else self.grid_prefix(fine_prefix, k)
        with torch.no_grad():
            v_base = self.adjoint_base.velocity(grid_base, xs, ts).reshape(b, k, *event)
        v_fine = self.fine.velocity(grid_fine, xs, ts).reshape(b, k, *event)
        sigma = memoryless_sigma(k, xs.device)
        return {
            "loss_am": adjoint_matching_loss(v_fine, v_base, adj, sigma),
            "adjoint_norm": adj_k.flatten(1).norm(dim=1).mean().detach(),
            "final_action_abs": self.executed(iterates[:, -1]).abs().mean().detach(),
        }
