"""``vla-rl up --policy smolvla|pi0|pi05``: the loop's base as a LeRobot flow VLA acting from the camera.

The base starts as a small configuration of the published architecture built on this machine
(:func:`policies.lerobot_tiny.save_tiny_policy`: no download), at :func:`up_sizes` (with the vision tower at
the loop's camera resolution), and is then trained by SFT on the demos like FlowVLA's base. Its VLM is
random, so that SFT trains the whole policy (``trainable="full"``); the rounds on it train what their
algorithm trains by default (the action expert on a CPU).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from vla_rl.up.config import UpConfig

if TYPE_CHECKING:
    from policies.lerobot_local import PiSizes
    from policies.lerobot_tiny import SmolVLMSizes

UP_CHUNK = {"chunk_size": 10, "n_action_steps": 5}
"""Action chunk predicted / executed per call: FlowVLA's defaults (``SFTConfig.chunk_len`` / ``n_exec``)."""
INIT_DIR = "init"
"""WORKDIR/init: the randomly initialised folder the base's SFT starts from."""


def up_sizes(cfg: UpConfig) -> SmolVLMSizes | PiSizes:
    """The sizes of ``cfg.policy``'s small VLM (:func:`tiny_sizes` at ``cfg.image_size``)."""
    return tiny_sizes(cfg.policy, cfg.image_size)


def tiny_sizes(policy: str, image_size: int) -> SmolVLMSizes | PiSizes:
    """The sizes of ``policy``'s small VLM: the test configurations (``TINY_SMOLVLM`` / ``TINY_PI``),
    which SFT trains in minutes on a 2-core CPU (docs/policy.md states them), with the vision tower at
    ``image_size``. Imported here, not at module level: ``policies.lerobot_tiny`` loads torch, and the
    CLI imports this package for its flags."""
    from policies.lerobot_local import TINY_PI
    from policies.lerobot_tiny import TINY_SMOLVLM

    sizes = TINY_SMOLVLM if policy == "smolvla" else TINY_PI
    vision = dataclasses.replace(sizes.vision, image_size=image_size)
    return dataclasses.replace(sizes, vision=vision)


def init_folder(cfg: UpConfig, work: Path) -> Path:
    """WORKDIR/init: a random ``cfg.policy`` folder for ``cfg.task``'s robot seen from its camera at
    ``cfg.image_size`` (made once; an earlier run's is reused)."""
    return save_init_folder(work / INIT_DIR, cfg.policy, cfg.task, cfg.image_size, cfg.seed)


def save_init_folder(folder: Path, policy: str, task: str, image_size: int, seed: int) -> Path:
    """``folder``: a random small ``policy`` folder (:func:`tiny_sizes`, chunks of :data:`UP_CHUNK`) for
    ``task``'s robot seen from its camera at ``image_size``, the start of a LeRobot base's SFT; made once,
    a folder that already holds one is reused. The one way ``vla-rl up`` and ``bench/rl.py`` build it."""
    import sim
    from policies.lerobot_tiny import save_tiny_policy

    if (folder / "config.json").is_file():
        return folder
    env = sim.make(task, obs="rgb", image_size=image_size, num_envs=1, seed=seed)
    try:
        spec = env.spec
    finally:
        env.close()
    return save_tiny_policy(folder, policy, spec, sizes=tiny_sizes(policy, image_size), seed=seed, **UP_CHUNK)


def parameter_count(folder: Path) -> int:
    """Parameters in ``folder``'s ``model.safetensors`` (read from its header, no weights loaded)."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        total = 0
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            n = 1
            for d in f.get_slice(key).get_shape():
                n *= d
            total += n
    return total


def policy_line(cfg: UpConfig, work: Path) -> str:
    """Which policy the loop runs and its sizes, for the banner and the report (e.g. ``smolvla (0.41M
    parameters: VLM text width 64 x 4 layers, vision width 32 x 2 layers) from the 64 px camera``)."""
    if not cfg.lerobot:
        return "flowvla (ours) from the task's state"
    from policies.lerobot_tiny import SmolVLMSizes

    sizes = up_sizes(cfg)
    text = sizes.text if isinstance(sizes, SmolVLMSizes) else sizes.vlm
    millions = parameter_count(work / INIT_DIR) / 1e6
    return (
        f"{cfg.policy} ({millions:.2f}M parameters: VLM text width {text.width} x {text.depth} layers, vision "
        f"width {sizes.vision.width} x {sizes.vision.depth} layers) from the {cfg.image_size} px camera"
    )
