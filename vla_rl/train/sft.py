"""Supervised fine-tuning of a flow-matching VLA on demonstrations: one algorithm, one file.

Conditional flow matching with π0's Beta(1.5, 1) time sampling (in the policy), AdamW, linear warmup
then cosine decay, gradient clipping, EMA weights (those are what we ship), bf16 autocast on CUDA.

Two starts (``init``): **from scratch**, our FlowVLA built from the architecture knobs, its normalisation
statistics computed from the training data and saved inside the checkpoint; or **from the base**
(continued fine-tuning) of any flow policy through the contract (:mod:`vla_rl.train.contract`): our
checkpoint, or a LeRobot SmolVLA / π0 / π0.5 folder (its own normalisation, its architecture; the
``trainable`` knob says which parts train; it is saved back as a LeRobot folder). ``auto``: from the base
when it is a LeRobot folder, else from scratch. Span
labels of key ``segment`` apply as in every trainer (:func:`vla_rl.train.transitions.span_effects`):
frames in an ``idle`` span (not also in a ``recovery`` one) are no samples, and no action chunk
crosses them.

Output folder::

    <out>/checkpoints/step_000500/   checkpoint folders (EMA weights; see vla_rl.hub.checkpoint)
    <out>/checkpoints/last/          the latest one (what `vla-rl eval` and rounds usually take)
    <out>/train_state.pt             model, EMA, optimiser, schedule and step, for exact resume
    <out>/tb/                        TensorBoard logs (loss, lr, grad norm, samples/s)

Run ``vla-rl train sft --help`` for the command-line form of :class:`SFTConfig`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from torch import nn

from fleet.dataset import ChunkDataset, labelled_instructions
from fleet.db import MetadataDB, default_url
from fleet.selection import Selection
from fleet.store import Episode, EpisodeStore
from policies.flow_policy import FlowPolicy, FlowVLAFlowPolicy
from policies.flow_vla import FlowVLAConfig, FlowVLAPolicy, compute_normalization_stats
from policies.flow_vla.configuration_flow_vla import (
    ImageEncoderKind,
    InstructionEncoder,
    zero_delay_prob_problem,
)
from policies.loading import FlowCheckpoint
from vla_rl.hub.checkpoint import Lineage
from vla_rl.train.base import TrainerConfig, TrainResult, check_flow_base
from vla_rl.train.common import EMA, RunClock, Throughput, autocast_for, dataset_digest, sample_indices
from vla_rl.train.contract import (
    PolicyInputs,
    as_policy,
    load_base,
    save_trained,
    trainable_parameters,
    trained_module,
    weighted_flow_loss,
)
from vla_rl.train.distributed import Dist, Shard, broadcast_module, distributed
from vla_rl.train.loop import (
    Beat,
    Optimiser,
    TrainLog,
    TrainState,
    UpdateLoop,
    gradient_step,
    publish_last,
    warmup_cosine_schedule,
)
from vla_rl.train.transitions import SPAN_KEY, select_episode_ids, span_effects

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class SFTConfig(TrainerConfig):
    """Every knob of an SFT run. Defaults train a ~1.5M-parameter state-only policy in minutes on CPU.

    SFT trains on the episodes ``data`` selects from ``store``, e.g. ``data="success=true"`` for
    filtered behaviour cloning: from scratch (the model knobs below), or on from ``base`` (``init``).
    """

    algorithm: ClassVar[str] = "sft"
    distributed: ClassVar[bool] = True
    needs_base: ClassVar[bool] = False
    chooses_trainable: ClassVar[bool] = True

    store: Path = field()
    """Episode store holding the demonstrations."""
    task: str | None = None
    """Task id whose episodes to train on; None = the store's only task (an error if it holds several)."""
    init: Literal["auto", "scratch", "base"] = "auto"
    """Where training starts: ``scratch``, a new FlowVLA of the model knobs below; ``base``, the ``base``
    checkpoint (ours or a LeRobot SmolVLA / π0 / π0.5 folder: continued fine-tuning, the model knobs
    unused); ``auto``, ``base`` when the base is a LeRobot folder, else ``scratch`` (a round's base is then
    only what the new policy is compared against)."""

    # model (see FlowVLAConfig for what each means; from scratch only)
    chunk_len: int = 10
    n_exec: int = 5
    d_model: int = 128
    n_layers: int = 2
    expert_n_layers: int = 4
    n_heads: int = 4
    instruction_encoder: InstructionEncoder = "minilm"
    image_size: int | None = None
    """Train (and serve) at this square resolution: the model resizes every camera to image_size x
    image_size before its image encoder (FlowVLAConfig.image_resize, saved in the checkpoint); robots
    keep sending native-size images. None = the cameras' native size. E.g. 96 for 224 px cameras."""
    image_encoder: ImageEncoderKind = "conv"
    """Camera encoder: 'conv' (small, from scratch) or 'resnet18' (torchvision ResNet-18, ImageNet
    normalisation; pair it with image_size on a CPU)."""
    image_encoder_weights: str | None = None
    """resnet18's initial weights: a folder with model.safetensors (torchvision names) or
    hub://org/name@rev. None = random init. safetensors only."""
    freeze_image_encoder: bool = False
    """Keep the resnet18 backbone frozen (train only its projection) instead of fine-tuning it."""
    model_overrides: dict[str, Any] = field(default_factory=dict)
    """Any other FlowVLAConfig field, e.g. {"image_encoder_width": 16}."""
    rtc_max_delay: int = 0
    """Training-time real-time chunking (docs/serving.md): each chunk's first d ~ U{0..rtc_max_delay}
    actions are given clean and the loss is on the rest; saved in the checkpoint, whose server then feeds
    a robot's executed actions as that prefix and refuses larger delays. 0 = off. FlowVLA (from scratch,
    or continuing a FlowVLA base), or continuing a LeRobot SmolVLA / π0 base (recorded in its sidecar);
    not π0.5 (its expert takes one flow time per chunk)."""
    rtc_zero_delay_prob: float | None = None
    """With ``rtc_max_delay``: how often a training delay is 0. None = d ~ U{0..rtc_max_delay}, as runs
    before this option; p in [0, 1) = d = 0 with probability p, else d ~ U{1..rtc_max_delay}. Action h
    is trained only when d <= h, so the uniform draw trains the first action (all a plain evaluation and
    every episode's first chunk execute at delay 0) in 1 / (rtc_max_delay + 1) of the samples; a larger p
    trains it more, the delayed cases less (docs/training.md). Saved in the checkpoint beside it."""

    # optimisation
    steps: int = 3000
    batch_size: int = 128
    lr: float = 3e-4
    weight_decay: float = 1e-4
    warmup_steps: int = 200
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio."""
    grad_clip: float = 1.0
    ema_decay: float = 0.999
    amp: Literal["auto", "bf16", "none"] = "auto"
    """'auto' = bf16 autocast on CUDA, none on CPU; 'none' disables it."""

    # bookkeeping
    checkpoint_every: int = 1000
    resume: bool = True
    """Continue from <out>/train_state.pt when it exists (exactly: same batches and noise)."""
    stop_at: int | None = None
    """Stop after this step, as a preempted job would (the schedule still spans ``steps``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("steps", "batch_size", "checkpoint_every", "chunk_len", "n_exec"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)}")
        if self.n_exec > self.chunk_len:
            raise ValueError(f"n_exec: expected <= chunk_len ({self.chunk_len}), got {self.n_exec}")
        if isinstance(self.rtc_max_delay, bool) or not isinstance(self.rtc_max_delay, int):
            raise ValueError(f"rtc_max_delay: expected an integer, got {self.rtc_max_delay!r}")
        if self.rtc_max_delay < 0 or (self.init == "scratch" and self.rtc_max_delay >= self.chunk_len):
            raise ValueError(
                f"rtc_max_delay: expected 0 (off) up to chunk_len - 1 ({self.chunk_len - 1}) actions, "
                f"got {self.rtc_max_delay}"
            )
        problem = zero_delay_prob_problem(self.rtc_zero_delay_prob, self.rtc_max_delay)
        if problem is not None:
            raise ValueError(f"rtc_zero_delay_prob: {problem}")
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"ema_decay: expected in [0, 1), got {self.ema_decay}")
        if self.lr <= 0:
            raise ValueError(f"lr: expected > 0, got {self.lr}")
        if self.image_size is not None and self.image_size < 1:
            raise ValueError(f"image_size: expected a positive integer or None, got {self.image_size}")
        if self.amp not in ("auto", "bf16", "none"):
            raise ValueError(f"amp: expected auto|bf16|none, got {self.amp!r}")
        if self.init == "base" and not self.base:
            raise ValueError("base: init 'base' continues a base checkpoint; give one (--base REF)")
        if self.init == "scratch" and self.trainable not in (None, "full"):
            raise ValueError(
                f"trainable: SFT from scratch trains the whole new model, got {self.trainable!r} "
                "(a part of a base trains with init 'base')"
            )
        if self.init != "scratch":  # a local LeRobot base that is not a flow VLA: said now, not after loading
            check_flow_base(self.base, self.algorithm)


