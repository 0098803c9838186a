"""A success / progress estimator learned from the store's own outcomes, for tasks with no simulator.

**What it estimates.** ``P(success | o_t, a_{t:t+H})``: the chance that an episode succeeds when, at the
recorded observation ``o_t``, the robot runs the chunk ``a_{t:t+H}``; and a per-frame *progress*
``phi(o_t)`` in [0, 1] (SARM / RA-BC style: how far along a successful episode the observation is).

**Why action-conditioned, on policy-independent inputs.** The promotion gate must judge a *candidate*
policy on recorded observations it never acted on: the observation is the recording's, the chunk is the
candidate's. So the head reads the observation through inputs no policy owns (the robot state and a
fixed, parameter-free pooling of each camera to a ``camera_grid x camera_grid`` colour grid) and the chunk
in its raw action units, standardised with the data's own statistics. Reading the base's or the
candidate's prefix features instead would let the score move with the policy's encoder rather than
with what the policy does; reading no action at all would give every candidate the same score.

**Labels** (the credit of :func:`vla_rl.train.transitions.credit_labels`, as the failure predictor's):
an autonomous frame is 1 in a stretch credited as a success, 0 in a failing stretch (one a human took
over from, that a ``failure-inducing`` span ends, or the last stretch of a failed episode); a human
(teleoperated) frame takes its episode's outcome (a demonstration that succeeded shows chunks that lead
to success); idle frames are left out. The outcome is the recorded one unless a dashboard ``outcome``
label overrides it; an episode whose outcome is unknown (e.g. a LeRobot dataset without
``next.success``) contributes only its takeover-ended stretches.

**Wrong-action rows.** Recorded data shows only the actions its policy took, so success alone could
be predicted from the observation, ignoring the chunk. For every successful row, ``negatives`` extra rows
carry the same observation with another chunk (half a chunk of another frame, half the recorded chunk
plus Gaussian noise of ``noise_scale`` action standard deviations) labelled 0: the head learns that
success at ``o_t`` comes from acting like the successful recordings there, so a candidate that acts
otherwise scores lower.

**Progress.** ``phi`` is fit (binary cross-entropy on soft targets) to ``t / (T - 1)`` over the frames of
successful episodes, observation only.

Fit with AdamW on balanced binary cross-entropy; inputs standardised with the training rows' statistics.
The promote gate (:mod:`vla_rl.gate_success`) and the AWR trainer's ``weighting`` (:func:`estimator_weights`)
use it; the equations are in docs/algorithms.md §6d.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from vla_rl_client.meta import Controller

from fleet.db import MetadataDB, effective_outcome
from fleet.db.labels import OUTCOME_KEY
from fleet.store import Episode, EpisodeStore
from fleet.store.layout import outcome_known
from policies.critics import mlp
from vla_rl.train.loop import fit_minibatches
from vla_rl.train.transitions import SPAN_KEY, credit_labels, span_effects

Tensor = torch.Tensor

__all__ = [
    "OutcomeRows",
    "SuccessEstimator",
    "SuccessFitConfig",
    "camera_summary",
    "check_outcomes",
    "episode_outcome_rows",
    "estimator_weights",
    "fit_success_estimator",
    "outcome_rows",
]


@dataclass(kw_only=True)
class SuccessFitConfig:
    """How the estimator is fit (module docstring)."""

    horizon: int
    """H: chunk steps the head reads (a candidate's chunk is cut to its first H steps)."""
    hidden: tuple[int, ...] = (128, 128)
    """MLP widths of both heads."""
    camera_grid: int = 4
    """Each camera pooled to a grid x grid colour grid as an input (0 = state only)."""
    negatives: float = 1.0
    """Wrong-action rows per successful row (0 = none)."""
    noise_scale: float = 1.0
    """The noised wrong-action rows' noise, in action standard deviations."""
    steps: int = 1500
    """AdamW updates (each head)."""
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 1e-4
    seed: int = 0

    def __post_init__(self) -> None:
        self.hidden = tuple(int(h) for h in self.hidden)
        for name in ("horizon", "steps", "batch_size"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)!r}")
        if not self.hidden or min(self.hidden) < 1:
            raise ValueError(f"hidden: expected positive integer widths, got {self.hidden!r}")
        if not (isinstance(self.camera_grid, int) and self.camera_grid >= 0):
            raise ValueError(f"camera_grid: expected an integer >= 0, got {self.camera_grid!r}")
        for name in ("negatives", "noise_scale", "weight_decay"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name}: expected a finite number >= 0, got {getattr(self, name)!r}")
        if not self.lr > 0:
            raise ValueError(f"lr: expected > 0, got {self.lr!r}")


