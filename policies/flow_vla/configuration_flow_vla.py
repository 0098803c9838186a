"""Configuration of the flow-matching VLA (:class:`FlowVLAConfig`).

The config is the only thing needed to rebuild the network: a checkpoint's ``config.json`` holds
``config.to_dict()`` and ``model.safetensors`` holds the weights. It therefore also carries the
normalisation statistics (so a checkpoint is self-contained even without its weights file's buffers)
and is validated eagerly: a bad value fails at construction with a message that names the field, not
later as a shape error deep inside a forward pass.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, get_args

from vla_rl_client.spec import CameraSpec, RobotSpec

POLICY_TYPE = "flow_vla"
# Option sets: the Literal is the one spelling; the tuple (for checks and messages) is derived from it.
InstructionEncoder = Literal["minilm", "none"]
ActionNorm = Literal["min_max", "mean_std"]
ImageEncoderKind = Literal["conv", "resnet18"]
INSTRUCTION_ENCODERS = get_args(InstructionEncoder)
IMAGE_ENCODERS = get_args(ImageEncoderKind)
ACTION_NORM_MODES = get_args(ActionNorm)
MINILM_DIM = 384


class ConfigError(ValueError):
    """A config value is invalid. ``field`` names it (dotted for nested values)."""

    def __init__(self, field_name: str, message: str) -> None:
        self.field = field_name
        super().__init__(f"FlowVLAConfig.{field_name}: {message}")


@dataclass
class FlowVLAConfig:
    """Everything that defines a :class:`~policies.flow_vla.modeling_flow_vla.FlowVLAPolicy`.

    Defaults give a ~1.5M-parameter state-only model that trains in minutes on a CPU; adding one
    64x64 camera adds ~0.5M parameters.
    """

    # ---------------------------------------------------------------- robot interface
    state_dim: int
    """Proprioceptive state size (``RobotSpec.state_dim``). 0 means no state token."""
    action_dim: int
    """Action size per step (``RobotSpec.action_dim``)."""
    chunk_len: int = 10
    """H: actions predicted per call. The chunk is the RL action."""
    n_exec: int = 5
    """Actions executed per call (receding horizon). Chain log-probs and `accel` only score these."""
    cameras: tuple[CameraSpec, ...] = ()
    """The cameras, at their native size (the robot spec's). Empty = state-only."""

    # ---------------------------------------------------------------- transformer
    d_model: int = 128
    """Token width of the trunk and the action expert."""
    n_layers: int = 2
    """Transformer blocks in the prefix trunk (run once per observation)."""
    expert_n_layers: int = 4
    """Blocks in the action expert (run K times per chunk, so it dominates sampling latency)."""
    n_heads: int = 4
    """Attention heads; must divide d_model."""
    mlp_ratio: float = 4.0
    """Hidden width of each block's MLP as a multiple of d_model."""
    dropout: float = 0.0
    """Dropout in attention and MLPs. 0 by default so that a chain's log-prob recomputed for PPO is
    a deterministic function of the parameters."""

    # ---------------------------------------------------------------- image encoder
    image_resize: tuple[int, int] | None = None
    """(H, W) the model resizes every camera image to (bilinear, antialiased) before its image encoder:
    the training and inference resolution, saved with the checkpoint and applied identically wherever
    the policy runs, while robots keep sending native-size images. An int n means (n, n). None = each
    camera's own size in ``cameras`` (images of another size are resized to it)."""
    image_encoder: ImageEncoderKind = "conv"
    """'conv': a small CoordConv ResNet trained from scratch (``image_encoder_width`` / ``_stages``).
    'resnet18': torchvision's ResNet-18 trunk (as ACT and Diffusion Policy use; frozen batch norm,
    ImageNet normalisation, 512-channel stride-32 features), optionally initialised from
    ``image_encoder_weights``; ~11M parameters per camera, so give it ``image_resize`` on a CPU."""
    image_encoder_weights: str | None = None
    """'resnet18' only: where its pretrained weights come from: a folder holding ``model.safetensors``
    (or a ``.safetensors`` file) with torchvision ResNet-18 names (``conv1.weight``, ``layer1.0...``;
    ``fc.*`` is ignored), or ``hub://org/name@rev`` pulled through the registry. safetensors only,
    never a pickle. Read when a fresh model is built for training
    (:meth:`FlowVLAPolicy.load_pretrained_image_encoders`); a checkpoint carries the weights itself,
    so loading one never reads this. None = random initialisation."""
    freeze_image_encoder: bool = False
    """'resnet18' only: keep the backbone fixed (only the projection to d_model trains) instead of
    fine-tuning it."""
    image_encoder_width: int = 32
    """'conv': channels of the first conv stage; each further stage doubles them."""
    image_encoder_stages: int = 3
    """'conv': stride-2 residual stages after the stride-2 stem (64 px -> 4x4 feature map with 3)."""
    image_tokens_grid: int = 2
    """The feature map is pooled to a g x g grid: g*g tokens per camera."""
    share_image_encoder: bool = False
    """One conv net for all cameras (with a learned camera embedding) instead of one per camera."""
    image_augment_pad: int = 4
    """Random-shift augmentation (pad + random crop, in pixels) applied in the training loss. 0 = off."""

    # ---------------------------------------------------------------- instruction encoder
    instruction_encoder: InstructionEncoder = "minilm"
    """'minilm': frozen all-MiniLM-L6-v2 sentence embedding projected to one token (only the
    projection is trained and saved). 'none': no instruction token (single-task policies)."""

    # ---------------------------------------------------------------- flow matching
    num_inference_steps: int = 10
    """K: default number of denoising steps when sampling."""
    time_beta_alpha: float = 1.5
    """Training time is drawn as in π0: b ~ Beta(alpha, beta) in openpi time (1 = noise)..."""
    time_beta_beta: float = 1.0
    """...so Beta(1.5, 1) puts more weight on noisy times, then t_ours = 1 - (time_max * b + 1 - time_max)."""
    time_max: float = 0.999
    """Upper end of the training time range in our convention (π0's s = 0.999); avoids t = 1."""
    time_min_period: float = 4e-3
    """Shortest period of the sin-cos time embedding (π0)."""
    time_max_period: float = 4.0
    """Longest period of the sin-cos time embedding (π0)."""

    # ---------------------------------------------------------------- learnable noise (Flow-Noise)
    noise_std_min: float = 0.08
    """Lower bound of the noise head's per-step std (RLinf default)."""
    noise_std_max: float = 0.16
    """Upper bound of the noise head's per-step std (RLinf default)."""
    noise_head_hidden: tuple[int, ...] = (128, 64)
    """Hidden widths of the noise head MLP (RLinf's ExploreNoiseNet uses [128, 64], tanh)."""
    noise_head_detach: bool = False
    """Stop gradients from the noise head into the action expert (train only the head's own weights)."""

    # ---------------------------------------------------------------- advantage conditioning (RECAP)
    advantage_conditioning: bool = False
    """RECAP: condition on an improvement indicator (0 = unconditional, 1 = negative, 2 = positive) via
    a learned embedding added to every prefix token. Zero-initialised, so turning it on for an SFT
    model starts from exactly that model. Observations without ``"advantage"`` act as positive."""
    guidance_scale: float = 1.0
    """CFG weight β at inference: v = (1 - β) v_uncond + β v_positive. 1 = just condition on positive
    (one pass); > 1 sharpens towards better-than-average actions (two prefix passes)."""

    # ---------------------------------------------------------------- real-time chunking (trained)
    rtc_max_delay: int = 0
    """Training-time real-time chunking: each training chunk's first d ~ U{0..rtc_max_delay} actions are
    given clean (flow time 1 per action) and the loss is on the rest, so at inference the server feeds
    the actions a robot executes meanwhile as that prefix (policies/rtc.py, ``inpaint_sample``) and
    refuses larger delays. 0 = off (guided RTC serves this policy training-free)."""
    rtc_zero_delay_prob: float | None = None
    """How often a training delay is 0 (with ``rtc_max_delay``): None = d ~ U{0..rtc_max_delay}; p in
    [0, 1) = d = 0 with probability p, else d ~ U{1..rtc_max_delay}. Action h is trained only when d <= h,
    so the uniform draw trains action 0 (what a plain evaluation and every episode's first chunk execute)
    in only 1 / (rtc_max_delay + 1) of the samples; a larger p trains it more at the cost of the delayed
    cases. Training only: inference is the same (:func:`policies.flow_vla.sampling.sample_delays`)."""

    # ---------------------------------------------------------------- normalisation
    action_norm: ActionNorm = "min_max"
    """'min_max': each action dim's [min, max] maps to [-1, 1] (the robot-spec contract, and the range
    the N(0, I) noise covers). 'mean_std': zero mean, unit std (better for heavy-tailed dims)."""
    normalization_stats: dict[str, dict[str, list[float]]] | None = None
    """``{"state": {"mean", "std"}, "action": {"min", "max"} or {"mean", "std"}}`` (lists of floats),
    e.g. from :func:`policies.flow_vla.normalize.compute_normalization_stats`. None = identity."""

    extras: dict[str, Any] = field(default_factory=dict)
    """Free-form JSON metadata (not used by the model)."""

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        self.cameras = tuple(_camera(c, i) for i, c in enumerate(self.cameras))
        self.noise_head_hidden = tuple(int(h) for h in self.noise_head_hidden)
        _int_at_least(self, "state_dim", 0)
        _int_at_least(self, "action_dim", 1)
        _int_at_least(self, "chunk_len", 1)
        _int_at_least(self, "n_exec", 1)
        if self.n_exec > self.chunk_len:
            raise ConfigError("n_exec", f"must be <= chunk_len ({self.chunk_len}), got {self.n_exec}")
        names = [c.name for c in self.cameras]
        if len(set(names)) != len(names):
            raise ConfigError("cameras", f"camera names must be unique, got {names}")
        _int_at_least(self, "d_model", 8)
        _int_at_least(self, "n_layers", 0)
        _int_at_least(self, "expert_n_layers", 1)
        _int_at_least(self, "n_heads", 1)
        if self.d_model % self.n_heads:
            raise ConfigError("d_model", f"must be divisible by n_heads ({self.n_heads}), got {self.d_model}")
        if self.d_model % 2:
            raise ConfigError("d_model", f"must be even (sin-cos time embedding), got {self.d_model}")
        _number_in(self, "mlp_ratio", 0.0, math.inf, low_open=True)
        _number_in(self, "dropout", 0.0, 1.0, high_open=True)
        self.image_resize = _image_size("image_resize", self.image_resize)
        if self.image_encoder not in IMAGE_ENCODERS:
            raise ConfigError("image_encoder", f"must be one of {IMAGE_ENCODERS}, got {self.image_encoder!r}")
        if self.image_encoder_weights is not None:
            if not isinstance(self.image_encoder_weights, str) or not self.image_encoder_weights:
                raise ConfigError(
                    "image_encoder_weights",
                    f"must be a folder, a .safetensors file or hub://org/name@rev, got {self.image_encoder_weights!r}",
                )
            if self.image_encoder != "resnet18":
                raise ConfigError(
                    "image_encoder_weights", f"needs image_encoder='resnet18', got {self.image_encoder!r}"
                )
        if not isinstance(self.freeze_image_encoder, bool):
            raise ConfigError("freeze_image_encoder", f"must be a bool, got {self.freeze_image_encoder!r}")
        if self.freeze_image_encoder and self.image_encoder != "resnet18":
            raise ConfigError(
                "freeze_image_encoder", f"needs image_encoder='resnet18', got {self.image_encoder!r}"
            )
        _int_at_least(self, "image_encoder_width", 1)
        _int_at_least(self, "image_encoder_stages", 1)
        _int_at_least(self, "image_tokens_grid", 1)
        _int_at_least(self, "image_augment_pad", 0)
        if not isinstance(self.share_image_encoder, bool):
            raise ConfigError("share_image_encoder", f"must be a bool, got {self.share_image_encoder!r}")
        if self.instruction_encoder not in INSTRUCTION_ENCODERS:
            raise ConfigError(
                "instruction_encoder",
                f"must be one of {INSTRUCTION_ENCODERS}, got {self.instruction_encoder!r}",
            )
        if self.state_dim == 0 and not self.cameras and self.instruction_encoder == "none":
            raise ConfigError(
                "state_dim", "the policy has no input: give a state, a camera or an instruction"
            )
        _int_at_least(self, "num_inference_steps", 1)
        _number_in(self, "time_beta_alpha", 0.0, math.inf, low_open=True)
        _number_in(self, "time_beta_beta", 0.0, math.inf, low_open=True)
        _number_in(self, "time_max", 0.0, 1.0, low_open=True)
        _number_in(self, "time_min_period", 0.0, math.inf, low_open=True)
        _number_in(self, "time_max_period", self.time_min_period, math.inf, low_open=True)
        _number_in(self, "noise_std_min", 0.0, math.inf, low_open=True)
        _number_in(self, "noise_std_max", self.noise_std_min, math.inf)
        if not self.noise_head_hidden or any(h < 1 for h in self.noise_head_hidden):
            raise ConfigError(
                "noise_head_hidden", f"must be non-empty positive ints, got {self.noise_head_hidden}"
            )
        if not isinstance(self.advantage_conditioning, bool):
            raise ConfigError(
                "advantage_conditioning", f"must be a bool, got {self.advantage_conditioning!r}"
            )
        _number_in(self, "guidance_scale", 0.0, math.inf)
        if isinstance(self.rtc_max_delay, bool) or not isinstance(self.rtc_max_delay, int):
            raise ConfigError("rtc_max_delay", f"must be an int, got {self.rtc_max_delay!r}")
        if not 0 <= self.rtc_max_delay < self.chunk_len:
            raise ConfigError(
                "rtc_max_delay",
                f"must be in [0, chunk_len - 1 = {self.chunk_len - 1}], got {self.rtc_max_delay}",
            )
        problem = zero_delay_prob_problem(self.rtc_zero_delay_prob, self.rtc_max_delay)
        if problem is not None:
            raise ConfigError("rtc_zero_delay_prob", problem)
        if self.rtc_zero_delay_prob is not None:
            self.rtc_zero_delay_prob = float(self.rtc_zero_delay_prob)
        if self.action_norm not in ACTION_NORM_MODES:
            raise ConfigError("action_norm", f"must be one of {ACTION_NORM_MODES}, got {self.action_norm!r}")
        if self.normalization_stats is not None:
            self.normalization_stats = _check_stats(
                self.normalization_stats, self.state_dim, self.action_dim, self.action_norm
            )
        if not isinstance(self.extras, dict):
            raise ConfigError("extras", f"must be a dict, got {type(self.extras).__name__}")

    # ------------------------------------------------------------------ helpers
    @property
    def camera_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.cameras)

    def image_input_size(self, camera: CameraSpec) -> tuple[int, int]:
        """(H, W) the image encoder sees for ``camera``: ``image_resize``, else the camera's size."""
        return self.image_resize if self.image_resize is not None else (camera.height, camera.width)

    @property
    def uses_instruction(self) -> bool:
        return self.instruction_encoder != "none"

    @property
    def n_prefix_tokens(self) -> int:
        """Tokens in the prefix: [instruction?, state?, g*g per camera]."""
        return (
            int(self.uses_instruction)
            + int(self.state_dim > 0)
            + len(self.cameras) * self.image_tokens_grid**2
        )

    @classmethod
    def from_robot_spec(cls, spec: RobotSpec, **overrides: Any) -> FlowVLAConfig:
        """A config whose state, action and cameras match ``spec`` (cameras at the spec's size)."""
        kw: dict[str, Any] = {
            "state_dim": spec.state_dim,
            "action_dim": spec.action_dim,
            "cameras": spec.cameras,
        }
        kw.update(overrides)
        return cls(**kw)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict, with ``"type": "flow_vla"`` so a loader can dispatch on it."""
        d = asdict(self)
        d["cameras"] = [asdict(c) for c in self.cameras]
        d["noise_head_hidden"] = list(self.noise_head_hidden)
        d["image_resize"] = None if self.image_resize is None else list(self.image_resize)
        return {"type": POLICY_TYPE, **d}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FlowVLAConfig:
        d = dict(d)
        kind = d.pop("type", POLICY_TYPE)
        if kind != POLICY_TYPE:
            raise ConfigError("type", f"expected {POLICY_TYPE!r}, got {kind!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(unknown[0], "unknown field")
        for req in ("state_dim", "action_dim"):
            if req not in d:
                raise ConfigError(req, "missing")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> FlowVLAConfig:
        return cls.from_dict(json.loads(s))


# ---------------------------------------------------------------------- validators
def _camera(c: Any, i: int) -> CameraSpec:
    if isinstance(c, CameraSpec):
        return c
    if isinstance(c, Mapping):
        try:
            return CameraSpec(name=str(c["name"]), height=int(c["height"]), width=int(c["width"]))
        except KeyError as e:
            raise ConfigError(f"cameras[{i}].{e.args[0]}", "missing") from None
        except ValueError as e:
            raise ConfigError(f"cameras[{i}]", str(e)) from None
    raise ConfigError(f"cameras[{i}]", f"expected a CameraSpec or a mapping, got {type(c).__name__}")


def _image_size(name: str, v: Any) -> tuple[int, int] | None:
    """None, an int n (-> (n, n)) or an (H, W) pair of positive ints."""
    if v is None:
        return None
    pair = (v, v) if isinstance(v, int) and not isinstance(v, bool) else v
    if (
        isinstance(pair, (str, bytes))
        or not isinstance(pair, Sequence)
        or len(pair) != 2
        or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in pair)
    ):
        raise ConfigError(name, f"must be None, a positive int or (height, width) positive ints, got {v!r}")
    return int(pair[0]), int(pair[1])


def _int_at_least(cfg: FlowVLAConfig, name: str, low: int) -> None:
    v = getattr(cfg, name)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(name, f"must be an int, got {v!r}")
    if v < low:
        raise ConfigError(name, f"must be >= {low}, got {v}")


def zero_delay_prob_problem(prob: object, max_delay: int) -> str | None:
    """Why ``prob`` is no ``rtc_zero_delay_prob`` for a policy trained with ``rtc_max_delay`` =
    ``max_delay`` (what was expected), or None when it is one."""
    if prob is None:
        return None
    if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not 0 <= prob < 1:
        return f"expected None (d ~ U{{0..rtc_max_delay}}) or a probability in [0, 1), got {prob!r}"
    if not max_delay:
        return f"expected None without training-time RTC (rtc_max_delay 0), got {prob!r}"
    return None


def _number_in(
    cfg: FlowVLAConfig, name: str, low: float, high: float, low_open: bool = False, high_open: bool = False
) -> None:
    v = getattr(cfg, name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(name, f"must be a finite number, got {v!r}")
    too_low = v <= low if low_open else v < low
    too_high = v >= high if high_open else v > high
    if too_low or too_high:
        lo, hi = ("(" if low_open else "["), (")" if high_open else "]")
        raise ConfigError(name, f"must be in {lo}{low}, {high}{hi}, got {v}")
    setattr(cfg, name, float(v))


def _check_stats(
    stats: Mapping[str, Any], state_dim: int, action_dim: int, action_norm: str
) -> dict[str, dict[str, list[float]]]:
    """Validate the stats dict and return a plain copy with float lists (JSON-able, no numpy)."""
    if not isinstance(stats, Mapping):
        raise ConfigError("normalization_stats", f"must be a mapping, got {type(stats).__name__}")
    need = {"action": ("min", "max") if action_norm == "min_max" else ("mean", "std")}
    if state_dim > 0:
        need["state"] = ("mean", "std")
    out: dict[str, dict[str, list[float]]] = {}
    for group, dim in (("state", state_dim), ("action", action_dim)):
        if group not in stats:
            if group in need:
                raise ConfigError(f"normalization_stats.{group}", "missing")
            continue
        g = stats[group]
        if not isinstance(g, Mapping):
            raise ConfigError(f"normalization_stats.{group}", f"must be a mapping, got {type(g).__name__}")
        for key in need.get(group, ()):
            if key not in g:
                raise ConfigError(f"normalization_stats.{group}.{key}", "missing")
        out[group] = {}
        for key, values in g.items():
            name = f"normalization_stats.{group}.{key}"
            vals = _float_list(name, values)
            if len(vals) != dim:
                raise ConfigError(name, f"expected {dim} values, got {len(vals)}")
            if key == "std" and any(v < 0 for v in vals):
                raise ConfigError(name, "must be >= 0")
            out[group][key] = vals
        if "min" in out[group] and "max" in out[group]:
            bad = [
                i
                for i, (lo, hi) in enumerate(zip(out[group]["min"], out[group]["max"], strict=True))
                if lo > hi
            ]
            if bad:
                raise ConfigError(f"normalization_stats.{group}.min", f"min > max at dims {bad}")
    return out


def _float_list(name: str, values: Any) -> list[float]:
    if hasattr(values, "tolist"):
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ConfigError(name, f"must be a list of numbers, got {type(values).__name__}")
    try:
        vals = [float(v) for v in values]
    except (TypeError, ValueError):
        raise ConfigError(name, "must be a list of numbers") from None
    if not all(math.isfinite(v) for v in vals):
        raise ConfigError(name, "must be finite")
    return vals
