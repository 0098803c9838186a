"""The trainer contract: what every algorithm takes and what it hands back.

Every trainer's config dataclass subclasses :class:`TrainerConfig` (base checkpoint, data, output, seed,
device, threads, progress, logging) and its ``train_*`` function returns a :class:`TrainResult`
(checkpoint, metrics, curve, data snapshot), possibly a subclass with typed extras. Rounds, the CLI,
benchmarks and ``vla-rl up`` therefore drive every algorithm the same way (see
:mod:`vla_rl.train.algorithms`).

Progress: every trainer counts its steps with :class:`StepProgress` (a terminal bar when ``progress`` is
on, and a report to whoever runs it: ``train(cfg, on_progress=callback)`` in
:mod:`vla_rl.train.algorithms`, e.g. a round worker writing it into the DB for the dashboard).

This module imports nothing heavy (no torch), so the CLI can build ``--help`` from the configs cheaply.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from policies.lora import LoraSettings  # imports nothing heavy
from vla_rl.core.configs import check_values

LORA_DEFAULTS = LoraSettings()
DEVICES = ("auto", "cpu", "cuda", "mps")
Trainable = Literal["expert", "full", "lora"]
"""Which parts of a flow policy train (:data:`policies.flow_policy.TRAINABLE_PARTS`)."""


@dataclass(kw_only=True)
class TrainerConfig:
    """Knobs every trainer shares. Subclasses add their algorithm's knobs and say which of these they need."""

    algorithm: ClassVar[str] = ""
    """The algorithm's name in rounds, presets and checkpoint lineage (``sft``, ``qam``, ...)."""
    needs_base: ClassVar[bool] = True
    """Starts from a base checkpoint (all but SFT)."""
    needs_store: ClassVar[bool] = True
    """Reads an episode store (all but online-only PPO)."""
    distributed: ClassVar[bool] = False
    """Runs data-parallel under torchrun (vla_rl.train.distributed): SFT, AWR / RECAP and QAM."""
    chooses_trainable: ClassVar[bool] = False
    """Honours the ``trainable`` knob (SFT from a base, AWR / RECAP, awr-pi, distill, Flow-Noise / Flow-SDE PPO); any
    other trainer refuses it rather than ignore it."""

    out: Path
    """Output folder: ``checkpoints/``, the train state for resuming, TensorBoard logs, ``curve.json``."""
    base: str | None = None
    """Checkpoint to start from and improve: a local folder or ``hub://org/name@rev``."""
    store: Path | None = None
    """Episode store with the data: demonstrations, fleet rollouts, human interventions."""
    data: str | None = None
    """Which episodes to learn from, as selection text (docs/training.md), e.g.
    ``robot=arm-1|arm-2,since=2026-11-01,success=true,label.quality=good,round=3,max=200``.
    None = every closed episode of the task."""
    task: str | None = None
    """Task id; None = the base checkpoint's."""
    db_url: str | None = None
    """Metadata DB (labels, rounds) as an SQLAlchemy URL; None = the SQLite file next to the store."""
    seed: int = 0
    """Seeds batches, noise and simulators: a run is a pure function of its config."""
    device: str = "auto"
    """``auto`` (CUDA when present, else CPU), ``cpu``, ``cuda``, ``cuda:N`` or ``mps``."""
    threads: int = 0
    """CPU threads for torch; 0 = all cores but one. Leaving headroom matters on small machines: busy
    processes that each spin all cores' OpenMP threads slow each other down (docs/experiment-log.md)."""
    log_every: int = 50
    """Updates between log lines and TensorBoard points."""
    progress: bool = True
    """Show a progress bar."""
    round_index: int | None = None
    """Post-training round number recorded in the checkpoint's lineage (set by rounds)."""
    trainable: Trainable | None = None
    """Which parts of the policy train when fine-tuning a base (trainers whose ``chooses_trainable``:
    SFT from a base, AWR, RECAP, awr-pi, distill, Flow-Noise / Flow-SDE PPO, whose noise head always trains):
    ``expert`` = the action expert and its projections (the VLM / trunk frozen), ``full`` = everything,
    ``lora`` = LoRA adapters only (``lora_*`` below; merged into the weights when saved, so the output is an
    ordinary checkpoint or LeRobot folder). None = the policy's default: ``full`` for our FlowVLA,
    ``expert`` for a LeRobot VLA on a CPU (on a GPU, its config's ``train_expert_only``)."""
    lora_rank: int = LORA_DEFAULTS.rank
    """LoRA's rank r (``trainable lora`` only): the adapters' inner width."""
    lora_alpha: float = LORA_DEFAULTS.alpha
    """LoRA's alpha (``trainable lora`` only): the update ``B A`` is scaled by ``alpha / rank``."""
    lora_dropout: float = LORA_DEFAULTS.dropout
    """Dropout on the adapters' input while training (``trainable lora`` only), in [0, 1)."""
    lora_targets: str | None = None
    """Which linear layers get adapters (``trainable lora`` only): a regular expression matched against
    full module names, e.g. ``.*lm_expert.*\\.(q|v)_proj``. None = the architecture's default: the attention
    and MLP projections of the action expert and of the VLM's language layers (FlowVLA: of the trunk and
    expert blocks) and the action / state / time projections."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Every algorithm's config starts its validation with the fields' types (here, in
        ``TrainerConfig.__post_init__``) and ends it with the shared ranges (:func:`knob_bounds`), after
        its own checks (whose messages are the specific ones): each subclass's ``__post_init__`` is
        wrapped, and the ranges are checked once, in the outermost (the instance's class's)."""
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("__post_init__")
        if own is None:
            return

        def __post_init__(self: TrainerConfig) -> None:
            own(self)
            if type(self).__post_init__ is __post_init__:  # the outermost: every check above has run
                check_values(self, knob_bounds)

        cls.__post_init__ = __post_init__  # type: ignore[method-assign]

    def __post_init__(self) -> None:
        check_values(self, _any_value)  # types first (1.5 steps, an infinite lr): before any other check
        name = type(self).__name__
        self.out = Path(self.out)
        if self.store is not None:
            self.store = Path(self.store)
        if self.needs_base and not self.base:
            raise ValueError(f"base: {name} needs a base checkpoint (a folder or hub://org/name@rev)")
        if self.needs_store and self.store is None:
            raise ValueError(f"store: {name} needs an episode store (--store PATH)")
        kind, _, index = self.device.partition(":")
        if kind not in DEVICES or (
            index and not (kind == "cuda" and index.isdigit() and int(index) < MAX_GPUS)
        ):
            raise ValueError(
                f"device: expected one of {', '.join(DEVICES)} (or cuda:N, N < {MAX_GPUS}), got {self.device!r}"
            )
        if self.log_every < 1:
            raise ValueError(f"log_every: expected a positive integer, got {self.log_every}")
        if self.trainable is not None and not self.chooses_trainable:
            raise ValueError(
                f"trainable: {self.algorithm or name} does not choose which parts of its policy train "
                f"(it trains what it always did); leave it unset, got {self.trainable!r}"
            )
        self._check_lora()
        if self.needs_base:  # SFT says its own (it may train from scratch)
            check_flow_base(self.base, self.algorithm)

    def _check_lora(self) -> None:
        """The ``lora_*`` knobs: valid (:class:`~policies.lora.LoraSettings` names the field) and set only
        with ``trainable lora``; LoRA needs the peft package."""
        settings = LoraSettings(self.lora_rank, self.lora_alpha, self.lora_dropout, self.lora_targets)
        if self.trainable != "lora":
            for name in ("rank", "alpha", "dropout", "targets"):
                if getattr(settings, name) != getattr(LORA_DEFAULTS, name):
                    raise ValueError(
                        f"lora_{name}: set only with trainable 'lora' (got trainable {self.trainable!r}); "
                        f"leave it at {getattr(LORA_DEFAULTS, name)!r}"
                    )
            return
        from policies.flow_policy import check_trainable  # only on this path: it imports torch

        check_trainable(self.trainable)  # refused when peft is not installed

    def lora_settings(self) -> LoraSettings | None:
        """The ``lora_*`` knobs as :class:`~policies.lora.LoraSettings` when ``trainable`` is ``lora``,
        else None."""
        if self.trainable != "lora":
            return None
        return LoraSettings(self.lora_rank, self.lora_alpha, self.lora_dropout, self.lora_targets)