# ============================================================================ inputs and rows
def camera_summary(images: Mapping[str, np.ndarray], grid: int, n: int) -> np.ndarray:
    """``{camera: uint8 [n, H, W, 3]}`` -> float32 ``[n, cameras * grid * grid * 3]``: each image's mean
    colour over a grid x grid partition, in [0, 1] (cameras in name order; ``[n, 0]`` without cameras or
    for grid 0). Parameter-free, so no policy owns it."""
    if not images or grid == 0:
        return np.zeros((n, 0), np.float32)
    if n == 0:
        return np.zeros((0, len(images) * grid * grid * 3), np.float32)
    out = []
    for name in sorted(images):
        img = torch.as_tensor(np.asarray(images[name])).float().permute(0, 3, 1, 2) / 255.0
        out.append(torch.nn.functional.adaptive_avg_pool2d(img, grid).reshape(n, -1).numpy())
    return np.concatenate(out, 1).astype(np.float32)


@dataclass
class OutcomeRows:
    """Rows for the estimator: ``obs`` float32 ``[N, D]`` (state + camera summary), ``chunk`` float32
    ``[N, H, A]`` (the recorded next H actions, the last repeated past the end), ``y`` int8 ``[N]``
    (1 / 0 / -1 no label), ``progress`` float32 ``[N]`` (NaN outside successful episodes), ``episode``
    (index into ``episode_ids``) and ``frame``; ``known`` counts episodes with a known outcome."""

    obs: np.ndarray
    chunk: np.ndarray
    y: np.ndarray
    progress: np.ndarray
    episode: np.ndarray
    frame: np.ndarray
    episode_ids: list[str] = field(default_factory=list)
    known: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.y)


def recorded_chunks(action: np.ndarray, frames: np.ndarray, horizon: int) -> np.ndarray:
    """``[len(frames), horizon, A]``: actions ``t .. t + horizon - 1`` of each frame, the last repeated."""
    window = np.asarray(frames)[:, None] + np.arange(horizon)[None, :]
    return np.asarray(action, np.float32)[np.minimum(window, len(action) - 1)]


def _unknown_ending(credit: np.ndarray, cut: np.ndarray) -> np.ndarray:
    """Frames of the stretch that runs to the episode's end without a takeover: an unknown outcome says
    nothing about them."""
    out = np.zeros(len(credit), bool)
    if not len(credit) or cut[-1]:
        return out  # a failure-inducing span ends the last stretch: a failure whatever the outcome
    j = len(credit) - 1
    while j >= 0 and credit[j] >= 0 and not (j < len(credit) - 1 and cut[j]):
        out[j] = True
        j -= 1
    return out


def episode_outcome_rows(
    ep: Episode,
    labels: Mapping[str, Any],
    spans: Sequence[Any],
    horizon: int,
    camera_grid: int,
    cameras: Sequence[str] | None = None,
) -> tuple[dict[str, np.ndarray], bool | None]:
    """One episode's rows (arrays as :class:`OutcomeRows`'s, without ``episode``) and its outcome
    (True / False, None when unknown); ``cameras``: those the summary pools (None: every one recorded)."""
    known = outcome_known(ep.meta) or OUTCOME_KEY in labels
    _, success = effective_outcome(ep.meta.outcome, ep.meta.success, labels)
    span_list = [(str(lb.value), lb.start, lb.end) for lb in spans if lb.key == SPAN_KEY]
    keep, failure_at, _ = span_effects(ep.length, ep.controller, span_list)
    credit, cut = credit_labels(ep.controller, bool(success), failure_at)
    y = credit.astype(np.int8)
    if not known:
        y[_unknown_ending(credit, cut)] = -1
    y[ep.controller == int(Controller.HUMAN)] = int(bool(success)) if known else -1
    frames = np.flatnonzero(keep & (y >= 0))
    t = ep.length
    progress = np.full(t, np.nan, np.float32)
    if known and success:
        progress[:] = np.arange(t) / max(t - 1, 1)
    names = [k for k in ep.cameras if cameras is None or k in cameras] if camera_grid else []
    cams = {k: ep.cameras[k][frames] for k in names}
    summary = camera_summary(cams, camera_grid, len(frames))
    obs = np.concatenate([ep.state[frames].astype(np.float32), summary], 1)
    rows = {
        "obs": obs,
        "chunk": recorded_chunks(ep.action, frames, horizon),
        "y": y[frames],
        "progress": progress[frames],
        "frame": frames.astype(np.int64),
    }
    return rows, (bool(success) if known else None)


