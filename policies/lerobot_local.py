"""Build LeRobot VLA folders whose VLM lives in the folder, and π0 / π0.5 models of other sizes.

A published SmolVLA names its VLM on the hub (``vlm_model_name``) and a published π0 / π0.5 is PaliGemma-3B
(LeRobot 0.6.1 hard-codes its sizes: variants ``gemma_2b`` / ``gemma_300m``, a 257,152-token vocabulary,
a 27-layer SigLIP, and the ``google/paligemma-3b-pt-224`` tokenizer). Folders made here
(:mod:`policies.lerobot_tiny`) carry instead

* ``vlm/`` (:data:`LOCAL_VLM_DIR`): the tokenizer, and for SmolVLA the SmolVLM config, that the policy
  config and the tokenizer step point at;
* for π0 / π0.5, :data:`PI_SIZES_FILE`: the :class:`PiSizes` that :func:`pi_sizes` substitutes for
  PaliGemma's while the model is constructed (by our loaders or by LeRobot's own ``from_pretrained``).

:func:`local_build` reads both from a folder (so a copy pulled from the hub works wherever it lands);
:func:`copy_local_resources` carries them into a folder being saved. A published folder has neither and
builds unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

LOCAL_VLM_DIR = "vlm"
"""Sub-folder of a policy folder holding the VLM config / tokenizer its config points at."""
PI_SIZES_FILE = "vla_rl_pi_sizes.json"
"""π0 / π0.5 folders built here: the sizes :func:`pi_sizes` must substitute to rebuild the model."""
PI_TYPES = ("pi0", "pi05")
LEROBOT_PI_HEADS = 8  # LeRobot's π0 attention reshapes to 1 * 8 * head_dim: 8 query heads, always


# ---------------------------------------------------------------------------- sizes
def positive_ints(owner: str, **values: int) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{owner}.{name}: expected a positive int, got {v!r}")


@dataclass(frozen=True)
class TransformerSizes:
    """A Gemma / Llama decoder: token width, layers, MLP width, attention heads."""

    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        positive_ints("TransformerSizes", **asdict(self))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"TransformerSizes.num_kv_heads: expected a divisor of num_heads ({self.num_heads}), "
                f"got {self.num_kv_heads}"
            )


@dataclass(frozen=True)
class VisionSizes:
    """A SigLIP-style vision tower on square images of ``image_size`` cut into ``patch_size`` patches."""

    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    patch_size: int
    image_size: int

    def __post_init__(self) -> None:
        positive_ints("VisionSizes", **asdict(self))
        if self.image_size % self.patch_size:
            raise ValueError(
                f"VisionSizes.patch_size: expected a divisor of image_size ({self.image_size}), "
                f"got {self.patch_size}"
            )
        if self.width % self.num_heads:
            raise ValueError(
                f"VisionSizes.num_heads: expected a divisor of width ({self.width}), got {self.num_heads}"
            )


@dataclass(frozen=True)
class PiSizes:
    """π0 / π0.5: the PaliGemma VLM, the Gemma action expert, the SigLIP tower, the vocabulary."""

    vlm: TransformerSizes = TransformerSizes(64, 2, 128, LEROBOT_PI_HEADS, 1, 8)
    expert: TransformerSizes = TransformerSizes(32, 2, 64, LEROBOT_PI_HEADS, 1, 8)
    vision: VisionSizes = VisionSizes(32, 2, 64, 2, 16, 64)
    vocab_size: int = 0
    """Rows of the token embedding; 0 = the tokenizer's size (``lerobot_tiny.save_tiny_policy`` fills it in)."""

    def __post_init__(self) -> None:
        if not isinstance(self.vocab_size, int) or self.vocab_size < 0:
            raise ValueError(f"PiSizes.vocab_size: expected an int >= 0, got {self.vocab_size!r}")
        for name in ("vlm", "expert"):
            s = getattr(self, name)
            if s.num_heads != LEROBOT_PI_HEADS:
                raise ValueError(
                    f"PiSizes.{name}.num_heads: LeRobot's π0 attention needs {LEROBOT_PI_HEADS}, got {s.num_heads}"
                )
        for name in ("depth", "head_dim", "num_kv_heads"):  # the two share every attention layer
            if getattr(self.vlm, name) != getattr(self.expert, name):
                raise ValueError(
                    f"PiSizes.expert.{name}: expected the VLM's {getattr(self.vlm, name)} (the VLM and the "
                    f"expert attend jointly), got {getattr(self.expert, name)}"
                )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PiSizes:
        try:
            return cls(
                vlm=TransformerSizes(**d["vlm"]),
                expert=TransformerSizes(**d["expert"]),
                vision=VisionSizes(**d["vision"]),
                vocab_size=int(d["vocab_size"]),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"{PI_SIZES_FILE}: expected vlm, expert, vision and vocab_size ({e})") from None


TINY_PI = PiSizes()


# ---------------------------------------------------------------------------- π0 sizes
_PI_LOCK = threading.RLock()  # the substitution patches module globals: one construction at a time


def _pi_modules() -> list[Any]:
    import lerobot.policies.pi0.modeling_pi0 as pi0
    import lerobot.policies.pi05.modeling_pi05 as pi05

    return [pi0, pi05]