def check_flow_base(base: str | None, algorithm: str) -> None:
    """Refuse a local LeRobot folder whose policy is not a flow VLA, naming the algorithm and the type
    (``"awr needs a flow-matching policy; act is not one — use sft"``), when the config is made; a hub
    reference is checked when its round or run loads it. Reads only ``config.json``."""
    if not base or base.startswith("hub://") or not (Path(base) / "config.json").is_file():
        return
    from policies.lerobot_adapter import read_lerobot_config  # only here: the policies import torch
    from policies.lerobot_flow import require_flow_type

    raw = read_lerobot_config(base)
    if raw is None:  # our checkpoint, or not ours to judge here: loading the base says what is wrong
        return
    try:
        require_flow_type(str(raw["type"]), algorithm)
    except ValueError as e:
        raise ValueError(f"base: {e}") from None


MAX_GPUS = 64
"""cuda:N beyond this is refused when a config is made; whether cuda:N exists is the worker's to say (a
round may be queued on a machine without the GPU that runs it)."""
_COUNT = (0, 10**9)


def _any_value(name: str) -> None:
    """No range: :func:`check_values` checks only the fields' types."""
    return None


def knob_bounds(name: str) -> tuple[float, float] | None:
    """The range of a trainer knob, by name, shared by every algorithm's config: what the CLI, the
    dashboard and the round queue accept (a hostile or mistyped value is refused naming the field, before
    anything allocates or trains). None: any finite number."""
    if name.endswith("seed"):
        return (0, 2**31 - 1)
    if name in ("batch_size", "minibatch_size"):
        return (1, 2**20)
    if name == "threads":
        return (0, 1024)
    if name in ("num_envs", "eval_envs"):
        return (1, 1024)
    if name in ("d_model", "critic_hidden", "value_hidden"):
        return (1, 65536)
    if name == "n_layers":
        return (0, 1024)  # 0: no trunk layers (a tiny model)
    if name in (
        "expert_n_layers",
        "n_heads",
        "members",
        "value_bins",
        "value_folds",
        "group_size",
    ):
        return (1, 1024)
    if name in ("chunk_len", "n_exec", "image_size"):
        return (1, 4096)
    if name == "lr" or name.endswith("_lr"):
        return (0, 10)
    if name in ("max_minutes", "max_seconds", "weight_decay", "w_max", "hindsight_weight", "human_weight"):
        return (0, math.inf)
    if name.endswith(("steps", "episodes", "_every", "iterations")) or name in (
        "critic_warmup", "start_online_after", "stop_at", "round_index", "next_action_cache", "update_epochs",
        "buffer_episodes", "utd",
    ):  # fmt: skip
        return _COUNT
    return None


