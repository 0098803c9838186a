"""Fit the failure / takeover predictor (:mod:`policies.failure`) from the fleet's own data.

**Rows.** One row per autonomous frame ``t`` of a stored episode (every ``stride``-th), with the policy's
``features(prefix)`` of frame t's observation, the chunk's ``accel`` uncertainty as the robot recorded it
(the last score at or before t; NaN when the store has none) and the seconds since the episode began.

**Labels** (docs/algorithms.md §6c). The episode's autonomous stretches are credited as in
:func:`vla_rl.train.transitions.credit_labels`: a stretch that a human took over from, that a
``failure-inducing`` span label ends, or the last stretch of a failed episode is a *failing* stretch, whose
*event* is its end ``e`` (the takeover, or the failed ending). With ``H = round(horizon_s * control_hz)``:

    y_t = 1   if t is in a failing stretch and e - t <= H   (the window before the event)
    y_t = 0   if t is in a stretch credited as a success    (successful autonomous stretches)
    excluded  otherwise (human frames; a failing stretch's frames more than H before its event).

The dashboard's labels fold in through the same credit: an ``outcome`` label overrides the recorded
success, a ``failure-inducing`` span makes a failing stretch of what it covers.

**Split.** Episodes, not frames, are split (a hash of seed and episode id): ``1 - calib_fraction`` train
the head (balanced binary cross-entropy: positives weighted by #neg / #pos), the rest calibrate. The
alarm threshold is split conformal on the calibration episodes that succeeded without help: the r-th
smallest of their M peak scores, ``r = ceil((M + 1)(1 - alpha))`` (:func:`fleet.uncertainty.conformal_threshold`),
so a new successful episode alarms with probability at most ``alpha``. The calibration episodes that
failed report how many the alarm flags at least ``lead_s`` before their event (a held-out check).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vla_rl_client.meta import Controller

from fleet import store_index
from fleet.dataset import labelled_instructions
from fleet.db import MetadataDB, effective_outcome
from fleet.selection import Selection
from fleet.store import Episode, EpisodeStore
from fleet.uncertainty import conformal_threshold, min_calibration_episodes
from policies.failure import (
    FAILURE_DIR,
    FailureHead,
    FailureHeadConfig,
    FailurePredictor,
    check_rows,
    decision_features,
    failure_lineage,
    head_inputs,
    policy_weights_sha256,
)
from vla_rl.train.loop import fit_minibatches
from vla_rl.train.transitions import SPAN_KEY, credit_labels, select_episode_ids, span_effects

log = logging.getLogger(__name__)
Tensor = torch.Tensor

__all__ = [
    "EpisodeRows",
    "FailureFitConfig",
    "calibrate_threshold",
    "failure_labels",
    "first_alarm",
    "fit_head",
    "split_episodes",
    "train_failure",
]


@dataclass(kw_only=True)
class FailureFitConfig:
    """Fit a failure / takeover predictor on a policy's features from an episode store (``vla-rl failure
    fit``); the policy server serves its score next to ``accel`` when it sits in the checkpoint folder."""

    base: str
    """The checkpoint whose ``features(prefix)`` the predictor reads (a folder or hub://org/name@rev)."""
    store: Path
    """Episode store with the fleet's episodes (autonomous stretches, interventions, outcomes)."""
    out: Path | None = None
    """Folder for ``failure.safetensors`` + ``failure.json``; None = ``BASE/failure`` (a local base
    folder only: a pulled Hub checkpoint is read-only, push the folder with it instead)."""
    data: str | None = None
    """Which episodes, as selection text (docs/training.md); None = every closed episode of the task."""
    task: str | None = None
    """Task id; None = the base checkpoint's."""
    db_url: str | None = None
    """Metadata DB (labels) as an SQLAlchemy URL; None = the store's own SQLite file, when it has one."""
    horizon_s: float = 2.0
    """Positive rows: within this many seconds before a takeover or failed ending."""
    lead_s: float = 1.0
    """The held-out check: a failing calibration episode counts as flagged when the alarm comes at least
    this many seconds before its event."""
    hidden: tuple[int, ...] = (16,)
    """Head MLP widths. Small by default: a wide head fits the fit set's successes so well that the
    conformal threshold on the calibration successes' peaks lands at 1.0 and it never alarms under the
    server's per-decision rule (docs/benchmarks.md, "Learned failure predictor")."""
    use_time: bool = False
    """Feed seconds-since-episode-start too (the policy server cannot serve such a head: offline use)."""
    steps: int = 300
    """Adam updates (few, for the same reason as ``hidden``)."""
    batch_size: int = 256
    """Rows per update."""
    lr: float = 1e-3
    """Adam learning rate."""
    weight_decay: float = 1e-4
    """AdamW weight decay."""
    alpha: float = 0.05
    """Target false-alarm rate on successful episodes (the conformal level)."""
    calib_fraction: float = 0.3
    """Share of the episodes held out to calibrate the threshold (and check the flag rate)."""
    stride: int = 1
    """Use every stride-th autonomous frame as a row."""
    seed: int = 0
    """Seeds the split, the initialisation and the batches."""
    threads: int = 1
    """CPU threads for torch."""

    def __post_init__(self) -> None:
        self.store = Path(self.store)
        self.out = None if self.out is None else Path(self.out)
        self.hidden = tuple(int(h) for h in self.hidden)
        for name in ("steps", "batch_size", "stride", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)}")
        for name in ("horizon_s", "lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected > 0, got {getattr(self, name)}")
        if not self.lead_s >= 0:
            raise ValueError(f"lead_s: expected >= 0 seconds, got {self.lead_s}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay: expected >= 0, got {self.weight_decay}")
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha: expected a value in (0, 1), got {self.alpha}")
        if not 0 < self.calib_fraction < 1:
            raise ValueError(f"calib_fraction: expected a value in (0, 1), got {self.calib_fraction}")


