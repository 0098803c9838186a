"""Load a policy from a checkpoint reference (``hub://org/name@rev`` or a local folder) and run it.

:class:`LoadedPolicy` is what evaluation, and later the policy server, hold: the model, the checkpoint
info, the commit it came from, and ``predict_chunks`` in env units.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vla_rl_client.spec import RobotSpec

from policies.flow_policy import FlowVLAFlowPolicy, RTCRequest, seeded_chunks, seeded_rtc_chunks
from policies.flow_vla import FlowVLAConfig, FlowVLAPolicy
from vla_rl.hub.checkpoint import CheckpointError, CheckpointInfo, Lineage, LoadLimits, load_checkpoint

log = logging.getLogger("vla_rl.loading")

if TYPE_CHECKING:
    from policies.flow_policy import FlowPolicy
    from policies.lerobot_adapter import LeRobotModel

POLICY_TYPES = ("flow_vla",)
MAX_SAFETENSORS_HEADER_BYTES = 64 * 1024 * 1024
# Bounds on model_config fields checked before anything is built (even on the meta device): a config that
# names absurd sizes is refused in microseconds, naming the field.
CONFIG_INT_BOUNDS = {
    "state_dim": 4096,
    "action_dim": 1024,
    "chunk_len": 1024,
    "n_exec": 1024,
    "d_model": 16384,
    "n_layers": 256,
    "expert_n_layers": 256,
    "n_heads": 256,
    "image_encoder_width": 4096,
    "image_encoder_stages": 12,
    "image_tokens_grid": 64,
    "num_inference_steps": 1000,
}
SAFETENSORS_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


def safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (dtype, shape) from a safetensors file's header, reading only the header.

    Raises :class:`CheckpointError` for a header that is oversized, malformed, or whose offsets do not
    fit the file (so the header's sizes can be trusted before anything is allocated).
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError("model.safetensors: shorter than its 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_SAFETENSORS_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(
                f"model.safetensors: header length {n} does not fit the file ({size} bytes)"
            )
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError("model.safetensors: header is not valid JSON") from None
    if not isinstance(header, dict):
        raise CheckpointError("model.safetensors: header is not a JSON object")
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    data_bytes = size - 8 - n
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = (
                entry["dtype"],
                tuple(int(d) for d in entry["shape"]),
                entry["data_offsets"],
            )
            nbytes = math.prod(shape) * SAFETENSORS_DTYPE_BYTES[dtype]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"model.safetensors: tensor {name!r}: malformed header entry") from None
        if any(d < 0 for d in shape) or not (0 <= begin <= end <= data_bytes) or end - begin != nbytes:
            raise CheckpointError(
                f"model.safetensors: tensor {name!r}: shape {list(shape)} does not fit its bytes"
            )
        out[name] = (dtype, shape)
    return out


def check_config_against_weights(info: CheckpointInfo, weights: Path) -> None:
    """Refuse a config whose implied model does not match the weight file, before building the model.

    The config's fields are bounded first (:data:`CONFIG_INT_BOUNDS`); the model is then built on the
    meta device (no memory) and its parameter/buffer shapes compared with the safetensors header.
    """
    if info.policy_type != "flow_vla":
        raise CheckpointError(f"policy_type: expected one of {POLICY_TYPES}, got {info.policy_type!r}")
    mc = info.model_config
    for key, bound in CONFIG_INT_BOUNDS.items():
        v = mc.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= bound):
            raise CheckpointError(f"model_config.{key}: expected an int in [0, {bound}], got {v!r}")
    ratio = mc.get("mlp_ratio")
    if ratio is not None and (not isinstance(ratio, int | float) or not 0 < ratio <= 64):
        raise CheckpointError(f"model_config.mlp_ratio: expected a number in (0, 64], got {ratio!r}")
    hidden = mc.get("noise_head_hidden")
    if hidden is not None and (
        not isinstance(hidden, list | tuple)
        or len(hidden) > 16
        or not all(isinstance(h, int) and 0 < h <= 65536 for h in hidden)
    ):
        raise CheckpointError(
            f"model_config.noise_head_hidden: expected <= 16 ints in (0, 65536], got {hidden!r}"
        )
    for cam in info.robot_spec.cameras:
        if cam.height * cam.width > 4096 * 4096:
            raise CheckpointError(f"robot_spec.cameras.{cam.name}: {cam.height}x{cam.width} is too large")
    header = safetensors_header(weights)
    try:
        with torch.device("meta"):
            meta = FlowVLAPolicy(FlowVLAConfig.from_dict(mc))
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"model_config: {e}") from None
    want = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    missing = sorted(set(want) - set(header))
    unexpected = sorted(set(header) - set(want))
    if missing or unexpected:
        raise CheckpointError(
            f"weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for k, shape in want.items():
        if header[k][1] != shape:
            raise CheckpointError(
                f"model_config implies {k} of shape {list(shape)}, model.safetensors holds {list(header[k][1])}"
            )


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


def checkpoint_task(spec: RobotSpec, asked: str | None) -> str:
    """``spec``'s task, or a ValueError naming both when ``asked`` is another."""
    if asked is not None and asked != spec.name:
        raise ValueError(f"task: the base checkpoint is for {spec.name!r}, not {asked!r}")
    return spec.name


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
    def lineage(self) -> Lineage:
        return self.info.lineage

    @property
    def metrics(self) -> dict[str, Any]:
        return self.info.metrics

    @property
    def chunk_len(self) -> int:
        return self.policy.config.chunk_len

    @property
    def n_exec(self) -> int:
        """Actions executed per chunk: the checkpoint's, as the policy server serves it."""
        return self.policy.config.n_exec

    def task(self, asked: str | None) -> str:
        """The checkpoint's task, which ``asked`` (a config's ``task``) must match when given."""
        return checkpoint_task(self.spec, asked)

    def predict_chunks(
        self, obs: dict[str, Any], seed: int, rtc: list[RTCRequest] | None = None
    ) -> np.ndarray:
        """float32 [N, H, A] env-unit chunks for a batch of observations; seeded initial noise; ``rtc``:
        real-time chunking per row (:func:`policies.flow_policy.seeded_rtc_chunks`)."""
        if rtc is not None:
            contract = FlowVLAFlowPolicy.from_checkpoint(self.policy, self.info)
            return seeded_rtc_chunks(contract, obs, seed, self.num_steps, rtc)
        return seeded_chunks(self.policy, obs, seed, self.num_steps)