@dataclass(kw_only=True)
class SFTResult(TrainResult):
    steps: int
    final_loss: float
    first_loss: float
    samples_per_s: float


def _lineage_data(cfg: SFTConfig, ds: ChunkDataset) -> dict[str, Any]:
    return {"store": str(cfg.store), "task": ds.spec.name, "selection": cfg.data, **dataset_digest(ds)}


def continues_base(cfg: SFTConfig) -> bool:
    """Whether this run starts from ``cfg.base`` (:attr:`SFTConfig.init`; ``auto`` pulls the base to see
    whether it is a LeRobot folder)."""
    if cfg.init != "auto":
        return cfg.init == "base"
    if not cfg.base:
        return False
    from policies.lerobot_adapter import is_lerobot_folder
    from vla_rl.hub.registry import pull

    return is_lerobot_folder(pull(cfg.base).path)


def span_keep(db: MetadataDB, episode_ids: list[str]) -> Callable[[Episode], np.ndarray]:
    """The ``keep`` of :class:`fleet.dataset.ChunkDataset` from the episodes' current ``segment`` span
    labels: :func:`~vla_rl.train.transitions.span_effects`'s mask (False in idle spans not covered by a
    recovery span), the same frames AWR / RECAP / QAM drop."""
    spans = db.current_spans(episode_ids)

    def keep(ep: Episode) -> np.ndarray:
        mine = [
            (str(lb.value), lb.start, lb.end)
            for lb in spans.get(ep.meta.episode_id, [])
            if lb.key == SPAN_KEY
        ]
        return span_effects(ep.length, ep.controller, mine)[0]

    return keep