# ============================================================================ labels and split
def failure_labels(
    controller: np.ndarray, success: bool, horizon_steps: int, failure_at: Sequence[int] = ()
) -> tuple[np.ndarray, np.ndarray]:
    """Per-frame labels of one episode (module docstring): ``y`` int8 ``[T]`` (1 / 0 / -1 excluded) and
    ``event`` int64 ``[T]``: the frame index of the failing stretch's event (its end, exclusive), -1 where
    the frame is in no failing stretch. ``failure_at``: frames a ``failure-inducing`` span ends a stretch at."""
    credit, cut = credit_labels(controller, success, failure_at)
    t = len(credit)
    y = np.full(t, -1, np.int8)
    event = np.full(t, -1, np.int64)
    i = 0
    while i < t:
        j = i + 1
        while j < t and credit[j] == credit[i] and not cut[j - 1]:
            j += 1
        if credit[i] == 1:
            y[i:j] = 0
        elif credit[i] == 0:
            event[i:j] = j
            frames = np.arange(i, j)
            y[i:j] = np.where(j - frames <= horizon_steps, 1, -1)
        i = j
    return y, event


def split_episodes(
    episode_ids: Sequence[str], calib_fraction: float, seed: int
) -> tuple[list[str], list[str]]:
    """``(train, calibration)``: episodes ordered by sha1 of ``seed:id``, the last ``calib_fraction`` (at
    least one, at most all but one) calibrate: deterministic given the ids and the seed."""
    if len(episode_ids) < 2:
        raise ValueError(
            f"episodes: expected at least 2 to split into train and calibration, got {len(episode_ids)}"
        )
    keyed = sorted(episode_ids, key=lambda e: hashlib.sha1(f"{seed}:{e}".encode()).hexdigest())
    n_cal = min(len(keyed) - 1, max(1, round(len(keyed) * calib_fraction)))
    return keyed[: len(keyed) - n_cal], keyed[len(keyed) - n_cal :]


def forward_fill(x: np.ndarray) -> np.ndarray:
    """Each NaN replaced by the last finite value before it (NaN until the first one)."""
    x = np.asarray(x, np.float64)
    idx = np.where(np.isfinite(x), np.arange(len(x)), -1)
    np.maximum.accumulate(idx, out=idx)
    return np.where(idx >= 0, x[np.maximum(idx, 0)], np.nan).astype(np.float32)


# ============================================================================ rows from the store
@dataclass
class EpisodeRows:
    """One episode's rows: frame indices, labels, events, inputs; ``clean_success``: it succeeded without
    any human frame (what calibrates the threshold)."""

    episode_id: str
    frames: np.ndarray
    y: np.ndarray
    event: np.ndarray
    time_s: np.ndarray
    features: Tensor
    uncertainty: np.ndarray
    clean_success: bool
    control_hz: float

    def inputs(self, use_time: bool) -> Tensor:
        return head_inputs(self.features, self.uncertainty, self.time_s if use_time else None)


