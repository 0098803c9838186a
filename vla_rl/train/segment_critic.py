"""HELP's segment critic: split fleet episodes into progress / idle / failure-inducing / recovery spans.

HELP (arXiv 2607.09776; docs/algorithms.md §4e) publishes the classes, not the
equations; this is our design ([inferred] there). It needs only what a real fleet records: states,
controllers (human takeovers) and outcomes, never the simulator's shaped reward, which the benchmark
keeps as the ground truth it is scored against.

1. **Progress value** V(s) in [0, 1]: a state-value MLP regressed (MSE) on the *fraction of the way to
   success* along every successful autonomous stretch, i.e. the frames credited with a success as
   training credits them (:func:`~vla_rl.train.transitions.credit_labels`: the stretch after the last
   takeover of a successful episode): ``y_t = (t − a) / (b − a)`` for a stretch of frames ``a..b``
   (1 when ``a = b``). Failed and taken-over stretches are not fitted (how far they got is what V is
   asked); a value of discounted success (``γ^(T_s − t)``, 0 on failures) was tried first and tracked
   the simulator's progress far worse (docs/benchmarks.md).
2. **Slope** over a centred window of w frames, clipped at the episode's ends:
   ``d_t = (p_hi − p_lo) / (hi − lo)``, ``lo = max(0, t − w)``, ``hi = min(T − 1, t + w)``
   (0 for a one-frame episode), for a progress signal p (V(s_t) here; the dense reward for the truth).
3. **Frame classes** with the threshold ``δ = delta · ρ``, ρ the signal's own typical rise rate: the
   median of ``d_t`` over the frames of the successful episodes (1/T_max when there are none; a median
   of frames, so a reward's jumps at a grasp or at success do not set the scale). The critic's V and
   the simulator's reward are each judged on their own scale. A human frame is ``recovery`` (a
   takeover); otherwise ``progress`` if ``d_t > δ``, ``failure-inducing`` if ``d_t < −δ``, else ``idle``.
4. **Runs**: runs shorter than ``min_span`` frames (autonomous ones only; takeovers are facts, never
   merged away) join the run before them (the one after, at the start), repeated until none is left;
   then an autonomous progress run whose last non-idle autonomous run before it was
   failure-inducing is a ``recovery`` (the robot undoing a mistake), and each run is one span
   ``(class, start, end)``, end exclusive, covering the episode.

:func:`label_store` writes the spans as ``segment`` span labels with ``source = "auto"``
(``vla-rl label auto``); training reads them like a human's (module docstring of
:mod:`vla_rl.train.transitions`), the dashboard shows them as pre-labels. It never touches an episode
that has a human ``segment`` span, leaves earlier automatic spans alone unless ``replace``, and leaves
an episode it finds idle throughout unlabelled (training refuses an episode with no frame kept).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vla_rl_client.meta import Controller

from fleet.db import MetadataDB
from fleet.selection import Selection
from fleet.store import EpisodeStore
from policies.critics import ValueMLP
from vla_rl.train.loop import fit_minibatches
from vla_rl.train.transitions import SPAN_KEY, TransitionBuffer, select_episode_ids

log = logging.getLogger(__name__)

CLASSES: tuple[str, ...] = ("progress", "idle", "failure-inducing", "recovery")
"""The HELP segment classes, in the order of fleet/labels.toml; class ids index this tuple."""
PROGRESS, IDLE, FAILURE, RECOVERY = range(4)
AUTHOR = "segment-critic"

__all__ = [
    "CLASSES",
    "SegmentCriticConfig",
    "agreement",
    "classify_signal",
    "confusion_matrix",
    "fit_progress_value",
    "frame_classes",
    "label_store",
    "mark_recoveries",
    "merge_short_runs",
    "per_class_scores",
    "progress_slope",
    "progress_targets",
    "reward_truth",
    "rise_rate",
    "runs",
    "segment_episode",
    "segment_signals",
    "slope_threshold",
]


@dataclass(kw_only=True)
class SegmentCriticConfig:
    """Label fleet episodes with HELP's segment classes (``vla-rl label auto``): fit a progress value on
    the selected episodes, classify every frame, write the spans as ``source = auto`` labels."""

    store: Path
    """Episode store with the fleet's episodes."""
    data: str | None = None
    """Which episodes, as selection text (``robot=arm-1,since=2026-11-01,max=200``, see
    docs/training.md); None = every closed episode of the task."""
    task: str | None = None
    """Task id; None = the store's only task."""
    db_url: str | None = None
    """Metadata DB URL; None = the SQLite file next to the store."""
    window: int = 3
    """w: half-width of the centred slope window (frames)."""
    delta: float = 0.5
    """Slope threshold as a fraction of the value's typical rise rate on successful episodes:
    |d_t| <= delta·ρ is idle."""
    min_span: int = 3
    """Autonomous runs shorter than this merge into a neighbour (frames)."""
    value_hidden: tuple[int, ...] = (32, 32)
    """Progress-value MLP widths (small: a few dozen episodes must not be memorised)."""
    value_steps: int = 300
    """Adam updates of the progress value."""
    batch_size: int = 256
    """Frames per value update."""
    lr: float = 1e-3
    """Adam learning rate of the value fit."""
    seed: int = 0
    """Seeds the value fit's initialisation and batches."""
    threads: int = 1
    """CPU threads for torch."""
    dry_run: bool = False
    """Print what would be written; write nothing."""
    replace: bool = False
    """Undo this critic's earlier automatic spans on the selected episodes and write new ones (default:
    episodes that already have automatic spans are skipped). Human spans are never touched."""
    author: str = AUTHOR
    """Author recorded on the labels."""
    out: Path | None = None
    """Also write the spans per episode as JSON here."""

    def __post_init__(self) -> None:
        self.store = Path(self.store)
        self.value_hidden = tuple(int(h) for h in self.value_hidden)
        for name in ("window", "min_span", "value_steps", "batch_size", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)}")
        if not self.delta > 0:
            raise ValueError(f"delta: expected > 0 (a fraction of the typical rise rate), got {self.delta}")
        if not self.lr > 0:
            raise ValueError(f"lr: expected > 0, got {self.lr}")
        if not self.author.strip():
            raise ValueError("author: expected a non-empty name")


