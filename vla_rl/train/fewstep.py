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

**The student's own states** (``dagger_rounds`` R > 0, DAgger-style): the store's frames are where the
parent's demonstrator went, not where a slightly different student goes; on a contact-rich task its
small errors near the grasp take it into states no demo shows, where nothing taught it the parent's
actions. The updates then run in R + 1 phases; before each phase after the first the student as it is
(deterministic, its own K_S) drives ``dagger_episodes`` simulator episodes (online-range seeds:
:meth:`DistillConfig.collection_seeds`), recorded in ``<out>/dagger_store``, and their frames join the
observations the teacher labels (only their observations: the teacher says what to do there). A task
without a simulator refuses it.

The student starts from the parent (at t = 0 a flow's velocity points at the data mean, so the copy's
one-step chunk starts near E[a | s] and far from the parent's: a from-scratch learning rate, as FQL's
actor, with a warm-up and a cosine decay to a tenth). What trains follows ``trainable`` (FlowVLA: all of
it; a LeRobot VLA on a CPU: its action expert).

Output: ``<out>/checkpoints/last`` (the student; lineage algorithm "distill", parent the base's commit,
data naming K_T, K_S and the on-policy episodes), ``<out>/tb``, ``<out>/curve.json``, with
``dagger_rounds`` ``<out>/dagger_store``. One process, no resume (a re-run starts
over). A round gates the student against its parent like any round's output (docs/training.md).
"""

from __future__ import annotations

import dataclasses
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
from policies.loading import FlowCheckpoint, pick_device
from vla_rl.core.seeds import ONLINE
from vla_rl.train.base import TrainerConfig, TrainResult, check_optional_positive
from vla_rl.train.common import RunClock, sample_indices, seed_step
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
    dagger_rounds: int = 0
    """On-policy observations (DAgger): 0 = off, the teacher labels the store's frames only. R > 0: the
    updates run in R + 1 equal phases, and before each phase after the first the student as it then is
    (its own K_S-step sampler) drives ``dagger_episodes`` simulator episodes of the task into
    ``<out>/dagger_store``; their frames join the observations the teacher labels (their actions are never
    a target: the teacher says what to do there). A few-step student drifts from the parent's states
    where its chunks differ from the parent's (on a contact-rich task, around the grasp), into states the
    demos never show; this distils the parent there as well."""
    dagger_episodes: int = 20
    """Episodes of each on-policy collection (``dagger_rounds`` > 0)."""
    num_envs: int = 2
    """Simulator processes of the on-policy collections."""
    online_seed: int = ONLINE
    """First episode seed of the on-policy collections (:meth:`collection_seeds`): the online-training
    range, far from every evaluation's seeds (:mod:`vla_rl.core.seeds`)."""
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
        for name in ("student_steps", "steps", "batch_size", "dagger_episodes", "num_envs"):
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
        self._check_dagger()

    def _check_dagger(self) -> None:
        if not 0 <= self.dagger_rounds < self.steps:
            raise ValueError(
                f"dagger_rounds: expected 0 (off) .. steps - 1 ({self.steps - 1}), so every phase "
                f"between two collections has an update; got {self.dagger_rounds}"
            )
        if self.online_seed < ONLINE:
            raise ValueError(
                f"online_seed: expected >= {ONLINE} (the online-training seeds, away from every "
                f"evaluation's), got {self.online_seed}"
            )
        if self.dagger_rounds and self.fm_weight > 0:
            raise ValueError(
                "fm_weight: the on-policy episodes' actions are the student's own, no target to regress; "
                f"expected 0 with dagger_rounds > 0, got {self.fm_weight}"
            )

    def collection_seeds(self) -> range:
        """The episode seeds the on-policy collections may use (empty without ``dagger_rounds``):
        collection r (1..R) starts at ``online_seed + (r - 1) (E + N)`` and starts at most E + N - 1
        episodes."""
        stride = self.dagger_episodes + self.num_envs
        return range(self.online_seed, self.online_seed + self.dagger_rounds * stride)

    def collection_starts(self) -> list[int]:
        """The updates before which the student is rolled out: the starts of phases 2..R + 1 of
        ``steps`` updates cut into R + 1 (near) equal phases."""
        return [self.steps * r // (self.dagger_rounds + 1) for r in range(1, self.dagger_rounds + 1)]


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
        self.labelled = 0
        """Frames of ``buf`` in the pool (every one of them ``pairs_per_frame`` times)."""
        if cfg.pairs_per_frame:
            self._label_pool()

    def frames_added(self, inputs: PolicyInputs) -> None:
        """``buf`` grew (on-policy frames appended): read its batches through ``inputs`` (which knows the
        new frames' instructions) and, with a pool, label the new frames into it."""
        self.inputs = inputs
        if self.cfg.pairs_per_frame:
            self._label_pool()

    def label(self, batch: Mapping[str, Any]) -> Tensor:
        """The teacher's points at the student's grid from fresh noise, for a batch of observations."""
        z = torch.randn(batch["state"].shape[0], *self.teacher.event_shape, device=self.teacher.device)
        return teacher_grid_points(
            teacher_iterates(self.teacher, observations(batch), z, self.k_t), self.cfg.student_steps
        )

    def _label_pool(self, chunk: int = 256) -> None:
        """Label the frames not yet in the pool (from :attr:`labelled` on) and append them to it."""
        rows = np.repeat(np.arange(self.labelled, len(self.buf)), self.cfg.pairs_per_frame)
        points = [] if self.pool_points is None else [self.pool_points]
        for i in range(0, len(rows), chunk):
            batch = self.inputs(self.buf.batch(rows[i : i + chunk], horizon=self.horizon, n_step=1))
            points.append(self.label(batch).cpu())
        old = np.zeros(0, np.int64) if self.pool_rows is None else self.pool_rows
        self.pool_rows, self.pool_points = np.concatenate([old, rows]), torch.cat(points)
        self.labelled = len(self.buf)

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


class OnPolicyFrames:
    """``dagger_rounds``: the student's own episodes in the simulator, their frames appended to the buffer
    the teacher labels. The environment opens at the first collection and stays open until :meth:`close`."""

    def __init__(self, cfg: DistillConfig, base: FlowCheckpoint, task: str, buf: Any) -> None:
        from vla_rl.evaluation_offline import is_sim_task

        if cfg.dagger_rounds and not is_sim_task(task):
            raise ValueError(
                f"dagger_rounds: the student's own episodes need a simulator, and task {task!r} has none; "
                "expected 0"
            )
        self.cfg, self.base, self.task, self.buf = cfg, base, task, buf
        self.env: Any = None
        self.store: EpisodeStore | None = None
        self.collected = 0
        self.episode_ids: list[str] = []
        self.success: list[float] = []
        """Each collection's success rate: the student's, as it was then."""

    def collect(self, student: FlowPolicy) -> None:
        """Collection :attr:`collected` + 1: ``dagger_episodes`` episodes of ``student`` (deterministic, its
        own K), written to ``<out>/dagger_store`` and appended to the buffer."""
        from sim.demos import record_policy_episodes

        cfg, cameras = self.cfg, bool(self.base.spec.cameras)
        if self.env is None:
            from sim.vector import VectorSimEnv

            self.env = VectorSimEnv(
                self.task,
                num_envs=cfg.num_envs,
                seed=cfg.online_seed,
                obs="rgb" if cameras else "state",
                image_size=self.base.spec.cameras[0].height if cameras else 128,
            )
            root = cfg.out / "dagger_store"
            self.store = EpisodeStore(root, create=not root.exists())
        assert self.store is not None
        revision = f"distill-student:{self.collected + 1}"
        student.train(False)
        try:
            rep = record_policy_episodes(
                self.store,
                self.env,
                dataclasses.replace(self.base, policy=student, commit=revision, ref="distill"),
                cfg.dagger_episodes,
                seed=cfg.collection_seeds()[self.collected * (cfg.dagger_episodes + cfg.num_envs)],
                n_exec=self.base.policy.n_exec,
                revision=revision,
                robot_prefix="distill",
                progress=False,
            )
        finally:
            student.train(True)
        for e in rep.episode_ids:
            self.buf.add_stored_episode(self.store.read_episode(e, cameras=cameras))
        self.collected += 1
        self.episode_ids += rep.episode_ids
        self.success.append(rep.success_rate)
        log.info(
            "distill on-policy episodes",
            extra={"collection": self.collected, "success_rate": rep.success_rate, "frames": len(self.buf)},
        )

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None


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
    on_policy = OnPolicyFrames(cfg, base, task, buf)
    starts = set(cfg.collection_starts())

    def update(step: int) -> dict[str, Tensor]:
        if step in starts:
            on_policy.collect(student)
            pairs.frames_added(PolicyInputs(student, buf, device))
            seed_step(cfg.seed, step)  # the update's draws as without the collection before it
        batch, points = pairs(step)
        out = student_losses(student, batch, points, cfg)
        gradient_step(out["loss"], [opt], SINGLE)
        return out

    try:
        loop = UpdateLoop.run_single(update, cfg, tlog, clock, "distill")
    finally:
        on_policy.close()
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
        "dagger_episodes": len(on_policy.episode_ids),
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
        "dagger_episodes": len(on_policy.episode_ids),
        "dagger_success": on_policy.success,
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
