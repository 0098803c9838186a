"""Pieces every trainer shares: data selection, EMA, LR schedule, exact resume, logging, checkpoints.

Exact resume works by making every step a pure function of (run seed, step): the batch indices come
from ``np.random.default_rng([seed, step])`` and torch's global RNG (flow noise, flow time, image
augmentation, dropout) is reseeded with :func:`seed_step` before each step. A resumed run therefore
replays the very same batches and noise as an uninterrupted one.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fleet.dataset import ChunkDataset
from policies.lora import lora_state, merged_state_dict
from vla_rl.core.secrets import shown_url
from vla_rl.hub.checkpoint import CheckpointInfo, Lineage, save_checkpoint
from vla_rl.train.transitions import TransitionBuffer

log = logging.getLogger(__name__)
TRAIN_STATE = "train_state.pt"


# ---------------------------------------------------------------------------- data
def batch_to_policy_inputs(
    batch: Mapping[str, torch.Tensor],
    device: torch.device,
    instruction_embeddings: torch.Tensor | None = None,
) -> dict[str, Any]:
    """ChunkDataset keys (LeRobot naming) -> the policy's observation/action dict, on ``device``.

    ``instruction_embeddings`` ``[U, 384]``: the embeddings of the dataset's distinct instructions
    (:func:`instruction_table`); each sample then gets its own row as ``instruction_embedding``.
    """
    prefix = "observation.images."
    out = {
        "state": batch["observation.state"].to(device, non_blocking=True),
        "cameras": {k[len(prefix) :]: v.to(device) for k, v in batch.items() if k.startswith(prefix)},
        "action": batch["action"].to(device, non_blocking=True),
        "action_is_pad": batch["action_is_pad"].to(device, non_blocking=True),
    }
    if instruction_embeddings is not None:
        out["instruction_embedding"] = instruction_embeddings[batch["instruction_index"].to(device)]
    return out


def instruction_table(ds: ChunkDataset | TransitionBuffer, device: torch.device) -> torch.Tensor:
    """Frozen embeddings ``[U, 384]`` of the data's distinct instructions, in ``ds.instructions`` order
    (a :class:`ChunkDataset` for SFT, a :class:`TransitionBuffer` for AWR / RECAP and QAM): each distinct
    string is embedded once (one batched MiniLM call, cached per process); ``batch_to_policy_inputs``
    then gives every sample the row of its ``instruction_index``."""
    from policies.flow_vla import embed_instructions

    return embed_instructions(list(ds.instructions)).to(device)


@torch.no_grad()
def observation_features(policy: Any, obs: Mapping[str, Any]) -> torch.Tensor:
    """Critic / value input for a batch of observations, from a (frozen) flow VLA.

    State-only policies: the normalised proprio state (a small standalone critic learns fastest from
    it). With cameras: the policy's pooled trunk features (``PrefixCache.pooled()``), as π0.5's
    VLM-side value head does. No gradient reaches the policy.
    """
    if not policy.config.cameras and policy.config.state_dim > 0:
        return policy.normalizer.normalize_state(obs["state"].float())
    return policy.encode_prefix(obs).pooled().float()


def feature_dim(policy: Any) -> int:
    """Width of :func:`observation_features` for ``policy``."""
    c = policy.config
    return c.state_dim if not c.cameras and c.state_dim > 0 else c.d_model


def sample_indices(n: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    return np.random.default_rng([seed, step]).integers(0, n, size=batch_size)


def seed_step(seed: int, step: int) -> None:
    torch.manual_seed((seed * 1_000_003 + step) % (2**63))


def dataset_digest(ds: ChunkDataset) -> dict[str, Any]:
    """What a checkpoint records about its training data (its lineage ``data`` field)."""
    return {"episodes": len(ds.episode_ids), "frames": len(ds), "episode_ids_head": ds.episode_ids[:3]}


# ---------------------------------------------------------------------------- optimisation
class EMA:
    """Exponential moving average of a model's parameters and buffers (evaluated and shipped)."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.updates = 0

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.updates += 1
        # Warm up the decay so early, random weights are forgotten quickly (as in timm's ModelEmaV2).
        d = min(self.decay, (1 + self.updates) / (10 + self.updates))
        for ema_p, p in zip(self.model.state_dict().values(), model.state_dict().values(), strict=True):
            if ema_p.dtype.is_floating_point:
                ema_p.lerp_(p.detach(), 1 - d)
            else:
                ema_p.copy_(p)

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.updates = int(state["updates"])


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def autocast_for(device: torch.device, amp: str) -> Any:
    """bf16 autocast on CUDA when asked (``amp="auto"`` or ``"bf16"``); a no-op context on CPU."""
    enabled = device.type == "cuda" and amp in ("auto", "bf16")
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=enabled)


# ---------------------------------------------------------------------------- resume
def save_train_state(path: Path, **state: Any) -> None:
    """Atomically save trainer state (tensors and plain data) for exact resume."""
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_train_state(path: Path) -> dict[str, Any]:
    # weights_only: the restricted unpickler (tensors, dicts, numbers, strings) never runs code.
    return torch.load(path, map_location="cpu", weights_only=True)


class RunClock:
    """A run's wall time across resumes: the seconds its earlier processes spent (the train state's
    ``seconds``, which every resumable trainer saves as :attr:`seconds`) plus this process's own. A run
    preempted and resumed reports what it cost in all, not what its last process took."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.before = 0.0

    def resume(self, state: Mapping[str, Any]) -> None:
        """Continue from a train state this run saved (states written before it carried no ``seconds``)."""
        self.before = float(state.get("seconds", 0.0))

    @property
    def seconds(self) -> float:
        return self.before + time.perf_counter() - self.t0


def config_dict(cfg: Any) -> dict[str, Any]:
    """A run's config as JSON types, as logged (TensorBoard's ``config`` text): a DB URL's password masked."""
    d = asdict(cfg) if is_dataclass(cfg) else dict(cfg)
    if isinstance(d.get("db_url"), str):
        d["db_url"] = shown_url(d["db_url"])
    return json.loads(json.dumps(d, default=str))


# ---------------------------------------------------------------------------- checkpoints
def save_derived_checkpoint(
    path: Path,
    model: nn.Module,
    base: CheckpointInfo,
    *,
    algorithm: str,
    parent_revision: str | None,
    data: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
    round_index: int | None = None,
) -> CheckpointInfo:
    """Save a post-trained copy of ``base``: same policy type, spec and normalisation, new weights and
    a lineage naming the algorithm and the parent it was trained from (LoRA adapters merged into the
    weights, and recorded in the lineage)."""
    config = getattr(model, "config", None)
    adapters = lora_state(model)
    info = CheckpointInfo(
        policy_type=base.policy_type,
        model_config=config.to_dict() if config is not None else base.model_config,
        robot_spec=base.robot_spec,
        normalization=base.normalization,
        lineage=Lineage(
            algorithm=algorithm,
            parent_revision=parent_revision,
            round=round_index,
            data=dict(data or {}),
            lora=adapters.record() if adapters is not None else None,
        ),
        metrics=dict(metrics or {}),
    )
    return save_checkpoint(path, merged_state_dict(model), info)


# ---------------------------------------------------------------------------- progress
class Throughput:
    """Samples per second over the last logging window."""

    def __init__(self) -> None:
        self.t = time.perf_counter()
        self.n = 0

    def add(self, n: int) -> None:
        self.n += n

    def rate(self) -> float:
        now = time.perf_counter()
        r = self.n / max(now - self.t, 1e-9)
        self.t, self.n = now, 0
        return r
