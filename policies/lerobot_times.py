"""Per-action flow times for LeRobot's SmolVLA and π0: what training-time real-time chunking needs.

LeRobot's action experts take one flow time per chunk: ``embed_suffix(x, timestep)`` turns ``timestep``
``[B]`` into a sinusoid ``[B, W]``, expands it over the H action tokens, concatenates it with
``action_in_proj(x)`` and mixes the two with the action-time MLP (``action_time_mlp_in``, SiLU,
``action_time_mlp_out``). Trained RTC (:mod:`policies.rtc`) gives the executed prefix clean, at its own
time, so it needs one time per action. Every piece of that embedding acts on each token on its own, so
the same sinusoid computed per action (``[B, H]`` -> ``[B, H, W]``) through the same MLP is the per-action
embedding, and with one time per row it is LeRobot's exactly.

:func:`per_action_suffix` puts that embedding in place of the action tokens of the model's
``embed_suffix`` while LeRobot's own ``denoise_step`` or ``forward`` runs (the installed package is left
as it is): the velocity and the loss of :class:`policies.lerobot_flow.LeRobotFlowPolicy` take per-action
times through it.

π0.5 cannot: its time does not enter the action tokens but conditions every norm of the expert (adaRMS,
``time_mlp_in`` / ``time_mlp_out`` -> ``adarms_cond`` ``[B, C]``), and LeRobot's ``PiGemmaRMSNorm`` as
installed unsqueezes that condition at dim 1 to broadcast it over the tokens: a per-token condition
``[B, H, C]`` comes out ``[B, 1, H, 3W]`` and broadcasts the hidden states to ``[B, B, H, W]`` instead of
modulating each token. :func:`check_per_action_times` refuses it, naming ``rtc_max_delay``.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from policies.flow_policy import FlowPolicyError

Tensor = torch.Tensor
PER_ACTION_TYPES = ("smolvla", "pi0")
"""LeRobot flow VLAs whose expert can take one flow time per action (the time is in the action tokens)."""
_LOCKS: weakref.WeakKeyDictionary[nn.Module, threading.Lock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def check_per_action_times(lerobot_type: str) -> None:
    """Refuse a LeRobot type whose expert cannot take per-action flow times (π0.5), naming
    ``rtc_max_delay`` and the type."""
    if lerobot_type not in PER_ACTION_TYPES:
        raise FlowPolicyError(
            f"rtc_max_delay: training-time RTC needs one flow time per action; {lerobot_type} conditions its "
            "action expert on the flow time through adaRMS, which LeRobot's PiGemmaRMSNorm takes as one "
            f"condition per chunk, so {lerobot_type} cannot (only {', '.join(PER_ACTION_TYPES)} and FlowVLA "
            "can); train without it and serve guided RTC"
        )


def action_time_tokens(model: nn.Module, lerobot_type: str, x: Tensor, s: Tensor) -> Tensor:
    """``[B, H, W]``: the expert's action tokens for ``x`` ``[B, H, D]`` at openpi times ``s`` ``[B, H]``
    (one per action), as ``embed_suffix`` computes them for one time per row (same sinusoid, same MLP)."""
    from lerobot.policies.common.vla_utils import create_sinusoidal_pos_embedding

    check_per_action_times(lerobot_type)
    b, h = s.shape
    cfg = model.config
    if lerobot_type == "smolvla":
        width = model.vlm_with_expert.expert_hidden_size
    else:
        width = model.action_in_proj.out_features
    time_emb = create_sinusoidal_pos_embedding(
        s.reshape(b * h), width, cfg.min_period, cfg.max_period, device=s.device
    ).reshape(b, h, width)
    action_emb = _checkpointed(model, model.action_in_proj, x)
    # SmolVLA casts the sinusoid to the action embedding's dtype, π0 to the time's (as embed_suffix does)
    time_emb = time_emb.type(action_emb.dtype if lerobot_type == "smolvla" else s.dtype)

    def mlp(z: Tensor) -> Tensor:
        return model.action_time_mlp_out(nn.functional.silu(model.action_time_mlp_in(z)))

    return _checkpointed(model, mlp, torch.cat([action_emb, time_emb], dim=2))


@contextmanager
def per_action_suffix(model: nn.Module, lerobot_type: str, s: Tensor) -> Iterator[None]:
    """While inside, ``model.embed_suffix`` (SmolVLA's ``VLAFlowMatching`` or π0's ``PI0Pytorch``) embeds
    its action tokens at the per-action openpi times ``s`` ``[B, H]`` (:func:`action_time_tokens`) whatever
    time it is called with; everything else it returns (π0's state token, the masks) is LeRobot's. Calls
    from other threads meanwhile get LeRobot's own method; per-action callers of one model take turns."""
    check_per_action_times(lerobot_type)
    original = type(model).embed_suffix
    owner = threading.get_ident()

    def embed_suffix(*args: Any) -> Any:
        out = original(model, *args)
        if threading.get_ident() != owner:
            return out
        embs, *rest = out
        tokens = action_time_tokens(model, lerobot_type, args[-2], s).to(embs.dtype)  # args[-2]: x_t
        return (torch.cat([embs[:, : embs.shape[1] - tokens.shape[1]], tokens], dim=1), *rest)

    with _lock(model):
        model.embed_suffix = embed_suffix
        try:
            yield
        finally:
            del model.embed_suffix


def _lock(model: nn.Module) -> threading.Lock:
    """One lock per model (kept off the module itself, which is deep-copied by trainers)."""
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(model, threading.Lock())


def _checkpointed(model: nn.Module, fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """``fn(x)`` through the model's gradient checkpointing where it has it (π0), as its own code runs."""
    apply = getattr(model, "_apply_checkpoint", None)
    return fn(x) if apply is None else apply(fn, x)


__all__ = ["PER_ACTION_TYPES", "action_time_tokens", "check_per_action_times", "per_action_suffix"]
