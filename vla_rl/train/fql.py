"""FQL: Flow Q-Learning (Park, Li & Levine, ICML 2025; ``seohongpark/fql``), offline, on a flow VLA.

One algorithm, one file: the offline baseline the QAM paper compares to (docs/algorithms.md
§5a; time convention t = 0 noise, t = 1 data, as our policies). Networks:

* **base** v_β: the SFT checkpoint's velocity field, the behaviour (BC) flow. Frozen by default; with
  ``train_base`` it keeps training with the flow-matching loss L_BC (the reference trains it).
* **one-step policy** μ_ω(s, z) = z + v_ω(s, z, t = 0): a copy of the base evaluated with ONE Euler step
  (so the saved checkpoint is an ordinary flow policy with ``num_inference_steps = 1`` that every server
  and evaluation deploys as is); the deployed policy. The copy is NOT yet a one-step version of the base:
  a flow's velocity at t = 0 points at the data mean, so z + v_β(s, z, 0) starts near E[a | s] for every z
  and succeeds less often than the base. Only the distillation term makes it one: the first
  ``critic_warmup`` updates distil alone, at a from-scratch learning rate (``actor_lr``), as the reference
  trains its one-step MLP from scratch; enough such updates bring it back to the base's success
  (measured: docs/benchmarks.md, DIVL and FQL on PickCube state, "Why FQL lost to its base").
* **critic**: a chunked Q ensemble (:class:`policies.critics.ChunkQEnsemble`) on the *executed* sub-chunk
  (n_exec of H actions, normalised and clipped), with a Polyak target Q̄.

One update (z ~ N(0, I), x ~ ODE_β(s, z) the base's K-step Euler ODE from z, no gradient through it):

1. critic: ``y = R_n + γ^n · bootstrap · (mean_m Q̄_m − ρ std_m Q̄_m)(s', clip(μ_ω(s', z')))`` and
   ``L_Q = mean_{m,B} valid·(Q_m(s, a_data) − y)²`` (:func:`vla_rl.train.qam_math.critic_td_target`; ρ = 0 is
   FQL's mean, QAM's chunked setup uses 0.5). The first ``critic_mc_steps`` regress Q on the Monte-Carlo
   return instead (as QAM: a cheap warm start);
2. actor: ``L_π = α · mean ||μ_ω(s, z) − ODE_β(s, z)||² − λ_q · mean_B mean_m Q_m(s, clip(μ_ω(s, z)))``
   with ``λ_q = 1 / mean_B |mean_m Q_m|`` (stop-gradient; ``normalize_q_loss``) or 1; the Q term joins
   after ``critic_warmup`` updates (before it the one-step policy only distils the base);
3. ``L_BC`` for the base (``train_base`` only).

The base is our FlowVLA checkpoint or a LeRobot SmolVLA / π0 / π0.5 folder (:class:`LeRobotFQLLearner`:
the actor's expert trains, the critic reads the VLM prefix features, losses over the robot's dims, the
folder saved with K = 1; docs/training.md, RL on LeRobot VLAs).

Output folder: ``<out>/checkpoints/last`` (the one-step policy, lineage algorithm "fql"; a LeRobot folder
from a LeRobot base), ``<out>/tb``, ``<out>/curve.json``. Offline only, one process, no resume (a re-run
starts over).
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

import torch
from torch import nn
from vla_rl_client.spec import RobotSpec

from fleet.selection import Selection
from fleet.store import EpisodeStore
from policies.critics import ChunkQEnsemble, polyak_update
from policies.flow_vla import FlowVLAPolicy
from policies.lerobot_flow import LeRobotFlowPolicy
from policies.loading import LoadedPolicy, load_chunk_policy, pick_device
from vla_rl.hub.checkpoint import Lineage
from vla_rl.train.base import TrainerConfig, TrainResult
from vla_rl.train.common import (
    RunClock,
    batch_to_policy_inputs,
    sample_indices,
    save_derived_checkpoint,
)
from vla_rl.train.distributed import SINGLE
from vla_rl.train.lerobot_rl import LeRobotCriticInputs, check_feature_mode, copy_sharing
from vla_rl.train.loop import Optimiser, TrainLog, UpdateLoop, gradient_step
from vla_rl.train.qam_math import ChunkCriticInputs, critic_loss, critic_td_target
from vla_rl.train.transitions import (
    REWARD_KINDS,
    RewardKind,
    load_transitions,
    next_observation,
)

log = logging.getLogger(__name__)
Tensor = torch.Tensor
VelocityFn = Callable[[Tensor, float], Tensor]

__all__ = ["FQLConfig", "FQLLearner", "distillation_loss", "fql_q_loss", "one_step_actions", "train_fql"]


# ============================================================================ pure pieces
def one_step_actions(velocity: VelocityFn, z: Tensor) -> Tensor:
    """The one-step policy ``μ(s, z) = z + v(s, z, 0)``: one Euler step of a flow from t = 0 to 1."""
    return z + velocity(z, 0.0)


def distillation_loss(actions: Tensor, ode_target: Tensor) -> Tensor:
    """``mean ||μ(s, z) − ODE_β(s, z)||²`` over batch and elements (the reference's ``jnp.mean``)."""
    return (actions - ode_target.detach()).square().mean()


def fql_q_loss(q: Tensor, normalize: bool) -> Tensor:
    """``−λ_q · mean_B mean_m Q_m`` from ``q [M, B]``, ``λ_q = 1 / mean_B |mean_m Q_m|`` (no gradient)
    with ``normalize`` (the README's recommended ``normalize_q_loss``), else 1."""
    q_mean = q.mean(0)
    loss = -q_mean.mean()
    if normalize:
        loss = loss / q_mean.abs().mean().detach().clamp_min(1e-6)
    return loss


# ============================================================================ config
FeatureMode = Literal["auto", "state", "trunk"]


@dataclass(kw_only=True)
class FQLConfig(TrainerConfig):
    """Every knob of an FQL run (offline). Defaults follow the reference where it applies to a VLA."""

    algorithm: ClassVar[str] = "fql"

    store: Path = field()
    """Episode store holding the offline data (demos, earlier rollouts)."""
    reward: RewardKind = "steps_to_go"
    """Reward relabelling (see transitions.py), as QAM's."""
    gamma: float = 0.99
    """Per-step discount; the chunked TD uses γ^n_exec."""
    alpha: float = 10.0
    """α: weight of the distillation loss, the behaviour constraint (reference: 10 antmaze, 300 cube; the
    README's range 0.03-10 with ``normalize_q_loss``). Smaller = greedier on Q."""
    normalize_q_loss: bool = True
    """Divide the Q term by mean |Q| (no gradient), so α reads the same at any reward scale."""
    rho: float = 0.0
    """Ensemble pessimism in the TD target (mean − ρ·std); 0 = FQL's mean, QAM's chunked setup 0.5."""
    members: int = 2
    """Critic ensemble size (FQL's 2; QAM's setup 10)."""
    critic_hidden: tuple[int, ...] = (512, 512, 512, 512)
    """Critic MLP widths (LayerNorm)."""
    tau: float = 0.005
    """Polyak rate of the target critic."""
    flow_steps: int = 10
    """K: Euler steps of the base ODE that the one-step policy distils."""
    clip_actions: bool = True
    """Clip normalised actions to [−1, 1] before Q (min-max normalisation only)."""
    train_base: bool = False
    """Keep training the behaviour flow with L_BC (the reference); False freezes the SFT policy."""
    feature_mode: FeatureMode = "auto"
    """Critic input: 'state', 'trunk' (the frozen base's pooled trunk tokens) or 'auto' (trunk with
    cameras, else state)."""

    steps: int = 3000
    """Gradient updates in all (MC warm start and critic warm-up included)."""
    batch_size: int = 256
    critic_lr: float = 3e-4
    actor_lr: float = 3e-4
    """One-step policy learning rate: the reference's from-scratch rate, not a fine-tuning one (the copy
    starts far from the base's ODE, see the module docstring; the distillation error each rate leaves:
    docs/benchmarks.md, "Why FQL lost to its base")."""
    base_lr: float = 3e-5
    """Behaviour-flow learning rate (train_base only)."""
    grad_clip: float = 1.0
    """Global-norm clip, per module."""
    critic_mc_steps: int = 1000
    """The first this-many updates regress Q(s, a_data) on the Monte-Carlo return (as QAM)."""
    critic_warmup: int = 2000
    """Updates before the Q term enters the actor loss: until then the one-step policy only distils the
    base (and the critic trains), so Q pulls on a faithful copy of the base with a critic that has had
    time to carry outcomes back (as QAM's critic-first warm-up, whose default this is: docs/experiment-log.md,
    Kinematic test bed: QAM)."""
    final_eval_episodes: int = 0
    """Episodes of a final evaluation in simulation recorded in the metrics (0 = none)."""
    num_envs: int = 2
    """Simulator processes of the final evaluation."""
    max_seconds: float | None = None
    """Wall-clock budget: stop updating after this many seconds and finish normally."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.critic_hidden = tuple(int(h) for h in self.critic_hidden)
        for name in ("members", "batch_size", "steps", "num_envs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)}")
        if self.flow_steps < 1:
            raise ValueError(f"flow_steps: expected >= 1, got {self.flow_steps}")
        for name in ("critic_mc_steps", "critic_warmup", "final_eval_episodes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected >= 0, got {getattr(self, name)}")
        if max(self.critic_warmup, self.critic_mc_steps) >= self.steps:
            raise ValueError(
                f"critic_warmup: the Q term would never train the actor (warm-up "
                f"{max(self.critic_warmup, self.critic_mc_steps)} >= steps {self.steps})"
            )
        if self.reward not in REWARD_KINDS:
            raise ValueError(f"reward: expected one of {list(REWARD_KINDS)}, got {self.reward!r}")
        if not 0.0 < self.gamma <= 1.0:
            raise ValueError(f"gamma: expected in (0, 1], got {self.gamma}")
        if self.alpha < 0 or self.rho < 0:
            raise ValueError(f"alpha and rho: expected >= 0, got {self.alpha} and {self.rho}")
        if not 0.0 < self.tau <= 1.0:
            raise ValueError(f"tau: expected in (0, 1], got {self.tau}")
        for name in ("critic_lr", "actor_lr", "base_lr", "grad_clip"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected > 0, got {getattr(self, name)}")
        if self.feature_mode not in get_args(FeatureMode):
            raise ValueError(f"feature_mode: expected auto|state|trunk, got {self.feature_mode!r}")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise ValueError(f"max_seconds: expected > 0 or None, got {self.max_seconds}")


# ============================================================================ the learner
class FQLLearner(ChunkCriticInputs, nn.Module):
    """Behaviour flow (base), the one-step policy, the critic ensemble and its target."""

    def __init__(self, base: FlowVLAPolicy, cfg: FQLConfig) -> None:
        super().__init__()
        pc = base.config
        self.cfg = cfg
        self.n_exec, self.horizon, self.action_dim = pc.n_exec, pc.chunk_len, pc.action_dim
        self.event = (pc.chunk_len, pc.action_dim)
        self.clip = cfg.clip_actions and pc.action_norm == "min_max"
        mode = cfg.feature_mode
        if mode == "auto":
            mode = "trunk" if pc.cameras else "state"
        if mode == "state" and pc.state_dim == 0:
            raise ValueError("feature_mode: 'state' needs a policy with a state input; use 'trunk'")
        self.feature_mode = mode
        self.base = base.requires_grad_(cfg.train_base)
        self.feature_net = copy.deepcopy(base).requires_grad_(False) if mode == "trunk" else None
        self.actor = copy.deepcopy(base).requires_grad_(True)
        self.actor.config.num_inference_steps = 1  # deployed as one Euler step: μ(s, z)
        feature_dim = pc.state_dim if mode == "state" else pc.d_model
        self.critic = ChunkQEnsemble(
            feature_dim, self.n_exec * self.action_dim, cfg.members, cfg.critic_hidden
        )
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)

    def bc_loss(self, batch: Mapping[str, Any]) -> Tensor:
        """The behaviour flow's flow-matching loss (``train_base``)."""
        return self.base.flow_matching_loss(batch)[0]

    def one_step(self, obs: Mapping[str, Any], z: Tensor) -> Tensor:
        """μ_ω(s, z) ``[B, H, D]`` (normalised, unclipped), differentiable in the actor's weights."""
        prefix = self.actor.encode_prefix(obs)
        return one_step_actions(lambda x, t: self.actor.velocity(prefix, x, t), z)

    @torch.no_grad()
    def base_ode(self, obs: Mapping[str, Any], z: Tensor) -> Tensor:
        """ODE_β(s, z): the base's K-step Euler ODE from z (normalised, unclipped)."""
        return self.base.sample(obs, method="ode", num_steps=self.cfg.flow_steps, noise=z[:, None]).actions[
            :, 0
        ]

    def losses(
        self, batch: Mapping[str, Any], next_obs: Mapping[str, Any] | None, mc: bool, use_q: bool
    ) -> dict[str, Tensor]:
        """All losses of one update; ``next_obs`` None only for an MC critic update."""
        cfg = self.cfg
        b = batch["state"].shape[0]
        event, robot = self.event, slice(0, self.action_dim)
        feats = self.features(batch)
        out: dict[str, Tensor] = {}
        with torch.no_grad():
            if mc:
                y = batch["mc_return"]
            else:
                assert next_obs is not None
                z_next = torch.randn(b, *event, device=feats.device)
                a_next = self.executed(self.clip_norm(self.one_step(next_obs, z_next)))
                q_next = self.critic_target(self.features(next_obs), a_next)
                y = critic_td_target(
                    q_next, batch["reward_n"], batch["bootstrap"], cfg.gamma, self.n_exec, cfg.rho
                )
        q = self.critic(feats, self.dataset_chunk(batch["action"]))
        out["loss_q"] = critic_loss(q, y, batch["valid"])
        out["q_mean"] = q.mean().detach()
        out["target_mean"] = y.mean().detach()

        z = torch.randn(b, *event, device=feats.device)
        mu = self.one_step(batch, z)
        # over the robot's dims: a LeRobot VLA's padding is no action to distil (FlowVLA has none)
        out["loss_distill"] = distillation_loss(mu[..., robot], self.base_ode(batch, z)[..., robot])
        actor = cfg.alpha * out["loss_distill"]
        if use_q:
            # Q at the policy's action trains the actor only: the critic's weights are constants here
            # (the reference evaluates the critic with its current, not its gradient, parameters)
            self.critic.requires_grad_(False)
            try:
                q_pi = self.critic(feats, self.executed(self.clip_norm(mu)))
            finally:
                self.critic.requires_grad_(True)
            out["loss_q_pi"] = fql_q_loss(q_pi, cfg.normalize_q_loss)
            actor = actor + out["loss_q_pi"]
            out["q_pi_mean"] = q_pi.mean().detach()
        out["loss_actor"] = actor
        if cfg.train_base:
            out["loss_bc"] = self.bc_loss(batch)
        return out


class LeRobotFQLLearner(LeRobotCriticInputs, FQLLearner):
    """FQL on a LeRobot SmolVLA / π0 / π0.5 through the flow-policy contract (docs/training.md, RL on
    LeRobot VLAs). The one-step policy is a copy of the base whose action expert trains (the VLM frozen,
    and shared with the base rather than duplicated) and whose config says K = 1, so the saved folder
    deploys μ_ω(s, z) in LeRobot's own code; the critic reads the base's VLM prefix features (frozen: the
    base only ever trains its expert) and the executed steps' robot dims of the normalised chunk,
    unclipped (LeRobot's normalisation is not bounded): :class:`~vla_rl.train.lerobot_rl.LeRobotCriticInputs`."""

    def __init__(self, base: LeRobotFlowPolicy, cfg: FQLConfig) -> None:
        nn.Module.__init__(self)
        check_feature_mode(cfg.feature_mode)
        self.cfg = cfg
        self.n_exec, self.horizon, self.action_dim = base.n_exec, base.chunk_len, base.action_dim
        self.event = base.event_shape
        self.clip, self.feature_mode, self.feature_net = False, "trunk", None
        base.set_trainable("expert")
        self.actor = copy_sharing(base, [base.vlm])  # the frozen VLM, held once
        self.actor.set_num_inference_steps(1)  # deployed as one Euler step: μ(s, z)
        if not cfg.train_base:
            base.requires_grad_(False)
        self.base = base
        self.critic = ChunkQEnsemble(
            base.feature_dim, self.n_exec * self.action_dim, cfg.members, cfg.critic_hidden
        )
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)

    def bc_loss(self, batch: Mapping[str, Any]) -> Tensor:
        return self.base.loss(batch).mean()

    @torch.no_grad()
    def base_ode(self, obs: Mapping[str, Any], z: Tensor) -> Tensor:
        return self.base.sample(obs, num_steps=self.cfg.flow_steps, noise=z[:, None]).actions[:, 0]


