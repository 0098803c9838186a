"""A learned failure / takeover predictor over a flow policy's own features (docs/algorithms.md §6c).

The robot's "ask for help" signal besides the ``accel`` CUSUM (:mod:`fleet.uncertainty`): a small head
that reads, at every decision (chunk) t,

    x_t = [ features(prefix_t)  (F: the policy's pooled prefix, ``FlowPolicy.features``),
            u_t                 (the chunk's ``accel`` uncertainty; NaN -> the training rows' mean),
            tau_t               (seconds since the episode started; only when ``use_time``) ]

standardises it with the training rows' mean and std, and returns

    p_t = sigmoid(MLP((x_t - mean) / std)) ~ P(failure or takeover within the next ``horizon_s`` seconds).

It alarms when ``p_t > threshold``; the threshold is split conformal on held-out *successful* episodes'
peak score (:func:`fleet.uncertainty.conformal_threshold` of ``max_t p_t`` at level ``alpha``), so a new
successful episode alarms with probability at most ``alpha``, as the CUSUM alarm is calibrated.

The predictor is a sibling artefact of the checkpoint it reads features from: a folder ``failure/`` next
to (inside) the checkpoint folder with ``failure.safetensors`` (the MLP and the standardisation; no
pickle) and ``failure.json`` (shape, horizon, threshold and its own lineage: the policy's commit and the
sha256 of its weights file, the data it was fit on, the round). The policy server loads it when present
and the weights match (:func:`find_predictor`); fitting is :mod:`vla_rl.train.failure`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from policies.critics import mlp
from vla_rl.hub.checkpoint import sha256_file

Tensor = torch.Tensor

FAILURE_DIR = "failure"
"""The predictor's folder inside (next to the files of) the checkpoint folder it was fit on."""
FAILURE_WEIGHTS, FAILURE_CONFIG = "failure.safetensors", "failure.json"
POLICY_WEIGHTS = "model.safetensors"
"""The checkpoint file whose sha256 ties a predictor to the weights that computed its features (ours and
LeRobot folders both name their weights so)."""
FORMAT = 1

__all__ = [
    "FAILURE_DIR",
    "FailureHead",
    "FailureHeadConfig",
    "FailurePredictor",
    "check_rows",
    "decision_features",
    "failure_lineage",
    "find_predictor",
    "head_inputs",
    "policy_weights_sha256",
]


