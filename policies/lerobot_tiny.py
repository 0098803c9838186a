"""Small LeRobot flow VLAs (SmolVLA, π0, π0.5) of the published architectures, built here: no download.

The published policies start from a hub VLM (SmolVLM2-500M for SmolVLA, PaliGemma-3B for π0 / π0.5) and
its tokenizer. Tests, CPU benchmarks and a CPU ``vla-rl up`` need the same code paths at a size a CPU
trains in minutes, without the internet. :func:`save_tiny_policy` writes a LeRobot policy folder
(``config.json`` with its ``type``, ``model.safetensors``, the pre/post-processors) whose VLM is small:

* a tokenizer made on the spot (:func:`build_tokenizer`: a word-level vocabulary of task words, the
  numbers 0-255 π0.5 writes its discretised state with, punctuation, and SmolVLM's image tokens);
* SmolVLA: a SmolVLM config (:class:`SmolVLMSizes`) saved with that tokenizer in ``<folder>/vlm/``,
  which ``vlm_model_name`` points at (SmolVLA builds its VLM from that folder);
* π0 / π0.5: LeRobot 0.6.1 hard-codes PaliGemma's sizes (variants ``gemma_2b`` / ``gemma_300m``, a
  257,152-token vocabulary, a 27-layer SigLIP) and its tokenizer's hub name, so :func:`pi_sizes`
  substitutes :class:`PiSizes` while a policy is constructed, and the processors are created with the
  local tokenizer (:mod:`policies.lerobot_local`). The sizes are saved beside the weights
  (``vla_rl_pi_sizes.json``); every load of the folder (ours, or LeRobot's own ``from_pretrained``) must
  run inside ``pi_sizes`` with them (``lerobot_local.local_build`` does this for our loaders).

Default sizes (:data:`TINY_SMOLVLM`, :data:`TINY_PI`), on 64 px images: SmolVLA ~0.4M parameters
(VLM text width 64, 4 layers, 4 heads of 16 with 2 KV heads; vision width 32, 2 layers, 16 px patches,
4 image tokens after pixel shuffle; expert width 48), π0 ~0.2M (VLM width 64, expert width 32, 2
layers each, 8 heads of 8 with 1 KV head as LeRobot's attention requires; vision width 32, 2 layers,
16 image tokens). Larger "small" configurations are the same classes with other numbers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

from vla_rl_client.spec import RobotSpec

from policies.lerobot_adapter import save_random_policy
from policies.lerobot_local import (
    LOCAL_VLM_DIR,
    PI_SIZES_FILE,
    PI_TYPES,
    TINY_PI,
    PiSizes,
    TransformerSizes,
    VisionSizes,
    pi_sizes,
    positive_ints,
)
from policies.lerobot_sidecar import Sidecar, write_sidecar

SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>", "<eos>")
SMOLVLM_IMAGE_TOKENS = {
    "fake_image_token": "<fake_token_around_image>",
    "image_token": "<image>",
    "global_image_token": "<global-img>",
    "end_of_utterance_token": "<end_of_utterance>",
}
BASE_WORDS = (
    "task state action advantage positive negative pick up lift the a an to on in into of and with "
    "push pull move place put stack open close grasp reach press turn insert slide cube block ball "
    "peg hole drawer door button target goal red green blue yellow white black left right top front"
)
"""Words every tiny tokenizer knows (space-separated), besides the numbers, punctuation and given words."""
PUNCTUATION = tuple(":,;.!?-'\"()")


# ---------------------------------------------------------------------------- sizes
TINY_SMOLVLM_TEXT = TransformerSizes(64, 4, 128, 4, 2, 16)
TINY_VISION = TINY_PI.vision


@dataclass(frozen=True)
class SmolVLMSizes:
    """SmolVLA's VLM. The action expert is ``expert_width_multiplier`` x the text width, as deep."""

    text: TransformerSizes = TINY_SMOLVLM_TEXT
    vision: VisionSizes = TINY_VISION
    scale_factor: int = 2
    """SmolVLM's pixel shuffle: (image_size / patch_size) must be divisible by it."""

    def __post_init__(self) -> None:
        positive_ints("SmolVLMSizes", scale_factor=self.scale_factor)
        grid = self.vision.image_size // self.vision.patch_size
        if grid % self.scale_factor:
            raise ValueError(
                f"SmolVLMSizes.scale_factor: expected a divisor of the {grid}x{grid} patch grid, "
                f"got {self.scale_factor}"
            )