def train_sft(cfg: SFTConfig) -> SFTResult:
    """Train (or resume) an SFT run; returns where the last checkpoint is and how the loss moved.

    Under torchrun every process trains on its share of each global batch (see
    :mod:`vla_rl.train.distributed`); rank 0 writes the checkpoints, the train state and the logs."""
    with distributed(cfg.device) as (dist, device):
        return _train_sft(cfg, dist, device)


def _train_sft(cfg: SFTConfig, dist: Dist, device: torch.device) -> SFTResult:
    clock = RunClock()
    dist.check_batch(cfg.batch_size)
    shard = Shard(dist, cfg.batch_size)
    torch.set_num_threads(dist.threads(cfg.threads))
    store = EpisodeStore(cfg.store)
    db = MetadataDB(cfg.db_url or default_url(store.root))
    base = load_base(cfg, device) if continues_base(cfg) else None
    # a base acts in its own task (cfg.task must match it; a LeRobot folder from elsewhere needs cfg.task)
    task = base.task(cfg.task) if base is not None else cfg.task or _only_task(store)
    selection = Selection.parse(cfg.data, task=task)
    episode_ids = select_episode_ids(store, selection, db)
    ds = ChunkDataset(
        store,
        base.policy.chunk_len if base is not None else cfg.chunk_len,
        episode_ids=episode_ids,
        keep=span_keep(db, episode_ids),
        instructions=labelled_instructions(db.current_labels(episode_ids)),
    )
    if base is not None:
        _check_data_fits(base, ds)
        policy: FlowPolicy = base.policy
        if cfg.rtc_max_delay:
            train_with_rtc(policy, cfg.rtc_max_delay, cfg.rtc_zero_delay_prob)
        params = trainable_parameters(cfg, policy)
    else:
        policy = _new_policy(cfg, ds)
        params = [p for p in policy.parameters() if p.requires_grad]
    model = trained_module(policy)
    model.to(device)
    broadcast_module(model, dist)
    ema = EMA(model, cfg.ema_decay)
    opt = _optimiser(cfg, model, params)
    cfg.out.mkdir(parents=True, exist_ok=True)
    state = TrainState(
        cfg.out, clock, {"model": model, "ema": ema, "optimizer": opt.optimizer, "scheduler": opt.scheduler}
    )
    st = state.load(cfg.resume)
    step = int(st["step"]) if st is not None else 0
    first_loss: float | None = st.get("first_loss") if st is not None else None
    last_loss = float(st.get("last_loss", "nan")) if st is not None else float("nan")

    # Each sample is conditioned on its own episode's instruction: FlowVLA embeds the distinct strings
    # once (frozen MiniLM, one batched call) and each batch gathers its rows; a LeRobot VLA reads the text.
    inputs = PolicyInputs(policy, ds, device)

    tlog = TrainLog(cfg, dist, purge_step=step, config_step=step)
    log.info(
        "sft start",
        extra={
            "task": cfg.task,
            "episodes": len(episode_ids),
            "frames": len(ds),
            "params": sum(p.numel() for p in params),
            "base": cfg.base if base is not None else None,
            "device": str(device),
            "steps": cfg.steps,
            "processes": dist.world,
        },
    )
    speed = Throughput()

    def update(step: int) -> dict[str, Any]:
        """Flow matching on the global batch's rows, noise and times (the same draws as one process),
        this rank's share."""
        rows = shard.take(sample_indices(len(ds), cfg.batch_size, cfg.seed, step))
        batch = inputs(ds.batch(rows))
        noise = shard.randn(*policy.event_shape, device=device)
        t = shard.take(policy.sample_time(cfg.batch_size))
        with autocast_for(device, cfg.amp):
            loss, metrics = weighted_flow_loss(policy, batch, noise=noise, time=t)
        norms = gradient_step(loss, [opt], dist)
        ema.update(model)
        speed.add(cfg.batch_size)
        return {"loss": metrics["loss"], "grad_norm": norms["policy"]}

    def on_log(step: int, metrics: dict[str, float]) -> None:
        sps = speed.rate()
        tlog.writer.add_scalar("train/loss", metrics["loss"], step)
        tlog.writer.add_scalar("train/lr", opt.scheduler.get_last_lr()[0], step)
        tlog.writer.add_scalar("train/grad_norm", metrics["grad_norm"], step)
        tlog.writer.add_scalar("train/samples_per_s", sps, step)
        bar.set_postfix(loss=f"{metrics['loss']:.4f}", sps=f"{sps:.0f}")

    def on_checkpoint(step: int) -> None:
        """A checkpoint of the EMA weights (copied to ``last``) and the train state."""
        loss = loop.metrics["loss"]
        ckpt = cfg.out / "checkpoints" / f"step_{step:06d}"
        _save(as_policy(ema.model, policy), ckpt, base, cfg, ds, step)
        publish_last(ckpt)
        state.save(step=step, first_loss=run_first_loss(), last_loss=loss)
        log.info("checkpoint", extra={"step": step, "path": str(ckpt), "loss": round(loss, 5)})

    def run_first_loss() -> float | None:
        """The run's first loss: the saved one when resumed, else this process's first update's."""
        return first_loss if first_loss is not None else (loop.first or {}).get("loss")

    end = min(cfg.steps, cfg.stop_at or cfg.steps)
    checkpoint = Beat(cfg.checkpoint_every, also=end)
    loop = UpdateLoop.over_steps(
        update, cfg, dist, step=step, on_log=on_log, checkpoint=checkpoint, on_checkpoint=on_checkpoint
    )
    bar = tlog.progress(cfg.steps, initial=step, stage="train", desc="sft")
    policy.train()
    step = loop.run(end, bar)
    tlog.close()
    seconds = clock.seconds
    loss_val = loop.metrics.get("loss", last_loss)
    first = float(v if (v := run_first_loss()) is not None else float("nan"))
    samples_per_s = step * cfg.batch_size / max(seconds, 1e-9)
    return SFTResult(
        checkpoint=cfg.out / "checkpoints" / "last",
        seconds=seconds,
        metrics={"steps": step, "first_loss": first, "final_loss": loss_val, "samples_per_s": samples_per_s},
        data={"selection": selection.to_dict(), **dataset_digest(ds)},
        steps=step,
        final_loss=loss_val,
        first_loss=first,
        samples_per_s=samples_per_s,
    )


