"""Advantage-weighted (AWR) and advantage-conditioned (RECAP) flow matching: one algorithm, one file.

Both fit a value function on the fleet's experience, score every autonomous frame's action chunk by
its advantage, and re-train the flow policy to prefer better-than-average actions
(docs/algorithms.md §4):

1. **Value.** V(s) regressed on credit-aware Monte-Carlo returns (see
   :mod:`vla_rl.train.transitions`: returns are cut at human takeovers, which count as failures of the
   autonomous stretch) of non-human frames, cross-fitted: each episode is scored by a value that did
   not see it (a value fitted on the same returns memorises them and leaves only noise). ``value="categorical"``: RECAP/DIVL's distributional
   head (cross-entropy on atoms spanning the data's return range, read out by its mean); ``"divl"``:
   LWD's distributional implicit value, the same head read out by an upper quantile
   (:mod:`vla_rl.train.divl`); ``"expectile"``: IQL's asymmetric L2 (tau > 0.5 leans optimistic).
2. **Advantage.** A_t = G_t - V(s_t), computed once for every frame with the value frozen.
3. **Policy extraction**, from the base checkpoint:

   * ``variant="awr"``: weighted flow matching, w = min(exp(A / (beta * std A)), w_max) (advantages
     scaled by their std over autonomous frames so beta means the same on every task);
   * ``variant="recap"``: binarised indicator I = 1[A > eps], eps the quantile that makes
     ``positive_fraction`` of autonomous frames positive; the policy is conditioned on it (dropped
     to "unconditional" with ``unconditional_prob``) and acts conditioned on positive at deployment,
     optionally with classifier-free guidance (``guidance_scale``).

**Estimator weights** (``weighting="success"`` / ``"progress"``, ``variant="awr"``): instead of steps 1
and 2, a success / progress estimator is fit on the selected episodes' outcomes
(:mod:`vla_rl.train.success`) and every frame, demonstrations included, is weighted RA-BC / SARM style
by its chunk's estimated success or its estimated progress over the chunk (:func:`_estimator_weighting`).

**Intervention-aware credit.** Human-controlled frames never get an advantage from an outcome: they
are kept as positive behaviour cloning (AWR weight ``human_weight``; RECAP indicator positive). So are
the frames of a ``recovery`` span label (the buffer's ``bc`` array, :mod:`vla_rl.train.transitions`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from vla_rl_client.meta import Controller

from fleet import store_index
from fleet.db import MetadataDB
from fleet.selection import Selection
from fleet.store import EpisodeStore
from policies.critics import CategoricalValue, ValueMLP, expectile_loss
from policies.flow_policy import FlowPolicy, FlowVLAFlowPolicy
from policies.flow_vla.modeling_flow_vla import (
    ADVANTAGE_NEGATIVE,
    ADVANTAGE_POSITIVE,
    ADVANTAGE_UNCONDITIONAL,
)
from policies.loading import FlowCheckpoint
from vla_rl.train.base import StepProgress, TrainerConfig, TrainResult
from vla_rl.train.common import EMA, RunClock, sample_indices
from vla_rl.train.contract import (
    PolicyInputs,
    as_policy,
    load_base,
    save_trained,
    trainable_parameters,
    trained_module,
    value_features,
    weighted_flow_loss,
)
from vla_rl.train.distributed import (
    Dist,
    Shard,
    broadcast_module,
    broadcast_object,
    broadcast_tensor,
    distributed,
)
from vla_rl.train.divl import DIVLConfig, DIVLValue
from vla_rl.train.hindsight import add_hindsight_copies, goal_layout
from vla_rl.train.loop import (
    Beat,
    Optimiser,
    TrainLog,
    TrainState,
    UpdateLoop,
    fit_minibatches,
    gradient_step,
    warmup_cosine_schedule,
)
from vla_rl.train.privileged import ReplayedStates
from vla_rl.train.success import (
    WEIGHTINGS,
    SuccessFitConfig,
    buffer_weights,
    fit_success_estimator,
    outcome_rows,
)
from vla_rl.train.transitions import RewardKind, TransitionBuffer, load_transitions

log = logging.getLogger(__name__)

__all__ = [
    "AWRConfig",
    "AWRResult",
    "AdvantageConfig",
    "all_features",
    "awr_weights",
    "cross_fitted_values",
    "episode_folds",
    "fit_value",
    "recap_indicators",
    "train_awr",
    "value_advantages",
    "value_head",
]


@dataclass(kw_only=True)
class AdvantageConfig(TrainerConfig):
    """The knobs every advantage-weighted trainer shares (offline AWR / RECAP, :class:`AWRConfig`, and
    online AWR policy iteration, :class:`vla_rl.train.awr_pi.AWRPIConfig`), defined and validated here
    once: the value fit (:func:`fit_value`, :func:`cross_fitted_values`), the AWR weights
    ``w = min(exp(A / (beta * std A)), w_max)`` (:func:`awr_weights`) and the policy's optimiser. The
    subclasses inherit the fields, so their command-line flags stay flat (``--value-steps``)."""

    chooses_trainable: ClassVar[bool] = True

    store: Path = field()
    """Episode store with the experience (demos, fleet rollouts, human interventions)."""

    # value function
    value: Literal["categorical", "expectile", "divl"] = "categorical"
    """V(s): a categorical head's mean, IQL's expectile, or DIVL's τ-quantile of the categorical head
    (``divl_quantile``; vla_rl/train/divl.py)."""
    value_input: Literal["policy", "privileged"] = "policy"
    """What V(s) reads: ``policy``, the frozen base's features of the policy's own inputs (the normalised
    state for state-only policies); ``privileged``, the simulator's full state replayed from each
    episode's seed and actions, for training only (asymmetric actor-critic for camera policies:
    :mod:`vla_rl.train.privileged`; simulated episodes recorded with their seed)."""
    reward: RewardKind = "steps_to_go"
    """Return definition (see transitions.py). steps_to_go makes faster successes better, as RECAP."""
    gamma: float = 1.0
    """Discount of the Monte-Carlo returns (RECAP uses 1 with steps-to-go rewards)."""
    advantage_lambda: float = 1.0
    """λ of the advantage ``A_t = G^λ_t - V(s_t)``, with the λ-return
    ``G^λ_t = r_t + γ((1 - λ) V(s_{t+1}) + λ G^λ_{t+1})`` (TD(λ), GAE; :func:`lambda_returns`). 1 = the
    Monte-Carlo return, as the original AWR; smaller leans on the value: lower variance, and credit for
    what the next few chunks did rather than for the whole episode's outcome."""
    value_steps: int = 1500
    """Gradient steps per value fit (one fit per fold)."""
    value_folds: int = 2
    """Cross-fitting: each episode's advantages come from a value fitted on the other folds (1 = off)."""
    value_lr: float = 1e-3
    """AdamW learning rate of the value head."""
    value_hidden: tuple[int, ...] = (256, 256)
    """Hidden widths of the value head's MLP."""
    value_bins: int = 51
    """Atoms of the categorical value, spanning the data's return range."""
    expectile: float = 0.7
    """tau of the expectile value (value="expectile"): > 0.5 leans optimistic."""
    divl_quantile: float = 0.7
    """τ of the DIVL read-out V_τ(s) = Quant_τ(p(G | s)) (value="divl"): > 0.5 leans optimistic."""

    # advantage weights and the policy's optimiser
    beta: float = 1.0
    """AWR temperature on std-normalised advantages: smaller = greedier."""
    w_max: float = 20.0
    """AWR weight clip (AWR's 20; IQL uses 100)."""
    human_weight: float = 1.0
    """AWR weight of human-intervention and recovery frames (plain behaviour cloning)."""
    hindsight_weight: float = 0.0
    """> 0: add a hindsight-relabelled copy of each failed episode, ending in success where it came
    nearest its goal with the object in hand (:mod:`vla_rl.train.hindsight`; tasks whose state holds
    their goal), cloned with this weight and kept out of the value fit. 0 = off."""
    batch_size: int = 128
    """Rows per value and policy update."""
    lr: float = 1e-4
    """Policy learning rate; lower than SFT's: we fine-tune a working policy."""
    weight_decay: float = 1e-4
    """AdamW weight decay of the policy."""
    warmup_steps: int = 50
    """Linear learning-rate warm-up of the policy, in updates."""
    grad_clip: float = 1.0
    """Clip of the policy gradient's global norm."""
    ema_decay: float = 0.995
    """EMA of the policy weights: the EMA is the policy shipped (and, online, the one that acts)."""

    def __post_init__(self) -> None:
        """Validates the shared knobs; subclasses call it first and then check their own."""
        super().__post_init__()
        self.value_hidden = tuple(self.value_hidden)
        if self.value not in ("categorical", "expectile", "divl"):
            raise ValueError(f"value: expected categorical, expectile or divl, got {self.value!r}")
        if self.value_input not in ("policy", "privileged"):
            raise ValueError(f"value_input: expected policy or privileged, got {self.value_input!r}")
        DIVLConfig(quantile=self.divl_quantile, bins=self.value_bins)  # validates divl_quantile
        for name in ("value_steps", "value_folds", "value_bins", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)}")
        if not all(h >= 1 for h in self.value_hidden):
            raise ValueError(f"value_hidden: expected positive layer widths, got {self.value_hidden}")
        for name in ("lr", "value_lr", "beta", "w_max", "grad_clip"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected > 0, got {getattr(self, name)}")
        for name in ("weight_decay", "human_weight", "hindsight_weight", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected >= 0, got {getattr(self, name)}")
        if not 0.0 < self.gamma <= 1.0:
            raise ValueError(f"gamma: expected in (0, 1], got {self.gamma}")
        if not 0.0 <= self.advantage_lambda <= 1.0:
            raise ValueError(f"advantage_lambda: expected in [0, 1], got {self.advantage_lambda}")
        if not 0.0 < self.expectile < 1.0:
            raise ValueError(f"expectile: expected in (0, 1), got {self.expectile}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"ema_decay: expected in [0, 1), got {self.ema_decay}")

    def replay_uses(self, cameras: bool) -> list[str]:
        """What needs each episode's simulator state replayed (:mod:`vla_rl.train.privileged`), as the
        knobs that ask for it: a privileged value, and a camera policy's hindsight copies (its own state
        lacks where the object was brought). Empty: nothing is replayed, and recordings need no seed."""
        uses = ["value_input 'privileged'"] if self.value_input == "privileged" else []
        return uses + (
            ["hindsight_weight > 0 on a camera policy"] if cameras and self.hindsight_weight else []
        )


@dataclass(kw_only=True)
class AWRConfig(AdvantageConfig):
    """Every knob of an AWR / RECAP run; the value, weighting and optimiser knobs are those of the
    shared :class:`AdvantageConfig`. Defaults suit the small state-only policies on CPU."""

    distributed: ClassVar[bool] = True

    variant: Literal["awr", "recap"] = "awr"
    """awr: advantage-weighted regression; recap: advantage-conditioned (π0.6's RECAP)."""

    # policy extraction
    steps: int = 1500
    """Policy-extraction updates (one cosine schedule after the warm-up)."""
    positive_fraction: float = 0.3
    """RECAP: share of autonomous frames labelled positive (RLinf's positive_quantile)."""
    unconditional_prob: float = 0.3
    """RECAP: probability of dropping the indicator during training (learns the unconditional policy)."""
    guidance_scale: float = 1.0
    """RECAP: CFG weight saved into the checkpoint for deployment (1 = condition on positive)."""
    weighting: str = "advantage"
    """AWR's sample weights: ``advantage`` (the value's, steps 1 and 2), or a success estimator's learned
    from the selected episodes' outcomes (no value is fit; every frame is weighted, demonstrations too):
    ``success``: w = P(success | o_t, a_t:t+H) / mean; ``progress``: w = max(phi(o_t+H) - phi(o_t), 0) /
    mean; both clipped at ``w_max`` (:func:`vla_rl.train.success.estimator_weights`). For real data,
    where outcomes are labelled but there is no simulator to score rollouts."""

    # bookkeeping
    checkpoint_every: int = 500
    """Policy-extraction steps between saves of ``<out>/train_state.pt`` (for resuming)."""
    resume: bool = True
    """Continue from <out>/train_state.pt when it exists (exactly: the value fit and advantages are kept,
    policy extraction replays the same batches and noise)."""
    stop_at: int | None = None
    """Stop after this policy-extraction step, as a preempted job would (the schedule still spans
    ``steps``)."""

    @property
    def algorithm(self) -> str:  # type: ignore[override]
        return self.variant

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.variant not in ("awr", "recap"):
            raise ValueError(f"variant: expected awr or recap, got {self.variant!r}")
        for name in ("steps", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)}")
        if not 0.0 < self.positive_fraction < 1.0:
            raise ValueError(f"positive_fraction: expected in (0, 1), got {self.positive_fraction}")
        if not 0.0 <= self.unconditional_prob < 1.0:
            raise ValueError(f"unconditional_prob: expected in [0, 1), got {self.unconditional_prob}")
        if self.guidance_scale < 0:
            raise ValueError(f"guidance_scale: expected >= 0, got {self.guidance_scale}")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting: expected one of {list(WEIGHTINGS)}, got {self.weighting!r}")
        if self.weighting != "advantage" and self.variant != "awr":
            raise ValueError(
                f"weighting: {self.weighting!r} weights AWR's samples; variant {self.variant!r} conditions on "
                "advantages (use weighting advantage, or variant awr)"
            )


AWRResult = TrainResult
"""AWR / RECAP hand back the common result: metrics, curve and the data snapshot."""


# ---------------------------------------------------------------------------- pure pieces
def awr_weights(
    adv: np.ndarray, human: np.ndarray, beta: float, w_max: float, human_weight: float
) -> np.ndarray:
    """``min(exp(A / (beta * std_A)), w_max)`` for autonomous frames (std over them), ``human_weight``
    for human frames."""
    auto = ~human
    scale = float(adv[auto].std()) if auto.sum() > 1 else 1.0
    scale = scale if scale > 1e-8 else 1.0
    w = np.minimum(np.exp(np.clip(adv / (beta * scale), -50.0, 50.0)), w_max)
    return np.where(human, human_weight, w).astype(np.float32)


def recap_indicators(
    adv: np.ndarray, human: np.ndarray, positive_fraction: float
) -> tuple[np.ndarray, float]:
    """Indicator per frame (positive / negative) and the threshold eps: the (1 - fraction) quantile of
    autonomous advantages. Human frames are always positive."""
    auto = ~human
    eps = float(np.quantile(adv[auto], 1.0 - positive_fraction)) if auto.any() else 0.0
    ind = np.where(adv > eps, ADVANTAGE_POSITIVE, ADVANTAGE_NEGATIVE)
    return np.where(human, ADVANTAGE_POSITIVE, ind).astype(np.int64), eps


# ---------------------------------------------------------------------------- training
def all_features(policy: FlowPolicy, buf: TransitionBuffer, inputs: PolicyInputs) -> torch.Tensor:
    """Value inputs for every frame (:func:`vla_rl.train.contract.value_features`), each frame encoded
    with its own instruction (``inputs``: :class:`~vla_rl.train.contract.PolicyInputs` of ``buf``), in
    batches of 1024 frames (FlowVLA) or 64 (a VLA's prefix pass is larger)."""
    chunk = 1024 if isinstance(policy, FlowVLAFlowPolicy) else 64
    feats = []
    for start in range(0, len(buf), chunk):
        idx = np.arange(start, min(start + chunk, len(buf)))
        feats.append(value_features(policy, inputs(buf.batch(idx, horizon=1, n_step=1))))
    return torch.cat(feats)


def value_head(cfg: AdvantageConfig, feature_dim: int, v_min: float, v_max: float) -> torch.nn.Module:
    """A fresh value head of kind ``cfg.value``; the categorical ones put their atoms on ``[v_min, v_max]``."""
    if cfg.value == "categorical":
        return CategoricalValue(feature_dim, cfg.value_bins, v_min, v_max, cfg.value_hidden)
    if cfg.value == "divl":
        divl = DIVLConfig(quantile=cfg.divl_quantile, bins=cfg.value_bins)
        return DIVLValue(feature_dim, divl, v_min, v_max, cfg.value_hidden)
    return ValueMLP(feature_dim, cfg.value_hidden)


def fit_value(
    cfg: AdvantageConfig,
    feats: torch.Tensor,
    returns: torch.Tensor,
    train_rows: np.ndarray,
    bar_desc: str,
    head: torch.nn.Module | None = None,
) -> tuple[torch.nn.Module, float]:
    """Fit V on ``feats[train_rows] -> returns[train_rows]`` for ``value_steps`` updates (a fresh AdamW);
    returns the head and its last loss. ``head``: continue from it (a warm start: its weights and its
    atoms' support are kept) instead of a fresh head whose support spans the rows' return range."""
    if head is None:
        fit = returns[torch.from_numpy(train_rows).to(returns.device)]
        lo, hi = float(fit.min()), float(fit.max())
        if hi - lo < 1e-6:
            lo, hi = lo - 1.0, hi + 1.0
        head = value_head(cfg, feats.shape[1], lo, hi).to(feats.device)
    head.train()
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.value_lr, weight_decay=1e-4)
    rng = np.random.default_rng([cfg.seed, 1])

    def loss_fn() -> torch.Tensor:
        rows = torch.from_numpy(rng.choice(train_rows, size=cfg.batch_size))
        f, g = feats[rows], returns[rows]
        if isinstance(head, CategoricalValue):
            return head.loss(f, g)
        return expectile_loss(head(f), g, cfg.expectile)

    with StepProgress(cfg.value_steps, stage="value", desc=bar_desc, show=cfg.progress) as bar:
        loss_val = fit_minibatches(opt, loss_fn, cfg.value_steps, bar)[-1]
    return head.eval(), loss_val


def episode_folds(keys: Sequence[int | str], folds: int, seed: int) -> np.ndarray:
    """Fold of each episode, ``sha1(seed, key) mod folds``, from a key that names the episode for the
    whole run (awr-pi: its arrival index, offline episodes first, then online ones in collection order):
    an episode keeps its fold whatever else the buffer holds, so a value head kept across iterations
    (``value_warm_start``) never scores an episode it was trained on, even as episodes arrive and
    leave. Deterministic given the keys (a run stays a function of its config)."""
    out = np.empty(len(keys), np.int64)
    for i, key in enumerate(keys):
        digest = hashlib.sha1(f"{seed}:{key}".encode(), usedforsecurity=False).digest()
        out[i] = int.from_bytes(digest[:8], "big") % folds
    return out


def lambda_returns(
    reward: np.ndarray,
    mc_return: np.ndarray,
    values: np.ndarray,
    last: np.ndarray,
    cut: np.ndarray,
    gamma: float,
    lam: float,
) -> np.ndarray:
    """λ-returns over a buffer's frames (arrays ``[N]`` in buffer order), backwards within each run of
    consecutive frames::

        G^λ_t = r_t + γ ((1 - λ) V(s_{t+1}) + λ G^λ_{t+1})

    The last frame of a run (an episode's end, or the frame before a dropped idle stretch) and a frame
    whose return is cut (a takeover scored as a failure) keep their Monte-Carlo return ``mc_return``,
    which already holds what lies beyond them (nothing after a terminal, the failure's cost after a cut,
    the dropped frames' rewards before a gap). ``λ = 1`` gives ``mc_return`` back (the recursion is the
    Monte-Carlo one); ``λ = 0`` the one-step TD target ``r_t + γ V(s_{t+1})``."""
    out = np.empty(len(reward), np.float64)
    nxt = 0.0
    for t in range(len(reward) - 1, -1, -1):
        if last[t] or cut[t]:
            nxt = float(mc_return[t])
        else:
            nxt = float(reward[t]) + gamma * ((1.0 - lam) * float(values[t + 1]) + lam * nxt)
        out[t] = nxt
    return out.astype(np.float32)


def cross_fitted_values(
    cfg: AdvantageConfig,
    feats: torch.Tensor,
    returns: torch.Tensor,
    episode: np.ndarray,
    human: np.ndarray,
    fold_of: np.ndarray | None = None,
    heads: dict[int, torch.nn.Module] | None = None,
) -> tuple[torch.Tensor, float]:
    """V(s) for every frame from a value fitted WITHOUT that frame's episode (``value_folds`` folds).

    A value trained on the very returns it is compared with memorises them (each trajectory's states
    identify it), so G - V collapses to noise; out-of-fold values give honest advantages.

    ``fold_of``: each episode's fold (indexed by ``episode``); None = a seeded balanced permutation.
    ``heads`` (a warm start across calls): fold k's fit continues from ``heads[k]`` when present, and
    the fitted head is stored there; with stable folds (:func:`episode_folds`) each head only ever
    trains on episodes outside its fold. A head that had to fall back to every episode (no other fold
    holds any) is not kept.
    """
    if heads is not None and fold_of is None:
        raise ValueError("heads: a warm start needs folds fixed per episode (fold_of, see episode_folds)")
    n_ep = int(episode.max()) + 1
    if fold_of is None:
        folds = min(cfg.value_folds, n_ep)
        fold_of = np.random.default_rng([cfg.seed, 2]).permutation(n_ep) % folds
    else:
        folds = cfg.value_folds
    frame_fold = fold_of[episode]
    values = torch.empty_like(returns)
    losses = []
    for k in range(folds):
        rows = torch.from_numpy(np.flatnonzero(frame_fold == k)).to(feats.device)
        if len(rows) == 0:
            continue  # nothing to score in this fold (stable folds can leave one empty)
        train_rows = np.flatnonzero((frame_fold != k) & ~human) if folds > 1 else np.flatnonzero(~human)
        out_of_fold = len(train_rows) > 0 or folds == 1
        if not out_of_fold:
            train_rows = np.flatnonzero(~human)
        warm = heads.get(k) if heads is not None and out_of_fold else None
        head, loss = fit_value(cfg, feats, returns, train_rows, f"value {k + 1}/{folds}", head=warm)
        if heads is not None and out_of_fold:
            heads[k] = head
        with torch.no_grad():
            values[rows] = head(feats[rows]).to(values.dtype)
        losses.append(loss)
    return values, float(np.mean(losses))


def value_advantages(
    cfg: AdvantageConfig,
    feats: torch.Tensor,
    buf: TransitionBuffer,
    bc: np.ndarray,
    heads: dict[int, torch.nn.Module] | None = None,
    fold_of: np.ndarray | None = None,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Steps 1 and 2: ``A_t = G_t - V(s_t)`` for every frame of ``buf`` (``G`` its credit-aware
    ``mc_return``, or its λ-return for ``advantage_lambda < 1`` (:func:`lambda_returns`); ``V``
    cross-fitted by episode on the frames not in ``bc``, :func:`cross_fitted_values`),
    and how well the value fits: its last loss, the std of the autonomous advantages, and the
    out-of-fold value's correlation with the returns and explained variance ``1 - Var(G - V) / Var(G)``
    over the autonomous frames. ``heads`` and ``fold_of``: a warm start of the fold heads from (and
    into) ``heads`` on folds fixed per episode (:func:`episode_folds`, :func:`cross_fitted_values`);
    None = fresh heads on a seeded permutation."""
    returns = torch.from_numpy(buf.array("mc_return")).to(feats.device)
    values, value_loss = cross_fitted_values(cfg, feats, returns, buf.array("episode"), bc, fold_of, heads)
    g_all, v_all = returns.cpu().numpy(), values.cpu().numpy()
    target = g_all
    if cfg.advantage_lambda < 1.0:
        end = buf.array("end")
        last = np.arange(len(end)) == end - 1
        target = lambda_returns(
            buf.array("reward"), g_all, v_all, last, buf.array("cut"), cfg.gamma, cfg.advantage_lambda
        )
    adv = target - v_all
    g, v = g_all[~bc], v_all[~bc]
    metrics: dict[str, Any] = {
        "value_loss": value_loss,
        "adv_std": float(adv[~bc].std()),
        "value_return_corr": float(np.corrcoef(v, g)[0, 1]) if len(g) > 2 and g.std() > 0 else float("nan"),
        "value_explained_var": float(1.0 - (g - v).var() / g.var()) if g.var() > 0 else float("nan"),
    }
    return adv, metrics


def train_awr(cfg: AWRConfig) -> AWRResult:
    """Fit the value, score advantages, re-train the policy; returns the checkpoint and metrics.

    Re-running into the same ``out`` resumes from ``train_state.pt`` (value fit and advantages kept).
    Under torchrun every process trains on its share of each global batch (see
    :mod:`vla_rl.train.distributed`); rank 0 writes the checkpoint, the train state and the logs."""
    with distributed(cfg.device) as (dist, device):
        return _train_awr(cfg, dist, device)


def _score(
    cfg: AWRConfig,
    base: FlowCheckpoint,
    buf: TransitionBuffer,
    human: np.ndarray,
    hindsight: np.ndarray,
    device: torch.device,
    inputs: PolicyInputs,
    replayed: ReplayedStates,
) -> tuple[dict[str, Any], torch.Tensor]:
    """Steps 1 and 2: the cross-fitted value and every frame's AWR weight or RECAP indicator
    (``hindsight`` frames, a subset of ``human``'s frames to clone: weight ``hindsight_weight``;
    ``replayed``: the episodes' full simulator state, V's input with ``value_input = "privileged"``)."""
    if cfg.weighting != "advantage":
        replayed.close()
        return _estimator_weighting(cfg, buf, hindsight, int(base.policy.chunk_len))
    if not (~human).any():
        raise ValueError(
            f"the selected episodes hold no autonomous frames to score ({len(buf)} frames, all human or "
            f"recovery: e.g. teleoperated demonstrations); {cfg.variant} weighs the policy's own actions, so "
            "select rollouts too, or train sft (or qam) on demonstrations"
        )
    # 1. value on credit-aware returns of autonomous frames, cross-fitted by episode; 2. advantages
    if cfg.value_input == "privileged":
        try:
            feats = torch.from_numpy(replayed.features(buf)).to(device)
        finally:
            replayed.close()
    else:
        feats = all_features(base.policy, buf, inputs)
    adv, metrics = value_advantages(cfg, feats, buf, human)
    if cfg.variant == "awr":
        weights = awr_weights(adv, human, cfg.beta, cfg.w_max, cfg.human_weight)
        weights[hindsight] = cfg.hindsight_weight
        w_auto = weights[~human]
        metrics.update(
            weight_mean=float(w_auto.mean()),
            weight_max=float(w_auto.max()),
            effective_sample_frac=float(w_auto.sum() ** 2 / (len(w_auto) * (w_auto**2).sum())),
        )
        return metrics, torch.from_numpy(weights)
    indicators, eps = recap_indicators(adv, human, cfg.positive_fraction)
    metrics.update(threshold=eps, positive_frac=float((indicators[~human] == ADVANTAGE_POSITIVE).mean()))
    return metrics, torch.from_numpy(indicators)


def _estimator_weighting(
    cfg: AWRConfig, buf: TransitionBuffer, hindsight: np.ndarray, chunk_len: int
) -> tuple[dict[str, Any], torch.Tensor]:
    """Every frame's weight from a success / progress estimator fit on the selected episodes' outcomes
    (``weighting``; hindsight copies keep ``hindsight_weight``); ValueError without outcome labels."""
    store = EpisodeStore(cfg.store)
    db = store_index.store_db(store, MetadataDB(cfg.db_url) if cfg.db_url else None)
    stored = set(store.episode_ids())
    ids = [e for e in buf.episode_ids if e in stored]  # hindsight copies are not stored episodes
    fit = SuccessFitConfig(horizon=chunk_len, camera_grid=4 if buf.use_cameras else 0, seed=cfg.seed)
    cams = list(buf.spec.camera_names)
    rows = outcome_rows(store, ids, db, horizon=fit.horizon, camera_grid=fit.camera_grid, cameras=cams)
    est, summary = fit_success_estimator(rows, fit)
    weights, raw = buffer_weights(est, buf, cfg.weighting, cfg.w_max)
    weights[hindsight] = cfg.hindsight_weight
    metrics = {
        "estimator_success_rows": float(summary["success_rows"]),
        "estimator_failure_rows": float(summary["failure_rows"]),
        "estimator_loss": summary["success_loss" if cfg.weighting == "success" else "progress_loss"],
        "raw_score_mean": float(raw.mean()),
        "weight_mean": float(weights.mean()),
        "weight_max": float(weights.max()),
        "effective_sample_frac": float(weights.sum() ** 2 / (len(weights) * (weights**2).sum())),
    }
    return metrics, torch.from_numpy(weights)


def _train_awr(cfg: AWRConfig, dist: Dist, device: torch.device) -> AWRResult:
    clock = RunClock()
    dist.check_batch(cfg.batch_size)
    shard = Shard(dist, cfg.batch_size)
    if not dist.is_main:
        cfg = dataclasses.replace(cfg, progress=False)  # one set of progress bars: rank 0's
    torch.set_num_threads(dist.threads(cfg.threads))
    torch.manual_seed(cfg.seed)
    base = load_base(cfg, device)
    spec, task = base.spec, base.task(cfg.task)
    selection = Selection.parse(cfg.data, task=task)
    db = MetadataDB(cfg.db_url) if cfg.db_url else None
    buf = load_transitions(cfg.store, selection, db=db, reward=cfg.reward, gamma=cfg.gamma)
    if buf.spec.state_dim != spec.state_dim or buf.spec.camera_names != spec.camera_names:
        raise ValueError(f"store episodes (spec {buf.spec.name}) do not match the base checkpoint's spec")
    # each episode's full simulator state, replayed once where it is needed: a camera policy's hindsight
    # copies and a privileged value (vla_rl/train/privileged.py)
    store = EpisodeStore(cfg.store)
    replayed = ReplayedStates(
        task, lambda e: store.read_episode(e, cameras=False), uses=cfg.replay_uses(bool(spec.cameras))
    )
    copies: list[int] = []
    if cfg.hindsight_weight:
        layout = goal_layout(task, bool(spec.cameras))
        try:
            copies = add_hindsight_copies(buf, layout, replayed.states if spec.cameras else None)
        finally:
            replayed.close()
    hindsight = np.isin(buf.array("episode"), copies)
    # each frame is conditioned on its own instruction (its episode's task string), as in SFT
    inputs = PolicyInputs(base.policy, buf, device)
    # frames to clone: human interventions, and autonomous frames a person labelled `recovery` (the buffer's bc)
    human = buf.array("bc").astype(bool)
    snap = buf.snapshot()
    data = {
        "selection": selection.to_dict(),
        "episodes": snap["episodes"],
        "frames": snap["frames"],
        "human_frames": int((buf.array("controller") == int(Controller.HUMAN)).sum()),
        "clone_frames": int(human.sum()),
        "hindsight_episodes": len(copies),
        "digest": snap["digest"],
    }
    cfg.out.mkdir(parents=True, exist_ok=True)
    state = TrainState(cfg.out, clock)
    st = state.read(cfg.resume)
    log.info(
        f"{cfg.variant} {'resumed' if st is not None else 'start'}",
        extra={
            "base": cfg.base,
            "processes": dist.world,
            **{k: v for k, v in data.items() if k != "selection"},
            **({"step": int(st["step"]), "from": str(state.path)} if st is not None else {}),
        },
    )
    if st is not None:
        metrics: dict[str, Any] = json.loads(st["metrics"])
        per_frame = st["per_frame"]
        if len(per_frame) != len(buf):
            raise ValueError(
                f"resume: {state.path} scored {len(per_frame)} frames, the selected data holds {len(buf)}; "
                "give another --out (or --no-resume) for other data"
            )
    else:
        metrics, per_frame = _score(cfg, base, buf, human, hindsight, device, inputs, replayed)
        # every rank fitted the same value; rank 0's result is the one all train on (GPU kernels need
        # not be bit-reproducible across processes)
        per_frame = broadcast_tensor(per_frame, dist)
        metrics = broadcast_object(metrics, dist)

    # 3. policy extraction, starting from the base weights
    policy = _extraction_policy(cfg, base.policy)
    params = trainable_parameters(cfg, policy)
    model = trained_module(policy)
    broadcast_module(model, dist)
    ema = EMA(model, cfg.ema_decay)
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    opt = Optimiser(
        optimizer,
        {"policy": list(model.parameters())},
        cfg.grad_clip,
        warmup_cosine_schedule(optimizer, cfg.warmup_steps, cfg.steps, 0.1),
    )
    state.parts.update(model=model, ema=ema, optimizer=optimizer, scheduler=opt.scheduler)
    start, last_loss = 0, float("nan")
    if st is not None:
        state.restore(st)
        start, last_loss = int(st["step"]), float(st["last_loss"])
    tlog = TrainLog(
        cfg,
        dist,
        purge_step=start,
        config_step=0 if st is None else None,
        curve=json.loads(st["curve"]) if st is not None else None,
    )
    if st is None:
        tlog.scalars("value", metrics, 0)

    def update(step: int) -> dict[str, Any]:
        """Weighted (AWR) or advantage-conditioned (RECAP) flow matching on the global batch's rows and
        random draws (as one process makes them), this rank's share."""
        idx = shard.take(sample_indices(len(buf), cfg.batch_size, cfg.seed, step))
        batch = inputs(buf.batch(idx, horizon=policy.chunk_len, n_step=1))
        sel = per_frame[idx].to(device)
        weights = None
        if cfg.variant == "awr":
            weights = sel
        else:  # RECAP: the indicator (dropped to unconditioned) conditions the policy
            drop = shard.rand(device=device) < cfg.unconditional_prob
            batch["advantage"] = torch.where(drop, torch.full_like(sel, ADVANTAGE_UNCONDITIONAL), sel)
        noise = shard.randn(*policy.event_shape, device=device)
        t = shard.take(policy.sample_time(cfg.batch_size))
        loss, m = weighted_flow_loss(policy, batch, weights=weights, noise=noise, time=t)
        gradient_step(loss, [opt], dist)
        ema.update(model)
        return {"loss": m["loss"], "mse": m["mse"]}

    def on_log(step: int, m: dict[str, float]) -> None:
        tlog.row("train", {"step": step, "loss": m["loss"], "mse": m["mse"]}, step)
        bar.set_postfix(loss=f"{m['loss']:.4f}")

    def save(step: int) -> None:
        """The train state (every ``checkpoint_every`` steps before the end, and at the end), rank 0 only."""
        state.save(
            step=step,
            per_frame=per_frame,
            metrics=json.dumps(metrics),
            curve=json.dumps(tlog.curve),
            last_loss=loop.metrics.get("loss", last_loss),
        )

    end = min(cfg.steps, cfg.stop_at or cfg.steps)
    loop = UpdateLoop.over_steps(
        update,
        cfg,
        dist,
        step=start,
        on_log=on_log,
        checkpoint=Beat(cfg.checkpoint_every),
        on_checkpoint=lambda step: save(step) if step < end else None,  # the end's state follows below
    )
    policy.train()
    bar = tlog.progress(cfg.steps, initial=start, stage="train", desc=cfg.variant)
    loop.run(end, bar)
    tlog.close()
    step = max(start, end)
    metrics["final_loss"] = loop.metrics.get("loss", last_loss)
    ckpt = cfg.out / "checkpoint"
    if dist.is_main:
        save_trained(
            as_policy(ema.model, policy),
            ckpt,
            base,
            algorithm=cfg.variant,
            data=data,  # the digest pins the exact episodes; the round's DB row lists them
            metrics={"train_steps": step, **{k: round(v, 6) for k, v in metrics.items()}},
            round_index=cfg.round_index,
        )
        save(step)
    seconds = clock.seconds
    log.info(f"{cfg.variant} done", extra={"checkpoint": str(ckpt), "seconds": round(seconds, 1), **metrics})
    return AWRResult(
        checkpoint=ckpt,
        seconds=seconds,
        metrics=metrics,
        curve=tlog.curve,
        data={**data, "episode_lengths": snap["episode_lengths"]},
    )


def _extraction_policy(cfg: AWRConfig, base: FlowPolicy) -> FlowPolicy:
    """The policy that extraction trains, starting from the base's weights: made advantage-conditioned for
    RECAP with the guidance scale it deploys with (FlowVLA: a new model with a fresh advantage embedding;
    a LeRobot VLA: the indicator's text in its prompt). FlowVLA trains a new copy in either variant, as
    it always did (its construction's random draws keep every later draw where it was)."""
    if cfg.variant == "recap":
        return base.condition_on_advantage(cfg.guidance_scale)
    return base.rebuilt() if isinstance(base, FlowVLAFlowPolicy) else base
