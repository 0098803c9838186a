"""The training loop every trainer runs: each algorithm file holds its math and its step, this the rest.

A trainer (``sft.py``, ``awr.py``, ``qam.py``, ``fql.py``, ``awr_pi.py``, ``ppo.py``) builds its data and
models, writes one update as a function ``update(step) -> scalars`` and hands it to an
:class:`UpdateLoop`, or, online, one iteration (collect, then learn) to an :class:`IterationLoop`. What
all of them share lives here, once:

* **seeding** — before update ``step`` the loop reseeds torch's global RNG from ``(seed, step)``
  (:func:`~vla_rl.train.common.seed_step`), so every update's batch and noise are a function of the run's
  seed and the update's index, and a resumed run replays what an uninterrupted one would have drawn;
* **gradients** — :func:`gradient_step`: zero, backward, the data-parallel all-reduce
  (:mod:`vla_rl.train.distributed`), each parameter group's norm clipped on its own, the optimisers and
  their learning-rate schedules stepped; :func:`warmup_cosine_schedule` is the schedule SFT and AWR use;
* **metrics** — each update's scalars averaged over the ranks (one ``all_reduce``; nothing with one
  process), so rank 0 logs the global batch's numbers;
* **beats** — logs every ``log_every`` updates (TensorBoard on rank 0, the curve, the progress bar:
  :class:`TrainLog`) and checkpoints every ``checkpoint_every`` (rank 0): :class:`Beat`;
* **stopping** — at the end of the schedule, at ``stop_at`` (as a preempted job would), or when a
  wall-clock budget runs out (:func:`time_budget`: rank 0's clock decides for every rank);
* **resume** — :class:`TrainState`: named state dicts plus counters and the run's wall time in
  ``<out>/train_state.pt``, written atomically and read back on re-run;
* **iterations** — :class:`IterationLoop`: the online trainers' outer loop, until an env-step budget is
  spent, with one curve row (TensorBoard, a log line) per iteration.

The loops call back into the trainer at fixed points (``on_log``, ``on_checkpoint``), so a trainer reads as
its algorithm: build, one update, what to log, what a checkpoint holds.
"""

from __future__ import annotations

import itertools
import logging
import math
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from vla_rl.train.base import StepProgress, TrainerConfig
from vla_rl.train.common import (
    TRAIN_STATE,
    RunClock,
    config_dict,
    load_train_state,
    save_train_state,
    seed_step,
    warmup_cosine,
)
from vla_rl.train.distributed import Dist, agree, all_reduce_grads, mean_scalars, summary_writer

log = logging.getLogger(__name__)
Scalars = Mapping[str, float | torch.Tensor]
"""What an update returns: named scalars (python numbers or 0-d tensors) of this rank's rows."""


# ---------------------------------------------------------------------------- gradients
@dataclass
class Optimiser:
    """One torch optimiser, the parameter groups whose gradient norms it clips (each group on its own,
    so a large loss of one module never shrinks another's step) and its learning-rate schedule."""

    optimizer: torch.optim.Optimizer
    groups: dict[str, list[nn.Parameter]]
    """Name -> parameters; :func:`gradient_step` reports each group's norm under its name."""
    clip: float
    """Maximum global gradient norm of each group."""
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    """Stepped after every optimiser step (None: a constant learning rate)."""

    def __post_init__(self) -> None:
        self.groups = {name: list(params) for name, params in self.groups.items()}
        if not self.clip > 0:
            raise ValueError(f"clip: expected a gradient-norm bound > 0, got {self.clip}")

    def parameters(self) -> list[nn.Parameter]:
        return [p for params in self.groups.values() for p in params]


def warmup_cosine_schedule(
    optimizer: torch.optim.Optimizer, warmup: int, total: int, min_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup`` updates, then cosine decay to ``min_ratio`` of the rate at ``total``
    (:func:`~vla_rl.train.common.warmup_cosine`; ``total = warmup + 1, min_ratio = 1``: warm-up, then
    constant)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, warmup, total, min_ratio))


