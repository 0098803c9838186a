"""LeRobot's flow VLAs at their published sizes, built locally with random weights (no download): what the
serving and GPU benchmarks run.

The published policies start from hub VLMs. Their architectures are configurations, so they are rebuilt
here with the same builders the tests use for tiny ones (:mod:`policies.lerobot_tiny`), with the published
numbers; only the tokenizer is ours (a word-level vocabulary made on the spot), with the embedding table
kept at the published vocabulary size so that the parameter count is the published one:

* **SmolVLA** (``lerobot/smolvla_base``): SmolVLM2-500M-Video-Instruct's config, text model SmolLM2-360M
  (width 960, 32 layers of which SmolVLA keeps the first ``num_vlm_layers`` = 16, MLP 2560, 15 heads of
  64 with 5 KV heads, vocabulary 49,280), SigLIP vision tower (width 768, 12 layers, MLP 3072, 12 heads,
  16 px patches on 512 px images), pixel shuffle 4 (64 image tokens); the action expert 0.75 x the text
  width, as deep; LeRobot's SmolVLA defaults for the rest (chunk 50, ``max_state_dim`` / ``max_action_dim``
  32, 48 language tokens, K = 10).
* **π0** (``lerobot/pi0``): PaliGemma-3B (Gemma-2B: width 2048, 18 layers, MLP 16,384, 8 heads of 256 with
  1 KV head, vocabulary 257,152; SigLIP-So400m: width 1152, 27 layers, MLP 4304, 16 heads, 14 px patches
  on 224 px images) with the Gemma-300M expert (width 1024, MLP 4096, same attention) — the sizes LeRobot
  hard-codes, passed through :func:`policies.lerobot_local.pi_sizes` unchanged.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from vla_rl_client.spec import RobotSpec

from policies.lerobot_adapter import save_random_policy
from policies.lerobot_local import LOCAL_VLM_DIR, PiSizes, TransformerSizes, VisionSizes
from policies.lerobot_tiny import SmolVLMSizes, save_tiny_policy, write_smolvlm_folder

SMOLVLM2_500M = SmolVLMSizes(
    text=TransformerSizes(width=960, depth=32, mlp_dim=2560, num_heads=15, num_kv_heads=5, head_dim=64),
    vision=VisionSizes(width=768, depth=12, mlp_dim=3072, num_heads=12, patch_size=16, image_size=512),
    scale_factor=4,
)
SMOLVLM2_VOCAB = 49_280
SMOLVLA_VLM_LAYERS = 16
PI0_PUBLISHED = PiSizes(
    vlm=TransformerSizes(width=2048, depth=18, mlp_dim=16_384, num_heads=8, num_kv_heads=1, head_dim=256),
    expert=TransformerSizes(width=1024, depth=18, mlp_dim=4096, num_heads=8, num_kv_heads=1, head_dim=256),
    vision=VisionSizes(width=1152, depth=27, mlp_dim=4304, num_heads=16, patch_size=14, image_size=224),
    vocab_size=257_152,
)
PUBLISHED_TYPES = ("smolvla", "pi0")


def save_published_smolvla(
    folder: str | os.PathLike[str],
    spec: RobotSpec,
    *,
    words: Iterable[str] = (),
    seed: int = 0,
    stats: Mapping[str, Mapping[str, Any]] | None = None,
    **config: Any,
) -> Path:
    """A SmolVLA policy folder of the published size (random weights) for ``spec``.

    The SmolVLM config is written as for a tiny policy, then its vocabulary widened to SmolVLM2's
    (the local tokenizer uses the first rows only). ``config``: SmolVLA config overrides."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    vlm = write_smolvlm_folder(out / LOCAL_VLM_DIR, SMOLVLM2_500M, [*words, spec.instruction])
    cfg_path = vlm / "config.json"
    raw = json.loads(cfg_path.read_text())
    raw["text_config"]["vocab_size"] = SMOLVLM2_VOCAB
    cfg_path.write_text(json.dumps(raw, indent=2))
    defaults = {"vlm_model_name": str(vlm), "load_vlm_weights": False, "num_vlm_layers": SMOLVLA_VLM_LAYERS}
    return save_random_policy(out, "smolvla", spec, seed=seed, stats=stats, **{**defaults, **config})


def save_published_policy(
    folder: str | os.PathLike[str], policy_type: str, spec: RobotSpec, *, seed: int = 0, **config: Any
) -> Path:
    """``smolvla`` or ``pi0`` at its published size, random weights, for ``spec``."""
    if policy_type == "smolvla":
        return save_published_smolvla(folder, spec, seed=seed, **config)
    if policy_type == "pi0":
        return save_tiny_policy(folder, "pi0", spec, sizes=PI0_PUBLISHED, seed=seed, **config)
    raise ValueError(f"policy_type: expected one of {list(PUBLISHED_TYPES)}, got {policy_type!r}")


def parameter_count(folder: str | os.PathLike[str]) -> int:
    """Parameters in a saved policy, read from its ``model.safetensors`` header (no model built)."""
    from policies.loading import safetensors_header

    total = 0
    for _dtype, shape in safetensors_header(Path(folder) / "model.safetensors").values():
        n = 1
        for d in shape:
            n *= d
        total += n
    return total