# ============================================================================ pure pieces
def progress_slope(p: np.ndarray, window: int) -> np.ndarray:
    """``d_t = (p[hi] − p[lo]) / (hi − lo)`` with ``lo = max(0, t − w)``, ``hi = min(T − 1, t + w)``;
    0 where ``hi == lo`` (a one-frame episode)."""
    p = np.asarray(p, np.float64)
    t = np.arange(len(p))
    lo, hi = np.maximum(0, t - window), np.minimum(len(p) - 1, t + window)
    span = hi - lo
    return np.where(span > 0, (p[hi] - p[lo]) / np.maximum(span, 1), 0.0)


def frame_classes(slope: np.ndarray, human: np.ndarray, threshold: float) -> np.ndarray:
    """Per-frame class ids: human -> recovery; else slope > thr -> progress, < −thr -> failure-inducing,
    else idle."""
    slope = np.asarray(slope)
    out = np.full(len(slope), IDLE, np.int64)
    out[slope > threshold] = PROGRESS
    out[slope < -threshold] = FAILURE
    out[np.asarray(human, bool)] = RECOVERY
    return out


def runs(classes: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs of equal values as ``(value, start, end)``, end exclusive."""
    c = np.asarray(classes)
    if len(c) == 0:
        return []
    cuts = np.flatnonzero(c[1:] != c[:-1]) + 1
    starts, ends = np.concatenate([[0], cuts]), np.concatenate([cuts, [len(c)]])
    return [(int(c[s]), int(s), int(e)) for s, e in zip(starts, ends, strict=True)]


def merge_short_runs(classes: np.ndarray, human: np.ndarray, min_len: int) -> np.ndarray:
    """Autonomous runs shorter than ``min_len`` take the class of the run before them (the one after,
    for the first run), shortest first, until none is left or only one run remains. Human frames keep
    their class."""
    c = np.asarray(classes, np.int64).copy()
    human = np.asarray(human, bool)
    while True:
        rs = runs(c)
        short = [(e - s, i) for i, (_, s, e) in enumerate(rs) if e - s < min_len and not human[s:e].any()]
        if not short or len(rs) == 1:
            return c
        _, i = min(short)
        _, s, e = rs[i]
        c[s:e] = rs[i - 1][0] if i > 0 else rs[i + 1][0]


def mark_recoveries(classes: np.ndarray, human: np.ndarray) -> np.ndarray:
    """An autonomous progress run whose last non-idle autonomous run before it is failure-inducing
    becomes recovery (human runs in between do not count as that run)."""
    c = np.asarray(classes, np.int64).copy()
    human = np.asarray(human, bool)
    last = None
    for k, s, e in runs(c):
        if human[s:e].any() or k == IDLE:
            continue
        if k == PROGRESS and last == FAILURE:
            c[s:e] = RECOVERY
        last = k if k != RECOVERY else PROGRESS
    return c


def rise_rate(signals: Sequence[np.ndarray], successes: Sequence[bool], window: int) -> float | None:
    """ρ: the median of the slopes :func:`progress_slope` over every frame of the successful episodes
    (a median of frames, so a reward's jumps at a grasp or at success do not set the scale); None when
    no episode succeeded."""
    slopes = [
        progress_slope(p, window) for p, ok in zip(signals, successes, strict=True) if ok and len(p) > 1
    ]
    return float(np.median(np.concatenate(slopes))) if slopes else None


def slope_threshold(
    signals: Sequence[np.ndarray], successes: Sequence[bool], delta: float, window: int, max_steps: int
) -> float:
    """``δ = delta · ρ`` (:func:`rise_rate`), or ``delta / max_steps`` when ρ is None or not positive."""
    rho = rise_rate(signals, successes, window)
    return delta * (rho if rho is not None and rho > 0 else 1.0 / max(max_steps, 1))


def segment_episode(
    p: np.ndarray, human: np.ndarray, *, threshold: float, window: int, min_span: int
) -> np.ndarray:
    """Per-frame class ids of one episode from a progress signal ``p`` (steps 2-4 of the module
    docstring)."""
    c = frame_classes(progress_slope(p, window), human, threshold)
    return mark_recoveries(merge_short_runs(c, human, min_span), human)


def segment_signals(
    signals: Sequence[np.ndarray],
    humans: Sequence[np.ndarray],
    successes: Sequence[bool],
    *,
    window: int,
    delta: float,
    min_span: int,
    max_steps: int,
) -> list[np.ndarray]:
    """:func:`segment_episode` on each episode's signal, with one :func:`slope_threshold` over them all."""
    thr = slope_threshold(signals, successes, delta, window, max_steps)
    return [
        segment_episode(p, h, threshold=thr, window=window, min_span=min_span)
        for p, h in zip(signals, humans, strict=True)
    ]


def spans_of(classes: np.ndarray) -> list[tuple[str, int, int]]:
    """The runs as span labels ``(class name, start, end)``."""
    return [(CLASSES[k], s, e) for k, s, e in runs(classes)]


def confusion_matrix(truth: np.ndarray, pred: np.ndarray, n: int = len(CLASSES)) -> np.ndarray:
    """``M[i, j]`` = frames of true class i predicted as j."""
    m = np.zeros((n, n), np.int64)
    np.add.at(m, (np.asarray(truth, np.int64), np.asarray(pred, np.int64)), 1)
    return m


def per_class_scores(m: np.ndarray) -> dict[str, Any]:
    """Precision ``M_jj / Σ_i M_ij``, recall ``M_ii / Σ_j M_ij``, F1 = their harmonic mean (0 where
    undefined), support, accuracy = trace / total, macro F1 over the classes with support."""
    m = np.asarray(m, np.float64)
    tp = np.diag(m)
    pred, true = m.sum(0), m.sum(1)
    precision = np.divide(tp, pred, out=np.zeros_like(tp), where=pred > 0)
    recall = np.divide(tp, true, out=np.zeros_like(tp), where=true > 0)
    denom = precision + recall
    f1 = np.divide(2 * precision * recall, denom, out=np.zeros_like(tp), where=denom > 0)
    present = true > 0
    return {
        "per_class": {
            CLASSES[i] if len(m) == len(CLASSES) else str(i): {
                "precision": float(precision[i]),
                "recall": float(recall[i]),
                "f1": float(f1[i]),
                "support": int(true[i]),
            }
            for i in range(len(m))
        },
        "accuracy": float(tp.sum() / max(m.sum(), 1)),
        "macro_f1": float(f1[present].mean()) if present.any() else 0.0,
    }


# ============================================================================ the value fit
@dataclass
class ProgressValue:
    """A fitted V(s) in [0, 1] with its state normalisation."""

    net: ValueMLP
    mean: np.ndarray
    std: np.ndarray
    max_steps: int
    final_loss: float = 0.0
    losses: list[float] = field(default_factory=list)

    @torch.no_grad()
    def __call__(self, states: np.ndarray) -> np.ndarray:
        x = torch.from_numpy(((np.asarray(states, np.float32) - self.mean) / self.std).astype(np.float32))
        return self.net(x).clamp(0.0, 1.0).numpy().astype(np.float64)


def progress_targets(
    credit: np.ndarray, episode: np.ndarray, frame: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, y)``: the buffer rows of successful autonomous stretches (``credit == 1``) and their
    targets ``y = (frame − a) / (b − a)``, a / b = the first / last such frame of the episode (1 if a = b)."""
    rows = np.flatnonzero(np.asarray(credit) == 1)
    y = np.ones(len(rows), np.float32)
    ep, fr = np.asarray(episode)[rows], np.asarray(frame)[rows]
    for e in np.unique(ep):
        m = ep == e
        a, b = fr[m].min(), fr[m].max()
        if b > a:
            y[m] = (fr[m] - a) / (b - a)
    return rows, y


def fit_progress_value(
    buffer: TransitionBuffer,
    *,
    hidden: Sequence[int] = (32, 32),
    steps: int = 300,
    batch_size: int = 256,
    lr: float = 1e-3,
    seed: int = 0,
) -> ProgressValue:
    """Regress V(s) on :func:`progress_targets` of ``buffer``'s successful stretches (MSE, Adam,
    seeded; states standardised by those frames' mean / std)."""
    rows, y = progress_targets(buffer.array("credit"), buffer.array("episode"), buffer.array("frame"))
    if not len(rows):
        raise ValueError("episodes: none has a successful autonomous stretch; nothing to fit progress on")
    states = buffer.states[rows].astype(np.float32)
    mean, std = states.mean(0), states.std(0) + 1e-6
    x = torch.from_numpy((states - mean) / std)
    yt = torch.from_numpy(y)
    torch.manual_seed(seed)
    net = ValueMLP(x.shape[1], tuple(hidden))
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    rng = np.random.default_rng(seed)

    def loss_fn() -> torch.Tensor:
        idx = torch.from_numpy(rng.integers(0, len(x), size=min(batch_size, len(x))))
        return torch.nn.functional.mse_loss(net(x[idx]), yt[idx])

    losses = fit_minibatches(opt, loss_fn, steps)
    net.eval()
    return ProgressValue(net, mean, std, buffer.max_steps, float(np.mean(losses[-50:])), losses)


def load_buffer(store: EpisodeStore, episode_ids: Sequence[str]) -> TransitionBuffer:
    """The episodes (no cameras) as a buffer WITHOUT span labels (so the critic's own earlier labels
    never feed back into its value); frames stay in order per episode, credit as training assigns it,
    and the ``reward`` column as recorded (``dense``: for simulated episodes the simulator's reward)."""
    return TransitionBuffer.from_store(store, list(episode_ids), reward="dense", cameras=False)


def classify_signal(
    buffer: TransitionBuffer, signal: np.ndarray, cfg: SegmentCriticConfig
) -> dict[str, np.ndarray]:
    """Per-episode class ids of ``buffer``'s episodes from a per-frame progress ``signal`` (aligned with
    the buffer's rows), with one :func:`slope_threshold` over its successful episodes."""
    ep = buffer.array("episode")
    human = buffer.array("controller") == int(Controller.HUMAN)
    rows = [np.flatnonzero(ep == i) for i in range(len(buffer.episode_ids))]
    classes = segment_signals(
        [np.asarray(signal, np.float64)[r] for r in rows],
        [human[r] for r in rows],
        buffer.episode_success,
        window=cfg.window,
        delta=cfg.delta,
        min_span=cfg.min_span,
        max_steps=buffer.max_steps,
    )
    return dict(zip(buffer.episode_ids, classes, strict=True))


def classify_buffer(
    buffer: TransitionBuffer, value: ProgressValue, cfg: SegmentCriticConfig
) -> dict[str, np.ndarray]:
    """The critic: :func:`classify_signal` on the fitted value V(s) of every frame."""
    return classify_signal(buffer, value(buffer.states), cfg)


def reward_truth(buffer: TransitionBuffer, cfg: SegmentCriticConfig) -> dict[str, np.ndarray]:
    """The same rule on the recorded reward instead of V (:func:`load_buffer` keeps it as recorded):
    for simulated episodes that is the simulator's dense reward, so this is the ground truth the critic
    is scored against (bench/segment_critic.py, tests). Never used for labelling."""
    return classify_signal(buffer, buffer.array("reward"), cfg)


def agreement(truth: dict[str, np.ndarray], pred: dict[str, np.ndarray]) -> dict[str, Any]:
    """Frame-level :func:`per_class_scores` of ``pred`` against ``truth`` over ``truth``'s episodes, with
    the confusion matrix (rows truth, columns prediction)."""
    m = np.zeros((len(CLASSES), len(CLASSES)), np.int64)
    for e, t in truth.items():
        m += confusion_matrix(t, pred[e])
    return {**per_class_scores(m), "confusion": m.tolist()}


# ============================================================================ writing labels
@dataclass
class LabelReport:
    episodes: int = 0
    labelled: list[str] = field(default_factory=list)
    skipped_human: list[str] = field(default_factory=list)
    skipped_auto: list[str] = field(default_factory=list)
    all_idle: list[str] = field(default_factory=list)
    """Episodes classified idle throughout: left unlabelled (an all-idle episode would leave training
    nothing to keep of it, which it refuses)."""
    undone: int = 0
    spans: dict[str, list[tuple[str, int, int]]] = field(default_factory=dict)
    frames_per_class: dict[str, int] = field(default_factory=dict)
    value_loss: float = 0.0
    seconds: float = 0.0


def label_store(cfg: SegmentCriticConfig, db: MetadataDB | None = None) -> LabelReport:
    """Fit the progress value on the selected episodes, classify them and write their spans as
    ``segment`` labels (source ``auto``), except on episodes with a human ``segment`` span (skipped) or,
    without ``replace``, with earlier automatic ones. ``dry_run`` writes nothing."""
    from vla_rl.train.sft import _only_task

    t0 = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    db = db or (MetadataDB(cfg.db_url) if cfg.db_url else MetadataDB.for_store(cfg.store))
    store = EpisodeStore(cfg.store, db=db)
    selection = Selection.parse(cfg.data, task=cfg.task or _only_task(store))
    ids = select_episode_ids(store, selection, db)
    if not ids:
        raise ValueError(f"data: no closed episodes of {selection.task} match {cfg.data or 'the task'}")
    buffer = load_buffer(store, ids)
    value = fit_progress_value(
        buffer,
        hidden=cfg.value_hidden,
        steps=cfg.value_steps,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        seed=cfg.seed,
    )
    classes = classify_buffer(buffer, value, cfg)
    current = db.current_spans(list(classes))
    report = LabelReport(episodes=len(classes), value_loss=value.final_loss)
    counts = np.zeros(len(CLASSES), np.int64)
    for eid, c in classes.items():
        mine = [lb for lb in current.get(eid, []) if lb.key == SPAN_KEY]
        if any(lb.source != "auto" for lb in mine):
            report.skipped_human.append(eid)
            continue
        if mine and not cfg.replace:
            report.skipped_auto.append(eid)
            continue
        spans = spans_of(c)
        if all(k == "idle" for k, _, _ in spans):
            # training refuses an episode with no frame left (transitions.TransitionBuffer.add_episode)
            report.all_idle.append(eid)
            continue
        report.spans[eid] = spans
        report.labelled.append(eid)
        counts += np.bincount(c, minlength=len(CLASSES))
        if cfg.dry_run:
            continue
        for lb in mine:
            db.undo_label(
                lb.id, author=cfg.author, note="replaced by a new segment-critic run", source="auto"
            )
            report.undone += 1
        for kind, s, e in spans:
            db.add_label(eid, SPAN_KEY, kind, author=cfg.author, start=s, end=e, source="auto")
    report.frames_per_class = {k: int(n) for k, n in zip(CLASSES, counts, strict=True)}
    report.seconds = time.perf_counter() - t0
    log.info(
        "segment critic",
        extra={
            "episodes": report.episodes,
            "labelled": len(report.labelled),
            "skipped_human": len(report.skipped_human),
            "skipped_auto": len(report.skipped_auto),
            "all_idle": len(report.all_idle),
            "dry_run": cfg.dry_run,
        },
    )
    return report