def outcome_rows(
    store: EpisodeStore,
    episode_ids: Sequence[str],
    db: MetadataDB | None,
    *,
    horizon: int,
    camera_grid: int = 4,
    cameras: Sequence[str] | None = None,
) -> OutcomeRows:
    """The labelled rows of ``episode_ids`` under their current DB labels (module docstring); ``cameras``:
    those the observation's summary pools (None: every one recorded; a policy's own, so that its
    requests' cameras give the same inputs)."""
    labels = db.current_labels(episode_ids) if db is not None else {}
    spans = db.current_spans(episode_ids) if db is not None else {}
    parts, kept, known = [], [], {"success": 0, "failure": 0, "unknown": 0}
    for eid in episode_ids:
        ep = store.read_episode(eid, cameras=camera_grid > 0)
        if not ep.length:
            continue
        rows, outcome = episode_outcome_rows(
            ep, labels.get(eid, {}), spans.get(eid, []), horizon, camera_grid, cameras
        )
        known[{True: "success", False: "failure", None: "unknown"}[outcome]] += 1
        rows["episode"] = np.full(len(rows["y"]), len(kept), np.int64)
        parts.append(rows)
        kept.append(eid)
    if not parts:
        raise ValueError("episodes: the selection holds no frames to learn success from")
    cat = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    return OutcomeRows(**cat, episode_ids=kept, known=known)


def check_outcomes(rows: OutcomeRows) -> None:
    """Refuse rows that cannot teach success (ValueError naming what is missing and how to fix it)."""
    pos, neg = int((rows.y == 1).sum()), int((rows.y == 0).sum())
    if pos and neg:
        return
    k = rows.known
    missing = "successful" if not pos else "failing"
    raise ValueError(
        f"outcome labels: the {len(rows.episode_ids)} training episodes hold {pos} frames labelled success "
        f"and {neg} labelled failure ({k.get('success', 0)} episodes known to succeed, "
        f"{k.get('failure', 0)} to fail, {k.get('unknown', 0)} of unknown outcome); a success estimate needs "
        f"both, and no {missing} ones are there. Record episode outcomes (the collector's success, a LeRobot "
        "dataset's next.success), label episodes' outcome on the dashboard (label key 'outcome'), or "
        "record takeovers; or gate on action MSE (--offline-gate action_mse)"
    )


# ============================================================================ the heads
class _Standardised(nn.Module):
    """``x [B, D] -> logit [B]``: ``(x - mean) / std`` (the training rows'), then an MLP."""

    def __init__(self, in_dim: int, hidden: Sequence[int]) -> None:
        super().__init__()
        self.net = mlp(in_dim, hidden, 1, layer_norm=False)
        self.register_buffer("mean", torch.zeros(in_dim))
        self.register_buffer("std", torch.ones(in_dim))

    def set_stats(self, x: Tensor) -> None:
        std, mean = torch.std_mean(x, 0, correction=0)
        self.mean.copy_(mean)
        self.std.copy_(torch.where(std > 1e-6, std, torch.ones_like(std)))

    def forward(self, x: Tensor) -> Tensor:
        return self.net((x - self.mean) / self.std)[:, 0]


