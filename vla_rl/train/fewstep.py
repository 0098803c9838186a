"""Few-step distillation ("distill"): a K = 1 or 2 student of a K-step flow policy, as a round algorithm.

A flow policy deploys an Euler ODE of K steps (``x_{k+1} = x_k + v(s, x_k, t_k) / K``, t_k = k / K; time
convention t = 0 noise, t = 1 data, docs/algorithms.md §0); its inference time grows with K. This trainer
distils the parent's K_T-step sampler into a student that deploys with K_S steps (K_S < K_T, K_S dividing
K_T; 1 or 2 in practice): the student is a copy of the parent whose config says ``num_inference_steps =
K_S``, so its checkpoint is an ordinary flow policy that :func:`policies.loading.load_policy`, evaluation
and the server serve as they serve any other (a LeRobot SmolVLA / π0 / π0.5 folder saves K_S in its own
config: ``num_steps`` / ``num_inference_steps``).

**Teacher pairs.** Each update draws observations s from the store (demos and / or the fleet's episodes,
``data``) and noise z ~ N(0, I), and runs the parent's deterministic K_T-step ODE from z with no gradient:
its iterates x^T_j at t = j / K_T. The student's grid t_k = k / K_S falls on teacher iterates (K_T / K_S
teacher steps per student step), so the teacher's flow map over each student step is known:
``X_k = x^T_{k K_T / K_S}`` (X_0 = z, X_{K_S} = the parent's chunk on z). With ``pairs_per_frame`` N > 0
every frame is labelled N times once, before training, and the updates draw from that pool (a teacher
pass per pair rather than per update: several times cheaper on a CPU).

**Objective** (Δ = 1 / K_S, errors over the robot's action dims: a LeRobot VLA's padding is no action)::

    L_map  = (1 / K_S) Σ_k mean ||X_k + Δ v_θ(s, X_k, t_k) − X_{k+1}||²       (flow-map regression)
    L_roll = mean ||Φ_θ(s, z) − X_{K_S}||²,   Φ_θ = the student's own K_S-step Euler ODE from z
    L      = w_map L_map + w_roll L_roll + w_fm L_FM(data)

* ``L_map`` teaches each student step the teacher's flow map over its interval, started from the
  teacher's own point (the secant ``(X_{k+1} − X_k) / Δ`` is the average velocity over the step, the
  quantity MeanFlow / shortcut models learn, here at the student's fixed grid, so the parent's network
  needs no step-size input);
* ``L_roll`` regresses the student's deployed sampler end to end on the teacher's chunk (a K_S-step
  student's later steps start from its own, not the teacher's, iterates: this term corrects what they
  compound). With K_S = 1 the two terms are the same number, ``mean ||z + v_θ(s, z, 0) − ODE_T(s, z)||²``
  (FQL's distillation loss, :func:`vla_rl.train.fql.distillation_loss`), computed once;
* ``L_FM`` (``fm_weight``, default 0): the ordinary flow-matching loss on the data's actions, an anchor for
  little data. Off by default: at the student's grid times its target, the instantaneous velocity, is not
  the secant the student must learn, so it pulls against the objective.

The student starts from the parent (at t = 0 a flow's velocity points at the data mean, so the copy's
one-step chunk starts near E[a | s] and far from the parent's: a from-scratch learning rate, as FQL's
actor, with a warm-up and a cosine decay to a tenth). What trains follows ``trainable`` (FlowVLA: all of
it; a LeRobot VLA on a CPU: its action expert).

Output: ``<out>/checkpoints/last`` (the student; lineage algorithm "distill", parent the base's commit,
data naming K_T and K_S), ``<out>/tb``, ``<out>/curve.json``. One process, no resume (a re-run starts
over). A round gates the student against its parent like any round's output (docs/training.md).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from fleet.selection import Selection
from fleet.store import EpisodeStore
from policies.flow_policy import FlowPolicy
from policies.flow_vla import euler_sample
from policies.loading import pick_device
from vla_rl.train.base import TrainerConfig, TrainResult, check_optional_positive
from vla_rl.train.common import RunClock, sample_indices
from vla_rl.train.contract import (
    ACTION_KEYS,
    PolicyInputs,
    load_base,
    save_trained,
    trainable_copy,
    trainable_parameters,
    weighted_flow_loss,
)
from vla_rl.train.distributed import SINGLE
from vla_rl.train.loop import (
    Optimiser,
    TrainLog,
    UpdateLoop,
    gradient_step,
    warmup_cosine_schedule,
)
from vla_rl.train.transitions import load_transitions

log = logging.getLogger(__name__)
Tensor = torch.Tensor
VelocityFn = Callable[[Tensor, float], Tensor]

__all__ = [
    "DistillConfig",
    "DistillResult",
    "check_grids",
    "distill_losses",
    "flow_map_loss",
    "rollout_loss",
    "teacher_grid_points",
    "train_distill",
]


# ============================================================================ pure pieces
def check_grids(teacher_steps: int, student_steps: int) -> None:
    """A student of K_S steps learns from a teacher of K_T steps only when K_S < K_T and the student's grid
    falls on the teacher's iterates (K_T a multiple of K_S); else a ValueError naming the fields."""
    if not 1 <= student_steps < teacher_steps or teacher_steps % student_steps:
        raise ValueError(
            f"student_steps: expected a divisor of the teacher's K = {teacher_steps} (teacher_steps) smaller "
            f"than it, so the student's grid k / K_S falls on the teacher's iterates; got {student_steps}"
        )