def episode_rows(
    policy: Any,
    ep: Episode,
    labels: Mapping[str, Any],
    spans: Sequence[Any],
    *,
    horizon_s: float,
    stride: int = 1,
    batch: int = 256,
) -> EpisodeRows:
    """The rows of a stored episode (autonomous frames, every ``stride``-th) under its current labels."""
    hz = float(ep.meta.spec.control_hz)
    _, success = effective_outcome(ep.meta.outcome, ep.meta.success, labels)
    span_list = [(str(lb.value), lb.start, lb.end) for lb in spans if lb.key == SPAN_KEY]
    _, failure_at, _ = span_effects(ep.length, ep.controller, span_list)
    y, event = failure_labels(ep.controller, bool(success), max(1, round(horizon_s * hz)), failure_at)
    human = ep.controller == int(Controller.HUMAN)
    frames = np.flatnonzero(~human)[::stride]
    unc = ep.uncertainty if ep.uncertainty is not None else np.full(ep.length, np.nan, np.float32)
    instructions = labelled_instructions({ep.meta.episode_id: dict(labels)})(ep)
    device = policy.device

    def observation(rows: np.ndarray) -> dict[str, Any]:
        return {
            "state": torch.from_numpy(np.ascontiguousarray(ep.state[rows])).to(device),
            "cameras": {
                k: torch.from_numpy(np.ascontiguousarray(v[rows])).to(device) for k, v in ep.cameras.items()
            },
            "instruction": [instructions[i] for i in rows],
        }

    feats = [
        decision_features(policy, observation(frames[a : a + batch])) for a in range(0, len(frames), batch)
    ]
    return EpisodeRows(
        episode_id=ep.meta.episode_id,
        frames=frames,
        y=y[frames],
        event=event[frames],
        time_s=(frames / hz).astype(np.float32),
        features=torch.cat(feats) if feats else torch.zeros(0, 0),
        uncertainty=forward_fill(unc)[frames],
        clean_success=bool(success) and not human.any(),
        control_hz=hz,
    )


# ============================================================================ fit and calibrate
def fit_head(
    x: Tensor,
    y: np.ndarray,
    config: FailureHeadConfig,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    weight_decay: float = 1e-4,
    seed: int = 0,
) -> tuple[FailureHead, list[float]]:
    """Fit the head on rows ``x [n, in_dim]`` with labels ``y`` in {0, 1} (rows labelled -1 are dropped):
    AdamW on balanced binary cross-entropy (positives weighted by #neg / #pos), standardisation from the
    kept rows. Returns the head (eval mode) and the loss curve."""
    y = np.asarray(y)
    keep = y >= 0
    x, yt = x[torch.from_numpy(keep)], torch.from_numpy(y[keep].astype(np.float32))
    check_rows(x, yt.numpy())
    torch.manual_seed(seed)
    head = FailureHead(config)
    head.set_standardisation(x)
    pos_weight = torch.tensor(float((yt == 0).sum()) / float((yt == 1).sum()))
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)
    rng = np.random.default_rng(seed + 1)
    n = len(x)

    def loss_fn() -> Tensor:
        idx = torch.from_numpy(rng.integers(0, n, size=min(batch_size, n)))
        return torch.nn.functional.binary_cross_entropy_with_logits(
            head(x[idx]), yt[idx], pos_weight=pos_weight
        )

    losses = fit_minibatches(opt, loss_fn, steps)
    return head.eval(), losses


def calibrate_threshold(peaks: Sequence[float], alpha: float) -> float:
    """The alarm threshold from successful held-out episodes' peak scores (split conformal at ``alpha``;
    ValueError naming how many are needed)."""
    if len(peaks) < min_calibration_episodes(alpha):
        raise ValueError(
            f"calibration: {len(peaks)} held-out episodes succeeded without help; a threshold at "
            f"alpha={alpha} needs at least {min_calibration_episodes(alpha)} (more episodes, or a larger "
            "calib_fraction)"
        )
    return conformal_threshold(peaks, alpha)


def first_alarm(scores: np.ndarray, threshold: float) -> int | None:
    """Index of the first score above ``threshold`` (None: no alarm)."""
    hit = np.flatnonzero(np.nan_to_num(np.asarray(scores, np.float64), nan=-1.0) > threshold)
    return int(hit[0]) if len(hit) else None


