"""Load a policy from a checkpoint reference (``hub://org/name@rev`` or a local folder) and run it.

:class:`LoadedPolicy` is what evaluation, and later the policy server, hold: the model, the checkpoint
info, the commit it came from, and ``predict_chunks`` in env units.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from policies.flow_vla import FlowVLAConfig, FlowVLAPolicy
from vla_rl.checkpoint import CheckpointError, CheckpointInfo, load_checkpoint
from vla_rl.spec import RobotSpec

if TYPE_CHECKING:
    from policies.lerobot_adapter import LeRobotModel

POLICY_TYPES = ("flow_vla",)


def build_policy(info: CheckpointInfo, state_dict: dict[str, torch.Tensor] | None = None) -> FlowVLAPolicy:
    """Instantiate the checkpoint's policy class (and load weights if given)."""
    if info.policy_type != "flow_vla":
        raise CheckpointError(f"policy_type: expected one of {POLICY_TYPES}, got {info.policy_type!r}")
    policy = FlowVLAPolicy(FlowVLAConfig.from_dict(info.model_config))
    if state_dict is not None:
        missing, unexpected = policy.load_state_dict(state_dict, strict=False)
        if missing or unexpected:
            raise CheckpointError(
                f"weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
    return policy


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@dataclass
class LoadedPolicy:
    """A verified checkpoint, ready to act. Implements :class:`vla_rl.evaluation.ChunkPolicy`."""

    policy: FlowVLAPolicy
    info: CheckpointInfo
    path: Path
    commit: str  # hub commit sha, or "local:<digest>" for a folder
    ref: str
    num_steps: int | None = None  # denoising steps K (None = the model's default)

    @property
    def spec(self) -> RobotSpec:
        return self.info.robot_spec

    @property
    def chunk_len(self) -> int:
        return self.policy.config.chunk_len

    @torch.no_grad()
    def predict_chunks(self, obs: dict[str, Any], seed: int) -> np.ndarray:
        """float32 [N, H, A] env-unit chunks for a batch of observations; seeded initial noise."""
        gen = torch.Generator(device=self.policy.device).manual_seed(int(seed))
        chunks = self.policy.predict_action_chunk(
            {"state": obs["state"], "cameras": obs.get("cameras", {}), "instruction": obs["instruction"]},
            num_steps=self.num_steps,
            generator=gen,
        )
        return chunks.float().cpu().numpy()


def load_policy(
    ref: str | os.PathLike[str], device: str = "auto", cache_dir: Path | None = None
) -> LoadedPolicy:
    """Resolve ``ref`` (hub ref or local folder), verify every file hash, build the policy in eval mode."""
    from vla_rl.hub.registry import pull

    ckpt = pull(str(ref), cache_dir=cache_dir)
    return _load_folder(Path(ckpt.path), ckpt.commit, str(ref), device)


def _load_folder(path: Path, commit: str, ref: str, device: str) -> LoadedPolicy:
    info, weights = load_checkpoint(path)
    policy = build_policy(info, weights).to(pick_device(device)).eval()
    return LoadedPolicy(policy=policy, info=info, path=path, commit=commit, ref=ref)


def load_servable(
    ref: str | os.PathLike[str], device: str = "auto", cache_dir: Path | None = None
) -> LoadedPolicy | LeRobotModel:
    """Like :func:`load_policy`, but a LeRobot policy folder (``config.json`` with ``"type"``) is loaded
    through :mod:`policies.lerobot_adapter`: what the policy server hosts."""
    from policies.lerobot_adapter import is_lerobot_folder, load_lerobot
    from vla_rl.hub.registry import pull

    ckpt = pull(str(ref), cache_dir=cache_dir)
    path = Path(ckpt.path)
    if is_lerobot_folder(path):
        return load_lerobot(path, commit=ckpt.commit, ref=str(ref), device=pick_device(device))
    return _load_folder(path, ckpt.commit, str(ref), device)