def check_optional_positive(cfg: Any, name: str, what: str) -> None:
    """``cfg.<name>`` is None or a finite number > 0 (not a bool); else a ValueError naming the field."""
    v = getattr(cfg, name)
    if v is not None and not (
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
    ):
        raise ValueError(f"{name}: expected {what} or None, got {v!r}")


@dataclass(kw_only=True)
class TrainResult:
    """What every trainer hands back: rounds evaluate ``checkpoint`` and record the rest."""

    checkpoint: Path
    """The trained policy's checkpoint folder (``<out>/checkpoints/last``)."""
    seconds: float
    """Wall time of the run."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """Final numbers (losses, rollout / eval success, ...)."""
    curve: list[dict[str, Any]] = field(default_factory=list)
    """One row per logged point (step, env steps, losses, success ...), for plots."""
    data: dict[str, Any] = field(default_factory=dict)
    """Snapshot of the data it learned from (selection, episodes, frames, env steps)."""


# ---------------------------------------------------------------------------- progress reports
ProgressCallback = Callable[[Mapping[str, Any]], None]
"""Receives ``{"stage": str, "step": int, "total_steps": int}`` after every counted step (cheap to call:
the listener throttles what it does with it)."""

_listener: ContextVar[ProgressCallback | None] = ContextVar("vla_rl_train_progress", default=None)


@contextmanager
def reporting_progress(callback: ProgressCallback | None) -> Iterator[None]:
    """Within the block, every :class:`StepProgress` of this thread reports to ``callback`` (None: to nobody)."""
    token = _listener.set(callback)
    try:
        yield
    finally:
        _listener.reset(token)


class StepProgress:
    """A trainer's (or an evaluation's) step counter: ``step`` of ``total`` in ``stage``.

    It shows a tqdm bar on the terminal when ``show`` and reports ``{"stage", "step", "total_steps"}`` to
    the callback of the enclosing :func:`reporting_progress` on creation and on every :meth:`update`;
    the one way every trainer tells a round how far it is."""

    def __init__(
        self,
        total: int,
        *,
        stage: str,
        initial: int = 0,
        desc: str | None = None,
        unit: str = "step",
        show: bool = True,
    ) -> None:
        from tqdm import tqdm

        self.total, self.stage, self.n = int(total), stage, int(initial)
        self._bar = tqdm(total=total, initial=initial, desc=desc or stage, unit=unit, disable=not show)
        self._callback = _listener.get()
        self._report()

    def _report(self) -> None:
        if self._callback is not None:
            self._callback({"stage": self.stage, "step": self.n, "total_steps": self.total})

    def update(self, n: int = 1) -> None:
        self.n += n
        self._bar.update(n)
        self._report()

    def set_postfix(self, **values: Any) -> None:
        self._bar.set_postfix(**values)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> StepProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