def _new_policy(cfg: SFTConfig, ds: ChunkDataset) -> FlowVLAFlowPolicy:
    """A new FlowVLA of the architecture knobs (seeded), with its pretrained image encoder when named."""
    model_cfg = _model_config(cfg, ds)
    torch.manual_seed(cfg.seed)
    model = FlowVLAPolicy(model_cfg)
    if model.load_pretrained_image_encoders():
        log.info("pretrained image encoder", extra={"weights": model_cfg.image_encoder_weights})
    return FlowVLAFlowPolicy(model, ds.spec)


def train_with_rtc(policy: FlowPolicy, max_delay: int, zero_delay_prob: float | None = None) -> None:
    """Make a base train (and be saved) with training-time RTC up to ``max_delay`` actions, a delay of 0
    drawn with ``zero_delay_prob`` (None: uniformly; :attr:`SFTConfig.rtc_zero_delay_prob`): FlowVLA's
    config, a LeRobot VLA's sidecar (:meth:`~policies.lerobot_flow.LeRobotFlowPolicy.set_rtc_max_delay`).
    ValueError naming ``rtc_max_delay`` for a policy whose expert cannot take per-action flow times (π0.5)
    or a delay of a whole chunk or more, naming ``rtc_zero_delay_prob`` for a probability it cannot be."""
    if isinstance(policy, FlowVLAFlowPolicy):
        config = policy.model.config
        if max_delay >= config.chunk_len:
            raise ValueError(
                f"rtc_max_delay: expected at most chunk_len - 1 ({config.chunk_len - 1}), got {max_delay}"
            )
        problem = zero_delay_prob_problem(zero_delay_prob, max_delay)
        if problem is not None:
            raise ValueError(f"rtc_zero_delay_prob: {problem}")
        config.rtc_max_delay, config.rtc_zero_delay_prob = max_delay, zero_delay_prob
        return
    setter = getattr(policy, "set_rtc_max_delay", None)
    if setter is None:
        raise ValueError(
            f"rtc_max_delay: training-time RTC needs per-action flow times, which {type(policy).__name__} "
            "does not take; train without it and serve guided RTC"
        )
    setter(max_delay, zero_delay_prob)