def load_policy(
    ref: str | os.PathLike[str], device: str = "auto", cache_dir: Path | None = None
) -> LoadedPolicy:
    """Resolve ``ref`` (hub ref or local folder), verify every file hash, build the policy in eval mode."""
    from vla_rl.hub.registry import pull

    ckpt = pull(str(ref), cache_dir=cache_dir)
    return _load_folder(Path(ckpt.path), ckpt.commit, str(ref), device)


def _load_folder(
    path: Path, commit: str, ref: str, device: str, limits: LoadLimits | None = None
) -> LoadedPolicy:
    info, weights = load_checkpoint(path, limits, check=check_config_against_weights)
    policy = build_policy(info, weights).to(pick_device(device)).eval()
    return LoadedPolicy(policy=policy, info=info, path=path, commit=commit, ref=ref)


@dataclass
class LoadedFlowPolicy:
    """A flow policy behind the contract with what serving it needs: the robot spec, the type GetInfo
    reports, where it came from. The policy server hosts LeRobot's SmolVLA / π0 / π0.5 folders as this."""

    policy: FlowPolicy
    spec: RobotSpec
    policy_type: str
    path: Path
    commit: str
    ref: str
    num_steps: int | None = None  # denoising steps K (None = the policy's default)
    notes: list[str] = field(default_factory=list)


def load_servable(
    ref: str | os.PathLike[str],
    device: str = "auto",
    cache_dir: Path | None = None,
    limits: LoadLimits | None = None,
) -> LoadedPolicy | LoadedFlowPolicy | LeRobotModel:
    """Like :func:`load_policy`, but a LeRobot policy folder (``config.json`` with ``"type"``) is loaded as
    :func:`load_lerobot_servable` says: what the policy server hosts."""
    from policies.lerobot_adapter import is_lerobot_folder
    from vla_rl.hub.registry import pull

    ckpt = pull(str(ref), cache_dir=cache_dir)
    path = Path(ckpt.path)
    if is_lerobot_folder(path):
        return load_lerobot_servable(path, commit=ckpt.commit, ref=str(ref), device=pick_device(device))
    if limits is not None:
        limits.check("pulling the checkpoint")
    return _load_folder(path, ckpt.commit, str(ref), device, limits)