def flagged_before(rows: EpisodeRows, scores: np.ndarray, threshold: float, lead_s: float) -> bool | None:
    """Whether a failing episode's first alarm in a failing stretch comes at least ``lead_s`` before that
    stretch's event; None when the episode has no failing stretch."""
    failing = rows.event >= 0
    if not failing.any():
        return None
    lead = (rows.event - rows.frames) / rows.control_hz
    alarm = np.nan_to_num(np.asarray(scores, np.float64), nan=-1.0) > threshold
    return bool((alarm & failing & (lead >= lead_s)).any())


def _predictor_scores(head: FailureHead, rows: EpisodeRows, use_time: bool) -> np.ndarray:
    with torch.no_grad():
        return torch.sigmoid(head(rows.inputs(use_time))).numpy()


# ============================================================================ the command
def _out_folder(cfg: FailureFitConfig, checkpoint_path: Path) -> Path:
    if cfg.out is not None:
        return cfg.out
    if cfg.base.startswith("hub://"):
        raise ValueError("out: a Hub base is pulled read-only; give --out (and push it with the checkpoint)")
    return checkpoint_path / FAILURE_DIR


def train_failure(cfg: FailureFitConfig) -> dict[str, Any]:
    """Select, split, fit, calibrate and save (module docstring); returns the run's summary (also in the
    artefact's lineage)."""
    from policies.loading import load_flow_checkpoint

    t0 = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    ckpt = load_flow_checkpoint(cfg.base, algorithm="failure", device="cpu")
    policy = ckpt.policy
    policy.train(False)
    out = _out_folder(cfg, ckpt.path)
    store = EpisodeStore(cfg.store)
    db = MetadataDB(cfg.db_url) if cfg.db_url else store_index.store_db(store)
    ids = select_episode_ids(store, Selection.parse(cfg.data, task=ckpt.task(cfg.task)), db)
    labels = db.current_labels(ids) if db is not None else {}
    spans = db.current_spans(ids) if db is not None else {}
    train_ids, calib_ids = split_episodes(ids, cfg.calib_fraction, cfg.seed)

    def rows_of(eid: str) -> EpisodeRows:
        ep = store.read_episode(eid, cameras=bool(ckpt.spec.cameras))
        return episode_rows(
            policy, ep, labels.get(eid, {}), spans.get(eid, []), horizon_s=cfg.horizon_s, stride=cfg.stride
        )

    train_rows = [r for r in map(rows_of, train_ids) if len(r.frames)]
    calib_rows = [r for r in map(rows_of, calib_ids) if len(r.frames)]
    if not train_rows:
        raise ValueError("episodes: the training episodes hold no autonomous frames")
    feature_dim = int(train_rows[0].features.shape[1])
    head_cfg = FailureHeadConfig(feature_dim, cfg.hidden, cfg.horizon_s, cfg.use_time)
    x = torch.cat([r.inputs(cfg.use_time) for r in train_rows])
    y = np.concatenate([r.y for r in train_rows])
    head, losses = fit_head(
        x,
        y,
        head_cfg,
        steps=cfg.steps,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        seed=cfg.seed,
    )
    scores = {r.episode_id: _predictor_scores(head, r, cfg.use_time) for r in calib_rows}
    peaks = [float(scores[r.episode_id].max()) for r in calib_rows if r.clean_success]
    threshold = calibrate_threshold(peaks, cfg.alpha)
    flags = [flagged_before(r, scores[r.episode_id], threshold, cfg.lead_s) for r in calib_rows]
    failing = [f for f in flags if f is not None]
    summary = {
        "episodes": len(ids),
        "train_episodes": len(train_rows),
        "calibration_episodes": len(calib_rows),
        "calibration_successes": len(peaks),
        "rows": int((y >= 0).sum()),
        "positive_rows": int((y == 1).sum()),
        "threshold": threshold,
        "heldout_failing_episodes": len(failing),
        "heldout_flagged": int(sum(failing)),
        "final_loss": float(np.mean(losses[-50:])),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    lineage = failure_lineage(
        policy_ref=str(cfg.base),
        policy_commit=ckpt.commit,
        policy_weights=policy_weights_sha256(ckpt.path),
        extra={
            "task": ckpt.spec.name,
            "round": ckpt.lineage.round if ckpt.lineage is not None else None,
            "store": str(cfg.store),
            "data": cfg.data,
            "episodes_sha1": hashlib.sha1("\n".join(sorted(ids)).encode()).hexdigest(),
            "calibration_ids": calib_ids,
            "fit": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
            "summary": summary,
            "created": time.time(),
        },
    )
    FailurePredictor(head, threshold, cfg.alpha, lineage).save(out)
    summary["out"] = str(out)
    log.info("failure predictor fit", extra=summary)
    return summary
