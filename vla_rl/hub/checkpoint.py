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
import stat
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from vla_rl_client.spec import RobotSpec

from vla_rl.core.version import __version__

CHECKPOINT_FORMAT = "vla-rl-checkpoint"
CHECKPOINT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
CARD_FILE = "README.md"
DEFAULT_MAX_FILE_BYTES = 64 * 1024**3  # one checkpoint file (weights of a ~16B-parameter fp32 model)
MAX_CONFIG_BYTES = 16 * 1024 * 1024
MAX_LISTED_FILES = 256


class CheckpointError(ValueError):
    """A checkpoint folder is missing, malformed, or fails its hash check."""


@dataclass
class LoadLimits:
    """Bounds on reading one checkpoint: file size, and a deadline (``time.monotonic()``) or cancel flag
    checked between blocks, so a slow or huge load ends with an error instead of holding its thread."""

    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    deadline: float | None = None
    cancelled: Any = None  # a threading.Event (or anything with is_set())

    def check(self, what: str) -> None:
        if self.cancelled is not None and self.cancelled.is_set():
            raise CheckpointError(f"{what}: load cancelled")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise CheckpointError(f"{what}: load_timeout_s exceeded; load abandoned")


def member_path(folder: str | os.PathLike[str], name: str, limits: LoadLimits | None = None) -> Path:
    """``folder / name`` for a file a checkpoint lists, after checking it is one of the checkpoint's own files.

    Refused (:class:`CheckpointError` naming the file): absolute names, ``..``, backslashes or NUL, links
    that resolve outside the folder (the Hugging Face cache layout, ``snapshots/<sha>/f -> ../../blobs/x``,
    is allowed), anything but a regular file, and files over ``limits.max_file_bytes``.
    """
    limits = limits or LoadLimits()
    shown = repr(name)[:80]
    if not isinstance(name, str) or not name or len(name) > 255 or "\x00" in name or "\\" in name:
        raise CheckpointError(f"files: {shown} is not a plain relative file name")
    parts = name.split("/")
    if name.startswith("/") or any(p in ("", ".", "..") for p in parts) or ":" in parts[0]:
        raise CheckpointError(f"files: {shown} must be a relative name inside the checkpoint folder")
    root = Path(folder).resolve()
    allowed = [root]
    if root.parent.name == "snapshots":  # huggingface_hub cache: files are links into ../../blobs
        allowed.append(root.parent.parent / "blobs")
    try:
        target = (root / name).resolve(strict=True)
    except (OSError, RuntimeError):
        raise CheckpointError(f"{folder}: {shown} is missing") from None
    if not any(target.is_relative_to(a) for a in allowed):
        raise CheckpointError(f"files: {shown} points outside the checkpoint folder")
    st = target.stat()
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"files: {shown} is not a regular file")
    if st.st_size > limits.max_file_bytes:
        raise CheckpointError(
            f"files: {shown} is {st.st_size} bytes, over max_file_bytes ({limits.max_file_bytes})"
        )
    return target


@dataclass(frozen=True)
class Lineage:
    """Where a checkpoint came from: enough to reproduce or audit it."""

    algorithm: str  # "sft", "awr", "qam", ...
    parent_revision: str | None = None  # the checkpoint it was trained from (hub ref or commit)
    round: int | None = None  # post-training round number
    data: dict[str, Any] = field(default_factory=dict)  # data selection + snapshot (store, episodes, frames)
    created: float = field(default_factory=time.time)
    code_version: str = __version__
    lora: dict[str, Any] | None = (
        None  # trained with LoRA adapters (rank, alpha, ...), merged into the weights
    )


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


def sha256_file(path: Path, limits: LoadLimits | None = None) -> str:
    """sha256 of ``path``; with ``limits``, reads at most ``max_file_bytes`` and honours the deadline."""
    h = hashlib.sha256()
    read = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            if limits is not None:
                read += len(block)
                if read > limits.max_file_bytes:
                    raise CheckpointError(
                        f"files: {path.name} is over max_file_bytes ({limits.max_file_bytes})"
                    )
                limits.check(f"hashing {path.name}")
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
        *(
            [f"- LoRA (merged into the weights): `{json.dumps(lin.lora, sort_keys=True)}`"]
            if lin.lora
            else []
        ),
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
    if not (Path(folder) / CONFIG_FILE).is_file():
        raise CheckpointError(f"{folder}: no {CONFIG_FILE}; is this a vla-rl checkpoint folder?")
    path = member_path(folder, CONFIG_FILE, LoadLimits(max_file_bytes=MAX_CONFIG_BYTES))
    try:
        raw = json.loads(path.read_bytes()[: MAX_CONFIG_BYTES + 1])
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{CONFIG_FILE}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{CONFIG_FILE}: expected a JSON object, got {type(raw).__name__}")
    return CheckpointInfo.from_dict(raw)


def verify_files(
    folder: str | os.PathLike[str], info: CheckpointInfo, limits: LoadLimits | None = None
) -> None:
    """Raise :class:`CheckpointError` unless every listed file is one of the folder's own regular files
    (:func:`member_path`), within the limits, with its recorded sha256."""
    limits = limits or LoadLimits()
    if WEIGHTS_FILE not in info.files:
        raise CheckpointError(f"{folder}: config.json lists no hash for {WEIGHTS_FILE}")
    if len(info.files) > MAX_LISTED_FILES:
        raise CheckpointError(f"files: {len(info.files)} listed, at most {MAX_LISTED_FILES}")
    paths = {name: member_path(folder, name, limits) for name in info.files}  # all names checked first
    for name, want in info.files.items():
        if not isinstance(want, str):
            raise CheckpointError(f"files: {name!r}: expected a sha256 hex string")
        limits.check(f"verifying {name}")
        got = sha256_file(paths[name], limits)
        if got != want:
            raise CheckpointError(
                f"{folder}: {name} fails its hash check (sha256 {got[:12]}..., config.json says {want[:12]}...): "
                "the file is corrupt or was modified; download the checkpoint again"
            )


def load_checkpoint(
    folder: str | os.PathLike[str],
    limits: LoadLimits | None = None,
    check: Any = None,
) -> tuple[CheckpointInfo, dict[str, torch.Tensor]]:
    """Read and verify a checkpoint folder; returns its info and weights (CPU tensors).

    ``check(info, weights_path)``, if given, runs after the hashes and before the weights are loaded
    (the policy loader compares the config's implied tensor shapes with the safetensors header there).
    """
    limits = limits or LoadLimits()
    info = read_info(folder)
    verify_files(folder, info, limits)
    weights = member_path(folder, WEIGHTS_FILE, limits)
    if check is not None:
        check(info, weights)
    limits.check(f"loading {WEIGHTS_FILE}")
    return info, load_file(str(weights))