@dataclass(frozen=True)
class FailureHeadConfig:
    """The head's shape and what its score means."""

    feature_dim: int
    """F: width of the policy's ``features(prefix)``."""
    hidden: tuple[int, ...] = (64, 64)
    """MLP widths."""
    horizon_s: float = 2.0
    """A row is positive when a failure or takeover comes within this many seconds after it."""
    use_time: bool = False
    """Whether seconds-since-episode-start is an input (the policy server does not know it: such a
    predictor is for offline use and benchmarks only)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.feature_dim, int) and self.feature_dim >= 1):
            raise ValueError(f"feature_dim: expected a positive integer, got {self.feature_dim!r}")
        if not self.hidden or any(not isinstance(h, int) or h < 1 for h in self.hidden):
            raise ValueError(f"hidden: expected positive integer widths, got {self.hidden!r}")
        if not (math.isfinite(self.horizon_s) and self.horizon_s > 0):
            raise ValueError(f"horizon_s: expected a positive number of seconds, got {self.horizon_s!r}")

    @property
    def in_dim(self) -> int:
        return self.feature_dim + 1 + int(self.use_time)


def head_inputs(
    features: Tensor | np.ndarray,
    uncertainty: Tensor | np.ndarray,
    time_s: Tensor | np.ndarray | None = None,
) -> Tensor:
    """``[B, F]``, ``[B]`` (and ``[B]`` seconds) -> the head's raw inputs ``[B, F + 1 (+ 1)]`` (float32);
    NaN uncertainty stays NaN here (:meth:`FailureHead.forward` fills it)."""
    f = torch.as_tensor(features, dtype=torch.float32).reshape(len(features), -1).cpu()
    cols = [f, torch.as_tensor(uncertainty, dtype=torch.float32).reshape(-1, 1).cpu()]
    if time_s is not None:
        cols.append(torch.as_tensor(time_s, dtype=torch.float32).reshape(-1, 1).cpu())
    return torch.cat(cols, 1)


class FailureHead(nn.Module):
    """``x [B, in_dim] -> logit [B]``: standardise (NaN inputs -> the mean, i.e. 0), then the MLP."""

    def __init__(self, config: FailureHeadConfig) -> None:
        super().__init__()
        self.config = config
        self.net = mlp(config.in_dim, config.hidden, 1, layer_norm=False)
        self.register_buffer("mean", torch.zeros(config.in_dim))
        self.register_buffer("std", torch.ones(config.in_dim))

    def set_standardisation(self, x: Tensor) -> None:
        """Mean and std of the training rows' inputs (NaN entries left out; constant columns std 1)."""
        finite = torch.isfinite(x)
        n = finite.sum(0).clamp_min(1)
        mean = torch.where(finite, x, 0.0).sum(0) / n
        var = torch.where(finite, (x - mean) ** 2, 0.0).sum(0) / n
        std = var.sqrt()
        self.mean.copy_(mean)
        self.std.copy_(torch.where(std > 1e-6, std, torch.ones_like(std)))

    def forward(self, x: Tensor) -> Tensor:
        z = (x - self.mean) / self.std
        return self.net(torch.nan_to_num(z, nan=0.0, posinf=0.0, neginf=0.0))[:, 0]


