"""Our metadata beside a LeRobot policy folder: lineage, metrics, the task's robot spec, RECAP conditioning,
training-time real-time chunking.

A LeRobot folder (``config.json`` with its ``type``, ``model.safetensors``, the processors) has no place for
what a round knows about it: which algorithm trained it from which parent, on which data, how it scored,
which task (robot spec, with its name and instruction) it acts in, whether it was trained
advantage-conditioned (RECAP) with which guidance scale, and the largest executed prefix it was trained to
take given clean (``rtc_max_delay``, training-time RTC; 0: not trained so) with how often its training
delay was 0 (``rtc_zero_delay_prob``, lineage only). That lives in
:data:`LINEAGE_FILE` beside it (LeRobot ignores the file, so ``PreTrainedPolicy.from_pretrained`` still
loads the folder), and a ``README.md`` model card is written from it, as for our own checkpoints
(:func:`vla_rl.hub.checkpoint.model_card`).

The file is JSON::

    {"lineage": {...} | null, "metrics": {...}, "robot_spec": {...} | null,
     "advantage": {"guidance_scale": 1.0, "negative": "Advantage: negative",
                   "positive": "Advantage: positive"} | null,
     "rtc_max_delay": 0, "rtc_zero_delay_prob": null}

(``rtc_max_delay`` absent, as in folders written before it existed: 0; ``rtc_zero_delay_prob`` absent:
null, the uniform delay.)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from vla_rl_client.spec import RobotSpec

from policies.flow_vla.configuration_flow_vla import zero_delay_prob_problem
from vla_rl.hub.checkpoint import CheckpointError, CheckpointInfo, Lineage, model_card
from vla_rl.hub.storage import atomic_write

LINEAGE_FILE = "vla_rl_lineage.json"
"""Beside a saved LeRobot folder: our lineage, metrics, robot spec, RECAP conditioning and RTC delay."""
CARD_FILE = "README.md"
MAX_SIDECAR_BYTES = 1 << 20
ADVANTAGE_TEXTS = {"negative": "Advantage: negative", "positive": "Advantage: positive"}
"""What RECAP appends to a LeRobot VLA's instruction (the π0.6 paper's and LeRobot's RECAP prompt)."""


@dataclass(frozen=True)
class AdvantageConditioning:
    """A LeRobot VLA trained advantage-conditioned (RECAP): the instruction gets ``positive`` /
    ``negative`` appended on its own line (nothing: unconditioned); at deployment it is conditioned on
    positive, with classifier-free guidance ``v = (1 - g) v_uncond + g v_positive`` when
    ``guidance_scale`` (g) is not 1."""

    guidance_scale: float = 1.0
    negative: str = ADVANTAGE_TEXTS["negative"]
    positive: str = ADVANTAGE_TEXTS["positive"]

    def __post_init__(self) -> None:
        g = self.guidance_scale
        if isinstance(g, bool) or not isinstance(g, int | float) or not 0 <= g < float("inf"):
            raise ValueError(f"advantage.guidance_scale: expected a finite number >= 0, got {g!r}")
        for name in ("negative", "positive"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name).strip():
                raise ValueError(f"advantage.{name}: expected a non-empty text, got {getattr(self, name)!r}")

    def prompt(self, instruction: str, indicator: int) -> str:
        """``instruction`` conditioned on ``indicator`` (0 unconditioned, 1 negative, 2 positive)."""
        if indicator == 0:
            return instruction
        if indicator not in (1, 2):
            raise ValueError(f"advantage: expected 0, 1 or 2, got {indicator}")
        return f"{instruction}\n{self.positive if indicator == 2 else self.negative}"