# ============================================================================ training
@dataclass(kw_only=True)
class FQLResult(TrainResult):
    steps: int
    """Gradient updates run."""


@dataclass
class _Base:
    """The behaviour flow a run starts from: our checkpoint (``loaded``) or a LeRobot flow VLA (``policy``,
    ``loaded`` None), its robot spec, the task whose episodes train it and the commit lineage names."""

    policy: Any
    spec: RobotSpec
    task: str
    commit: str
    loaded: LoadedPolicy | None


def _load_base(cfg: FQLConfig, device: torch.device) -> _Base:
    """Our checkpoint or a LeRobot SmolVLA / π0 / π0.5 folder (any other LeRobot type is refused naming
    it), with the task its episodes come from: the checkpoint's (``cfg.task`` must match it when given;
    :meth:`~policies.loading.FlowCheckpoint.task`), or ``cfg.task`` for a folder that names none."""
    base = load_chunk_policy(cfg.base, device=str(device), algorithm="fql")
    task = base.task(cfg.task)
    if isinstance(base, LoadedPolicy):
        return _Base(base.policy, base.spec, task, base.commit, base)
    return _Base(base.policy, base.spec, task, base.commit, None)


def train_fql(cfg: FQLConfig) -> FQLResult:
    """Run FQL offline on the store's data; returns the one-step policy's checkpoint and metrics."""
    clock = RunClock()
    device = pick_device(cfg.device)
    torch.set_num_threads(SINGLE.threads(cfg.threads))
    torch.manual_seed(cfg.seed)
    base = _load_base(cfg, device)
    spec, task, loaded = base.spec, base.task, base.loaded
    from fleet.db import MetadataDB

    selection = Selection.parse(cfg.data, task=task)
    buf = load_transitions(
        EpisodeStore(cfg.store),
        selection,
        db=MetadataDB(cfg.db_url) if cfg.db_url else None,
        reward=cfg.reward,
        gamma=cfg.gamma,
        cameras=bool(spec.cameras),
    )
    learner = (
        FQLLearner(loaded.policy, cfg) if loaded is not None else LeRobotFQLLearner(base.policy, cfg)
    ).to(device)
    learner.base.train(cfg.train_base)
    trained = {"critic": (learner.critic, cfg.critic_lr), "actor": (learner.actor, cfg.actor_lr)}
    if cfg.train_base:
        trained["base"] = (learner.base, cfg.base_lr)
    opts = []
    for name, (module, lr) in trained.items():
        params = [p for p in module.parameters() if p.requires_grad]  # a LeRobot VLA: its expert
        opts.append(Optimiser(torch.optim.Adam(params, lr=lr), {name: params}, cfg.grad_clip))
    emb = None
    if loaded is not None and loaded.policy.config.uses_instruction:
        from policies.flow_vla import embed_instructions

        emb = embed_instructions([spec.instruction]).to(device)
    cfg.out.mkdir(parents=True, exist_ok=True)
    tlog = TrainLog(cfg, SINGLE, purge_step=None, config_step=0)
    log.info("fql start", extra={"task": task, "base": cfg.base, "frames": len(buf), "steps": cfg.steps})

    def update(step: int) -> dict[str, Tensor]:
        """An MC or TD critic update, distillation (plus the Q term after the warm-up), the Polyak target."""
        rows = sample_indices(len(buf), cfg.batch_size, cfg.seed, step)
        raw = buf.batch(rows, horizon=learner.horizon, n_step=learner.n_exec)
        batch = batch_to_policy_inputs(raw, device)
        for key in ("reward_n", "bootstrap", "valid", "mc_return"):
            batch[key] = raw[key].to(device)
        mc = step < cfg.critic_mc_steps
        nxt = None
        if not mc:
            nxt = batch_to_policy_inputs(
                {**next_observation(raw), "action": raw["action"], "action_is_pad": raw["action_is_pad"]},
                device,
            )
        if emb is not None:
            batch["instruction_embedding"] = emb.expand(len(rows), -1)
            if nxt is not None:
                nxt["instruction_embedding"] = batch["instruction_embedding"]
        if loaded is None:  # a LeRobot VLA tokenises the text: each frame's own instruction
            batch["instruction"] = [buf.instructions[i] for i in raw["instruction_index"].tolist()]
            if nxt is not None:
                nxt["instruction"] = [buf.instructions[i] for i in raw["next.instruction_index"].tolist()]
        out = learner.losses(batch, nxt, mc, use_q=step >= max(cfg.critic_warmup, cfg.critic_mc_steps))
        gradient_step(out["loss_q"] + out["loss_actor"] + out.get("loss_bc", 0.0), opts, SINGLE)
        polyak_update(learner.critic_target, learner.critic, 1.0 if mc else cfg.tau)
        return out

    loop = UpdateLoop.run_single(update, cfg, tlog, clock, "fql")
    step = loop.step
    metrics = loop.metrics
    curve = tlog.curve
    tlog.close()
    ckpt = cfg.out / "checkpoints" / "last"
    data = {
        "store": str(cfg.store),
        "task": task,
        "selection": selection.to_dict(),
        "episodes": len(buf.episode_ids),
        "frames": len(buf),
        "reward": cfg.reward,
    }
    train_metrics = {"train_steps": step, "alpha": cfg.alpha}
    if loaded is None:
        lineage = Lineage("fql", parent_revision=base.commit, round=cfg.round_index, data=data)
        learner.actor.save(ckpt, lineage=lineage, metrics=train_metrics)
    else:
        save_derived_checkpoint(
            ckpt,
            learner.actor,
            loaded.info,
            algorithm="fql",
            parent_revision=loaded.commit if loaded.commit else cfg.base,
            round_index=cfg.round_index,
            data=data,
            metrics=train_metrics,
        )
    (cfg.out / "curve.json").write_text(json.dumps(curve, indent=1))
    result_metrics: dict[str, Any] = {**metrics, "updates": step, "frames": len(buf)}
    if cfg.final_eval_episodes:
        from vla_rl.evaluation import evaluate

        shipped = load_chunk_policy(ckpt, device=str(device), algorithm="fql")
        ev = evaluate(
            shipped,
            task,
            episodes=cfg.final_eval_episodes,
            num_envs=cfg.num_envs,
            progress=False,
        )
        result_metrics["eval_success"] = ev.success_rate
    seconds = clock.seconds
    log.info("fql done", extra={"checkpoint": str(ckpt), "seconds": round(seconds, 1), "updates": step})
    return FQLResult(
        checkpoint=ckpt,
        seconds=seconds,
        steps=step,
        metrics=result_metrics,
        curve=curve,
        data={"selection": selection.to_dict(), "episodes": len(buf.episode_ids), "frames": len(buf)},
    )