def gradient_step(
    loss: torch.Tensor,
    optimisers: Sequence[Optimiser],
    dist: Dist,
    stepping: Sequence[bool] | None = None,
) -> dict[str, float]:
    """One optimisation step on ``loss``: zero every optimiser's gradients, backward, average the
    gradients over the ranks (one bucketed all-reduce; none with one process), clip each group's norm,
    then step the optimisers (those ``stepping`` marks, all by default) and their schedules. Every group's
    norm before clipping is returned by name (an optimiser not stepped is clipped and reported too: its
    gradients are dropped at the next zeroing)."""
    for opt in optimisers:
        opt.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    all_reduce_grads(itertools.chain(*(opt.parameters() for opt in optimisers)), dist)
    norms: dict[str, float] = {}
    for opt in optimisers:
        for name, params in opt.groups.items():
            if params:
                norms[name] = float(torch.nn.utils.clip_grad_norm_(params, opt.clip))
    for opt, on in zip(optimisers, stepping or [True] * len(optimisers), strict=True):
        if on:
            opt.optimizer.step()
            if opt.scheduler is not None:
                opt.scheduler.step()
    return norms


def fit_minibatches(
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[], torch.Tensor],
    steps: int,
    bar: StepProgress | None = None,
) -> list[float]:
    """``steps`` plain updates of a small fitted model (a value head, a coin-flipping network): each
    calls ``loss_fn`` (which draws its own minibatch), zeroes, backpropagates and steps; returns every
    update's loss. No clipping, schedule or all-reduce: these fits run whole on every rank."""
    losses = []
    for _ in range(steps):
        loss = loss_fn()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        if bar is not None:
            bar.update(1)
    return losses


# ---------------------------------------------------------------------------- beats and stopping
@dataclass(frozen=True)
class Beat:
    """When something happens in a loop: every ``every`` updates (0: never) and at update ``also``."""

    every: int = 0
    also: int | None = None

    def __call__(self, step: int) -> bool:
        return (self.every > 0 and step % self.every == 0) or step == self.also


def time_budget(clock: RunClock, seconds: float | None, dist: Dist) -> Callable[[], bool]:
    """``keep_going()`` for a loop with a wall-clock budget of ``seconds`` from the start of this process
    (None: no budget, always True). Rank 0's clock decides for every rank (one broadcast per call, only
    with a budget), so all ranks leave their loops at the same update."""
    if seconds is None:
        return lambda: True
    deadline = clock.t0 + seconds
    return lambda: agree(time.perf_counter() < deadline, dist)