class SuccessEstimator(nn.Module):
    """The fitted heads: ``success(obs, chunk)`` and ``progress(obs)`` (module docstring)."""

    def __init__(self, obs_dim: int, action_dim: int, config: SuccessFitConfig) -> None:
        super().__init__()
        self.config, self.obs_dim, self.action_dim = config, obs_dim, action_dim
        self.success_head = _Standardised(obs_dim + config.horizon * action_dim, config.hidden)
        self.progress_head = _Standardised(obs_dim, config.hidden)

    def _inputs(self, obs: np.ndarray | Tensor, chunk: np.ndarray | Tensor) -> Tensor:
        c = torch.as_tensor(np.asarray(chunk, np.float32))
        h = self.config.horizon
        if c.ndim != 3 or c.shape[1] < h or c.shape[2] != self.action_dim:
            raise ValueError(
                f"chunk: expected [B, >= {h}, {self.action_dim}] (the estimator reads {h} steps), got {list(c.shape)}"
            )
        o = torch.as_tensor(np.asarray(obs, np.float32))
        return torch.cat([o, c[:, :h].reshape(len(c), -1)], 1)

    @torch.no_grad()
    def success(self, obs: np.ndarray | Tensor, chunk: np.ndarray | Tensor) -> np.ndarray:
        """``P(success | obs, chunk)`` float64 ``[B]``; ``obs`` from :meth:`observation`."""
        return torch.sigmoid(self.success_head.eval()(self._inputs(obs, chunk))).double().numpy()

    @torch.no_grad()
    def progress(self, obs: np.ndarray | Tensor) -> np.ndarray:
        """``phi(obs)`` in [0, 1], float64 ``[B]``."""
        x = torch.as_tensor(np.asarray(obs, np.float32))
        return torch.sigmoid(self.progress_head.eval()(x)).double().numpy()

    def observation(self, state: np.ndarray, cameras: Mapping[str, np.ndarray]) -> np.ndarray:
        """A batch's estimator inputs from its state ``[B, S]`` and camera images."""
        summary = camera_summary(cameras, self.config.camera_grid, len(state))
        obs = np.concatenate([np.asarray(state, np.float32), summary], 1)
        if obs.shape[1] != self.obs_dim:
            raise ValueError(
                f"observation: expected {self.obs_dim} inputs, got {obs.shape[1]} (other cameras?)"
            )
        return obs

    def chunk_scorer(self) -> Any:
        """``(obs dict, predicted chunks) -> P(success)``: what :func:`vla_rl.evaluation_offline.evaluate_offline`
        calls on each batch of a candidate's chunks."""

        def score(obs: Mapping[str, Any], chunks: np.ndarray) -> np.ndarray:
            return self.success(self.observation(np.asarray(obs["state"]), obs["cameras"]), chunks)

        return score