def load_lerobot_servable(
    folder: Path, *, commit: str, ref: str, device: torch.device | str = "cpu"
) -> LoadedFlowPolicy | LeRobotModel:
    """A LeRobot folder to serve. A flow VLA (SmolVLA, π0, π0.5) goes through the flow-policy contract
    (:class:`~policies.lerobot_flow.LeRobotFlowPolicy`: one prefix pass per batch, our ODE loop, its
    iterates for the uncertainty); any other type (ACT, Diffusion), or a flow VLA whose config the
    contract refuses (e.g. SmolVLA's ``adapt_to_pi_aloha``), through LeRobot's own
    ``predict_action_chunk`` (:func:`~policies.lerobot_adapter.lerobot_model`), with a note saying why."""
    from policies.flow_policy import FlowPolicyError
    from policies.lerobot_adapter import build_lerobot, lerobot_model
    from policies.lerobot_flow import FLOW_TYPES, LeRobotFlowPolicy

    b = build_lerobot(folder, device)
    if b.lerobot_type in FLOW_TYPES:
        try:
            policy = LeRobotFlowPolicy(b)
        except FlowPolicyError as e:
            b.notes.append(f"served through LeRobot's predict_action_chunk (no uncertainty): {e}")
            log.warning(b.notes[-1], extra={"path": str(folder)})
        else:
            return LoadedFlowPolicy(
                policy, b.spec, f"lerobot/{b.lerobot_type}", b.path, commit, ref, notes=b.notes
            )
    return lerobot_model(b, commit=commit, ref=ref)


def load_flow_policy(
    ref: str | os.PathLike[str],
    *,
    algorithm: str = "training",
    device: str = "auto",
    cache_dir: Path | None = None,
) -> FlowPolicy:
    """A checkpoint reference as a :class:`~policies.flow_policy.FlowPolicy`, what trainers hold: our
    checkpoint (verified as :func:`load_policy` does) or a LeRobot SmolVLA / π0 / π0.5 folder. Any other
    LeRobot type is refused naming it: ``"<algorithm> needs a flow-matching policy; act is not one — use sft"``."""
    return load_flow_checkpoint(ref, algorithm=algorithm, device=device, cache_dir=cache_dir).policy


@dataclass
class FlowCheckpoint:
    """A :class:`~policies.flow_policy.FlowPolicy` with where it came from: what trainers start from and what
    evaluation and rounds score (it is a :class:`vla_rl.evaluation.ChunkPolicy`). The same for our
    checkpoints and LeRobot folders: the robot spec (a LeRobot folder's from our sidecar when it has one,
    :mod:`policies.lerobot_sidecar`), the lineage and metrics it records, the commit it was pulled at."""

    policy: FlowPolicy
    spec: RobotSpec
    path: Path
    commit: str
    ref: str
    lineage: Lineage | None
    metrics: dict[str, Any]
    lerobot_type: str | None = None
    """``smolvla`` / ``pi0`` / ``pi05`` for a LeRobot folder, None for our checkpoint."""
    spec_names_task: bool = True
    """``spec.name`` is the task it acts in (False: a LeRobot folder without our sidecar's robot spec,
    whose spec is only what its config describes)."""
    num_steps: int | None = None

    def task(self, asked: str | None) -> str:
        """The task to train or evaluate in: the checkpoint's, which ``asked`` (a config's ``task``) must
        match when given; for a checkpoint that names none, ``asked`` (a ValueError asking for it if None),
        which the policy's spec takes as its name from then on, so a folder trained from it records its
        task (a LeRobot folder from elsewhere otherwise saves its config's name, e.g. ``lerobot/smolvla``,
        and the next round on it would refuse the task it was trained in)."""
        if self.spec_names_task:
            return checkpoint_task(self.spec, asked)
        if asked is None:
            raise ValueError(
                f"task: {self.ref} is a LeRobot {self.lerobot_type} folder that names no task (no robot spec "
                "in its vla_rl_lineage.json); say which (--task)"
            )
        self.spec = replace(self.spec, name=asked)
        self.policy.spec = self.spec  # type: ignore[attr-defined]  (a LeRobotFlowPolicy: what it saves)
        self.spec_names_task = True
        return asked

    @property
    def chunk_len(self) -> int:
        return self.policy.chunk_len

    @property
    def n_exec(self) -> int:
        return self.policy.n_exec

    @property
    def is_lerobot(self) -> bool:
        return self.lerobot_type is not None

    def predict_chunks(
        self, obs: dict[str, Any], seed: int, rtc: list[RTCRequest] | None = None
    ) -> np.ndarray:
        """float32 [N, H, A] env-unit chunks for a batch of observations; seeded initial noise (our
        checkpoints: the very chunks :meth:`LoadedPolicy.predict_chunks` gives), in eval mode; ``rtc``:
        real-time chunking per row (:func:`policies.flow_policy.seeded_rtc_chunks`)."""
        was_training = self.policy.training
        self.policy.train(False)
        try:
            if rtc is not None:
                return seeded_rtc_chunks(self.policy, obs, seed, self.num_steps, rtc)
            return seeded_chunks(self.policy, obs, seed, self.num_steps)
        finally:
            self.policy.train(was_training)