TINY_SMOLVLM = SmolVLMSizes()


# ---------------------------------------------------------------------------- tokenizer
def build_tokenizer(folder: str | os.PathLike[str], words: Iterable[str] = ()) -> Path:
    """Save a word-level Hugging Face tokenizer to ``folder`` and return it.

    Vocabulary: the special tokens, the numbers 0-255 (π0.5's discretised state), punctuation,
    :data:`BASE_WORDS` and ``words`` (lower-cased); anything else is ``<unk>``. SmolVLM's image tokens
    are registered as named special tokens (``tokenizer.fake_image_token_id``, ... as SmolVLA reads them).
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    split = pre_tokenizers.Whitespace()
    vocab: dict[str, int] = {}
    for tok in (*SPECIAL_TOKENS, *(str(i) for i in range(256)), *PUNCTUATION, *BASE_WORDS.split()):
        vocab.setdefault(tok, len(vocab))
    for text in words:
        for part, _ in split.pre_tokenize_str(str(text).lower()):
            vocab.setdefault(part, len(vocab))
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = split
    pad, unk, bos, eos = SPECIAL_TOKENS
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=pad,
        unk_token=unk,
        bos_token=bos,
        eos_token=eos,
        extra_special_tokens=dict(SMOLVLM_IMAGE_TOKENS),
    )
    out = Path(folder)
    tokenizer.save_pretrained(out)
    return out


def write_smolvlm_folder(
    folder: str | os.PathLike[str], sizes: SmolVLMSizes = TINY_SMOLVLM, words: Iterable[str] = ()
) -> Path:
    """A folder SmolVLA's ``vlm_model_name`` can point at: SmolVLM config, tokenizer and processor.

    The processor is Idefics3's (SmolVLM's predecessor, same tokenizer interface): SmolVLA only reads
    the tokenizer through it, and SmolVLM's own processor needs ``num2words``, which LeRobot's
    ``smolvla`` extra brings and this environment does not have.
    """
    from transformers import AutoTokenizer, Idefics3ImageProcessor, Idefics3Processor, SmolVLMConfig

    out = build_tokenizer(folder, words)
    tokenizer = AutoTokenizer.from_pretrained(out)
    t, v = sizes.text, sizes.vision
    config = SmolVLMConfig(
        vision_config={
            "hidden_size": v.width,
            "intermediate_size": v.mlp_dim,
            "num_hidden_layers": v.depth,
            "num_attention_heads": v.num_heads,
            "image_size": v.image_size,
            "patch_size": v.patch_size,
        },
        text_config={
            "model_type": "llama",
            "hidden_size": t.width,
            "intermediate_size": t.mlp_dim,
            "num_hidden_layers": t.depth,
            "num_attention_heads": t.num_heads,
            "num_key_value_heads": t.num_kv_heads,
            "head_dim": t.head_dim,
            "vocab_size": len(tokenizer),
            "max_position_embeddings": 1024,
        },
        scale_factor=sizes.scale_factor,
        image_token_id=tokenizer.convert_tokens_to_ids(SMOLVLM_IMAGE_TOKENS["image_token"]),
        pad_token_id=tokenizer.pad_token_id,
    )
    config.save_pretrained(out)
    image_tokens = (v.image_size // v.patch_size // sizes.scale_factor) ** 2
    Idefics3Processor(
        image_processor=Idefics3ImageProcessor(), tokenizer=tokenizer, image_seq_len=image_tokens
    ).save_pretrained(out)
    return out


@contextmanager
def _paligemma_tokenizer(folder: Path) -> Iterator[None]:
    """Fresh π0 / π0.5 processors tokenise with ``folder`` instead of PaliGemma's hub tokenizer."""
    import lerobot.policies.pi0.processor_pi0 as proc0
    import lerobot.policies.pi05.processor_pi05 as proc05
    from lerobot.processor import TokenizerProcessorStep

    def step(**kwargs: Any) -> TokenizerProcessorStep:
        return TokenizerProcessorStep(**{**kwargs, "tokenizer_name": str(folder)})

    with (
        mock.patch.object(proc0, "TokenizerProcessorStep", step),
        mock.patch.object(proc05, "TokenizerProcessorStep", step),
    ):
        yield