def _wrong_actions(
    rows: OutcomeRows, cfg: SuccessFitConfig, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Wrong-action rows for the successful ones (module docstring): ``(obs, chunk)``, all labelled 0."""
    pos = np.flatnonzero(rows.y == 1)
    n = round(cfg.negatives * len(pos))
    if n == 0:
        return rows.obs[:0], rows.chunk[:0]
    src = rng.choice(pos, size=n)
    chunk = rows.chunk[src].copy()
    half = n // 2
    chunk[:half] = rows.chunk[rng.integers(0, len(rows), size=half)]
    scale = rows.chunk.reshape(-1, rows.chunk.shape[-1]).std(0) + 1e-6
    chunk[half:] += (rng.standard_normal(chunk[half:].shape) * scale * cfg.noise_scale).astype(np.float32)
    return rows.obs[src], chunk


def _fit_binary(
    head: _Standardised, x: Tensor, y: Tensor, cfg: SuccessFitConfig, balanced: bool, seed: int
) -> list[float]:
    head.set_stats(x)
    pos_weight = None
    if balanced:
        pos_weight = torch.tensor(float((y < 0.5).sum()) / max(float((y >= 0.5).sum()), 1.0))
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    rng = np.random.default_rng(seed)

    def loss_fn() -> Tensor:
        idx = torch.from_numpy(rng.integers(0, len(x), size=min(cfg.batch_size, len(x))))
        return nn.functional.binary_cross_entropy_with_logits(head(x[idx]), y[idx], pos_weight=pos_weight)

    head.train()
    losses = fit_minibatches(opt, loss_fn, cfg.steps)
    head.eval()
    return losses


def fit_success_estimator(
    rows: OutcomeRows, cfg: SuccessFitConfig
) -> tuple[SuccessEstimator, dict[str, Any]]:
    """Fit both heads on ``rows`` (ValueError from :func:`check_outcomes` without both classes); returns
    the estimator and a summary (row counts, final losses)."""
    check_outcomes(rows)
    if rows.chunk.shape[1] != cfg.horizon:
        raise ValueError(f"rows: chunks of {rows.chunk.shape[1]} steps, the config reads {cfg.horizon}")
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    est = SuccessEstimator(rows.obs.shape[1], rows.chunk.shape[2], cfg)
    lab = rows.y >= 0
    neg_obs, neg_chunk = _wrong_actions(rows, cfg, rng)
    x = est._inputs(np.concatenate([rows.obs[lab], neg_obs]), np.concatenate([rows.chunk[lab], neg_chunk]))
    y = torch.from_numpy(np.concatenate([rows.y[lab], np.zeros(len(neg_obs), np.int8)]).astype(np.float32))
    s_losses = _fit_binary(est.success_head, x, y, cfg, balanced=True, seed=cfg.seed + 1)
    prog = np.isfinite(rows.progress)
    p_losses = [float("nan")]
    if prog.any():
        xp = torch.from_numpy(rows.obs[prog])
        p_losses = _fit_binary(
            est.progress_head,
            xp,
            torch.from_numpy(rows.progress[prog]),
            cfg,
            balanced=False,
            seed=cfg.seed + 2,
        )
    summary = {
        "episodes": len(rows.episode_ids),
        "outcomes": dict(rows.known),
        "rows": int(lab.sum()),
        "success_rows": int((rows.y == 1).sum()),
        "failure_rows": int((rows.y == 0).sum()),
        "wrong_action_rows": len(neg_obs),
        "progress_rows": int(prog.sum()),
        "success_loss": float(np.mean(s_losses[-50:])),
        "progress_loss": float(np.mean(p_losses[-50:])),
    }
    return est, summary


# ============================================================================ sample weights
WEIGHTINGS = ("advantage", "success", "progress")
"""The AWR trainer's ``weighting``: its advantage weights, or this estimator's (:func:`estimator_weights`)."""


def estimator_scores(
    est: SuccessEstimator, kind: str, obs: np.ndarray, chunk: np.ndarray, later_obs: np.ndarray
) -> np.ndarray:
    """The raw per-row score behind a weight: ``success``: ``P(success | o_t, a_{t:t+H})``; ``progress``:
    ``max(phi(o_{t+H}) - phi(o_t), 0)`` (``later_obs`` = ``o_{t+H}``, the run's last frame past its end)."""
    if kind == "success":
        return est.success(obs, chunk)
    if kind == "progress":
        return np.maximum(est.progress(later_obs) - est.progress(obs), 0.0)
    raise ValueError(f"weighting: expected one of {list(WEIGHTINGS[1:])}, got {kind!r}")


def estimator_weights(raw: np.ndarray, w_max: float) -> np.ndarray:
    """RA-BC / SARM-style sample weights from raw scores: ``w = min(raw / mean(raw), w_max)`` (mean 1
    before the clip; frames whose score is 0, e.g. no progress, count 0; all ones when every score is
    0), float32."""
    raw = np.asarray(raw, np.float64)
    mean = float(raw.mean()) if len(raw) else 0.0
    w = raw / mean if mean > 0 else np.ones_like(raw)
    return np.minimum(w, w_max).astype(np.float32)


def buffer_weights(
    est: SuccessEstimator, buf: Any, kind: str, w_max: float, batch: int = 4096
) -> tuple[np.ndarray, np.ndarray]:
    """``(weights, raw scores)`` of every row of a :class:`vla_rl.train.transitions.TransitionBuffer`:
    its recorded chunks of the estimator's horizon, observations ``H`` frames on for progress."""
    h = est.config.horizon
    cams = list(buf.spec.camera_names) if buf.use_cameras else []
    raw = []
    for start in range(0, len(buf), batch):
        b = buf.batch(np.arange(start, min(start + batch, len(buf))), horizon=h, n_step=h)
        obs = est.observation(
            b["observation.state"].numpy(), {c: b[f"observation.images.{c}"].numpy() for c in cams}
        )
        later = est.observation(b["next.state"].numpy(), {c: b[f"next.images.{c}"].numpy() for c in cams})
        raw.append(estimator_scores(est, kind, obs, b["action"].numpy(), later))
    scores = np.concatenate(raw)
    return estimator_weights(scores, w_max), scores