def load_flow_checkpoint(
    ref: str | os.PathLike[str],
    *,
    algorithm: str = "training",
    device: str = "auto",
    cache_dir: Path | None = None,
) -> FlowCheckpoint:
    """:func:`load_flow_policy` with the checkpoint's spec, lineage, metrics and commit
    (:class:`FlowCheckpoint`)."""
    from vla_rl.hub.registry import pull

    ckpt = pull(str(ref), cache_dir=cache_dir)
    return _flow_checkpoint(Path(ckpt.path), ckpt.commit, str(ref), algorithm, device)


def _flow_checkpoint(path: Path, commit: str, ref: str, algorithm: str, device: str) -> FlowCheckpoint:
    from policies.lerobot_adapter import is_lerobot_folder
    from policies.lerobot_flow import LeRobotFlowPolicy

    if is_lerobot_folder(path):
        lr = LeRobotFlowPolicy.load(path, algorithm=algorithm, device=pick_device(device))
        return FlowCheckpoint(
            policy=lr,
            spec=lr.spec,
            path=path,
            commit=commit,
            ref=ref,
            lineage=lr.lineage,
            metrics=dict(lr.sidecar.metrics),
            lerobot_type=lr.lerobot_type,
            spec_names_task=lr.sidecar.robot_spec is not None,
        )
    loaded = _load_folder(path, commit, ref, device)
    return FlowCheckpoint(
        policy=FlowVLAFlowPolicy.from_checkpoint(loaded.policy, loaded.info),
        spec=loaded.info.robot_spec,
        path=path,
        commit=commit,
        ref=ref,
        lineage=loaded.info.lineage,
        metrics=dict(loaded.info.metrics),
    )


def load_chunk_policy(
    ref: str | os.PathLike[str],
    device: str = "auto",
    cache_dir: Path | None = None,
    *,
    algorithm: str = "evaluation",
) -> LoadedPolicy | FlowCheckpoint:
    """What evaluation and rounds score: our checkpoint as :func:`load_policy` loads it (a
    :class:`LoadedPolicy`), a LeRobot SmolVLA / π0 / π0.5 folder as a :class:`FlowCheckpoint` (any other
    LeRobot type is refused naming it and ``algorithm``). Both are :class:`vla_rl.evaluation.ChunkPolicy` s
    with ``spec``, ``commit``, ``lineage``, ``metrics``, ``num_steps`` and ``task()``."""
    from policies.lerobot_adapter import is_lerobot_folder
    from vla_rl.hub.registry import pull

    ckpt = pull(str(ref), cache_dir=cache_dir)
    path = Path(ckpt.path)
    if is_lerobot_folder(path):
        return _flow_checkpoint(path, ckpt.commit, str(ref), algorithm, device)
    return _load_folder(path, ckpt.commit, str(ref), device)
