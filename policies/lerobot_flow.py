"""LeRobot's flow-matching VLAs (SmolVLA, π0, π0.5) behind the flow-policy contract (:mod:`policies.flow_policy`).

A LeRobot policy folder is built as LeRobot builds it (:func:`policies.lerobot_adapter.build_lerobot`: its own
``from_pretrained`` and its own pre/post-processors); :class:`LeRobotFlowPolicy` then drives LeRobot's public
pieces instead of its monolithic calls:

=======================  =====================================================================================
contract                 LeRobot pieces (``policy.model`` is ``VLAFlowMatching`` / ``PI0Pytorch`` / ``PI05Pytorch``)
=======================  =====================================================================================
``encode_prefix``        pre-processor, image / state preparation, ``embed_prefix``, the VLM forward that fills
                         the KV cache (what ``sample_actions`` does before its loop)
``velocity``             ``-denoise_step(x, 1 - t)``: openpi time converted by :mod:`policies.flow_vla.conventions`;
                         one time per action (``t`` ``[B, H]``) through :mod:`policies.lerobot_times`
``sample``               our Euler loop on ``velocity`` (equal to ``sample_actions(noise=...)``)
``loss``                 ``model.forward(..., noise, 1 - t)`` (elementwise), averaged over valid steps and robot dims
                         (trained RTC: the executed prefix given clean, :meth:`LeRobotFlowPolicy.loss`)
``features``             the VLM's last hidden state averaged over the valid prefix tokens
``(un)normalize``        the folder's normaliser / un-normaliser processor steps
``save``                 ``save_pretrained`` of the policy and both processors (+ ``vlm/`` for folders made here)
                         and our metadata beside them (:mod:`policies.lerobot_sidecar`)
=======================  =====================================================================================

**Advantage conditioning (RECAP)** is text, as the π0.6 paper and LeRobot's RECAP put it: an observation's
``"advantage"`` (int ``[B]``: 0 unconditioned, 1 negative, 2 positive; the contract's, FlowVLA takes the same)
appends ``"Advantage: negative"`` / ``"Advantage: positive"`` to its instruction. A policy made
advantage-conditioned (:meth:`LeRobotFlowPolicy.condition_on_advantage`, recorded in the sidecar) acts on
positive when an observation names none, with classifier-free guidance between the unconditioned and the
positive prompt when its guidance scale is not 1.

**Training-time real-time chunking** (``rtc_max_delay``, SmolVLA and π0; :mod:`policies.lerobot_times`
says why not π0.5): each training chunk's first d ~ U{0..rtc_max_delay} actions (or d = 0 with probability
``rtc_zero_delay_prob``, else U{1..rtc_max_delay}) are given clean at their own flow time and the loss is on
the rest, as FlowVLA trains; both values are recorded in the sidecar, and the
server serves such a folder in trained mode (:func:`policies.rtc.sample_rtc`).

Differences from LeRobot's own ``forward(reduction="none")``, said plainly: π0 / π0.5 ignore
``action_is_pad`` there (every step counts); here padded steps never count, as in SmolVLA and FlowVLA.
Refused at load, naming the field: SmolVLA's ``adapt_to_pi_aloha`` and ``use_cache=False``, π0's
``use_relative_actions`` (their conversions live outside the pieces used here).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from policies.flow_policy import (
    FlowPolicyError,
    Prefix,
    TrainableParts,
    check_trainable,
    euler_sample_prefix,
    masked_mean_per_sample,
)
from policies.flow_vla import FlowSample, from_openpi_time, to_openpi_time, velocity_from_openpi
from policies.flow_vla.configuration_flow_vla import zero_delay_prob_problem
from policies.flow_vla.conventions import VelocityFn
from policies.flow_vla.sampling import check_num_steps, initial_noise, random_prefix
from policies.lerobot_adapter import LeRobotBuild, build_lerobot, to_lerobot_batch
from policies.lerobot_local import copy_local_resources
from policies.lerobot_sidecar import (
    LINEAGE_FILE,
    AdvantageConditioning,
    write_sidecar,
)
from policies.lerobot_times import check_per_action_times, per_action_suffix
from policies.lora import LoraSettings, add_lora, lora_state, merged_state_dict
from vla_rl.hub.checkpoint import Lineage

Tensor = torch.Tensor
FLOW_TYPES = ("smolvla", "pi0", "pi05")
"""LeRobot policy types that are flow-matching VLAs (an action expert on a VLM prefix)."""
_LAYER_PROJECTIONS = r"\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
_ACTION_PROJECTIONS = r"model\.(state_proj|action_in_proj|action_out_proj|(action_)?time_mlp_(in|out))"
LORA_TARGETS = {
    "smolvla": rf"model\.vlm_with_expert\.(lm_expert|vlm\.model\.text_model){_LAYER_PROJECTIONS}|{_ACTION_PROJECTIONS}",
    "pi0": rf"model\.paligemma_with_expert\.(gemma_expert\.model|paligemma\.model\.language_model)"
    rf"{_LAYER_PROJECTIONS}|{_ACTION_PROJECTIONS}",
}
"""Where LoRA adapters go by default (``lora_targets`` unset): the attention (q, k, v, o) and MLP (gate, up,
down) projections of the action expert's and of the VLM's language layers, and the state / action / time
projections around the expert (LeRobot's own PEFT default adapts the expert's q / v and those projections);
the vision encoder is left as it is."""
LORA_TARGETS["pi05"] = LORA_TARGETS["pi0"]
__all__ = [
    "FLOW_TYPES",
    "LINEAGE_FILE",
    "GuidedPrefix",
    "LeRobotFlowPolicy",
    "LeRobotPrefix",
    "require_flow_type",
]


def require_flow_type(lerobot_type: str, algorithm: str) -> None:
    """Refuse a LeRobot policy that is not a flow VLA, naming the type and what to use instead."""
    if lerobot_type not in FLOW_TYPES:
        instead = (
            "fine-tune it with LeRobot's own trainer, or train our policy from scratch (init scratch)"
            if algorithm == "sft"  # continuing a base: our SFT continues flow VLAs only
            else "use sft"
        )
        raise FlowPolicyError(
            f"{algorithm} needs a flow-matching policy; {lerobot_type} is not one — {instead}"
        )


@dataclass
class LeRobotPrefix:
    """One batch of observations encoded by the VLM: what every denoising step reuses.

    ``cache``: the transformers ``DynamicCache`` of the prefix keys / values (per VLM layer);
    ``pad_masks`` ``[B, P]`` bool; ``hidden`` ``[B, P, W]`` the VLM's last hidden states; ``state``
    ``[B, max_state_dim]`` for π0, whose state token is in the suffix (None otherwise).
    """

    cache: Any
    pad_masks: Tensor
    hidden: Tensor
    state: Tensor | None

    @property
    def batch_size(self) -> int:
        return int(self.pad_masks.shape[0])

    def repeat_interleave(self, n: int) -> LeRobotPrefix:
        """Each observation's prefix repeated n times (row b * n + i is observation b)."""
        if n == 1:
            return self
        return LeRobotPrefix(
            cache=_cache([(k.repeat_interleave(n, 0), v.repeat_interleave(n, 0)) for k, v, _ in self.cache]),
            pad_masks=self.pad_masks.repeat_interleave(n, 0),
            hidden=self.hidden.repeat_interleave(n, 0),
            state=None if self.state is None else self.state.repeat_interleave(n, 0),
        )


