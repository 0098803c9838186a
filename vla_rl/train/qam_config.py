"""QAM's knobs: :class:`QAMConfig` (every field a ``vla-rl train qam`` flag) and :class:`QAMResult`.

The algorithm is described in :mod:`vla_rl.train.qam`; its equations and networks are in
:mod:`vla_rl.train.qam_math`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal, get_args

from sim.ray_workers import check_ray_address
from vla_rl.core.seeds import ONLINE
from vla_rl.train.base import TrainerConfig, TrainResult
from vla_rl.train.divl import DIVLConfig
from vla_rl.train.transitions import REWARD_KINDS, RewardKind

FeatureMode = Literal["auto", "state", "trunk"]


# ============================================================================ config
@dataclass(kw_only=True)
class QAMConfig(TrainerConfig):
    """Every knob of a QAM run (offline, then optionally online). Defaults follow the reference where it
    applies to a VLA; CPU-friendly budgets are named presets (:mod:`vla_rl.train.presets`)."""

    algorithm: ClassVar[str] = "qam"
    distributed: ClassVar[bool] = True
    chooses_trainable: ClassVar[bool] = True
    """``trainable`` picks what of a LeRobot base's fine copy trains (:mod:`vla_rl.train.qam_lerobot`:
    ``expert`` by default, sharing the frozen VLM with the base; ``full`` / ``lora`` on a VLM copy of its
    own); a flow_vla base's fine copy trains whole (unset or ``full``)."""

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
    MC update samples nothing (much cheaper: docs/experiment-log.md, Kinematic test bed: QAM) and starts
    Q at the behaviour policy's value. Counted in offline_steps and in critic_warmup (the actor never
    trains on an MC-only critic)."""

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