# ---------------------------------------------------------------------------- logs
class TrainLog:
    """A run's TensorBoard writer (rank 0 only), its curve (one dict per logged point) and the progress
    bar of its current phase."""

    def __init__(
        self,
        cfg: TrainerConfig,
        dist: Dist,
        *,
        purge_step: int | None,
        config_step: int | None,
        finite_only: bool = False,
        curve: list[dict[str, Any]] | None = None,
    ) -> None:
        """``purge_step``: a resumed run's step (TensorBoard drops what a killed run wrote after it);
        ``config_step``: where to write the config as text (None: not at all, e.g. on resume);
        ``finite_only``: write only finite scalars; ``curve``: rows a resumed run already has."""
        self.cfg, self.dist, self.finite_only = cfg, dist, finite_only
        kwargs = {} if purge_step is None else {"purge_step": purge_step}
        self.writer = summary_writer(dist, str(cfg.out / "tb"), **kwargs)
        if config_step is not None:
            self.writer.add_text("config", f"```\n{config_dict(cfg)}\n```", config_step)
        self.curve: list[dict[str, Any]] = curve if curve is not None else []
        self.bar: StepProgress | None = None

    def progress(
        self, total: int, *, stage: str, desc: str, initial: int = 0, unit: str = "step"
    ) -> StepProgress:
        """A new progress bar (shown on rank 0 when ``cfg.progress``): the current phase's."""
        self.bar = StepProgress(
            total,
            initial=initial,
            stage=stage,
            desc=desc,
            unit=unit,
            show=self.cfg.progress and self.dist.is_main,
        )
        return self.bar

    def scalars(self, prefix: str, values: Mapping[str, Any], step: int) -> None:
        """Every float of ``values`` as ``prefix/name`` at ``step`` (other types are not plotted)."""
        for k, v in values.items():
            if isinstance(v, float) and (math.isfinite(v) or not self.finite_only):
                self.writer.add_scalar(f"{prefix}/{k}", v, step)

    def row(self, prefix: str, row: dict[str, Any], step: int) -> None:
        """Append ``row`` to the curve and plot its floats under ``prefix``."""
        self.curve.append(row)
        self.scalars(prefix, row, step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.writer.close()


# ---------------------------------------------------------------------------- resume
class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


class TrainState:
    """``<out>/train_state.pt``: the named ``parts``' state dicts (models, EMA, optimisers, schedules),
    the run's wall time and whatever counters a trainer adds, saved atomically for an exact resume. A
    part may be None (a module this configuration has not): it is saved as ``{}`` and not restored."""

    def __init__(
        self, out: Path, clock: RunClock, parts: Mapping[str, Stateful | None] | None = None
    ) -> None:
        """``parts`` may also be added later (:attr:`parts`), e.g. models built after :meth:`read`."""
        self.path = out / TRAIN_STATE
        self.clock = clock
        self.parts: dict[str, Stateful | None] = dict(parts or {})

    def read(self, resume: bool) -> dict[str, Any] | None:
        """The saved state when ``resume`` and there is one (the clock continues from its seconds), else
        None. The parts are not touched yet: :meth:`restore`."""
        if not (resume and self.path.exists()):
            return None
        st = load_train_state(self.path)
        self.clock.resume(st)
        return st

    def restore(self, st: Mapping[str, Any]) -> None:
        """Load every part from ``st``."""
        for name, part in self.parts.items():
            if part is not None:
                part.load_state_dict(st[name])

    def load(self, resume: bool) -> dict[str, Any] | None:
        """:meth:`read` and :meth:`restore`: the saved state (parts loaded), or None."""
        st = self.read(resume)
        if st is not None:
            self.restore(st)
            log.info("resumed", extra={"step": st.get("step"), "from": str(self.path)})
        return st

    def save(self, **counters: Any) -> None:
        """Write the parts, the run's seconds so far and ``counters`` (tensors and plain data only)."""
        parts = {name: part.state_dict() if part is not None else {} for name, part in self.parts.items()}
        save_train_state(self.path, **parts, **counters, seconds=self.clock.seconds)


def publish_last(ckpt: Path) -> Path:
    """Copy the checkpoint folder ``ckpt`` to ``last`` beside it (replacing the previous one): the folder
    evaluations and rounds take. Returns ``last``."""
    last = ckpt.parent / "last"
    shutil.rmtree(last, ignore_errors=True)
    shutil.copytree(ckpt, last)
    return last


# ---------------------------------------------------------------------------- the update loop
class UpdateLoop:
    """Gradient updates ``update(step)`` for step = :attr:`step`, :attr:`step` + 1, ... with the beats
    around each: reseed before it, average its scalars over the ranks after it, then ``on_log`` (every
    rank: a log may need a collective) and ``on_checkpoint`` (rank 0) when their beat (a :class:`Beat`, or
    any predicate) is true of the number of updates done."""

    def __init__(
        self,
        update: Callable[[int], Scalars],
        *,
        seed: int,
        dist: Dist,
        step: int = 0,
        log: Callable[[int], bool] | None = None,
        on_log: Callable[[int, dict[str, float]], None] | None = None,
        checkpoint: Callable[[int], bool] | None = None,
        on_checkpoint: Callable[[int], None] | None = None,
    ) -> None:
        self.update, self.seed, self.dist = update, seed, dist
        self.step = step
        """Updates done so far in the run (a resumed run starts from the saved count)."""
        self.log, self.on_log = log or Beat(), on_log
        self.checkpoint, self.on_checkpoint = checkpoint or Beat(), on_checkpoint
        self.metrics: dict[str, float] = {}
        """The last update's scalars, averaged over the ranks."""
        self.first: dict[str, float] | None = None
        """The first update's (of this process), averaged over the ranks."""

    @classmethod
    def over_steps(
        cls,
        update: Callable[[int], Scalars],
        cfg: Any,
        dist: Dist,
        *,
        step: int = 0,
        on_log: Callable[[int, dict[str, float]], None] | None = None,
        checkpoint: Callable[[int], bool] | None = None,
        on_checkpoint: Callable[[int], None] | None = None,
    ) -> UpdateLoop:
        """The loop of a schedule of ``cfg.steps`` updates (SFT, AWR / RECAP, FQL): seeded by ``cfg.seed``,
        logging every ``cfg.log_every`` updates and at the schedule's last, resumed at ``step``."""
        log = Beat(cfg.log_every, also=cfg.steps)
        return cls(
            update,
            seed=cfg.seed,
            dist=dist,
            step=step,
            log=log,
            on_log=on_log,
            checkpoint=checkpoint,
            on_checkpoint=on_checkpoint,
        )

    @classmethod
    def run_single(
        cls, update: Callable[[int], Scalars], cfg: Any, tlog: TrainLog, clock: RunClock, desc: str
    ) -> UpdateLoop:
        """Run a one-process schedule of ``cfg.steps`` updates (FQL, few-step distillation) to its end or
        to ``cfg.max_seconds``: each logged beat a ``train`` row of ``tlog``, counted on its progress bar
        (``desc``); returns the loop (its :attr:`step` and :attr:`metrics`)."""
        dist = Dist()
        loop = cls.over_steps(
            update, cfg, dist, on_log=lambda step, metrics: tlog.row("train", {"step": step, **metrics}, step)
        )
        loop.run(
            cfg.steps,
            tlog.progress(cfg.steps, stage="train", desc=desc),
            time_budget(clock, cfg.max_seconds, dist),
        )
        return loop

    def one(self) -> dict[str, float]:
        """Run update :attr:`step` and its beats; returns its averaged scalars."""
        seed_step(self.seed, self.step)
        values = self.update(self.step)
        self.step += 1
        scalars = {k: float(v.detach() if isinstance(v, torch.Tensor) else v) for k, v in values.items()}
        self.metrics = mean_scalars(scalars, self.dist)
        if self.first is None:
            self.first = dict(self.metrics)
        if self.on_log is not None and self.log(self.step):
            self.on_log(self.step, self.metrics)
        if self.on_checkpoint is not None and self.dist.is_main and self.checkpoint(self.step):
            self.on_checkpoint(self.step)
        return self.metrics

    def run(
        self, end: int, bar: StepProgress | None = None, keep_going: Callable[[], bool] | None = None
    ) -> int:
        """Updates until ``end`` have been done (or ``keep_going()`` says stop, asked before each),
        counting each on ``bar``; returns the number done."""
        while self.step < end and (keep_going is None or keep_going()):
            self.one()
            if bar is not None:
                bar.update(1)
        return self.step


# ---------------------------------------------------------------------------- the iteration loop
@dataclass
class IterationLoop:
    """Online trainers' outer loop: iterations (collect with the current policy, then learn) until
    ``budget`` env steps are spent, ``stop_at`` iterations are done or ``max_minutes`` have passed.

    The iteration (a callable) counts its env steps with :meth:`collected` as it spends them and returns
    its curve row; the loop times it (``seconds``), appends the row to the curve (TensorBoard under
    ``prefix`` at the row's ``tb_step`` key, a log line), sets the progress bar's postfix and calls
    ``on_checkpoint(iteration)`` every ``checkpoint_every`` iterations, then ``on_iteration(iteration)``.
    """

    name: str
    """The trainer's name in log lines (``ppo``, ``awr-pi``)."""
    prefix: str
    """TensorBoard's prefix of the rows' scalars."""
    log: TrainLog
    clock: RunClock
    budget: int
    """Env steps to spend in all."""
    env_steps: int = 0
    iteration: int = 0
    max_minutes: float | None = None
    stop_at: int | None = None
    tb_step: str = "env_steps"
    """The row's key that is TensorBoard's step."""
    postfix: Callable[[Mapping[str, Any]], dict[str, Any]] = field(default=lambda row: {})
    checkpoint_every: int = 0
    on_checkpoint: Callable[[int], None] | None = None
    on_iteration: Callable[[int], None] | None = None
    stopped_by_time: bool = False
    last: bool = False
    """Set by :meth:`stop`: the current iteration is the last."""

    def collected(self, env_steps: int) -> None:
        """Count env steps the current iteration spent (the progress bar moves with them)."""
        self.env_steps += env_steps
        if self.log.bar is not None:
            self.log.bar.update(env_steps)

    def stop(self) -> None:
        """End the loop after the current iteration (e.g. the budget ran out inside its collection)."""
        self.last = True

    def run(self, iterate: Callable[[], dict[str, Any]]) -> None:
        deadline = self.clock.t0 + 60 * self.max_minutes if self.max_minutes else math.inf
        while (
            self.env_steps < self.budget
            and (self.stop_at is None or self.iteration < self.stop_at)
            and not self.last
        ):
            t0 = time.perf_counter()
            if t0 >= deadline:
                self.stopped_by_time = True
                log.info(
                    f"{self.name} stopped at its time budget",
                    extra={
                        "max_minutes": self.max_minutes,
                        "env_steps": self.env_steps,
                        "iteration": self.iteration,
                    },
                )
                break
            row = iterate()
            row["seconds"] = time.perf_counter() - t0
            self.iteration += 1
            self.log.row(self.prefix, row, row[self.tb_step])
            log.info(
                f"{self.name} iteration",
                extra={k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()},
            )
            if self.log.bar is not None:
                self.log.bar.set_postfix(**self.postfix(row))
            if (
                self.on_checkpoint is not None
                and self.checkpoint_every
                and self.iteration % self.checkpoint_every == 0
            ):
                self.on_checkpoint(self.iteration)
            if self.on_iteration is not None:
                self.on_iteration(self.iteration)
