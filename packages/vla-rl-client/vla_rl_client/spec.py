"""Robot spec: the contract between a robot (real or simulated), the policy, and the stores.

A spec says what a robot observes and how it acts:

* cameras: name -> H x W x 3 uint8 image,
* state:   float32[state_dim] proprioception (plus task extras for state-only tasks),
* action:  float32[action_dim], normalised to [-1, 1] (``action_range``; None for a spec in the robot's own
  units, e.g. a LeRobot dataset's joint targets),
* control rate and the instruction text.

One spec per task / robot type. Checkpoints record the spec they were trained for, and everything
that accepts observations checks them against it with :meth:`RobotSpec.check_observation`, which
raises :class:`SpecError` naming the offending field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

MAX_SPEC_JSON_CHARS = 64 * 1024
"""The longest robot spec, as JSON, a collector takes in a ``Hello``: its names, instruction and extras are
text a robot chooses, and every episode's commit record keeps a copy."""
RANGE_SLACK = 1e-5
"""How far (a fraction of the range's width) an action may stray outside ``action_range``: float rounding
of a value clipped to the bound, never a real excursion."""


class SpecError(ValueError):
    """An observation, action or frame does not match the robot spec. The message names the field."""

    def __init__(self, field_name: str, expected: str, got: str) -> None:
        self.field = field_name
        self.expected = expected
        self.got = got
        super().__init__(f"{field_name}: expected {expected}, got {got}")


@dataclass(frozen=True)
class CameraSpec:
    name: str
    height: int
    width: int

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").isalnum():
            raise ValueError(f"camera name must be non-empty [A-Za-z0-9_], got {self.name!r}")
        if self.height <= 0 or self.width <= 0:
            raise ValueError(
                f"camera {self.name!r}: height and width must be > 0, got {self.height}x{self.width}"
            )

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.height, self.width, 3)