@dataclass
class FailurePredictor:
    """A fitted head, its alarm threshold and where it came from (``lineage``: free JSON)."""

    head: FailureHead
    threshold: float
    alpha: float
    lineage: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold: expected a probability in [0, 1], got {self.threshold!r}")
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha: expected a value in (0, 1), got {self.alpha!r}")

    @property
    def config(self) -> FailureHeadConfig:
        return self.head.config

    @torch.no_grad()
    def score(
        self,
        features: Tensor | np.ndarray,
        uncertainty: Tensor | np.ndarray,
        time_s: Tensor | np.ndarray | None = None,
    ) -> np.ndarray:
        """``p`` float32 ``[B]`` for a batch of decisions (``time_s`` required iff the head uses time)."""
        if self.config.use_time != (time_s is not None):
            need = "needs" if self.config.use_time else "takes no"
            raise ValueError(f"time_s: this failure predictor {need} time in episode")
        x = head_inputs(features, uncertainty, time_s)
        if x.shape[1] != self.config.in_dim:
            raise ValueError(
                f"features: expected {self.config.feature_dim} per row, got {x.shape[1] - 1 - int(self.config.use_time)}"
            )
        return torch.sigmoid(self.head.eval()(x)).numpy().astype(np.float32)

    def alarms(self, scores: np.ndarray) -> np.ndarray:
        """bool ``[B]``: ``score > threshold`` (NaN never alarms)."""
        return np.nan_to_num(np.asarray(scores, np.float64), nan=-1.0) > self.threshold

    def save(self, folder: str | Path) -> Path:
        """Write ``failure.safetensors`` + ``failure.json`` into ``folder`` (created); returns it."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.head.state_dict().items()}
        save_file(state, str(folder / FAILURE_WEIGHTS))
        meta = {
            "format": FORMAT,
            "head": {**asdict(self.config), "hidden": list(self.config.hidden)},
            "threshold": self.threshold,
            "alpha": self.alpha,
            "lineage": self.lineage,
        }
        (folder / FAILURE_CONFIG).write_text(json.dumps(meta, indent=2, default=str))
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> FailurePredictor:
        """Read a saved predictor; FileNotFoundError / ValueError naming the file when it is not one."""
        folder = Path(folder)
        if not (folder / FAILURE_CONFIG).is_file():
            raise FileNotFoundError(
                f"failure predictor: no {FAILURE_CONFIG} in {folder} (vla-rl failure fit)"
            )
        try:
            meta = json.loads((folder / FAILURE_CONFIG).read_text())
            if meta.get("format") != FORMAT:
                raise ValueError(f"format: expected {FORMAT}, got {meta.get('format')!r}")
            h = meta["head"]
            config = FailureHeadConfig(
                feature_dim=int(h["feature_dim"]),
                hidden=tuple(int(x) for x in h["hidden"]),
                horizon_s=float(h["horizon_s"]),
                use_time=bool(h["use_time"]),
            )
            head = FailureHead(config)
            head.load_state_dict(load_file(str(folder / FAILURE_WEIGHTS)))
            return cls(head.eval(), float(meta["threshold"]), float(meta["alpha"]), dict(meta["lineage"]))
        except (KeyError, TypeError, RuntimeError, json.JSONDecodeError) as e:
            raise ValueError(
                f"{folder / FAILURE_CONFIG}: not a failure predictor this version reads ({e})"
            ) from None


def policy_weights_sha256(checkpoint: str | Path) -> str | None:
    """sha256 of a checkpoint folder's weights file (None when it has none): what ties a predictor to
    the exact weights that computed its features (a folder's commit changes when files are added)."""
    path = Path(checkpoint) / POLICY_WEIGHTS
    return sha256_file(path) if path.is_file() else None


def find_predictor(checkpoint: str | Path, feature_dim: int) -> tuple[FailurePredictor | None, str]:
    """The predictor of ``checkpoint/failure/`` when it fits this checkpoint, and a note.

    Returns ``(None, "")`` when there is none, ``(None, why)`` when there is one that cannot serve this
    checkpoint (other weights, another feature width, or it needs time in episode), ``(predictor, "")``
    otherwise. Never raises for a bad artefact: the policy still serves, without the score."""
    folder = Path(checkpoint) / FAILURE_DIR
    if not (folder / FAILURE_CONFIG).is_file():
        return None, ""
    try:
        pred = FailurePredictor.load(folder)
    except (OSError, ValueError) as e:
        return None, f"failure predictor not loaded: {e}"
    want = pred.lineage.get("policy_weights_sha256")
    if want is not None and want != policy_weights_sha256(checkpoint):
        return None, "failure predictor not loaded: it was fit on other policy weights (refit it)"
    if pred.config.feature_dim != feature_dim:
        return None, (
            f"failure predictor not loaded: it reads {pred.config.feature_dim} features, the policy gives {feature_dim}"
        )
    if pred.config.use_time:
        return None, "failure predictor not loaded: it needs time in episode, which requests do not carry"
    return pred, ""


def failure_lineage(
    *,
    policy_ref: str,
    policy_commit: str,
    policy_weights: str | None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The artefact's lineage: the policy it reads (ref, commit, weights sha256) plus ``extra``."""
    return {
        "policy_ref": policy_ref,
        "policy_commit": policy_commit,
        "policy_weights_sha256": policy_weights,
        **dict(extra or {}),
    }


def decision_features(policy: Any, obs: Mapping[str, Any]) -> Tensor:
    """``features(encode_prefix(obs))`` ``[B, F]`` float32 on the CPU: one prefix pass (no denoising)."""
    with torch.inference_mode():
        return policy.features(policy.encode_prefix(obs)).float().cpu()


def check_rows(x: Tensor, y: Sequence[int] | np.ndarray) -> None:
    """Refuse training rows without both classes (a head cannot learn a failure it never saw)."""
    y = np.asarray(y)
    if len(x) != len(y):
        raise ValueError(f"labels: expected one per row ({len(x)}), got {len(y)}")
    if not (y == 1).any() or not (y == 0).any():
        raise ValueError(
            f"labels: expected both failure windows and successful stretches, got {int((y == 1).sum())} "
            f"positive and {int((y == 0).sum())} negative rows; record more episodes (failures and successes)"
        )