def _check_data_fits(base: FlowCheckpoint, ds: ChunkDataset) -> None:
    """The episodes are of the robot the base acts for (state, action and cameras), or a ValueError."""
    have, want = ds.spec, base.spec
    if (have.state_dim, have.action_dim) != (want.state_dim, want.action_dim) or not set(
        want.camera_names
    ) <= set(have.camera_names):
        raise ValueError(
            f"base: {base.ref} acts for {want.name} (state {want.state_dim}, action {want.action_dim}, "
            f"cameras {list(want.camera_names)}), the episodes are {have.name} (state {have.state_dim}, "
            f"action {have.action_dim}, cameras {list(have.camera_names)})"
        )


def _save(
    policy: FlowPolicy, ckpt: Path, base: FlowCheckpoint | None, cfg: SFTConfig, ds: ChunkDataset, step: int
) -> None:
    """A checkpoint in the policy's own format; a scratch run's has no parent."""
    data, metrics = _lineage_data(cfg, ds), {"train_steps": step}
    if base is not None:
        save_trained(
            policy, ckpt, base, algorithm="sft", data=data, metrics=metrics, round_index=cfg.round_index
        )
    else:
        policy.save(ckpt, lineage=Lineage(algorithm="sft", round=cfg.round_index, data=data), metrics=metrics)


def _model_config(cfg: SFTConfig, ds: ChunkDataset) -> FlowVLAConfig:
    """The policy's architecture from the knobs, with normalisation statistics from the training data."""
    stats = compute_normalization_stats(ds.states, ds.actions)
    model_kw: dict[str, Any] = {
        "chunk_len": cfg.chunk_len,
        "n_exec": cfg.n_exec,
        "d_model": cfg.d_model,
        "n_layers": cfg.n_layers,
        "expert_n_layers": cfg.expert_n_layers,
        "n_heads": cfg.n_heads,
        "instruction_encoder": cfg.instruction_encoder,
        "image_resize": cfg.image_size,
        "image_encoder": cfg.image_encoder,
        "image_encoder_weights": cfg.image_encoder_weights,
        "freeze_image_encoder": cfg.freeze_image_encoder,
        "normalization_stats": stats,
        "rtc_max_delay": cfg.rtc_max_delay,
        "rtc_zero_delay_prob": cfg.rtc_zero_delay_prob,
    }
    return FlowVLAConfig.from_robot_spec(ds.spec, **(model_kw | cfg.model_overrides))


def _optimiser(cfg: SFTConfig, model: nn.Module, params: list[nn.Parameter]) -> Optimiser:
    """AdamW on ``params`` (the trainable ones) without weight decay on biases, norms and embeddings,
    warm-up then cosine decay."""
    decay, no_decay = [], []
    trained = {id(p) for p in params}
    for name, p in model.named_parameters():
        if id(p) in trained:
            (no_decay if p.ndim < 2 or "norm" in name or "emb" in name else decay).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    scheduler = warmup_cosine_schedule(optimizer, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio)
    return Optimiser(optimizer, {"policy": list(model.parameters())}, cfg.grad_clip, scheduler)


def _only_task(store: EpisodeStore) -> str:
    """The task of every closed episode in ``store``, or a ValueError asking for ``task``."""
    tasks = sorted({m.task for m in map(store.read_metadata, store.episode_ids()) if m.is_closed})
    if len(tasks) != 1:
        held = f"holds {', '.join(tasks)}" if tasks else "holds no closed episodes"
        raise ValueError(f"task: the store {store.root} {held}; say which to train on (--task)")
    return tasks[0]