@dataclass
class GuidedPrefix:
    """Classifier-free guidance: the unconditioned and the positive prefixes of the same observations;
    :meth:`LeRobotFlowPolicy.velocity` on it is ``(1 - scale) v(uncond) + scale v(cond)``."""

    uncond: LeRobotPrefix
    cond: LeRobotPrefix
    scale: float

    @property
    def batch_size(self) -> int:
        return self.cond.batch_size

    def repeat_interleave(self, n: int) -> GuidedPrefix:
        return GuidedPrefix(self.uncond.repeat_interleave(n), self.cond.repeat_interleave(n), self.scale)


def _cache(layers: Any) -> Any:
    """A fresh ``DynamicCache`` holding ``layers`` ((keys, values) per layer)."""
    from transformers import DynamicCache

    return DynamicCache(tuple((k, v) for k, v, *_ in layers))


class LeRobotFlowPolicy(nn.Module):
    """A LeRobot SmolVLA / π0 / π0.5 as a :class:`~policies.flow_policy.FlowPolicy` (see the module docstring)."""

    def __init__(self, build: LeRobotBuild) -> None:
        super().__init__()
        require_flow_type(build.lerobot_type, "the flow-policy contract")
        cfg = build.policy.config
        refused = {
            "adapt_to_pi_aloha": getattr(cfg, "adapt_to_pi_aloha", False),
            "use_relative_actions": getattr(cfg, "use_relative_actions", False),
            "use_cache": not getattr(cfg, "use_cache", True),
        }
        for name, bad in refused.items():
            if bad:
                raise FlowPolicyError(
                    f"{build.lerobot_type} config.{name}: {getattr(cfg, name)!r} is not supported by the flow "
                    "contract (LeRobot applies it outside the pieces used here)"
                )
        self.policy = build.policy
        self.preprocessor = build.preprocessor
        self.postprocessor = build.postprocessor
        self.spec = build.spec
        self.camera_keys = dict(build.camera_keys)
        self.lerobot_type = build.lerobot_type
        self.path = build.path
        self.local = build.local
        self._normalizer = _step(build.preprocessor, "NormalizerProcessorStep")
        self._unnormalizer = _step(build.postprocessor, "UnnormalizerProcessorStep")
        self.sidecar = build.sidecar  # build.spec is its robot spec when it has one
        self.advantage: AdvantageConditioning | None = self.sidecar.advantage
        self._rtc_max_delay, self._rtc_zero_delay_prob = 0, None
        self.set_rtc_max_delay(self.sidecar.rtc_max_delay, self.sidecar.rtc_zero_delay_prob)

    @classmethod
    def load(
        cls,
        folder: str | os.PathLike[str],
        *,
        algorithm: str = "training",
        device: torch.device | str = "cpu",
    ) -> LeRobotFlowPolicy:
        """Build the policy in a LeRobot folder; a non-flow type (act, diffusion) is refused before building:
        ``"<algorithm> needs a flow-matching policy; act is not one — use sft"``."""
        return cls(build_lerobot(folder, device, accept=lambda t: require_flow_type(t, algorithm)))

    # ---------------------------------------------------------------- shapes
    @property
    def _smol(self) -> bool:
        return self.lerobot_type == "smolvla"

    @property
    def chunk_len(self) -> int:
        return int(self.policy.config.chunk_size)

    @property
    def n_exec(self) -> int:
        return int(self.policy.config.n_action_steps)

    @property
    def action_dim(self) -> int:
        return self.spec.action_dim

    @property
    def event_shape(self) -> tuple[int, int]:
        return (self.chunk_len, int(self.policy.config.max_action_dim))

    @property
    def num_inference_steps(self) -> int:
        cfg = self.policy.config
        return int(cfg.num_steps if self._smol else cfg.num_inference_steps)

    def set_num_inference_steps(self, k: int) -> None:
        """Set K in the policy's own config (SmolVLA ``num_steps``, π0 ``num_inference_steps``), so a saved
        folder samples with the grid it was fine-tuned on (RL) in LeRobot's code as in ours."""
        check_num_steps(k)
        setattr(self.policy.config, "num_steps" if self._smol else "num_inference_steps", k)

    @property
    def device(self) -> torch.device:
        return next(self.policy.parameters()).device

    @property
    def rtc_max_delay(self) -> int:
        """The largest executed prefix the policy was trained to take given (0: not trained for RTC)."""
        return self._rtc_max_delay

    @property
    def rtc_zero_delay_prob(self) -> float | None:
        """How often a training delay is 0 (None: d ~ U{0..rtc_max_delay}; FlowVLAConfig's field)."""
        return self._rtc_zero_delay_prob

    def set_rtc_max_delay(self, max_delay: int, zero_delay_prob: float | None = None) -> None:
        """Train (and be saved, in the sidecar) with training-time RTC up to ``max_delay`` actions (0: off),
        a delay of 0 drawn with ``zero_delay_prob`` (None: uniformly, ``rtc_zero_delay_prob``);
        FlowPolicyError naming ``rtc_max_delay`` for π0.5
        (:func:`~policies.lerobot_times.check_per_action_times`) or a delay outside [0, chunk_len - 1],
        naming ``rtc_zero_delay_prob`` for a probability outside [0, 1) or one without a delay."""
        if (
            isinstance(max_delay, bool)
            or not isinstance(max_delay, int)
            or not 0 <= max_delay < self.chunk_len
        ):
            raise FlowPolicyError(
                f"rtc_max_delay: expected an integer in [0, chunk_len - 1 = {self.chunk_len - 1}], "
                f"got {max_delay!r}"
            )
        problem = zero_delay_prob_problem(zero_delay_prob, max_delay)
        if problem is not None:
            raise FlowPolicyError(f"rtc_zero_delay_prob: {problem}")
        if max_delay:
            check_per_action_times(self.lerobot_type)
        self._rtc_max_delay = max_delay
        self._rtc_zero_delay_prob = None if zero_delay_prob is None else float(zero_delay_prob)

    def logprob_mask(self) -> Tensor:
        m = torch.zeros(self.event_shape, dtype=torch.bool, device=self.device)
        m[: self.n_exec, : self.action_dim] = True
        return m

    # ---------------------------------------------------------------- inputs
    def _inputs(self, obs: Mapping[str, Any]) -> dict[str, Any]:
        """Our observation (+ action) batch -> LeRobot's batch after the folder's pre-processor."""
        b = _batch_size(obs)
        instr = obs.get("instruction")
        if instr is None:
            raise FlowPolicyError("instruction: missing (a string or one per observation)")
        texts = [instr] * b if isinstance(instr, str) else [str(x) for x in instr]
        if len(texts) != b:
            raise FlowPolicyError(f"instruction: expected {b} strings, got {len(texts)}")
        texts = self._conditioned(texts, obs.get("advantage"))
        state = None
        if self.spec.state_dim:
            state = _tensor(obs, "state", (b, self.spec.state_dim)).float()
        cams = obs.get("cameras") or {}
        for name in self.camera_keys:
            if name not in cams:
                raise FlowPolicyError(f"cameras.{name}: missing")
        batch = to_lerobot_batch(self.spec.state_dim, state, cams, texts, self.camera_keys)
        if obs.get("action") is not None:
            batch["action"] = _tensor(obs, "action", (b, self.chunk_len, self.action_dim)).float()
        if obs.get("action_is_pad") is not None:
            batch["action_is_pad"] = _tensor(obs, "action_is_pad", (b, self.chunk_len)).bool()
        return self.preprocessor(batch)

    def _conditioned(self, texts: list[str], advantage: Any) -> list[str]:
        """RECAP's prompts: each instruction with its ``advantage`` indicator's text (positive when the
        policy is advantage-conditioned and none is given); unchanged for a policy that is not."""
        cond = self.advantage
        if cond is None:
            if advantage is not None:
                raise FlowPolicyError(
                    "advantage: this policy is not advantage-conditioned (condition_on_advantage first)"
                )
            return texts
        if advantage is None:
            return [cond.prompt(t, 2) for t in texts]
        ind = torch.as_tensor(advantage).reshape(-1).tolist()
        if len(ind) != len(texts) or any(i not in (0, 1, 2) for i in ind):
            raise FlowPolicyError(f"advantage: expected {len(texts)} values in {{0, 1, 2}}, got {ind[:8]}")
        return [cond.prompt(t, int(i)) for t, i in zip(texts, ind, strict=True)]

    def _guided(self, obs: Mapping[str, Any]) -> GuidedPrefix | None:
        """The unconditioned and positive prefixes when classifier-free guidance applies to ``obs``."""
        cond = self.advantage
        if cond is None or cond.guidance_scale == 1.0 or obs.get("advantage") is not None:
            return None
        uncond = self.encode_prefix({**obs, "advantage": torch.zeros(_batch_size(obs), dtype=torch.long)})
        return GuidedPrefix(uncond, self.encode_prefix(obs), cond.guidance_scale)

    def _pieces(
        self, batch: Mapping[str, Any]
    ) -> tuple[list[Tensor], list[Tensor], Tensor, Tensor, Tensor | None]:
        """(images, image masks, tokens, token masks, padded state or None for π0.5) as the policy prepares them."""
        from lerobot.utils.constants import OBS_LANGUAGE_ATTENTION_MASK, OBS_LANGUAGE_TOKENS

        p = self.policy
        images, img_masks = p.prepare_images(batch) if self._smol else p._preprocess_images(batch)
        state = None if self.lerobot_type == "pi05" else p.prepare_state(batch)
        return images, img_masks, batch[OBS_LANGUAGE_TOKENS], batch[OBS_LANGUAGE_ATTENTION_MASK], state

    # ---------------------------------------------------------------- flow
    def encode_prefix(self, obs: Mapping[str, Any]) -> LeRobotPrefix:
        """The VLM pass over images, language (and SmolVLA's state token), once per observation."""
        from lerobot.policies.common.vla_utils import make_att_2d_masks, prepare_attention_masks_4d

        images, img_masks, tokens, masks, state = self._pieces(self._inputs(obs))
        m = self.policy.model
        if self._smol:
            embs, pad, att = m.embed_prefix(images, img_masks, tokens, masks, state=state)
            vlm, mask = m.vlm_with_expert, make_att_2d_masks(pad, att)
        else:
            embs, pad, att = m.embed_prefix(images, img_masks, tokens, masks)
            vlm, mask = m.paligemma_with_expert, prepare_attention_masks_4d(make_att_2d_masks(pad, att))
            vlm.paligemma.model.language_model.config._attn_implementation = "eager"
        (hidden, _), cache = vlm.forward(
            attention_mask=mask,
            position_ids=torch.cumsum(pad, dim=1) - 1,
            past_key_values=None,
            inputs_embeds=[embs, None],
            use_cache=True,
        )
        return LeRobotPrefix(cache, pad, hidden, state if self.lerobot_type == "pi0" else None)

    def _denoise(self, prefix: LeRobotPrefix, x: Tensor, s: Tensor) -> Tensor:
        """LeRobot's ``denoise_step``: the openpi velocity ``u(x, s)`` (s = 1 noise)."""
        m = self.policy.model
        if self._smol:  # its denoise_step appends to the cache and crops it back: give it a copy
            return m.denoise_step(
                prefix_pad_masks=prefix.pad_masks, past_key_values=_cache(prefix.cache), x_t=x, timestep=s
            )
        extra = {"state": prefix.state} if self.lerobot_type == "pi0" else {}
        return m.denoise_step(
            prefix_pad_masks=prefix.pad_masks, past_key_values=prefix.cache, x_t=x, timestep=s, **extra
        )

    def velocity(self, prefix: LeRobotPrefix | GuidedPrefix, x_t: Tensor, t: Tensor | float) -> Tensor:
        if isinstance(prefix, GuidedPrefix):
            g = prefix.scale
            return (1.0 - g) * self.velocity(prefix.uncond, x_t, t) + g * self.velocity(prefix.cond, x_t, t)
        n = x_t.shape[0]
        if n != prefix.batch_size or tuple(x_t.shape[1:]) != self.event_shape:
            raise FlowPolicyError(
                f"x_t: expected [{prefix.batch_size}, {self.event_shape[0]}, {self.event_shape[1]}] "
                f"(the prefix's rows, H, D), got {list(x_t.shape)}"
            )
        tt = torch.as_tensor(t, device=x_t.device, dtype=torch.float32)
        if tt.ndim == 2:
            return self._per_action_velocity(prefix, x_t, tt)
        tt = tt.expand(n) if tt.ndim == 0 else tt.reshape(n)
        return velocity_from_openpi(lambda x, s: self._denoise(prefix, x, s))(x_t.float(), tt)

    def _per_action_velocity(self, prefix: LeRobotPrefix, x_t: Tensor, t: Tensor) -> Tensor:
        """The velocity at one flow time per action (``t`` ``[B, H]``, trained RTC's prefix at 1): the
        action tokens embedded per action (:func:`~policies.lerobot_times.per_action_suffix`). π0.5 takes
        rows of one time only (its expert is conditioned once per chunk)."""
        if tuple(t.shape) != tuple(x_t.shape[:2]):
            raise FlowPolicyError(
                f"t: expected [{x_t.shape[0]}] or {list(x_t.shape[:2])}, got {list(t.shape)}"
            )
        if self.lerobot_type == "pi05" and bool((t == t[:, :1]).all()):
            return self.velocity(prefix, x_t, t[:, 0])
        s = to_openpi_time(t)
        with per_action_suffix(self.policy.model, self.lerobot_type, s):
            return -self._denoise(prefix, x_t.float(), s[:, -1])

    def observation_velocity(self, obs: Mapping[str, Any]) -> VelocityFn:
        """``v(x, t)`` for ``obs`` as :meth:`sample` integrates it (guided by :class:`GuidedPrefix` when
        the policy's guidance scale applies)."""
        prefix = self._guided(obs) or self.encode_prefix(obs)
        return lambda x, t: self.velocity(prefix, x, t)

    def sample(
        self,
        obs_or_prefix: Mapping[str, Any] | Prefix,
        *,
        num_steps: int | None = None,
        num_samples: int = 1,
        noise: Tensor | None = None,
        generator: torch.Generator | None = None,
        return_iterates: bool = False,
    ) -> FlowSample:
        """Euler on :meth:`velocity`; observations of an advantage-conditioned policy that name no
        ``"advantage"`` are guided (:class:`GuidedPrefix`) when its guidance scale is not 1."""
        if isinstance(obs_or_prefix, LeRobotPrefix | GuidedPrefix):
            prefix: LeRobotPrefix | GuidedPrefix = obs_or_prefix
        else:
            prefix = self._guided(obs_or_prefix) or self.encode_prefix(obs_or_prefix)
        return euler_sample_prefix(
            self,
            prefix,
            num_steps=num_steps,
            num_samples=num_samples,
            noise=noise,
            generator=generator,
            return_iterates=return_iterates,
        )

    @torch.no_grad()
    def predict_action_chunk(
        self,
        obs: Mapping[str, Any],
        *,
        num_steps: int | None = None,
        noise: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Env units ``[B, H, A]``: the post-processor's un-normalisation, unclipped (as LeRobot serves)."""
        s = self.sample(
            obs, num_steps=num_steps, noise=None if noise is None else noise[:, None], generator=generator
        )
        return self.unnormalize_actions(s.actions[:, 0])

    def loss(
        self, batch: Mapping[str, Any], *, noise: Tensor | None = None, time: Tensor | None = None
    ) -> Tensor:
        if batch.get("action") is None:
            raise FlowPolicyError("action: missing (the loss needs the demonstrated chunk)")
        lb = self._inputs(batch)
        images, img_masks, tokens, masks, state = self._pieces(lb)
        actions = self.policy.prepare_action(lb)  # normalised, padded to D
        b, device, m = actions.shape[0], actions.device, self.policy.model
        x0 = initial_noise((b, *self.event_shape), noise, None, device, torch.float32)
        if time is None:
            s = m.sample_time(b, device)  # openpi time, π0's Beta(1.5, 1)
        else:
            s = to_openpi_time(torch.as_tensor(time, device=device, dtype=torch.float32).reshape(b))
        args = [images, img_masks, tokens, masks] + ([] if state is None else [state])
        pad = lb.get("action_is_pad")
        given = self._rtc_prefix(b, device)
        if given is None:
            err = m.forward(*args, actions, x0, s)[..., : self.action_dim]
            return masked_mean_per_sample(err, pad)
        # trained RTC: the prefix clean (openpi time 0: x_t = actions there, which LeRobot's forward makes of
        # noise = actions), the rest at the row's time, embedded per action; no loss on the prefix (an input)
        x0 = torch.where(given[..., None], actions, x0)
        with per_action_suffix(
            m, self.lerobot_type, torch.where(given, torch.zeros_like(given, dtype=s.dtype), s[:, None])
        ):
            err = m.forward(*args, actions, x0, s)[..., : self.action_dim]
        return masked_mean_per_sample(err, given if pad is None else given | pad.bool())

    def _rtc_prefix(self, b: int, device: torch.device) -> Tensor | None:
        """``[B, H]`` bool: each sample's executed prefix given clean (trained RTC); None when the policy
        does not train for it."""
        if not self.rtc_max_delay:
            return None
        return random_prefix(self.rtc_max_delay, b, self.chunk_len, device, self.rtc_zero_delay_prob)

    def sample_time(self, n: int) -> Tensor:
        """LeRobot's training time (π0's Beta(1.5, 1), SmolVLA's fixed, π0's from its config) in our convention."""
        return from_openpi_time(self.policy.model.sample_time(n, self.device))

    def features(self, prefix: LeRobotPrefix | GuidedPrefix) -> Tensor:
        """``[B, W]``: the VLM's last hidden state averaged over the valid prefix tokens."""
        if isinstance(prefix, GuidedPrefix):
            prefix = prefix.cond
        w = prefix.pad_masks.to(prefix.hidden.dtype)[..., None]
        return ((prefix.hidden * w).sum(1) / w.sum(1).clamp_min(1.0)).float()

    @property
    def feature_dim(self) -> int:
        """F of :meth:`features`: the VLM's text width."""
        return int(self.vlm.config.text_config.hidden_size)

    def normalize_actions(self, actions: Tensor) -> Tensor:
        x = _apply_step(self._normalizer, actions.to(self.device, torch.float32))
        return nn.functional.pad(x, (0, self.event_shape[1] - self.action_dim))

    def unnormalize_actions(self, x: Tensor) -> Tensor:
        return _apply_step(self._unnormalizer, x[..., : self.action_dim])

    def executable_actions(self, x: Tensor) -> Tensor:
        """The post-processor's un-normalisation of the robot's dims, unclipped (as LeRobot serves)."""
        return self.unnormalize_actions(x)

    # ---------------------------------------------------------------- training / IO
    @property
    def vlm(self) -> nn.Module:
        """The VLM (vision encoder and language model) whose KV cache :meth:`encode_prefix` fills."""
        m = self.policy.model
        return m.vlm_with_expert.vlm if self._smol else m.paligemma_with_expert.paligemma

    def prefix_modules(self) -> list[nn.Module]:
        """Every module with parameters that :meth:`encode_prefix` reads: the VLM, and SmolVLA's state
        projection (its state token is in the prefix; π0's is in the suffix, π0.5 has none). With these
        frozen, a prefix is a constant of the trainable weights and can be shared by copies of the policy."""
        return [self.vlm, self.policy.model.state_proj] if self._smol else [self.vlm]

    def set_trainable(self, parts: TrainableParts, lora: LoraSettings | None = None) -> list[nn.Parameter]:
        """``"expert"``: LeRobot's ``train_expert_only`` (the VLM frozen and kept in eval mode; the action
        expert, the state / action / time projections train). ``"full"``: every parameter. ``"lora"``:
        only LoRA adapters (``lora``, default :class:`~policies.lora.LoraSettings`; placed by
        :data:`LORA_TARGETS` unless it names targets), merged into the weights when saved. The config's
        flags follow, so a saved folder says what was trained (``train_expert_only`` when no adapter is in
        the VLM, ``freeze_vision_encoder`` when none is in its vision encoder)."""
        check_trainable(parts)
        cfg, m = self.policy.config, self.policy.model
        with_expert = m.vlm_with_expert if self._smol else m.paligemma_with_expert
        vlm = self.vlm
        vision = vlm.model.vision_model if self._smol else vlm.model.vision_tower
        if parts == "lora":
            params, frozen_vlm, frozen_vision = self._add_lora(lora or LoraSettings(), vlm, vision)
        elif lora_state(self.policy) is not None:
            raise FlowPolicyError(
                f"trainable: {parts!r} on a policy that carries LoRA adapters; save it (the adapters are "
                "merged) and train the saved folder"
            )
        else:
            frozen_vlm = frozen_vision = parts == "expert"
            for p in self.policy.parameters():
                p.requires_grad = True
            for p in vlm.parameters():
                p.requires_grad = not frozen_vlm
            if self._smol and not cfg.train_state_proj:
                m.state_proj.requires_grad_(False)
            params = [p for p in self.policy.parameters() if p.requires_grad]
        for obj in (cfg, with_expert):
            obj.train_expert_only, obj.freeze_vision_encoder = frozen_vlm, frozen_vision
        self.train(self.training)  # LeRobot's train() puts a frozen VLM back in eval mode
        return params

    def _add_lora(
        self, settings: LoraSettings, vlm: nn.Module, vision: nn.Module
    ) -> tuple[list[nn.Parameter], bool, bool]:
        """:func:`~policies.lora.add_lora` on the LeRobot policy: the adapters' parameters, and whether the
        VLM and its vision encoder stay free of adapters (frozen)."""
        try:
            state, params = add_lora(
                self.policy, settings, default_targets=LORA_TARGETS[self.lerobot_type], what=self.lerobot_type
            )
        except ValueError as e:
            raise FlowPolicyError(str(e)) from None
        adapted = {id(self.policy.get_submodule(name)) for name in state.layers}
        return (
            params,
            not adapted & {id(x) for x in vlm.modules()},
            not adapted & {id(x) for x in vision.modules()},
        )

    def condition_on_advantage(self, guidance_scale: float) -> LeRobotFlowPolicy:
        """Make this policy advantage-conditioned (RECAP: the indicator's text in its prompt) with
        ``guidance_scale`` for deployment; returns itself (the weights are unchanged: the text is new)."""
        try:
            self.advantage = AdvantageConditioning(guidance_scale=guidance_scale)
        except ValueError as e:
            raise FlowPolicyError(str(e)) from None
        return self

    @property
    def lineage(self) -> Lineage | None:
        """The folder's lineage (:data:`LINEAGE_FILE`), None for a folder from elsewhere."""
        return self.sidecar.lineage

    def save(
        self,
        folder: str | os.PathLike[str],
        *,
        lineage: Lineage | None = None,
        metrics: Mapping[str, Any] | None = None,
    ) -> Path:
        """A LeRobot policy folder (``config.json`` with its ``type``, ``model.safetensors``, both processors)
        that LeRobot's own ``from_pretrained`` loads, plus ``vlm/`` for folders made here, and beside it
        :data:`LINEAGE_FILE` (lineage, default the loaded folder's; metrics; the robot spec; the advantage
        conditioning) with a ``README.md`` model card from it."""
        out = Path(folder)
        copy_local_resources(self.local, out, self.policy, self.preprocessor)
        adapters = lora_state(self.policy)
        if adapters is None:
            self.policy.save_pretrained(out)
        else:  # LoRA: the plain policy's weights with the adapters merged in
            self.policy.save_pretrained(out, state_dict=merged_state_dict(self.policy))
            lineage = replace(lineage or self.sidecar.lineage or Lineage("unknown"), lora=adapters.record())
        self.preprocessor.save_pretrained(out)
        self.postprocessor.save_pretrained(out)
        sidecar = replace(
            self.sidecar,
            lineage=lineage if lineage is not None else self.sidecar.lineage,
            metrics=dict(metrics or {}),
            robot_spec=self.spec,
            advantage=self.advantage,
            rtc_max_delay=self.rtc_max_delay,
            rtc_zero_delay_prob=self.rtc_zero_delay_prob,
        )
        write_sidecar(out, sidecar, f"lerobot/{self.lerobot_type}")
        return out


# ---------------------------------------------------------------------------- helpers
def _step(pipeline: Any, class_name: str) -> Any | None:
    return next((s for s in getattr(pipeline, "steps", ()) if type(s).__name__ == class_name), None)


def _apply_step(step: Any | None, action: Tensor) -> Tensor:
    """One (un)normaliser processor step applied to actions alone (identity when the folder has none)."""
    if step is None:
        return action
    from lerobot.lerobot_types import TransitionKey
    from lerobot.processor import create_transition

    return step(create_transition(action=action))[TransitionKey.ACTION]


def _batch_size(obs: Mapping[str, Any]) -> int:
    for key in ("state", "action"):
        if obs.get(key) is not None:
            return int(obs[key].shape[0])
    for img in (obs.get("cameras") or {}).values():
        return int(img.shape[0])
    instr = obs.get("instruction")
    if isinstance(instr, list | tuple):
        return len(instr)
    raise FlowPolicyError("observation: cannot infer the batch size (no state, camera or instruction list)")


def _tensor(obs: Mapping[str, Any], key: str, shape: tuple[int, ...]) -> Tensor:
    x = obs.get(key)
    if x is None:
        raise FlowPolicyError(f"{key}: missing")
    t = x if isinstance(x, Tensor) else torch.as_tensor(np.asarray(x))
    if tuple(t.shape) != shape:
        raise FlowPolicyError(f"{key}: expected shape {list(shape)}, got {list(t.shape)}")
    return t