def teacher_grid_points(iterates: Tensor, student_steps: int) -> Tensor:
    """The teacher's iterates ``[B, K_T + 1, H, D]`` (t = j / K_T) at the student's grid t_k = k / K_S:
    ``X_k = x^T_{k K_T / K_S}`` -> ``[B, K_S + 1, H, D]`` (X_0 the noise, X_{K_S} the teacher's chunk)."""
    teacher_steps = iterates.shape[1] - 1
    check_grids(teacher_steps, student_steps)
    return iterates[:, :: teacher_steps // student_steps]


def _robot_mse(x: Tensor, target: Tensor, dims: int) -> Tensor:
    """``mean ||x − target||²`` over batch, steps and the first ``dims`` (the robot's) action dims; the
    target carries no gradient."""
    return (x[..., :dims] - target[..., :dims].detach()).square().mean()


def flow_map_loss(velocity: VelocityFn, points: Tensor, dims: int) -> Tensor:
    """``L_map = (1 / K) Σ_k mean ||X_k + Δ v(X_k, t_k) − X_{k+1}||²`` for the teacher's points
    ``X`` ``[B, K + 1, H, D]`` at the student's grid (t_k = k / K, Δ = 1 / K), over the first ``dims`` dims."""
    k_s = points.shape[1] - 1
    dt = 1.0 / k_s
    terms = [
        _robot_mse(points[:, k] + dt * velocity(points[:, k], k * dt), points[:, k + 1], dims)
        for k in range(k_s)
    ]
    return torch.stack(terms).mean()


def rollout_loss(velocity: VelocityFn, z: Tensor, target: Tensor, student_steps: int, dims: int) -> Tensor:
    """``L_roll = mean ||Φ(z) − target||²``: the student's own ``student_steps``-step Euler ODE from ``z``
    ``[B, H, D]`` (the deployed sampler, differentiable) against the teacher's chunk, over ``dims`` dims."""
    return _robot_mse(euler_sample(velocity, z, student_steps).actions, target, dims)


def distill_losses(
    velocity: VelocityFn, points: Tensor, dims: int, *, map_weight: float, rollout_weight: float
) -> dict[str, Tensor]:
    """``loss_map``, ``loss_rollout`` and their weighted sum ``loss`` for the teacher's points ``X``
    ``[B, K_S + 1, H, D]`` at the student's grid (:func:`teacher_grid_points`; ``X_0`` the noise); with one
    student step the two terms are the same number, so the velocity is evaluated once."""
    student_steps = points.shape[1] - 1
    out = {"loss_map": flow_map_loss(velocity, points, dims)}
    if student_steps == 1:
        out["loss_rollout"] = out["loss_map"]
    else:
        out["loss_rollout"] = rollout_loss(velocity, points[:, 0], points[:, -1], student_steps, dims)
    out["loss"] = map_weight * out["loss_map"] + rollout_weight * out["loss_rollout"]
    return out


# ============================================================================ config
MAX_PAIRS_PER_FRAME = 1024
"""The pool holds frames x pairs_per_frame teacher chunks in memory: bounded so that a mistyped value is
refused when the config is made, not when the pool fills the machine."""


@dataclass(kw_only=True)
class DistillConfig(TrainerConfig):
    """Every knob of a few-step distillation run (the module docstring has the objective)."""

    algorithm: ClassVar[str] = "distill"
    chooses_trainable: ClassVar[bool] = True

    store: Path = field()
    """Episode store whose observations the teacher labels (demos, the fleet's rollouts)."""
    student_steps: int = 1
    """K_S: the student's Euler steps, saved as its ``num_inference_steps`` (1 or 2 for a few-step head)."""
    teacher_steps: int | None = None
    """K_T: the parent's Euler steps that the student distils; None = the parent's own K."""
    map_weight: float = 1.0
    """w_map: weight of the per-step flow-map regression L_map."""
    rollout_weight: float = 1.0
    """w_roll: weight of the end-to-end rollout regression L_roll."""
    fm_weight: float = 0.0
    """w_fm: weight of the flow-matching loss on the data's actions (an anchor; 0 = off)."""
    pairs_per_frame: int = 0
    """0: every update labels its batch with the teacher from fresh noise (the objective as written). N > 0:
    label every frame of the data N times (fresh noise each) once, before training, and draw the updates'
    pairs from that fixed pool: a teacher pass per pair instead of per update (several times cheaper on a
    CPU; the pool must be large enough not to be memorised)."""
    steps: int = 2000
    """Gradient updates."""
    batch_size: int = 128
    lr: float = 3e-4
    """Peak learning rate (Adam), after ``warmup_steps``, decayed by a cosine to a tenth at ``steps``."""
    warmup_steps: int = 100
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    max_seconds: float | None = None
    """Wall-clock budget: stop updating after this many seconds and save what there is."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("student_steps", "steps", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)}")
        if self.teacher_steps is not None:
            check_grids(self.teacher_steps, self.student_steps)
        if not 0 <= self.pairs_per_frame <= MAX_PAIRS_PER_FRAME:
            raise ValueError(
                f"pairs_per_frame: expected 0..{MAX_PAIRS_PER_FRAME} (0 = fresh pairs every update), "
                f"got {self.pairs_per_frame}"
            )
        for name in ("map_weight", "rollout_weight", "fm_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected >= 0, got {getattr(self, name)}")
        if self.map_weight + self.rollout_weight <= 0:
            raise ValueError(
                "map_weight: the student learns from the teacher only through map_weight or rollout_weight; "
                f"expected one of them > 0, got {self.map_weight} and {self.rollout_weight}"
            )
        for name in ("lr", "grad_clip"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected > 0, got {getattr(self, name)}")
        if self.warmup_steps >= self.steps:
            raise ValueError(
                f"warmup_steps: expected fewer than steps ({self.steps}), got {self.warmup_steps}"
            )
        check_optional_positive(self, "max_seconds", "a number of seconds > 0")


# ============================================================================ training
@dataclass(kw_only=True)
class DistillResult(TrainResult):
    steps: int
    """Gradient updates run."""


@torch.no_grad()
def teacher_iterates(teacher: FlowPolicy, obs: Mapping[str, Any], z: Tensor, teacher_steps: int) -> Tensor:
    """The parent's deterministic ``teacher_steps``-step Euler ODE from ``z`` ``[B, H, D]``: its iterates
    ``[B, K_T + 1, H, D]`` (normalised, unclipped), no gradient."""
    sample = teacher.sample(obs, num_steps=teacher_steps, noise=z[:, None], return_iterates=True)
    assert sample.iterates is not None
    return sample.iterates[:, 0]


def student_losses(
    student: FlowPolicy, batch: Mapping[str, Any], points: Tensor, cfg: DistillConfig
) -> dict[str, Tensor]:
    """One update's losses (:func:`distill_losses`, plus ``loss_fm`` when ``fm_weight``) on a batch of
    observations with their actions and the teacher's points ``[B, K_S + 1, H, D]`` on them."""
    prefix = student.encode_prefix(observations(batch))
    out = distill_losses(
        lambda x, t: student.velocity(prefix, x, t),
        points,
        student.action_dim,
        map_weight=cfg.map_weight,
        rollout_weight=cfg.rollout_weight,
    )
    if cfg.fm_weight > 0:
        out["loss_fm"] = weighted_flow_loss(student, batch)[0]
        out["loss"] = out["loss"] + cfg.fm_weight * out["loss_fm"]
    return out


def observations(batch: Mapping[str, Any]) -> dict[str, Any]:
    """A batch without its actions: what a prefix reads."""
    return {k: v for k, v in batch.items() if k not in ACTION_KEYS}


class TeacherPairs:
    """Where an update's (observation, teacher points) pairs come from: labelled by the teacher for each
    batch from fresh noise (``pairs_per_frame`` 0), or drawn from a pool labelled once, every frame
    ``pairs_per_frame`` times."""

    def __init__(
        self, teacher: FlowPolicy, buf: Any, inputs: PolicyInputs, cfg: DistillConfig, teacher_steps: int
    ) -> None:
        self.teacher, self.buf, self.inputs, self.cfg, self.k_t = teacher, buf, inputs, cfg, teacher_steps
        self.horizon = teacher.chunk_len
        self.pool_rows: np.ndarray | None = None
        self.pool_points: Tensor | None = None
        if cfg.pairs_per_frame:
            self._label_pool()

    def label(self, batch: Mapping[str, Any]) -> Tensor:
        """The teacher's points at the student's grid from fresh noise, for a batch of observations."""
        z = torch.randn(batch["state"].shape[0], *self.teacher.event_shape, device=self.teacher.device)
        return teacher_grid_points(
            teacher_iterates(self.teacher, observations(batch), z, self.k_t), self.cfg.student_steps
        )

    def _label_pool(self, chunk: int = 256) -> None:
        rows = np.repeat(np.arange(len(self.buf)), self.cfg.pairs_per_frame)
        points = []
        for i in range(0, len(rows), chunk):
            batch = self.inputs(self.buf.batch(rows[i : i + chunk], horizon=self.horizon, n_step=1))
            points.append(self.label(batch).cpu())
        self.pool_rows, self.pool_points = rows, torch.cat(points)

    def __call__(self, step: int) -> tuple[dict[str, Any], Tensor]:
        """Update ``step``'s batch (observations with their actions) and the teacher's points on it."""
        cfg = self.cfg
        if self.pool_rows is None or self.pool_points is None:
            rows = sample_indices(len(self.buf), cfg.batch_size, cfg.seed, step)
            batch = self.inputs(self.buf.batch(rows, horizon=self.horizon, n_step=1))
            return batch, self.label(batch)
        pick = sample_indices(len(self.pool_rows), cfg.batch_size, cfg.seed, step)
        batch = self.inputs(self.buf.batch(self.pool_rows[pick], horizon=self.horizon, n_step=1))
        return batch, self.pool_points[pick].to(self.teacher.device)


def train_distill(cfg: DistillConfig) -> DistillResult:
    """Distil the base checkpoint into a ``cfg.student_steps``-step student on the store's observations;
    returns the student's checkpoint and the last update's losses."""
    clock = RunClock()
    device = pick_device(cfg.device)
    torch.set_num_threads(SINGLE.threads(cfg.threads))
    torch.manual_seed(cfg.seed)
    base = load_base(cfg, device)
    task = base.task(cfg.task)
    teacher = base.policy
    teacher.requires_grad_(False)
    k_t = cfg.teacher_steps or teacher.num_inference_steps
    check_grids(k_t, cfg.student_steps)
    student = trainable_copy(teacher, num_inference_steps=cfg.student_steps)
    params = trainable_parameters(cfg, student)
    student.train(True)
    from fleet.db import MetadataDB

    selection = Selection.parse(cfg.data, task=task)
    buf = load_transitions(
        EpisodeStore(cfg.store),
        selection,
        db=MetadataDB(cfg.db_url) if cfg.db_url else None,
        cameras=bool(base.spec.cameras),
    )
    inputs = PolicyInputs(student, buf, device)
    adam = torch.optim.Adam(params, lr=cfg.lr)
    opt = Optimiser(
        adam,
        {"student": params},
        cfg.grad_clip,
        warmup_cosine_schedule(adam, cfg.warmup_steps, cfg.steps, 0.1),
    )
    cfg.out.mkdir(parents=True, exist_ok=True)
    tlog = TrainLog(cfg, SINGLE, purge_step=None, config_step=0)
    log.info(
        "distill start",
        extra={
            "task": task,
            "base": cfg.base,
            "frames": len(buf),
            "teacher_steps": k_t,
            "K": cfg.student_steps,
        },
    )

    pairs = TeacherPairs(teacher, buf, inputs, cfg, k_t)

    def update(step: int) -> dict[str, Tensor]:
        batch, points = pairs(step)
        out = student_losses(student, batch, points, cfg)
        gradient_step(out["loss"], [opt], SINGLE)
        return out

    loop = UpdateLoop.run_single(update, cfg, tlog, clock, "distill")
    step = loop.step
    curve = tlog.curve
    tlog.close()
    data = {
        "store": str(cfg.store),
        "task": task,
        "selection": selection.to_dict(),
        "episodes": len(buf.episode_ids),
        "frames": len(buf),
        "teacher_steps": k_t,
        "student_steps": cfg.student_steps,
        "pairs_per_frame": cfg.pairs_per_frame,
    }
    ckpt = cfg.out / "checkpoints" / "last"
    student.train(False)
    save_trained(
        student,
        ckpt,
        base,
        algorithm=cfg.algorithm,
        data=data,
        metrics={"train_steps": step, "num_inference_steps": cfg.student_steps, "teacher_steps": k_t},
        round_index=cfg.round_index,
    )
    (cfg.out / "curve.json").write_text(json.dumps(curve, indent=1))
    first = loop.first or {}
    metrics = {
        **loop.metrics,
        "first_loss_rollout": first.get("loss_rollout", float("nan")),
        "updates": step,
        "frames": len(buf),
    }
    seconds = clock.seconds
    log.info("distill done", extra={"checkpoint": str(ckpt), "seconds": round(seconds, 1), "updates": step})
    return DistillResult(
        checkpoint=ckpt,
        seconds=seconds,
        steps=step,
        metrics=metrics,
        curve=curve,
        data={"selection": selection.to_dict(), "episodes": len(buf.episode_ids), "frames": len(buf)},
    )