@dataclass(frozen=True)
class RobotSpec:
    """What one robot type observes and how it acts. Actions are float32 in [-1, 1]."""

    name: str
    state_dim: int
    action_dim: int
    control_hz: float
    instruction: str
    cameras: tuple[CameraSpec, ...] = ()
    # Human-readable meaning of each action / state dimension (optional, for docs and plots).
    action_names: tuple[str, ...] = ()
    state_names: tuple[str, ...] = ()
    extras: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    action_range: tuple[float, float] | None = field(default=(-1.0, 1.0), compare=False, hash=False)
    """The interval every executed action's dimensions lie in (the collector and the robot client refuse
    frames outside it); None = not declared: actions in the robot's own units. A spec saved before the
    field existed reads as None. Not part of equality: it states a bound, not another robot."""

    def __post_init__(self) -> None:
        if self.state_dim < 0:
            raise ValueError(f"state_dim must be >= 0, got {self.state_dim}")
        if self.action_dim <= 0:
            raise ValueError(f"action_dim must be > 0, got {self.action_dim}")
        if not (self.control_hz > 0 and math.isfinite(self.control_hz)):
            raise ValueError(f"control_hz must be a positive number, got {self.control_hz}")
        names = [c.name for c in self.cameras]
        if len(set(names)) != len(names):
            raise ValueError(f"camera names must be unique, got {names}")
        if self.action_names and len(self.action_names) != self.action_dim:
            raise ValueError(
                f"action_names has {len(self.action_names)} entries, action_dim is {self.action_dim}"
            )
        if self.state_names and len(self.state_names) != self.state_dim:
            raise ValueError(
                f"state_names has {len(self.state_names)} entries, state_dim is {self.state_dim}"
            )
        if self.action_range is not None:
            lo, hi = (float(v) for v in self.action_range)
            if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
                raise ValueError(
                    f"action_range must be finite (low, high) with low < high, got {self.action_range}"
                )
            object.__setattr__(self, "action_range", (lo, hi))

    # ------------------------------------------------------------------ helpers
    @property
    def camera_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.cameras)

    def camera(self, name: str) -> CameraSpec:
        for c in self.cameras:
            if c.name == name:
                return c
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cameras"] = [asdict(c) for c in self.cameras]
        d["action_names"] = list(self.action_names)
        d["state_names"] = list(self.state_names)
        d["action_range"] = None if self.action_range is None else list(self.action_range)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RobotSpec:
        try:
            return cls(
                name=str(d["name"]),
                state_dim=int(d["state_dim"]),
                action_dim=int(d["action_dim"]),
                control_hz=float(d["control_hz"]),
                instruction=str(d["instruction"]),
                cameras=tuple(CameraSpec(**c) for c in d.get("cameras", ())),
                action_names=tuple(d.get("action_names", ())),
                state_names=tuple(d.get("state_names", ())),
                extras=dict(d.get("extras", {})),
                action_range=_range(d.get("action_range")),
            )
        except KeyError as e:
            raise ValueError(f"robot spec is missing field {e.args[0]!r}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> RobotSpec:
        return cls.from_dict(json.loads(s))

    # ------------------------------------------------------------------ validation
    def check_images(
        self, cameras: Mapping[str, Any], prefix: str = "cameras", batch: int | None = None
    ) -> None:
        """Every camera present, uint8, H x W x 3 (with a leading batch dim when ``batch`` is set)."""
        extra = set(cameras) - set(self.camera_names)
        if extra:
            raise SpecError(
                f"{prefix}.{sorted(extra)[0]}", f"only cameras {list(self.camera_names)}", "an unknown camera"
            )
        for cam in self.cameras:
            key = f"{prefix}.{cam.name}"
            if cam.name not in cameras:
                raise SpecError(key, f"a {cam.height}x{cam.width}x3 uint8 image", "nothing (camera missing)")
            img = cameras[cam.name]
            want = cam.shape if batch is None else (batch, *cam.shape)
            _check_array(key, img, np.uint8, want, finite=False)

    def check_state(self, state: Any, name: str = "state", batch: int | None = None) -> None:
        want = (self.state_dim,) if batch is None else (batch, self.state_dim)
        _check_array(name, state, np.float32, want, finite=True)

    def check_action(
        self, action: Any, name: str = "action", batch: int | None = None, finite: bool = True
    ) -> None:
        """``finite=False`` checks only dtype and shape, for fields whose NaN rows carry a meaning."""
        want = (self.action_dim,) if batch is None else (batch, self.action_dim)
        _check_array(name, action, np.float32, want, finite=finite)

    def check_action_range(self, action: np.ndarray, name: str = "action") -> None:
        """Every value of ``action`` (any shape, last dim the action's) within :attr:`action_range` (when the
        spec declares one), up to :data:`RANGE_SLACK` of its width; names the first frame outside it."""
        if self.action_range is None or not action.size:
            return
        lo, hi = self.action_range
        slack = RANGE_SLACK * (hi - lo)
        bad = ~((action >= lo - slack) & (action <= hi + slack))
        if bad.any():
            where = np.argwhere(bad)[0]
            at = f" (frame {int(where[0])})" if action.ndim > 1 else ""
            raise SpecError(
                name,
                f"values within the spec's action_range [{lo:g}, {hi:g}]",
                f"{float(action[tuple(where)]):.6g}{at}",
            )

    def check_observation(self, obs: Mapping[str, Any]) -> None:
        """Check one observation ``{"cameras": {...}, "state": ...}`` against the spec."""
        if not isinstance(obs, Mapping):
            raise SpecError("observation", "a mapping with 'cameras' and 'state'", type(obs).__name__)
        self.check_images(obs.get("cameras", {}) or {})
        if "state" not in obs:
            raise SpecError("state", f"float32[{self.state_dim}]", "nothing (missing)")
        self.check_state(obs["state"])


def _range(value: Any) -> tuple[float, float] | None:
    """``action_range`` as saved: absent or null = not declared, else a pair of numbers."""
    if value is None:
        return None
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise ValueError(f"action_range must be [low, high] or null, got {value!r}")
    return float(value[0]), float(value[1])


def _check_array(name: str, value: Any, dtype: type, shape: tuple[int, ...], finite: bool) -> None:
    if not isinstance(value, np.ndarray):
        raise SpecError(name, f"a numpy array of {np.dtype(dtype).name}{list(shape)}", type(value).__name__)
    if value.dtype != dtype:
        raise SpecError(name, f"dtype {np.dtype(dtype).name}", f"dtype {value.dtype.name}")
    if value.shape != shape:
        raise SpecError(name, f"shape {list(shape)}", f"shape {list(value.shape)}")
    if finite and not np.isfinite(value).all():
        raise SpecError(name, "finite values", "NaN or inf")
