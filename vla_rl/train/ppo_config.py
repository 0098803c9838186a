"""PPO's knobs: :class:`PPOConfig` (every field a ``vla-rl train flow-noise`` / ``flow-sde`` flag), its
option sets and :class:`PPOResult`. The algorithm is described in :mod:`vla_rl.train.ppo`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, get_args

from sim.ray_workers import check_ray_address
from vla_rl.core.seeds import EVAL, ONLINE, check_disjoint
from vla_rl.train.base import TrainerConfig, TrainResult, check_optional_positive

# Option sets: the Literal is the one spelling (tyro shows its choices); the tuple is derived from it.
Method = Literal["noise", "sde"]
Reward = Literal["sparse", "dense"]
CriticInput = Literal["auto", "state", "prefix"]
Discount = Literal["chunk", "step"]
LogprobReduction = Literal["sum", "mean"]
Advantage = Literal["gae", "grpo"]
SdeSteps = Literal["one", "all"]
METHODS, REWARDS, CRITICS, DISCOUNTS = (
    get_args(Method),
    get_args(Reward),
    get_args(CriticInput),
    get_args(Discount),
)
LOGPROB_REDUCTIONS = get_args(LogprobReduction)
ADVANTAGES, SDE_STEPS = get_args(Advantage), get_args(SdeSteps)


# ============================================================================ config
@dataclass(kw_only=True)
class PPOConfig(TrainerConfig):
    """Every knob of a PPO fine-tuning run. Defaults follow RLinf's π_RL where they apply; the batch,
    learning-rate and reward defaults are the ones tried on PickCube state (docs/experiment-log.md)."""

    needs_store: ClassVar[bool] = False
    chooses_trainable: ClassVar[bool] = True  # `trainable`: the actor's parts; the noise head always trains

    base: str = field()  # type: ignore[assignment]
    """Checkpoint to start from: ``hub://org/name@rev`` or a local folder: a flow_vla SFT checkpoint or a
    LeRobot SmolVLA / π0 / π0.5 policy folder (docs/training.md, PPO on a LeRobot VLA)."""
    task: str | None = None
    """Simulated task to train in; None = the base checkpoint's robot spec name (a LeRobot folder names no
    task: give one)."""

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
    single transition at the same rate, so it wants a smaller one (try ~1e-6; why: docs/experiment-log.md,
    Measurements behind config defaults)."""
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
    that would otherwise be too small to compound or too large to be stable (the approx-KL PickCube saw at
    each rate: docs/benchmarks.md, Flow-SDE PPO at 100,000 env steps on PickCube state, and
    docs/experiment-log.md, Measurements behind config defaults)."""
    adaptive_lr_bounds: tuple[float, float] = (1e-7, 1e-4)
    """(min, max) actor learning rate under ``adaptive_kl``."""
    critic_warmup_iterations: int = 2
    """Iterations that train only the critic (a fresh critic's advantages are noise)."""

    # ------------------------------------------------------------ critic
    critic: CriticInput = "auto"
    """'state': MLP on the normalised state (state-only models); 'prefix': MLP on the policy's prefix
    features (π0.5-style, RLinf's value head after the VLM prefix; sees the cameras). 'auto': 'state' for
    our FlowVLA, 'prefix' for a LeRobot VLA (whose state normaliser lives in its pre-processor)."""
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
