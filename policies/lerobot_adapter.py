"""Serve LeRobot policies (ACT, Diffusion, PI0, ...) from a folder saved by ``PreTrainedPolicy.save_pretrained``.

Teams bring the models they already have: a LeRobot policy folder (``config.json`` with a ``"type"`` field,
``model.safetensors``, and, since LeRobot 0.4, ``policy_preprocessor.json`` / ``policy_postprocessor.json``
pipelines with their normalisation statistics) is served through the same batching path as our own
checkpoints. :func:`is_lerobot_folder` tells the two apart by ``config.json``; :func:`build_lerobot` builds
the policy with its processors. The flow VLAs among them (SmolVLA, π0, π0.5) are served through the
flow-policy contract (:class:`policies.lerobot_flow.LeRobotFlowPolicy`, picked by
:func:`policies.loading.load_servable`): one prefix pass per batch, our ODE loop, ``accel`` uncertainty. The
others (ACT, Diffusion, ...), and a flow VLA whose config the contract refuses, are served by
:class:`LeRobotModel` (:func:`lerobot_model`), which calls the policy's own ``predict_action_chunk`` on the batch.

How a robot observation maps onto LeRobot's batch (the same keys LeRobot's own async server builds):

==================================  ==================================================================
robot spec (wire)                   LeRobot batch (before the policy's pre-processor)
==================================  ==================================================================
``state`` float32 [S]               ``observation.state`` float32 [B, S]
``cameras[c]`` uint8 [H, W, 3]      ``observation.images.<c>`` float32 [B, 3, H, W] in [0, 1]
                                    (``observation.image`` when the policy has a single unnamed camera)
``instruction``                     ``task`` (list of B strings; language policies tokenise it)
==================================  ==================================================================

The robot spec is derived from the policy's ``input_features`` / ``output_features``; a LeRobot config
has no control rate, so the spec says :data:`DEFAULT_CONTROL_HZ` (LeRobot's own default fps). A folder with
our sidecar (:mod:`policies.lerobot_sidecar`) that records the task's robot spec is served with that spec
(its name, instruction and control rate), once it is checked to fit the config's dims and cameras.

Limits, said plainly:

* The server is stateless, so a policy with observation history (``n_obs_steps > 1``, e.g. Diffusion's
  default 2) sees the current observation repeated, as LeRobot itself does on the first step of an episode.
* Seeds reproduce a chunk only where the policy takes its initial noise as an argument and is otherwise
  deterministic: ACT (no noise at all), Diffusion with a DDIM scheduler. DDPM draws fresh noise at every
  denoising step from torch's global generator, so its chunks vary from call to call and with batching.
* Hashes: a LeRobot folder lists no file hashes; a ``hub://`` ref is pinned to one commit, a local folder to
  its fingerprint (names, sizes, mtimes).

``lerobot`` is imported only when a LeRobot folder is loaded (the import alone takes seconds).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vla_rl_client.spec import CameraSpec, RobotSpec

from policies.lerobot_local import LocalBuild, local_build
from policies.lerobot_sidecar import Sidecar, check_spec_fits, read_sidecar
from vla_rl.hub.checkpoint import CheckpointError

log = logging.getLogger("vla_rl.lerobot_adapter")

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
PREPROCESSOR_FILE = "policy_preprocessor.json"
POSTPROCESSOR_FILE = "policy_postprocessor.json"
DEFAULT_CONTROL_HZ = 30.0  # lerobot.async_inference.constants.DEFAULT_FPS
STATE_KEY = "observation.state"
IMAGES_PREFIX = "observation.images."
SINGLE_IMAGE_KEY = "observation.image"
ACTION_KEY = "action"
# What a blank config.json for each of these needs beyond the folder (said in the error when loading fails).
NEEDS_HUB = {
    "pi0": "PaliGemma weights and tokenizer",
    "pi05": "PaliGemma weights and tokenizer",
    "pi0_fast": "PaliGemma weights and the FAST tokenizer",
    "smolvla": "SmolVLM weights and tokenizer",
}


def read_lerobot_config(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The folder's ``config.json`` if it is a LeRobot policy config (has ``"type"``), else None."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(raw, dict) or raw.get("format") == "vla-rl-checkpoint" or "type" not in raw:
        return None
    return raw


def is_lerobot_folder(folder: str | os.PathLike[str]) -> bool:
    return read_lerobot_config(folder) is not None


def lerobot_policy_types() -> list[str]:
    """Policy types LeRobot can build here (registered config classes)."""
    import lerobot.policies  # noqa: F401  (registers the built-in policy configs)
    from lerobot.configs.policies import PreTrainedConfig

    return sorted(PreTrainedConfig.get_known_choices())


def _shape(feature: Mapping[str, Any], where: str) -> tuple[int, ...]:
    shape = feature.get("shape") if isinstance(feature, Mapping) else None
    if not isinstance(shape, list | tuple) or not all(isinstance(d, int) and d > 0 for d in shape):
        raise CheckpointError(
            f"{CONFIG_FILE}: {where}.shape: expected a list of positive ints, got {shape!r}"
        )
    return tuple(shape)


def spec_from_config(raw: Mapping[str, Any], name: str | None = None) -> tuple[RobotSpec, dict[str, str]]:
    """The robot spec a LeRobot config describes, and camera name -> LeRobot feature key.

    Raises :class:`CheckpointError` naming the feature that has no robot-spec counterpart.
    """
    ptype = str(raw.get("type"))
    inputs = raw.get("input_features")
    outputs = raw.get("output_features")
    if not isinstance(inputs, Mapping) or not inputs:
        raise CheckpointError(
            f"{CONFIG_FILE}: input_features: expected the policy's input features, got {inputs!r}"
        )
    if not isinstance(outputs, Mapping) or ACTION_KEY not in outputs:
        raise CheckpointError(
            f"{CONFIG_FILE}: output_features: expected an 'action' feature, got {outputs!r}"
        )
    action_shape = _shape(outputs[ACTION_KEY], f"output_features.{ACTION_KEY}")
    if len(action_shape) != 1:
        raise CheckpointError(
            f"{CONFIG_FILE}: output_features.action.shape: expected [A], got {list(action_shape)}"
        )
    state_dim = 0
    cameras: list[CameraSpec] = []
    keys: dict[str, str] = {}
    for key, feat in inputs.items():
        ftype = feat.get("type") if isinstance(feat, Mapping) else None
        where = f"input_features.{key}"
        if key == STATE_KEY and ftype == "STATE":
            shape = _shape(feat, where)
            if len(shape) != 1:
                raise CheckpointError(f"{CONFIG_FILE}: {where}.shape: expected [S], got {list(shape)}")
            state_dim = shape[0]
        elif ftype == "VISUAL" and (key.startswith(IMAGES_PREFIX) or key == SINGLE_IMAGE_KEY):
            shape = _shape(feat, where)
            if len(shape) != 3 or shape[0] != 3:
                raise CheckpointError(
                    f"{CONFIG_FILE}: {where}.shape: expected [3, H, W] (RGB), got {list(shape)}"
                )
            _, h, w = shape
            cam = key.removeprefix(IMAGES_PREFIX) if key.startswith(IMAGES_PREFIX) else "image"
            safe = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in cam)
            if safe in keys:
                raise CheckpointError(f"{CONFIG_FILE}: {where}: camera name {safe!r} is used twice")
            keys[safe] = key
            cameras.append(CameraSpec(safe, h, w))
        else:
            raise CheckpointError(
                f"{CONFIG_FILE}: {where} (type {ftype}): no robot-spec counterpart; supported inputs are "
                f"{STATE_KEY} (STATE) and {IMAGES_PREFIX}<camera> (VISUAL)"
            )
    spec = RobotSpec(
        name=name or f"lerobot/{ptype}",
        state_dim=state_dim,
        action_dim=action_shape[0],
        control_hz=DEFAULT_CONTROL_HZ,
        instruction="",
        cameras=tuple(cameras),
        action_range=None,  # a LeRobot policy acts in the robot's own units
    )
    return spec, keys


def to_lerobot_batch(
    state_dim: int,
    states: np.ndarray | torch.Tensor,
    cameras: Mapping[str, np.ndarray | torch.Tensor],
    instructions: list[str],
    camera_keys: Mapping[str, str],
) -> dict[str, Any]:
    """A robot observation batch as LeRobot's own async server hands it to the pre-processor (the table in
    the module docstring): ``observation.state`` float32 [B, S], ``observation.images.<c>`` float32
    [B, 3, H, W] in [0, 1], ``task`` B strings."""
    batch: dict[str, Any] = {}
    if state_dim:
        batch[STATE_KEY] = torch.as_tensor(
            np.ascontiguousarray(states) if isinstance(states, np.ndarray) else states
        )
    for cam, key in camera_keys.items():
        img = cameras[cam]
        img = torch.from_numpy(np.ascontiguousarray(img)) if isinstance(img, np.ndarray) else img
        batch[key] = (img.permute(0, 3, 1, 2).to(torch.float32) / 255.0).contiguous()
    batch["task"] = list(instructions)
    return batch


@dataclass
class LeRobotModel:
    """A loaded LeRobot policy with its pre/post-processors, run on batches of robot observations.

    Has what the policy server needs from any served model: ``spec``, ``chunk_len``, ``n_exec``,
    ``noise_shape`` (per-request initial noise the policy takes, None when it takes none), ``infer``.
    """

    policy: Any  # lerobot PreTrainedPolicy
    preprocessor: Any
    postprocessor: Any
    spec: RobotSpec
    camera_keys: dict[str, str]  # spec camera name -> LeRobot feature key
    lerobot_type: str
    path: Path
    commit: str
    ref: str
    noise_shape: tuple[int, int] | None
    chunk_len: int = 0  # set by the probe in load_lerobot
    has_processors: bool = True
    notes: list[str] = field(default_factory=list)

    @property
    def policy_type(self) -> str:
        return f"lerobot/{self.lerobot_type}"

    @property
    def device(self) -> torch.device:
        return next(self.policy.parameters()).device

    @property
    def n_exec(self) -> int:
        n = getattr(self.policy.config, "n_action_steps", None)
        return min(int(n), self.chunk_len) if isinstance(n, int) and n > 0 else self.chunk_len

    def infer(
        self,
        states: np.ndarray,
        cameras: Mapping[str, np.ndarray],
        instructions: list[str],
        noise: np.ndarray | None,
    ) -> np.ndarray:
        """float32 [B, chunk_len, A] actions in env units (after the post-processor)."""
        device = self.device
        n_obs = int(getattr(self.policy.config, "n_obs_steps", 1) or 1)
        with torch.inference_mode():
            batch = to_lerobot_batch(self.spec.state_dim, states, cameras, instructions, self.camera_keys)
            batch = self.preprocessor(batch)
            if n_obs > 1:  # stateless server: history = the current observation repeated
                for key in [STATE_KEY, *self.camera_keys.values()]:
                    if key in batch:
                        x = batch[key]
                        batch[key] = x.unsqueeze(1).expand(x.shape[0], n_obs, *x.shape[1:])
            kwargs = {}
            if noise is not None:
                kwargs["noise"] = torch.from_numpy(noise).to(device)
            actions = self.policy.predict_action_chunk(batch, **kwargs)
            if actions.ndim == 2:  # a policy that predicts one action
                actions = actions[:, None]
            actions = self.postprocessor(actions)
            return actions.float().cpu().numpy()

    def probe(self) -> None:
        """One forward pass on a blank observation: sets ``chunk_len`` from what the policy returns."""
        s = self.spec
        states = np.zeros((1, s.state_dim), np.float32)
        cams = {c.name: np.zeros((1, *c.shape), np.uint8) for c in s.cameras}
        noise = None if self.noise_shape is None else np.zeros((1, *self.noise_shape), np.float32)
        out = self.infer(states, cams, [s.instruction], noise)
        if out.ndim != 3 or out.shape[0] != 1 or out.shape[2] != s.action_dim:
            raise CheckpointError(
                f"{self.policy_type}: expected actions [1, H, {s.action_dim}] from predict_action_chunk, "
                f"got {list(out.shape)}"
            )
        self.chunk_len = int(out.shape[1])


def _noise_shape(policy: Any, action_dim: int) -> tuple[int, int] | None:
    """The initial-noise shape ``predict_action_chunk(noise=...)`` takes, or None (deterministic / no arg)."""
    if "noise" not in inspect.signature(policy.predict_action_chunk).parameters:
        return None
    cfg = policy.config
    if isinstance(getattr(cfg, "horizon", None), int):  # diffusion: noise over the whole horizon
        return (int(cfg.horizon), action_dim)
    if isinstance(getattr(cfg, "chunk_size", None), int) and isinstance(
        getattr(cfg, "max_action_dim", None), int
    ):
        return (int(cfg.chunk_size), int(cfg.max_action_dim))  # pi0 family: padded action dim
    return None


@dataclass
class LeRobotBuild:
    """A LeRobot policy built from its folder, with its processors: what serving and training start from."""

    policy: Any  # lerobot PreTrainedPolicy, in eval mode on the requested device
    preprocessor: Any
    postprocessor: Any
    spec: RobotSpec  # the sidecar's robot spec when it has one (the task's), else what the config describes
    camera_keys: dict[str, str]
    lerobot_type: str
    path: Path
    has_processors: bool
    local: LocalBuild  # a folder made here: its vlm/ and π0 sizes (policies.lerobot_tiny)
    notes: list[str] = field(default_factory=list)
    sidecar: Sidecar = field(default_factory=Sidecar)  # our metadata beside the folder (empty: none)


def build_lerobot(
    folder: str | os.PathLike[str],
    device: torch.device | str = "cpu",
    *,
    accept: Callable[[str], None] | None = None,
) -> LeRobotBuild:
    """Build the LeRobot policy in ``folder`` on ``device`` with its pre/post-processors.

    Raises :class:`CheckpointError` (naming the file or field) for anything wrong with the folder, before
    building the model where it can: a PI0 folder without weights fails in milliseconds, not after
    allocating 4B random parameters. ``accept(type)`` runs once the type is known and may refuse it.
    """
    root = Path(folder)
    raw = read_lerobot_config(root)
    if raw is None:
        raise CheckpointError(f"{root}: {CONFIG_FILE} is not a LeRobot policy config (no 'type' field)")
    ptype = str(raw["type"])
    known = lerobot_policy_types()
    if ptype not in known:
        raise CheckpointError(f"{CONFIG_FILE}: type: expected one of {known}, got {ptype!r}")
    if accept is not None:
        accept(ptype)
    spec, camera_keys = spec_from_config(raw)
    sidecar = read_sidecar(root)
    if sidecar.robot_spec is not None:  # the task's spec (its name, instruction, rate): what is served
        check_spec_fits(sidecar.robot_spec, spec)
        spec = sidecar.robot_spec
    weights = root / WEIGHTS_FILE
    if not weights.is_file():
        need = NEEDS_HUB.get(ptype)
        raise CheckpointError(
            f"{WEIGHTS_FILE} is missing from {root}: a {ptype} policy needs its trained weights"
            + (f" (built on {need}, which cannot be downloaded here)" if need else "")
        )
    from safetensors import SafetensorError, safe_open

    try:  # reads only the header: a truncated or foreign file is refused before any model is built
        with safe_open(str(weights), framework="pt") as f:
            if not list(f.keys()):
                raise CheckpointError(f"{WEIGHTS_FILE}: holds no tensors")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{WEIGHTS_FILE}: not a readable safetensors file ({e})") from None
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import get_policy_class, make_pre_post_processors

    dev = torch.device(device)
    try:
        cfg = PreTrainedConfig.from_pretrained(str(root))
    except Exception as e:
        raise CheckpointError(f"{CONFIG_FILE}: not a valid {ptype} config: {type(e).__name__}: {e}") from None
    cfg.device = dev.type
    if hasattr(cfg, "pretrained_backbone_weights"):
        cfg.pretrained_backbone_weights = None  # the trained weights below replace it; never download
    try:
        local = local_build(root, cfg)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    try:
        with local.context():
            policy = get_policy_class(ptype).from_pretrained(str(root), config=cfg, strict=True)
    except (RuntimeError, ValueError, OSError, SafetensorError) as e:  # shape/key mismatch, bad tensor data
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{WEIGHTS_FILE}: does not load into a {ptype} policy: {msg}") from None
    except Exception as e:  # e.g. a VLA that wants to fetch its language model
        need = NEEDS_HUB.get(ptype, "files")
        raise CheckpointError(
            f"could not build the {ptype} policy (needs {need}): {type(e).__name__}: {e}"
        ) from None
    _check_loaded_shapes(policy, weights, ptype)
    policy.to(dev).eval()
    has_proc = (root / PREPROCESSOR_FILE).is_file() and (root / POSTPROCESSOR_FILE).is_file()
    notes: list[str] = []
    pre_override = {"device_processor": {"device": str(dev)}, **local.preprocessor_overrides}
    post_override = {"device_processor": {"device": str(dev)}}
    try:
        if has_proc:
            pre, post = make_pre_post_processors(
                policy.config,
                pretrained_path=str(root),
                preprocessor_overrides=pre_override,
                postprocessor_overrides=post_override,
            )
        else:
            # Folders from before LeRobot 0.4 kept normalisation inside the model (their buffers would
            # have failed the strict load above); without saved processors there are no statistics.
            notes.append(f"no {PREPROCESSOR_FILE}/{POSTPROCESSOR_FILE}: serving without normalisation")
            log.warning(notes[-1], extra={"path": str(root)})
            pre, post = make_pre_post_processors(policy.config)
    except Exception as e:
        raise CheckpointError(
            f"{PREPROCESSOR_FILE}: could not build the {ptype} processors: {type(e).__name__}: {e}"
        ) from None
    return LeRobotBuild(policy, pre, post, spec, camera_keys, ptype, root, has_proc, local, notes, sidecar)


def _check_loaded_shapes(policy: Any, weights: Path, ptype: str) -> None:
    """π0's ``from_pretrained`` reports a weight file that does not fit the model by printing a warning and
    keeping random weights; refuse that here (only the safetensors header is read)."""
    from safetensors import safe_open

    model = {k: tuple(v.shape) for k, v in policy.state_dict().items()}
    matched = 0
    with safe_open(str(weights), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118  (a safetensors handle, not a dict)
            name = key if key in model else f"model.{key}"
            if name not in model:
                continue
            shape = tuple(f.get_slice(key).get_shape())
            if model[name] != shape:
                raise CheckpointError(
                    f"{WEIGHTS_FILE}: {key} has shape {list(shape)}, the {ptype} config builds "
                    f"{list(model[name])} (a folder built with other sizes?)"
                )
            matched += 1
    if not matched:
        raise CheckpointError(f"{WEIGHTS_FILE}: none of its tensors belongs to a {ptype} policy")


def load_lerobot(
    folder: str | os.PathLike[str], *, commit: str, ref: str, device: torch.device | str = "cpu"
) -> LeRobotModel:
    """Build the LeRobot policy in ``folder`` on ``device`` (:func:`build_lerobot`) and probe it once."""
    return lerobot_model(build_lerobot(folder, device), commit=commit, ref=ref)


def lerobot_model(b: LeRobotBuild, *, commit: str, ref: str) -> LeRobotModel:
    """A built LeRobot policy served through its own ``predict_action_chunk``, probed once on a blank
    observation (which sets ``chunk_len``)."""
    model = LeRobotModel(
        policy=b.policy,
        preprocessor=b.preprocessor,
        postprocessor=b.postprocessor,
        spec=b.spec,
        camera_keys=b.camera_keys,
        lerobot_type=b.lerobot_type,
        path=b.path,
        commit=commit,
        ref=ref,
        noise_shape=_noise_shape(b.policy, b.spec.action_dim),
        has_processors=b.has_processors,
        notes=b.notes,
    )
    try:
        model.probe()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(
            f"{b.lerobot_type}: a blank observation fails: {type(e).__name__}: {e}"
        ) from None
    return model


def features_for_spec(spec: RobotSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """LeRobot ``input_features`` / ``output_features`` for a robot spec (the inverse of :func:`spec_from_config`)."""
    from lerobot.configs.types import FeatureType, PolicyFeature

    inputs: dict[str, Any] = {}
    if spec.state_dim:
        inputs[STATE_KEY] = PolicyFeature(FeatureType.STATE, (spec.state_dim,))
    for c in spec.cameras:
        inputs[IMAGES_PREFIX + c.name] = PolicyFeature(FeatureType.VISUAL, (3, c.height, c.width))
    return inputs, {ACTION_KEY: PolicyFeature(FeatureType.ACTION, (spec.action_dim,))}


def save_random_policy(
    folder: str | os.PathLike[str],
    policy_type: str,
    spec: RobotSpec,
    *,
    seed: int = 0,
    stats: Mapping[str, Mapping[str, Any]] | None = None,
    **config: Any,
) -> Path:
    """Save a randomly initialised LeRobot policy (and its processors) for ``spec`` the way LeRobot does.

    For tests and benchmarks: no pretrained backbone is downloaded. ``stats`` are normalisation statistics
    per feature key (default: mean 0 / std 1, min -1 / max 1, q01 -1 / q99 1, i.e. identity normalisation).
    """
    from lerobot.policies.factory import get_policy_class, make_policy_config, make_pre_post_processors

    inputs, outputs = features_for_spec(spec)
    cfg = make_policy_config(
        policy_type, input_features=inputs, output_features=outputs, device="cpu", **config
    )
    if hasattr(cfg, "pretrained_backbone_weights"):
        cfg.pretrained_backbone_weights = None
    if stats is None:

        def unit(shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
            return {
                "mean": torch.zeros(shape),
                "std": torch.ones(shape),
                "min": -torch.ones(shape),
                "max": torch.ones(shape),
                "q01": -torch.ones(shape),  # π0.5 normalises with quantiles
                "q99": torch.ones(shape),
            }

        stats = {k: unit((3, 1, 1) if k.startswith(IMAGES_PREFIX) else f.shape) for k, f in inputs.items()}
        stats[ACTION_KEY] = unit((spec.action_dim,))
    torch.manual_seed(seed)
    policy = get_policy_class(policy_type)(cfg)
    out = Path(folder)
    policy.save_pretrained(out)
    pre, post = make_pre_post_processors(
        cfg, dataset_stats={k: {s: torch.as_tensor(v) for s, v in d.items()} for k, d in stats.items()}
    )
    pre.save_pretrained(out)
    post.save_pretrained(out)
    return out