# ---------------------------------------------------------------------------- folders
def save_tiny_policy(
    folder: str | os.PathLike[str],
    policy_type: str,
    spec: RobotSpec,
    *,
    sizes: SmolVLMSizes | PiSizes | None = None,
    words: Iterable[str] = (),
    seed: int = 0,
    stats: Mapping[str, Mapping[str, Any]] | None = None,
    **config: Any,
) -> Path:
    """Save a randomly initialised small ``smolvla`` / ``pi0`` / ``pi05`` policy for ``spec`` to ``folder``.

    ``sizes``: :class:`SmolVLMSizes` for smolvla, :class:`PiSizes` for pi0 / pi05 (default: the tiny
    ones). ``words``: instruction words for the tokenizer (the spec's instruction is added). ``config``:
    LeRobot config overrides (``chunk_size``, ``n_action_steps``, ``max_action_dim``, ...); the image
    resolution follows ``sizes.vision.image_size``. ``stats`` as :func:`~policies.lerobot_adapter.save_random_policy`.
    ``spec`` (its task name and instruction) is recorded beside the folder (:mod:`policies.lerobot_sidecar`).
    """
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    vocab_words = [*words, spec.instruction]
    if policy_type == "smolvla":
        s = sizes if sizes is not None else TINY_SMOLVLM
        if not isinstance(s, SmolVLMSizes):
            raise ValueError(f"sizes: expected SmolVLMSizes for smolvla, got {type(s).__name__}")
        vlm = write_smolvlm_folder(out / LOCAL_VLM_DIR, s, vocab_words)
        defaults = {
            "vlm_model_name": str(vlm),
            "load_vlm_weights": False,
            "num_vlm_layers": s.text.depth,
            "resize_imgs_with_padding": (s.vision.image_size, s.vision.image_size),
        }
        save_random_policy(out, policy_type, spec, seed=seed, stats=stats, **{**defaults, **config})
        return _with_spec(out, spec)
    if policy_type not in PI_TYPES:
        raise ValueError(f"policy_type: expected 'smolvla', 'pi0' or 'pi05', got {policy_type!r}")
    s = sizes if sizes is not None else TINY_PI
    if not isinstance(s, PiSizes):
        raise ValueError(f"sizes: expected PiSizes for {policy_type}, got {type(s).__name__}")
    tok = build_tokenizer(out / LOCAL_VLM_DIR, vocab_words)
    if s.vocab_size == 0:
        from transformers import AutoTokenizer

        s = PiSizes(s.vlm, s.expert, s.vision, len(AutoTokenizer.from_pretrained(tok)))
    (out / PI_SIZES_FILE).write_text(json.dumps(s.to_dict(), indent=2))
    defaults = {"image_resolution": (s.vision.image_size, s.vision.image_size)}
    with pi_sizes(s), _paligemma_tokenizer(tok):
        save_random_policy(out, policy_type, spec, seed=seed, stats=stats, **{**defaults, **config})
    return _with_spec(out, spec)


def _with_spec(folder: Path, spec: RobotSpec) -> Path:
    """Record the task's robot spec (its name and instruction) beside the folder, so a round on it knows
    its task (:mod:`policies.lerobot_sidecar`)."""
    write_sidecar(folder, Sidecar(robot_spec=spec), "")
    return folder