@dataclass(frozen=True)
class Sidecar:
    """The contents of :data:`LINEAGE_FILE` (every part optional: a folder from elsewhere has none)."""

    lineage: Lineage | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    robot_spec: RobotSpec | None = None
    advantage: AdvantageConditioning | None = None
    rtc_max_delay: int = 0
    """Training-time real-time chunking: the largest executed prefix (actions) the policy was trained to
    take given clean; the server then serves it in trained mode and refuses larger delays. 0: not so."""
    rtc_zero_delay_prob: float | None = None
    """How often a training delay was 0 (``FlowVLAConfig.rtc_zero_delay_prob``; None: d ~ U{0..max});
    recorded for lineage, serving does not read it."""

    def __post_init__(self) -> None:
        n = self.rtc_max_delay
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"rtc_max_delay: expected an integer >= 0, got {n!r}")
        problem = zero_delay_prob_problem(self.rtc_zero_delay_prob, n)
        if problem is not None:
            raise ValueError(f"rtc_zero_delay_prob: {problem}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "lineage": asdict(self.lineage) if self.lineage is not None else None,
            "metrics": dict(self.metrics),
            "robot_spec": self.robot_spec.to_dict() if self.robot_spec is not None else None,
            "advantage": asdict(self.advantage) if self.advantage is not None else None,
            "rtc_max_delay": self.rtc_max_delay,
            "rtc_zero_delay_prob": self.rtc_zero_delay_prob,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Sidecar:
        try:
            lineage, spec, adv = d.get("lineage"), d.get("robot_spec"), d.get("advantage")
            metrics = d.get("metrics") or {}
            if not isinstance(metrics, Mapping):
                raise TypeError(f"metrics: expected an object, got {type(metrics).__name__}")
            return cls(
                lineage=Lineage(**lineage) if lineage is not None else None,
                metrics=dict(metrics),
                robot_spec=RobotSpec.from_dict(spec) if spec is not None else None,
                advantage=AdvantageConditioning(**adv) if adv is not None else None,
                rtc_max_delay=d.get("rtc_max_delay", 0),
                rtc_zero_delay_prob=d.get("rtc_zero_delay_prob"),
            )
        except (TypeError, ValueError, KeyError) as e:
            raise CheckpointError(f"{LINEAGE_FILE}: {e}") from None

    def with_evaluation(self, metrics: Mapping[str, Any], round_index: int | None) -> Sidecar:
        """The sidecar after a round's evaluation: its metrics added, the round in the lineage."""
        lineage = self.lineage
        if lineage is not None and round_index is not None:
            lineage = replace(lineage, round=round_index)
        return replace(self, lineage=lineage, metrics={**self.metrics, **metrics})


def read_sidecar(folder: str | os.PathLike[str]) -> Sidecar:
    """The folder's :data:`LINEAGE_FILE` (an empty :class:`Sidecar` when it has none)."""
    path = Path(folder) / LINEAGE_FILE
    if not path.is_file():
        return Sidecar()
    if path.stat().st_size > MAX_SIDECAR_BYTES:
        raise CheckpointError(f"{LINEAGE_FILE}: over {MAX_SIDECAR_BYTES} bytes")
    try:
        raw = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{LINEAGE_FILE}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{LINEAGE_FILE}: expected a JSON object, got {type(raw).__name__}")
    return Sidecar.from_dict(raw)


def write_sidecar(folder: str | os.PathLike[str], sidecar: Sidecar, policy_type: str) -> None:
    """Write :data:`LINEAGE_FILE` and, when the sidecar has a lineage and a robot spec, a ``README.md``
    model card of ``policy_type`` (e.g. ``lerobot/smolvla``) from it. Each file is replaced atomically (as
    our checkpoints' are): a round rewrites them in a folder it is about to push, and a crash must leave
    the old file or the new one, never half of one."""
    out = Path(folder)
    atomic_write(out / LINEAGE_FILE, json.dumps(sidecar.to_dict(), indent=2, default=str).encode())
    if sidecar.lineage is not None and sidecar.robot_spec is not None:
        info = CheckpointInfo(
            policy_type=policy_type,
            model_config={},
            robot_spec=sidecar.robot_spec,
            normalization={},
            lineage=sidecar.lineage,
            metrics=dict(sidecar.metrics),
        )
        atomic_write(out / CARD_FILE, model_card(info).encode())


def record_evaluation(
    folder: str | os.PathLike[str], metrics: Mapping[str, Any], round_index: int | None
) -> None:
    """Add a round's evaluation ``metrics`` (and its number, in the lineage) to the folder's sidecar and
    rewrite its model card: what a round does to its candidate before pushing it."""
    out = Path(folder)
    try:
        policy_type = str(json.loads((out / "config.json").read_text())["type"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{out}: not a LeRobot policy folder ({e})") from None
    write_sidecar(out, read_sidecar(out).with_evaluation(metrics, round_index), f"lerobot/{policy_type}")


def check_spec_fits(spec: RobotSpec, config_spec: RobotSpec) -> None:
    """Refuse a sidecar robot spec that is not the robot the LeRobot config describes, naming the field."""
    for name in ("state_dim", "action_dim"):
        if getattr(spec, name) != getattr(config_spec, name):
            raise CheckpointError(
                f"{LINEAGE_FILE}: robot_spec.{name}: {getattr(spec, name)} does not match the LeRobot "
                f"config's {getattr(config_spec, name)}"
            )
    ours = {c.name: c.shape for c in spec.cameras}
    theirs = {c.name: c.shape for c in config_spec.cameras}
    if ours != theirs:
        raise CheckpointError(
            f"{LINEAGE_FILE}: robot_spec.cameras: {ours} does not match the LeRobot config's {theirs}"
        )
