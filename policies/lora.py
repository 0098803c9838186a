"""LoRA adapters on a flow policy's linear layers (the ``trainable = "lora"`` knob), through ``peft``.

:func:`add_lora` puts a low-rank adapter ``W + (alpha / rank) B A`` (A ``[rank, in]`` random, B
``[out, rank]`` zero: the policy starts exactly as it was) on every ``nn.Linear`` whose module name the
settings' ``targets`` pattern matches in full (None: the architecture's default, given by the policy), and
freezes everything else: only the adapters train, plus the modules the policy names as its own new heads.
The adapted model is the same module tree with ``peft``'s ``lora.Linear`` in place of each targeted layer
(``peft.inject_adapter_in_model``: no wrapper class, so code that reaches into the model keeps working).

:func:`merged_state_dict` is what a LoRA-trained policy saves: the plain model's state dict (no adapter
keys, ``<layer>.weight`` instead of ``<layer>.base_layer.weight``) with each adapter's delta added to its
base weight, so the saved checkpoint or LeRobot folder is an ordinary one that loads with nothing new. The
model itself is left as it is (training goes on after a checkpoint).

:class:`LoraSettings` are the trainer config's ``lora_*`` knobs; their errors name those fields. This module
imports nothing heavy at import time (the trainer configs validate the settings without torch).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

ADAPTER = "default"
"""The one adapter's name in peft's per-adapter dicts."""
MAX_RANK = 4096


@dataclass(frozen=True)
class LoraSettings:
    """LoRA's rank, scale, dropout and where the adapters go (the trainer config's ``lora_rank``,
    ``lora_alpha``, ``lora_dropout``, ``lora_targets``).

    ``targets``: a regular expression matched against the full module names (``re.fullmatch``, e.g.
    ``model\\.vlm_with_expert\\.lm_expert\\..*_proj``); the adapted layers are the ``nn.Linear`` modules it
    matches. None: the architecture's default (the policy's ``LORA_TARGETS``)."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: str | None = None

    def __post_init__(self) -> None:
        r = self.rank
        if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= MAX_RANK:
            raise ValueError(f"lora_rank: expected an integer in 1..{MAX_RANK}, got {r!r}")
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, int | float) or not 0 < a < float("inf"):
            raise ValueError(f"lora_alpha: expected a finite number > 0, got {a!r}")
        p = self.dropout
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0 <= p < 1:
            raise ValueError(f"lora_dropout: expected a probability in [0, 1), got {p!r}")
        if self.targets is not None:
            if not isinstance(self.targets, str) or not self.targets.strip():
                raise ValueError(
                    f"lora_targets: expected a regular expression over module names, or None for the "
                    f"architecture's default, got {self.targets!r}"
                )
            try:
                re.compile(self.targets)
            except re.error as e:
                raise ValueError(
                    f"lora_targets: not a valid regular expression ({e}): {self.targets!r}"
                ) from None

    @property
    def scaling(self) -> float:
        """``alpha / rank``: what multiplies ``B A``."""
        return float(self.alpha) / self.rank

    def record(self, targets: str, layers: int) -> dict[str, Any]:
        """What a checkpoint's lineage says of the adapters it was trained with (merged when saved)."""
        return {
            "rank": self.rank,
            "alpha": float(self.alpha),
            "dropout": float(self.dropout),
            "targets": targets,
            "layers": layers,
            "merged": True,
        }


@dataclass(frozen=True)
class LoraState:
    """The adapters a model carries: the settings, the pattern actually used and the adapted layers."""

    settings: LoraSettings
    targets: str
    layers: tuple[str, ...]

    def record(self) -> dict[str, Any]:
        return self.settings.record(self.targets, len(self.layers))


def add_lora(
    model: nn.Module,
    settings: LoraSettings,
    *,
    default_targets: str,
    heads: tuple[str, ...] = (),
    what: str = "policy",
) -> tuple[LoraState, list[nn.Parameter]]:
    """Adapt ``model`` in place (see the module docstring) and return the adapters' state and the
    parameters that train: the adapters' and those of the modules whose names start with one of
    ``heads`` (new heads the algorithm adds, trained whole). A model that already carries adapters keeps
    them when ``settings`` are the same ones (refused otherwise). A pattern that matches no linear layer
    raises a ValueError naming ``lora_targets`` and ``what``."""
    import torch
    from peft import LoraConfig, inject_adapter_in_model

    current = lora_state(model)
    if current is not None:
        if current.settings != settings:
            raise ValueError(
                f"lora: this {what} already carries LoRA adapters of {current.settings}, not {settings}"
            )
    else:
        pattern = settings.targets or default_targets
        layers = tuple(
            name
            for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and re.fullmatch(pattern, name)
        )
        if not layers:
            raise ValueError(
                f"lora_targets: {pattern!r} matches no linear layer of this {what} "
                f"(e.g. {_some_linear(model)})"
            )
        config = LoraConfig(
            r=settings.rank,
            lora_alpha=settings.alpha,
            lora_dropout=settings.dropout,
            target_modules="|".join(re.escape(n) for n in layers),
            bias="none",
        )
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
        current = LoraState(settings, pattern, layers)
        model._vla_rl_lora = current  # type: ignore[assignment]  (read back by lora_state)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name or name.startswith(heads))
    return current, [p for p in model.parameters() if p.requires_grad]


def lora_state(model: nn.Module) -> LoraState | None:
    """The adapters :func:`add_lora` put on ``model`` (None: none)."""
    return getattr(model, "_vla_rl_lora", None)


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every adapter merged into its base weight (``W + (alpha / rank) B A``,
    in the base weight's dtype) and the keys of the plain model; ``model`` is unchanged. A model without
    adapters: its state dict as it is."""
    state = model.state_dict()
    if lora_state(model) is None:
        return state  # (peft is not even imported)
    import torch
    from peft.tuners.lora import LoraLayer

    adapted = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        deltas = {f"{name}.base_layer.weight": m.get_delta_weight(ADAPTER) for name, m in adapted.items()}
        for key, value in state.items():
            layer = _adapted_layer(key, adapted)
            if layer is None:
                out[key] = value
                continue
            rest = key[len(layer) + 1 :]
            if not rest.startswith("base_layer."):
                continue  # the adapter's own weights: merged below
            if key in deltas:
                value = (value.float() + deltas[key].float()).to(value.dtype)
            out[f"{layer}.{rest.removeprefix('base_layer.')}"] = value
    return out


def _adapted_layer(key: str, adapted: dict[str, Any]) -> str | None:
    """The adapted layer a state-dict key belongs to (None: no adapted layer's)."""
    parts = key.split(".")
    for k in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:k])
        if prefix in adapted:
            return prefix
    return None


def _some_linear(model: nn.Module, n: int = 3) -> str:
    import torch

    names = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    return ", ".join(names[:n]) or "it has none"
