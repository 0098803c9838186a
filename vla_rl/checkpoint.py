"""Checkpoint format: one folder, the same on disk and in a Hub repo.

    config.json         format + version, policy type and model config, robot spec, normalisation
                        statistics, lineage (parent revision, round, data selection, algorithm),
                        metrics, and the sha256 of every other file
    model.safetensors   weights (safetensors: loading never runs code, unlike pickle)
    README.md           model card with the eval metrics

Loading recomputes every listed hash and refuses a checkpoint whose files do not match, so a truncated
download or an edited weight file never reaches a robot.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from vla_rl import __version__
from vla_rl.spec import RobotSpec

CHECKPOINT_FORMAT = "vla-rl-checkpoint"
CHECKPOINT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
CARD_FILE = "README.md"


class CheckpointError(ValueError):
    """A checkpoint folder is missing, malformed, or fails its hash check."""


@dataclass(frozen=True)
class Lineage:
    """Where a checkpoint came from: enough to reproduce or audit it."""

    algorithm: str  # "sft", "awr", "qam", ...
    parent_revision: str | None = None  # the checkpoint it was trained from (hub ref or commit)
    round: int | None = None  # post-training round number
    data: dict[str, Any] = field(default_factory=dict)  # data selection + snapshot (store, episodes, frames)
    created: float = field(default_factory=time.time)
    code_version: str = __version__


@dataclass(frozen=True)
class CheckpointInfo:
    """Everything in ``config.json``."""

    policy_type: str
    model_config: dict[str, Any]
    robot_spec: RobotSpec
    normalization: dict[str, Any]
    lineage: Lineage
    metrics: dict[str, Any] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # file name -> sha256

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": CHECKPOINT_FORMAT,
            "version": CHECKPOINT_VERSION,
            "policy_type": self.policy_type,
            "model_config": self.model_config,
            "robot_spec": self.robot_spec.to_dict(),
            "normalization": self.normalization,
            "lineage": asdict(self.lineage),
            "metrics": self.metrics,
            "files": self.files,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CheckpointInfo:
        if d.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(
                f"config.json: format: expected {CHECKPOINT_FORMAT!r}, got {d.get('format')!r}"
            )
        if d.get("version") != CHECKPOINT_VERSION:
            raise CheckpointError(
                f"config.json: version: expected {CHECKPOINT_VERSION}, got {d.get('version')!r}"
            )
        try:
            return cls(
                policy_type=str(d["policy_type"]),
                model_config=dict(d["model_config"]),
                robot_spec=RobotSpec.from_dict(d["robot_spec"]),
                normalization=dict(d.get("normalization", {})),
                lineage=Lineage(**d["lineage"]),
                metrics=dict(d.get("metrics", {})),
                files=dict(d.get("files", {})),
            )
        except KeyError as e:
            raise CheckpointError(f"config.json: missing field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"config.json: {e}") from None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def model_card(info: CheckpointInfo, title: str | None = None) -> str:
    """A Hub model card: YAML front matter (tags) + what a person needs to trust this checkpoint."""
    spec, lin = info.robot_spec, info.lineage
    lines = [
        "---",
        "library_name: vla-rl",
        "tags: [robotics, vla, flow-matching, vla-rl]",
        "---",
        "",
        f"# {title or spec.name + ' ' + info.policy_type}",
        "",
        f"A `{info.policy_type}` policy for `{spec.name}` trained with **{lin.algorithm}** by vla-rl {lin.code_version}.",
        "",
        "## Robot spec",
        "",
        f"- instruction: {spec.instruction!r}",
        f"- state: float32[{spec.state_dim}]; action: float32[{spec.action_dim}] in [-1, 1] "
        f"({', '.join(spec.action_names) or 'unnamed'}); control rate {spec.control_hz:g} Hz",
        f"- cameras: {', '.join(f'{c.name} {c.height}x{c.width}' for c in spec.cameras) or 'none (state only)'}",
        "",
        "## Lineage",
        "",
        f"- parent: {lin.parent_revision or 'none (trained from scratch)'}",
        f"- round: {lin.round if lin.round is not None else '-'}",
        f"- data: `{json.dumps(lin.data, sort_keys=True)}`",
        f"- created: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(lin.created))}",
        "",
        "## Metrics",
        "",
    ]
    if info.metrics:
        lines += ["| metric | value |", "|---|---|"]
        lines += [
            f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |"
            for k, v in info.metrics.items()
        ]
    else:
        lines.append("Not evaluated yet.")
    return "\n".join(lines) + "\n"


def save_checkpoint(
    folder: str | os.PathLike[str],
    state_dict: Mapping[str, torch.Tensor],
    info: CheckpointInfo,
    title: str | None = None,
) -> CheckpointInfo:
    """Write weights, model card and config (last, with the files' hashes) into ``folder``."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
    tmp = out / f".{WEIGHTS_FILE}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / WEIGHTS_FILE)
    _atomic_write(out / CARD_FILE, model_card(info, title).encode())
    files = {name: sha256_file(out / name) for name in (WEIGHTS_FILE, CARD_FILE)}
    final = CheckpointInfo(**{**info.__dict__, "files": files})
    _atomic_write(out / CONFIG_FILE, json.dumps(final.to_dict(), indent=2, sort_keys=True).encode())
    return final


def read_info(folder: str | os.PathLike[str]) -> CheckpointInfo:
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{folder}: no {CONFIG_FILE}; is this a vla-rl checkpoint folder?")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    return CheckpointInfo.from_dict(raw)


def verify_files(folder: str | os.PathLike[str], info: CheckpointInfo) -> None:
    """Raise :class:`CheckpointError` unless every listed file exists with its recorded sha256."""
    if WEIGHTS_FILE not in info.files:
        raise CheckpointError(f"{folder}: config.json lists no hash for {WEIGHTS_FILE}")
    for name, want in info.files.items():
        path = Path(folder) / name
        if not path.is_file():
            raise CheckpointError(f"{folder}: {name} is missing")
        got = sha256_file(path)
        if got != want:
            raise CheckpointError(
                f"{folder}: {name} fails its hash check (sha256 {got[:12]}..., config.json says {want[:12]}...): "
                "the file is corrupt or was modified; download the checkpoint again"
            )


def load_checkpoint(folder: str | os.PathLike[str]) -> tuple[CheckpointInfo, dict[str, torch.Tensor]]:
    """Read and verify a checkpoint folder; returns its info and weights (CPU tensors)."""
    info = read_info(folder)
    verify_files(folder, info)
    return info, load_file(str(Path(folder) / WEIGHTS_FILE))