@contextmanager
def pi_sizes(sizes: PiSizes) -> Iterator[None]:
    """Build π0 / π0.5 policies of ``sizes`` while inside (LeRobot's own ``from_pretrained`` included).

    LeRobot builds PaliGemma from ``get_gemma_config(variant)`` plus fixed vision and vocabulary sizes;
    inside this context the VLM variant (``gemma_2b``) means ``sizes.vlm``, the expert variant
    (``gemma_300m``) ``sizes.expert``, and the SigLIP tower and vocabulary are resized before the
    modules are built. Nothing else of LeRobot's code changes.
    """
    from lerobot.policies.pi0.modeling_pi0 import GemmaConfig

    if sizes.vocab_size <= 0:
        raise ValueError(f"PiSizes.vocab_size: expected the tokenizer's size (> 0), got {sizes.vocab_size}")

    def gemma(s: TransformerSizes) -> Any:
        return GemmaConfig(s.width, s.depth, s.mlp_dim, s.num_heads, s.num_kv_heads, s.head_dim)

    def variant(name: str) -> Any:
        return gemma(sizes.vlm if name == "gemma_2b" else sizes.expert)

    with _PI_LOCK, ExitStack() as stack:
        for module in _pi_modules():
            vlm_cls, expert_cls = (
                module.PaliGemmaForConditionalGenerationWithPiGemma,
                module.PiGemmaForCausalLM,
            )

            def vlm(config: Any, _cls: Any = vlm_cls) -> Any:
                vc, s = config.vision_config, sizes.vision
                vc.hidden_size, vc.intermediate_size, vc.num_hidden_layers = s.width, s.mlp_dim, s.depth
                vc.num_attention_heads, vc.patch_size = s.num_heads, s.patch_size
                vc.projection_dim = config.text_config.hidden_size  # the projector feeds the text tokens
                config.text_config.vocab_size = config._vocab_size = sizes.vocab_size
                config.image_token_index = sizes.vocab_size - 1  # never looked up: prefixes are embedded
                return _cls(config)

            def expert(config: Any, _cls: Any = expert_cls) -> Any:
                config.vocab_size = sizes.vocab_size
                return _cls(config)

            stack.enter_context(mock.patch.object(module, "get_gemma_config", variant))
            stack.enter_context(
                mock.patch.object(module, "PaliGemmaForConditionalGenerationWithPiGemma", vlm)
            )
            stack.enter_context(mock.patch.object(module, "PiGemmaForCausalLM", expert))
        yield


def read_pi_sizes(folder: str | os.PathLike[str]) -> PiSizes | None:
    path = Path(folder) / PI_SIZES_FILE
    if not path.is_file():
        return None
    try:
        return PiSizes.from_dict(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise ValueError(f"{PI_SIZES_FILE}: not valid JSON ({e})") from None


# ---------------------------------------------------------------------------- local builds
@dataclass
class LocalBuild:
    """What building a policy from a folder made here needs: the sizes context and processor overrides."""

    sizes: PiSizes | None = None
    vlm_dir: Path | None = None
    preprocessor_overrides: dict[str, Any] = field(default_factory=dict)

    @contextmanager
    def context(self) -> Iterator[None]:
        if self.sizes is None:
            yield
        else:
            with pi_sizes(self.sizes):
                yield


def local_build(folder: str | os.PathLike[str], config: Any) -> LocalBuild:
    """Point ``config`` (a LeRobot policy config read from ``folder``) at the folder's own ``vlm/`` when it
    has one (a copy pulled from the hub lives elsewhere than where it was saved), and say which sizes and
    tokenizer its build needs. Folders of published policies have neither and pass unchanged."""
    root = Path(folder)
    vlm = root / LOCAL_VLM_DIR
    build = LocalBuild(sizes=read_pi_sizes(root) if config.type in PI_TYPES else None)
    if (vlm / "tokenizer.json").is_file():
        build.vlm_dir = vlm
        build.preprocessor_overrides["tokenizer_processor"] = {"tokenizer_name": str(vlm)}
        if hasattr(config, "vlm_model_name"):
            config.vlm_model_name = str(vlm)
    return build


def copy_local_resources(src: LocalBuild, dest: str | os.PathLike[str], policy: Any, pre: Any) -> None:
    """Make a folder being saved self-contained: copy ``vlm/`` and the π0 sizes, and point the policy's
    config and the tokenizer step at the copy (call before ``save_pretrained``)."""
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    if src.sizes is not None:
        (out / PI_SIZES_FILE).write_text(json.dumps(src.sizes.to_dict(), indent=2))
    if src.vlm_dir is None:
        return
    vlm = out / LOCAL_VLM_DIR
    if vlm.resolve() != src.vlm_dir.resolve():
        shutil.copytree(src.vlm_dir, vlm, dirs_exist_ok=True)
    if hasattr(policy.config, "vlm_model_name"):
        policy.config.vlm_model_name = str(vlm)
    for step in getattr(pre, "steps", ()):
        if hasattr(step, "tokenizer_name") and step.tokenizer_name is not None:
            step.tokenizer_name = str(vlm)
